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
from regen.common.jobspec import JobSpec
from regen.common.tokenizer import load_job_tokenizer


@dataclass(frozen=True)
class JobChat:
    tokenizer: Any
    family: chat_family.ChatFamily
    template_kwargs: dict[str, Any]
    # Chunks run on threads; one renders at a time (tokenizers are not all thread-safe).
    _lock: threading.Lock = field(default_factory=threading.Lock, compare=False)

    def render(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """Prompt ids as serving renders them; raises chat_family.ChatTemplateError."""
        with self._lock:
            return chat_family.render_prompt_ids(self.tokenizer, messages, self.template_kwargs)

    def answer(self, prompt_ids: Sequence[int], text: str) -> dict[str, Any]:
        """A generated turn as the next turn's history holds it, its reasoning split off
        as the tokenize stage splits it, so the template keeps or drops it as serving
        would (e.g. Kimi drops earlier turns' thinking unless `preserve_thinking`)."""
        reasoning, answer = chat_family.split_output(self.family, prompt_ids, text)
        return chat_family.assistant_message(reasoning, answer)


def load_job_chat(spec: JobSpec) -> JobChat:
    tokenizer = load_job_tokenizer(spec)
    family = chat_family.detect_family(tokenizer)
    return JobChat(tokenizer, family, spec.chat_template_kwargs)
