"""How many bytes a record takes in a shard: measured on real records, not guessed.

A record's size is mostly its tokens: each is an id in decimal with a comma
(`input_ids`), a `0,` or `1,` (`loss_mask`) and its text inside `messages`; keys,
sampling, source and the rest are a fixed overhead. zstd compresses ids far less than
text and the loss mask to almost nothing, and the mix depends on the vocabulary (Kimi's
ids run to six digits, SmolLM2's to five) and the language, so no one ratio fits.

So the records are built with the job's real tokenizer by
`consumers.tokenize.record.build_record` itself (this model follows the schema as it
changes), serialized with orjson and compressed at the shard writer's zstd level, as a
shard is. The prompts are real: a sample of the dataset rendered as enqueue renders it.
The answers are synthetic: spans of the dataset's own text (of other prompts than the
examples'), tokenized by the target's tokenizer and laid out as the model emits them
(the think span when the job thinks, then the end-of-turn token), so they compress like
real answers in that language.

Records are built twice, with answers of O and O/2 tokens (O the expected mean answer,
kept within 64..4096). The difference gives k, the compressed bytes per token, and the
rest the fixed overhead f per record:

    bytes(record) = f + k * (prompt_tokens + output_tokens)

k is taken to be the same for prompt and answer tokens (each costs an id, a mask entry
and its text), so any mean answer length can be priced without building records that
long. Where prompts compress better than answers, f comes out small or even negative;
the sum stays exact at the examples' mean prompt length, which is the dataset's mean
within sampling error.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import orjson
import zstandard

from regen.common import defaults
from regen.common.chat_family import prompt_opens_think
from regen.common.record import CheckFailed, RecordContext, build_record
from regen.common.results import GeneratedResult
from regen.producer.rows import Prompt
from regen.producer.spec import PreparedJob

# Answer lengths the records are measured at: long enough that per-token costs dominate
# the fixed ones, short enough to build in a second or two.
MEASURE_MIN_TOKENS = 64
MEASURE_MAX_TOKENS = 4096
# Share of a thinking answer spent reasoning; only the place of `</think>` depends on it.
REASONING_SHARE = 0.75
# Plausible values for the fields a worker fills in.
_SERVER = "http://10.0.0.1:30000"
_WORKER = "gpu-host-01:123456"


@dataclass(frozen=True)
class Example:
    """An accepted prompt as enqueue would send it: messages, ids and where it came from."""

    prompt: Prompt
    prompt_ids: list[int]
    source: dict[str, Any]


class RecordModelError(Exception):
    """The record checks reject a well-formed synthetic answer: the job's real records
    would most likely be rejected the same way."""


@dataclass(frozen=True)
class RecordSizeModel:
    fixed_bytes: float
    bytes_per_token: float  # compressed
    zstd_ratio: float  # uncompressed / compressed, at the longer measured length
    records: int
    measured_output_tokens: int
    # The dataset's text ran out and answers reuse its tokens shuffled: a rough model.
    text_shuffled: bool

    def bytes_per_record(self, prompt_tokens: float, output_tokens: float) -> float:
        return self.fixed_bytes + self.bytes_per_token * (prompt_tokens + output_tokens)


def measure(
    job: PreparedJob, examples: Sequence[Example], texts: Sequence[str], output_tokens: float
) -> RecordSizeModel:
    """Fit the size model on records built from `examples`, with answers from `texts`."""
    if not examples:
        raise ValueError("no accepted prompt to build a record from")
    if not job.family.end_of_turn_ids:
        raise RecordModelError("the tokenizer has no end-of-turn or eos token to end a turn with")
    ctx = RecordContext(job.spec, job.tokenizer, job.family, on_truncated="keep", drift_check=False)
    long = int(min(max(output_tokens, MEASURE_MIN_TOKENS), MEASURE_MAX_TOKENS))
    short = long // 2
    # Without other text (a dataset of a few prompts), the examples' own tokens are
    # used, shuffled from the start so that no answer copies a prompt.
    own = [m["content"] for e in examples for m in e.prompt.messages if m["role"] != "system"]
    pool = _AnswerPool(job.tokenizer, texts or own, need=len(examples) * long)
    if not texts:
        pool.shuffle()
    # The short answers are the first halves of the long ones, so the two sets differ in
    # answer length only and their difference is the cost of the tokens alone.
    bodies = [pool.take(long) for _ in examples]
    raw_long, packed_long, tokens_long = _measure_set(ctx, examples, bodies, long)
    _raw, packed_short, tokens_short = _measure_set(ctx, examples, bodies, short)
    per_token = (packed_long - packed_short) / (tokens_long - tokens_short)
    fixed = (packed_long - per_token * tokens_long) / len(examples)
    return RecordSizeModel(
        fixed_bytes=fixed,
        bytes_per_token=per_token,
        zstd_ratio=raw_long / packed_long,
        records=len(examples),
        measured_output_tokens=long,
        text_shuffled=pool.shuffled,
    )


def _measure_set(
    ctx: RecordContext,
    examples: Sequence[Example],
    bodies: Sequence[list[int]],
    output_tokens: int,
) -> tuple[int, int, int]:
    """(uncompressed bytes, compressed bytes, tokens) of one record per example."""
    lines = []
    tokens = 0
    for example, body in zip(examples, bodies, strict=True):
        result = _result(ctx, example, body, output_tokens)
        try:
            record = build_record(result, ctx)
        except CheckFailed as exc:
            raise RecordModelError(f"{exc.reason}: {exc.message}") from exc
        lines.append(orjson.dumps(record) + b"\n")
        tokens += len(record["input_ids"])
    raw = b"".join(lines)
    return (
        len(raw),
        len(zstandard.ZstdCompressor(level=defaults.SHARD_ZSTD_LEVEL).compress(raw)),
        tokens,
    )


def _result(
    ctx: RecordContext, example: Example, body: list[int], output_tokens: int
) -> GeneratedResult:
    """A result whose answer is `output_tokens` long: a prefix of `body` in the layout
    the job's model emits."""
    family, sampling = ctx.family, ctx.spec.sampling
    opened = family.think_open_id is not None and prompt_opens_think(family, example.prompt_ids)
    thinking = ctx.thinking if ctx.thinking is not None else opened
    eot = family.end_of_turn_ids[0]
    if thinking and family.think_open_id is not None and family.think_close_id is not None:
        head = [] if opened else [family.think_open_id]
        text_ids = body[: max(2, output_tokens - len(head) - 2)]
        cut = int(len(text_ids) * REASONING_SHARE)
        output = [*head, *text_ids[:cut], family.think_close_id, *text_ids[cut:], eot]
    else:
        output = [*body[: max(1, output_tokens - 1)], eot]
    # The server's text, as SGLang's detokenizer makes it (see record._check_text).
    trim = bool(eot) and not sampling.get("no_stop_trim", False)
    text = ctx.tokenizer.decode(
        output[:-1] if trim else output,
        skip_special_tokens=sampling.get("skip_special_tokens", True),
    )
    return GeneratedResult(
        id=example.prompt.id,
        job=ctx.spec.name,
        chunk="",
        prompt_ids=example.prompt_ids,
        messages=example.prompt.messages,
        tools=example.prompt.tools,
        source=example.source,
        output_ids=output,
        text=text,
        finish_reason={"type": "stop", "matched": eot},
        prompt_tokens=len(example.prompt_ids),
        completion_tokens=len(output),
        cached_tokens=0,
        latency_s=0.0,
        server=_SERVER,
        worker=_WORKER,
        attempt=1,
        # A budget the sized answer fits: the estimate is of a record with this many
        # answer tokens, whatever the job's (record._check_one_answer).
        sampling={**sampling, "max_new_tokens": max(len(output), sampling["max_new_tokens"])},
    )


