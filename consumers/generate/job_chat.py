"""A job's chat template in the generate worker, for the turns it renders itself.

With `--turns all` the worker renders each turn after a conversation's first from the
target's own answers, so it needs the job's tokenizer: loaded from the spec (refused
when it is not the producer's), only for such jobs, once per job and process.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from regen.common import chat_family
from regen.common.detokenize import detokenize
from regen.common.jobspec import JobSpec
from regen.common.output_calls import turn_calls
from regen.common.tokenizer import load_job_tokenizer
from regen.consumers.generate.engine import GenerateResult


@dataclass(frozen=True)
class JobChat:
    tokenizer: Any
    family: chat_family.ChatFamily
    template_kwargs: dict[str, Any]
    # Chunks run on threads; one renders at a time (tokenizers are not all thread-safe).
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False)

    def render(
        self, messages: Sequence[Mapping[str, Any]], tools: list[dict[str, Any]] | None
    ) -> list[int]:
        """Prompt ids as serving renders them; raises chat_family.ChatTemplateError."""
        with self._lock:
            return chat_family.render_prompt_ids(
                self.tokenizer, messages, self.template_kwargs, tools
            )

    def answer(
        self,
        prompt_ids: Sequence[int],
        output: GenerateResult,
        tools: list[dict[str, Any]] | None,
        sampling: Mapping[str, Any],
        *,
        record_id: str,
    ) -> dict[str, Any]:
        """A generated turn as the next turn's history holds it, read as the tokenize
        stage reads it: the tool calls it ended in parsed (ids given from `record_id`,
        the turn's id, where the model wrote none), its reasoning split off, so the
        template renders the calls and keeps or drops the reasoning as serving would
        (e.g. Kimi drops earlier turns' thinking unless `preserve_thinking`)."""
        with self._lock:
            text = output.text
            if text is None:  # a server started with --skip-tokenizer-init
                text = detokenize(self.tokenizer, output.output_ids, output.finish_reason, sampling)
            text, calls = turn_calls(
                self.family,
                self.tokenizer,
                record_id=record_id,
                tools=tools,
                output_ids=list(output.output_ids),
                text=text,
                finish_reason=output.finish_reason,
                skip_special_tokens=sampling.get("skip_special_tokens", True),
            )
        reasoning, answer = chat_family.split_output(self.family, prompt_ids, text)
        return chat_family.assistant_message(reasoning, answer, calls)


def load_job_chat(spec: JobSpec) -> JobChat:
    tokenizer = load_job_tokenizer(spec)
    family = chat_family.detect_family(tokenizer)
    return JobChat(tokenizer, family, spec.chat_template_kwargs)
