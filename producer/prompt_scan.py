"""Read datasets as `regen enqueue` does and count prompts and their tokens, without Redis.

The datasets are read exactly as enqueue reads them: the same readers and row shapes,
dedupe by prompt id, the job's system prompt, chat template kwargs and prompt length
limit (from `producer.spec.prepare_job`, so plan and enqueue cannot disagree), and the
same rejection reasons. No Redis is touched, so prompts an earlier enqueue put into the
job are unknown here: the counts are those of a fresh job.

Reading and deduplicating rows is cheap; rendering and tokenizing is the cost. So the
unique prompts are reservoir-sampled (Algorithm R, seeded: the same command gives the
same counts) and only the sample is tokenized; its token figures and rejection rates
are scaled up to every unique prompt. With no more unique prompts than the sample size,
every prompt is tokenized and the figures are exact.

With `--turns all` a prompt is a conversation and each of its turns is counted as a
prompt to send. A later turn's prompt holds the target's earlier answers, unknown
before generation: it is counted with those answers empty, a lower bound.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regen.common import defaults
from regen.common.chat_family import render_prompt_ids
from regen.common.conversation import BLOCKED, Conversation
from regen.producer.conversations import job_prompt
from regen.producer.readers import iter_rows
from regen.producer.record_size import Example
from regen.producer.rows import BadRow, Prompt, Reason
from regen.producer.spec import PreparedJob

# Accepted prompts kept, with their ids, to model records on (see producer.record_size),
# and how much text of the next ones to keep for the synthetic answers.
EXAMPLES = 32
ANSWER_TEXT_CHARS = 1_000_000


@dataclass
class PromptScan:
    """What reading the datasets found; token figures cover the tokenized prompts only."""

    rows_read: int = 0
    unique: int = 0
    duplicates: int = 0
    # Rows that are no prompt or too large to tokenize (exact: every row is read) and,
    # among the tokenized prompts, those the job refuses (template_error, prompt_too_long).
    rejected_rows: dict[str, int] = field(default_factory=dict)
    rejected_tokenized: dict[str, int] = field(default_factory=dict)
    tokenized: int = 0
    accepted_lengths: list[int] = field(default_factory=list)
    examples: list[Example] = field(default_factory=list)
    answer_texts: list[str] = field(default_factory=list)
    answer_chars: int = 0

    @property
    def exact(self) -> bool:
        return self.tokenized == self.unique

    @property
    def scale(self) -> float:
        """Unique prompts per tokenized prompt: 1.0 when exact."""
        return self.unique / self.tokenized if self.tokenized else 0.0

    def rejected(self) -> dict[str, int]:
        """Every rejection by reason, the prompt-level ones scaled to all unique prompts."""
        out = dict(self.rejected_rows)
        for reason, count in self.rejected_tokenized.items():
            out[reason] = out.get(reason, 0) + round(count * self.scale)
        return dict(sorted(out.items()))

    @property
    def accepted(self) -> int:
        """Prompts that would be enqueued (scaled when sampled)."""
        return round(len(self.accepted_lengths) * self.scale)

    @property
    def prompt_tokens(self) -> int:
        return round(sum(self.accepted_lengths) * self.scale)


def scan_prompts(
    paths: Sequence[Path],
    job: PreparedJob,
    *,
    sample: int | None = defaults.PLAN_SAMPLE,
    seed: int = defaults.PLAN_SEED,
) -> PromptScan:
    """Read every row of `paths`; tokenize every unique prompt (`sample` None) or a
    random sample of `sample` of them."""
    if sample is not None and sample < 1:
        raise ValueError(f"sample must be at least 1 (None tokenizes every prompt), got {sample}")
    scan = PromptScan()
    # Ids as ints: a set of 8-byte ints is about half the size of one of hex strings,
    # which counts at millions of prompts.
    seen: set[int] = set()
    reservoir: list[tuple[Prompt, Conversation | None, dict[str, Any]]] = []
    rng = random.Random(seed)
    for path in paths:
        for raw in iter_rows(path):
            scan.rows_read += 1
            if raw.error is not None:
                _count(scan.rejected_rows, raw.error.reason)
                continue
            try:
                prompt, conversation = job_prompt(raw.value, job.spec)
            except BadRow as exc:
                _count(scan.rejected_rows, exc.reason)
                continue
            key = int(prompt.id if conversation is None else conversation.id, 16)
            if key in seen:
                scan.duplicates += 1
                continue
            seen.add(key)
            if job.too_large(prompt.messages) is not None:  # as enqueue: never tokenized
                _count(scan.rejected_rows, Reason.ROW_TOO_LARGE)
                continue
            scan.unique += 1
            source = {"file": str(path), "row": raw.row, "id": prompt.source_id}
            if sample is None:
                _tokenize(scan, job, prompt, conversation, source)
            elif len(reservoir) < sample:
                reservoir.append((prompt, conversation, source))
            else:
                slot = rng.randrange(scan.unique)
                if slot < sample:
                    reservoir[slot] = (prompt, conversation, source)
    for prompt, conversation, source in reservoir:
        _tokenize(scan, job, prompt, conversation, source)
    return scan


def _tokenize(
    scan: PromptScan,
    job: PreparedJob,
    prompt: Prompt,
    conversation: Conversation | None,
    source: dict[str, Any],
) -> None:
    """Render one prompt as `PromptRenderer.render` (producer/render.py) does, with the
    same outcomes."""
    scan.tokenized += 1
    contexts = [] if conversation is None else conversation.later
    ids = _accepted_ids(scan, job, prompt.messages, prompt.tools)
    if ids is None:
        _count(scan.rejected_tokenized, BLOCKED, len(contexts))
        return
    if len(scan.examples) < EXAMPLES:
        scan.examples.append(Example(prompt, ids, source))
    elif scan.answer_chars < ANSWER_TEXT_CHARS:
        # Other prompts than the examples', system prompts left out: answer text that
        # repeats text of the same shard would compress better than any real answer.
        text = "\n\n".join(m["content"] for m in prompt.messages if m["role"] != "system")
        scan.answer_texts.append(text)
        scan.answer_chars += len(text)
    messages = list(prompt.messages)
    for turn, context in enumerate(contexts, 1):
        # The worker refuses a later turn as enqueue refuses a first one, and the rest wait.
        messages += [{"role": "assistant", "content": ""}, *context]
        if _accepted_ids(scan, job, messages, prompt.tools) is None:
            _count(scan.rejected_tokenized, BLOCKED, len(contexts) - turn)
            return


def _accepted_ids(
    scan: PromptScan,
    job: PreparedJob,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
) -> list[int] | None:
    """The prompt's ids, its length counted; None when refused, the reason counted."""
    try:
        ids = render_prompt_ids(job.tokenizer, messages, job.spec.chat_template_kwargs, tools)
    except Exception:  # enqueue dead-letters whatever the template raises, so count it
        _count(scan.rejected_tokenized, Reason.TEMPLATE_ERROR)
        return None
    limit = job.spec.prompt_token_limit()
    if limit is not None and len(ids) > limit:
        _count(scan.rejected_tokenized, Reason.PROMPT_TOO_LONG)
        return None
    scan.accepted_lengths.append(len(ids))
    return ids


def _count(counts: dict[str, int], reason: str, n: int = 1) -> None:
    if n:
        code = str(reason)  # a Reason member is no JSON key: count by its string
        counts[code] = counts.get(code, 0) + n


def percentile(sorted_values: Sequence[int], q: float) -> int:
    """Nearest-rank percentile of an ascending sequence (0 when empty)."""
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]