class _AnswerPool:
    """Token ids of the dataset's text, handed out in order so that no two answers share
    text (shared text would compress far better than real answers do).

    When the text runs out (small datasets), it is handed out again in a shuffled
    order: the same tokens with no long repeats for zstd to find, a rough stand-in.
    """

    def __init__(self, tokenizer: Any, texts: Sequence[str], need: int) -> None:
        # Special and added tokens written in the data (a literal "<think>") would be
        # parsed as control tokens; a model's answer text never holds them.
        control = set(tokenizer.all_special_ids) | set(tokenizer.added_tokens_decoder)
        self._ids: list[int] = []
        for text in texts:
            if len(self._ids) >= need:
                break
            ids = tokenizer.encode(text + "\n\n", add_special_tokens=False)
            self._ids.extend(i for i in ids if i not in control)
        if not self._ids:
            raise ValueError("no dataset text to model answers on")
        self._cursor = 0
        self._rng = random.Random(0)
        self.shuffled = False

    def shuffle(self) -> None:
        self._rng.shuffle(self._ids)
        self._cursor, self.shuffled = 0, True

    def take(self, n: int) -> list[int]:
        out: list[int] = []
        while len(out) < n:
            if self._cursor == len(self._ids):
                self.shuffle()
            piece = self._ids[self._cursor : self._cursor + n - len(out)]
            out.extend(piece)
            self._cursor += len(piece)
        return out
