"""A dataset row's prompt on its way to a chunk: the prompt, where it came from, and
with `--turns all` its conversation, with `--samples K` its sample."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from regen.common.conversation import Conversation, turn_id
from regen.common.samples import sample_id
from regen.producer.rows import Prompt


@dataclass
class Pending:
    prompt: Prompt
    source: dict[str, Any]
    # With --turns all, the conversation whose first turn `prompt` is.
    conversation: Conversation | None = None
    # With --samples, the sample this is (None: the job draws one answer a prompt).
    sample: int | None = None
    # The characters of the dataset's own answer (producer/answer_length.py), which
    # orders the prompts of a window longest first; None: the row carries none.
    answer_chars: int | None = None

    @property
    def id(self) -> str:
        """The prompt's id: its first turn's for a conversation (all come in together),
        a sample's own (common/samples.py)."""
        if self.conversation is not None:
            return turn_id(self.conversation.id, 0)
        return self.prompt.id if self.sample is None else sample_id(self.prompt.id, self.sample)

    def as_sample(self, k: int) -> Pending:
        """Sample k of this prompt (a conversation: with its own conversation id), its
        index in the source."""
        source = {**self.source, "sample": k}
        conversation = self.conversation
        if conversation is not None:
            conversation = replace(conversation, id=sample_id(conversation.id, k))
        return replace(self, source=source, conversation=conversation, sample=k)


def turn_ids(item: Pending) -> list[str]:
    """The ids a prompt accounts for: a conversation's turns, else its own."""
    return [item.id] if item.conversation is None else item.conversation.turn_ids()
