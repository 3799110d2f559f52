"""A prompt rendered to the target's token ids with the job's chat template, or refused
to the input DLQ: too large a row, a template that raises, a prompt over the job's
token limit (producer/prompt_scan.py checks a dataset the same way before a job)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from regen.common import chat_family
from regen.common.chunk import ChunkPrompt
from regen.producer.input_refusals import RAW_SNIPPET_CHARS, Refusals
from regen.producer.pending_prompt import Pending
from regen.producer.rows import Reason
from regen.producer.spec import PreparedJob


class PromptRenderer:
    def __init__(self, job: PreparedJob, refusals: Refusals) -> None:
        self._job = job
        self._spec = job.spec
        self._refusals = refusals
        self._token_limit = self._spec.prompt_token_limit()

    def render_all(self, fresh: list[Pending]) -> list[ChunkPrompt | None]:
        """Each prompt rendered, or dead-lettered (None). The samples of one prompt share
        its rendering, which does not depend on the sample; one that fails is tried for
        each sample, so that each sample's id gets its own dead letter."""
        rendered: dict[str, ChunkPrompt | None] = {}
        out: list[ChunkPrompt | None] = []
        for item in fresh:
            if item.sample is None:
                out.append(self.render(item))
                continue
            base = item.prompt.id  # the same for every sample of the prompt
            if base not in rendered:
                rendered[base] = self.render(item)
                out.append(rendered[base])
                continue
            first = rendered[base]
            if first is None:
                out.append(self.render(item))
            else:
                out.append(replace(first, id=item.id, source=item.source,
                                   conversation=item.conversation))  # fmt: skip
        return out

    def render(self, item: Pending) -> ChunkPrompt | None:
        messages, tools = item.prompt.messages, item.prompt.tools
        too_large = self._job.too_large(messages)
        if too_large is not None:
            snippet = repr(messages)[:RAW_SNIPPET_CHARS]  # not the whole row: it can be huge
            self._refusals.prompt(item, Reason.ROW_TOO_LARGE, too_large, {"row": snippet})
            return None
        try:
            ids = chat_family.render_prompt_ids(
                self._job.tokenizer, messages, self._spec.chat_template_kwargs, tools
            )
        except Exception as exc:  # a template that raises on this conversation
            self._refusals.prompt(
                item, Reason.TEMPLATE_ERROR, f"chat template failed: {exc}", _payload(item, [])
            )
            return None
        if self._token_limit is not None and len(ids) > self._token_limit:
            self._refusals.prompt(
                item,
                Reason.PROMPT_TOO_LONG,
                (
                    f"prompt is {len(ids)} tokens; the job allows {self._token_limit} "
                    f"(max_prompt_tokens={self._spec.max_prompt_tokens}, context "
                    f"{self._spec.context_length} - max_new_tokens "
                    f"{self._spec.sampling['max_new_tokens']})"
                ),
                _payload(item, ids),
            )
            return None
        return ChunkPrompt(
            id=item.id,
            prompt_ids=ids,
            messages=messages,
            source=item.source,
            tools=tools,
            conversation=item.conversation,
        )


def _payload(item: Pending, prompt_ids: list[int]) -> dict[str, Any]:
    """What a requeue of a refused prompt needs (`regen dlq requeue`)."""
    return {
        "messages": item.prompt.messages,
        "tools": item.prompt.tools,
        "prompt_tokens": len(prompt_ids),
    }
