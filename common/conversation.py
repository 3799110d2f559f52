"""Conversations regenerated turn by turn (`regen enqueue --turns all`).

Every assistant turn of a conversation is regenerated in order, each on the target's
own earlier answers. A conversation travels in a chunk as one prompt whose
`conversation` says which turns it runs: the prompt's `prompt_ids` and `messages` are
those of its first turn (`start`), and `later` holds the dataset's messages (user, tool)
that come before each turn after it. The generate worker renders those later turns
itself, from the target's answers (consumers/generate/turns.py).

Each turn is accounted as its own id, `<conversation id>-<turn>`: the job's id set, the
chunk sizes, the chunks' `generated` marks, the committed index and the DLQs all hold
turn ids, so status and verify count turns. A turn that fails stops its conversation:
it is dead-lettered with its history (its prompt messages hold the target's earlier
answers), and each later turn gets a `blocked` entry in the same DLQ naming it, so those
ids stay accounted for. Requeueing the failed turn takes them along and resumes the
conversation from it (regen/ops/requeue.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import redis
from redis.typing import EncodableT, FieldT

from regen.common import defaults, keys
from regen.common.dlq import DeadLetter

# The DLQ reason of a turn that waits behind an earlier turn of its conversation.
BLOCKED = "blocked"


def turn_id(conversation_id: str, turn: int) -> str:
    """The accounted id of one turn (no ':', which DLQ entry ids reserve)."""
    return f"{conversation_id}-{turn}"


def split_turn_id(tid: str) -> tuple[str, int]:
    """(conversation id, turn) of a turn id made by `turn_id`."""
    conversation_id, _, turn = tid.rpartition("-")
    return conversation_id, int(turn)


@dataclass(frozen=True)
class Conversation:
    id: str
    # The turn the prompt carrying this conversation begins at (0 unless requeued).
    start: int = 0
    # The dataset's messages before each turn after `start`, in order.
    later: list[list[dict[str, Any]]] = field(default_factory=list)

    @property
    def end(self) -> int:
        """One past the last turn to run."""
        return self.start + 1 + len(self.later)

    def turn_ids(self, first: int | None = None) -> list[str]:
        """Ids of the turns from `first` (default: `start`) to the end."""
        begin = self.start if first is None else first
        return [turn_id(self.id, turn) for turn in range(begin, self.end)]

    def context_before(self, turn: int) -> list[dict[str, Any]]:
        """The dataset's messages that come right before `turn` (after `start`)."""
        return self.later[turn - self.start - 1]

    def from_turn(self, turn: int) -> Conversation:
        """The rest of the conversation, as a prompt resuming at `turn` carries it."""
        return replace(self, start=turn, later=self.later[turn - self.start :])

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def blocked_letters(letter: DeadLetter, conversation: Conversation, turn: int) -> list[DeadLetter]:
    """The entries of the turns after `turn`, which `letter` (turn `turn`'s) stops."""
    return [
        DeadLetter(
            entry_id=blocked,
            job=letter.job,
            stage=letter.stage,
            reason=BLOCKED,
            message=f"waits for turn {letter.entry_id} of its conversation ({letter.reason})",
            prompt_id=blocked,
            source=letter.source,
            payload={"blocked_by": letter.entry_id},
            worker=letter.worker,
        )
        for blocked in conversation.turn_ids(turn + 1)
    ]


def checkpoint_settled(
    pipe: redis.client.Pipeline,
    job: str,
    chunk_id: str,
    conversation_id: str,
    settled: list[str],
    answers: Mapping[str, bytes] | None,
) -> None:
    """Write where a conversation of a chunk stands, as the hand-offs of its `settled`
    turns would have: their ids marked generated in the chunk and their `answers` (turn
    -> answer JSON) in its checkpoint; answers None:
    the conversation is settled whole, its checkpoint dropped. A delivery of the chunk
    then resumes it after them (consumers/generate/turn_state.py). For what Redis lost:
    `regen recover` (a chunk it still holds) and the job's enqueue (one it lost).

    Both expire after RECOVERED_ANSWERS_TTL_S, not the chunk state's 8 hours: the chunk
    may wait on its queue longer than that before a delivery takes it (a paused fleet, a
    long backlog), and a delivery that found them gone would generate the settled turns
    again and build the next ones on other answers than the shards hold. The delivery's
    own hand-offs set the usual expiry from then on."""
    generated = keys.chunk_generated(job, chunk_id)
    pipe.sadd(generated, *settled)
    pipe.expire(generated, defaults.RECOVERED_ANSWERS_TTL_S)
    checkpoint = keys.conversation_answers(job, chunk_id, conversation_id)
    if answers is None:
        pipe.delete(checkpoint)
        return
    mapping: dict[FieldT, EncodableT] = {turn: answer for turn, answer in answers.items()}
    pipe.hset(checkpoint, mapping=mapping)
    pipe.expire(checkpoint, defaults.RECOVERED_ANSWERS_TTL_S)
