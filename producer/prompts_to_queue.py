"""Which of a buffer's prompts to queue: not those already in the job (exact duplicates,
or enqueued by another producer or an earlier run), nor those settled though Redis lost
them from the job's ids (committed to a shard or dead-lettered, after `regen recover`).
A conversation whose first turns are settled and the others in no place (Redis lost its
chunk) resumes after them, or, without their answers, has its open turns dead-lettered
(producer/lost_turns.py)."""

from __future__ import annotations

import redis

from regen.common import dlq
from regen.common.conversation import Conversation
from regen.common.ledger.committed_index import committed_index
from regen.common.ledger.job_ids import JobIds
from regen.producer.enqueue_stats import EnqueueStats
from regen.producer.input_refusals import Refusals
from regen.producer.lost_turns import LostTurns, history_lost_letters
from regen.producer.pending_prompt import Pending, turn_ids
from regen.producer.rows import Reason


class KnownPrompts:
    def __init__(
        self,
        r: redis.Redis,
        job: str,
        ids: JobIds,
        lost: LostTurns,
        refusals: Refusals,
        stats: EnqueueStats,
    ) -> None:
        self._r = r
        self._job = job
        self._ids = ids
        self._committed = committed_index(r, job)
        self._lost = lost
        self._refusals = refusals
        self._stats = stats

    def drop_known(self, buffer: list[Pending]) -> list[Pending]:
        """The buffer's prompts to queue: less those already in the job or earlier in
        this buffer (counted duplicates), and those already settled."""
        if not buffer:
            return []
        ids = [item.id for item in buffer]
        known = self._ids.contains(ids)
        unknown: dict[str, Pending] = {}
        for item, pid, is_known in zip(buffer, ids, known, strict=True):
            if not is_known:
                unknown.setdefault(pid, item)
        settled, dropped = self._settled(list(unknown.values()))
        seen: set[str] = set()
        fresh = []
        for item, pid, is_known in zip(buffer, ids, known, strict=True):
            if is_known or pid in seen:
                self._stats.duplicates += 1
            elif pid in settled:
                self._stats.already_settled += 1
            elif pid not in dropped:
                fresh.append(item)
            seen.add(pid)
        return fresh

    def _settled(self, items: list[Pending]) -> tuple[set[str], set[str]]:
        """Of prompts not in the job's ids: the ids of those settled, every turn committed
        to a shard or dead-lettered, put back into the job's ids so every place they are
        in counts them, and not queued again; and the ids of conversations not queued for
        another reason (the module doc)."""
        whole: list[Pending] = []
        lost: list[tuple[Pending, Conversation, list[bool]]] = []
        for item, flags in zip(items, self._turns_settled(items), strict=True):
            if all(flags):
                whole.append(item)
            elif flags[0] and item.conversation is not None:  # a prompt alone: all or none
                lost.append((item, item.conversation, flags))
        self._ids.add([tid for item in whole for tid in turn_ids(item)])
        self._lost.forget([tid for item in whole if item.conversation for tid in turn_ids(item)])
        return {item.id for item in whole}, self._refuse_unresumable(lost)

    def _turns_settled(self, items: list[Pending]) -> list[list[bool]]:
        """Whether each turn of each prompt (a prompt: its one id) is settled; the later
        turns of a conversation are looked up only when its first is settled."""
        firsts = self._is_settled([item.id for item in items])
        later = [
            turn_ids(item)[1:] if first else [] for item, first in zip(items, firsts, strict=True)
        ]
        flags = iter(self._is_settled([tid for ids in later for tid in ids]))
        pairs = zip(firsts, later, strict=True)
        return [[first, *(next(flags) for _ in ids)] for first, ids in pairs]

    def _is_settled(self, ids: list[str]) -> list[bool]:
        """Whether each id is committed to a shard (or claimed) or dead-lettered."""
        committed = self._committed.get(ids)
        dead = dlq.dead_lettered(self._r, self._job, ids)
        pairs = zip(committed, dead, strict=True)
        return [shard is not None or is_dead for shard, is_dead in pairs]

    def _refuse_unresumable(self, lost: list[tuple[Pending, Conversation, list[bool]]]) -> set[str]:
        """Of conversations Redis lost whose first turns are settled, those that can
        resume stay to be published; the others' open turns are dead-lettered. Returns
        the ids of the conversations not to queue."""
        if not lost:
            return set()
        resumable = self._lost.resume([(conversation, flags) for _, conversation, flags in lost])
        stuck = [each for each, ok in zip(lost, resumable, strict=True) if not ok]
        # Another producer may have resumed one meanwhile, dropping its answers.
        again = self._ids.contains([item.id for item, _, _ in stuck])
        dropped: set[str] = set()
        for (item, conversation, flags), is_in in zip(stuck, again, strict=True):
            dropped.add(item.id)
            if is_in:
                self._stats.duplicates += 1
                continue
            letters = history_lost_letters(self._job, conversation, flags, item.source)
            self._refusals.put(letters, conversation.turn_ids())
            self._lost.forget(conversation.turn_ids())
            self._refusals.count(Reason.HISTORY_LOST)
        return dropped
