"""Conversations (`--turns all`) whose chunk Redis lost while the shards hold their first
turns.

Redis restored from a copy taken before a conversation's chunk was published loses the
conversation whole, while a shard may hold its first turns: `regen recover` puts those
back in the committed index and saves their answers (`keys.recovered_answers`,
consumers/tokenize/recover_turns.py), and the job's enqueue finds the conversation's first turn
settled though not in the job. Its later turns are in no place, so the enqueue publishes
the conversation again, whole, with its new chunk's state written first as the
hand-offs of those turns would have left it: the turns marked generated and their
answers checkpointed (common/conversation.py `checkpoint_settled`). The generate worker
resumes it after them, on their answers, as it resumes any redelivered chunk.

Without the answers (recover was not run after Redis lost the job, or they expired), the
conversation cannot resume: its first open turn is dead-lettered `history_lost` and the
open turns after it are blocked behind it, so every turn stays accounted for.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import redis

from regen.common import keys
from regen.common.chunk import ChunkPrompt
from regen.common.conversation import Conversation, blocked_letters, checkpoint_settled
from regen.common.dlq import DeadLetter
from regen.producer.rows import Reason


@dataclass(frozen=True)
class _Resume:
    settled: list[str]  # the ids of the conversation's committed turns, a prefix
    answers: dict[str, bytes]  # turn -> its answer's JSON, as a checkpoint holds it


class LostTurns:
    """The conversations one enqueue resumes after their committed turns (module doc)."""

    def __init__(self, r: redis.Redis, job: str) -> None:
        self._r = r
        self._job = job
        self._key = keys.recovered_answers(job)
        self._resumes: dict[str, _Resume] = {}  # conversation id -> until published

    def resume(self, conversations: list[tuple[Conversation, list[bool]]]) -> list[bool]:
        """For each conversation and whether each of its turns is settled, whether it can
        resume: its settled turns are its first ones and their answers are saved. Those
        that can are resumed when published (`checkpoint`)."""
        wanted = [c.turn_ids()[: _prefix(flags)] for c, flags in conversations]
        flat = [tid for ids in wanted for tid in ids]
        saved = cast("list[bytes | None]", self._r.hmget(self._key, flat) if flat else [])
        answers = iter(saved)
        out = []
        for (conversation, flags), ids in zip(conversations, wanted, strict=True):
            found = [next(answers) for _ in ids]
            ok = _prefix(flags) == flags.count(True) and None not in found
            if ok:
                by_turn = {
                    str(conversation.start + i): answer
                    for i, answer in enumerate(found)
                    if answer is not None  # none is: `ok`
                }
                self._resumes[conversation.id] = _Resume(ids, by_turn)
            out.append(ok)
        return out

    def checkpoint(self, chunk_id: str, prompts: list[ChunkPrompt]) -> list[str]:
        """Write the state of chunk `chunk_id` for the conversations among `prompts` that
        resume, before the chunk is published (its id changes when another producer takes
        some prompts, so once per attempt); returns their conversation ids."""
        resumed = [
            p.conversation.id
            for p in prompts
            if p.conversation is not None and p.conversation.id in self._resumes
        ]
        if not resumed:
            return []
        pipe = self._r.pipeline(transaction=True)
        for conversation_id in resumed:
            plan = self._resumes[conversation_id]
            checkpoint_settled(pipe, self._job, chunk_id, conversation_id, plan.settled,
                               plan.answers)  # fmt: skip
        pipe.execute()
        return resumed

    def published(self, conversation_ids: list[str]) -> None:
        """The conversations are in a chunk again: drop their saved answers."""
        self.forget([tid for cid in conversation_ids for tid in self._resumes.pop(cid).settled])

    def forget(self, turn_ids: list[str]) -> None:
        """Drop the saved answers of turns whose conversation needs them no more."""
        if turn_ids:
            self._r.hdel(self._key, *turn_ids)

    def clear(self) -> None:
        """Forget conversations that were not published (refused when rendered)."""
        self._resumes.clear()


def _prefix(flags: list[bool]) -> int:
    """How many of the first turns are settled."""
    return next((i for i, flag in enumerate(flags) if not flag), len(flags))


def history_lost_letters(
    job: str, conversation: Conversation, settled: list[bool], source: dict[str, Any]
) -> list[DeadLetter]:
    """The dead letters of a conversation's open turns that cannot resume: its first open
    turn's, `history_lost`, and the open ones after it blocked behind it."""
    ids = conversation.turn_ids()
    first = _prefix(settled)
    committed = [tid for tid, flag in zip(ids, settled, strict=True) if flag]
    letter = DeadLetter(
        entry_id=ids[first],
        job=job,
        stage="input",
        reason=Reason.HISTORY_LOST,
        message=(
            f"turn(s) {', '.join(committed)} of its conversation are settled (in a shard or "
            "a DLQ) but Redis lost the conversation and has no answers saved for them, so "
            "it cannot resume on them; `regen recover --job "
            f"{job} --out OUT` saves them from the shards: run it first, before the job's "
            "enqueue, whenever Redis comes back behind the disk"
        ),
        prompt_id=ids[first],
        source=dict(source),
        payload={"settled": committed},
    )
    open_turns = {tid for tid, flag in zip(ids, settled, strict=True) if not flag}
    later = blocked_letters(letter, conversation, conversation.start + first)
    return [letter, *(each for each in later if each.entry_id in open_turns)]
