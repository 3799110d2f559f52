"""Chunk leases: a generate worker holds a delivered chunk only while it renews it.

kombu's Redis transport keeps each delivered, unacknowledged message in `unacked` and its
delivery time in the `unacked_index` sorted set; the sweep every consumer runs restores
a message whose score is older than the visibility timeout. regen makes that timeout a
short lease: each heartbeat moves the scores of the chunks a worker holds to now, so a
live worker keeps a chunk however long it runs, while a dead worker's chunks are restored
one lease after its last beat.

A worker holds a chunk while (a) its attempt is the chunk's latest (every delivery that
starts appends one), (b) the delivery is still in `unacked_index` (not restored to the
queue) and (c) the chunk's write count is the one this delivery last wrote (Redis
restored from an older copy lost some of its writes: a rollback cannot fake a count the
worker holds in memory). Every write a chunk makes checks all three inside the
transaction that writes (watching the attempts list and the count; a hand-off of
results checks them in its script), so a worker frozen past its lease that comes back
writes nothing for a chunk another delivery took, and a delivery whose writes Redis
lost is never acknowledged: it comes back and redoes them. The worker settles each
delivery itself, in the same kind of transaction: done removes it from kombu's keys, a
give-back sets its score to 0 so the next sweep restores it, and a lost lease touches
nothing (the delivery belongs to whoever holds it now). Celery then only updates its
local count of held messages (celery_delivery.py). The keys and scripts each write
touches are state.py's; the book of leases a worker holds and renews is lease_book.py's. See
docs/design/delivery.md, Delivery protocol.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, TypeVar

import redis

from regen.common import keys
from regen.common.backoff import REDIS_RETRY
from regen.common.connection import OUTAGE_ERRORS
from regen.common.results import FIELD as RESULT_FIELD
from regen.consumers.generate.chunk_life.outcome import AttemptStatus
from regen.consumers.generate.chunk_life.policy import lease_s
from regen.consumers.generate.chunk_life.state import (
    ACK_LUA,
    CHUNK_STATE_TTL_S,
    LOST_WHY,
    attempt_entry,
)

if TYPE_CHECKING:
    from regen.consumers.generate.chunk_life.lease_book import LeaseBook

log = logging.getLogger("regen.generate")

T = TypeVar("T")


class LeaseLost(Exception):
    """Another delivery of the chunk holds it now (or Redis lost writes of this one):
    this one's work is dropped."""


class Checkpoint(NamedTuple):
    """A conversation's checkpoint, written with a turn's hand-off (`--turns all`):
    `answer` under `field` of the hash `key`, or the hash deleted (answer None: the
    conversation's last turn)."""

    key: str
    field: str
    answer: bytes | None


class HandOff(NamedTuple):
    """One result for the results stream: its prompt id, the encoded result, and for a
    turn its conversation's checkpoint."""

    prompt_id: str
    encoded: bytes
    checkpoint: Checkpoint | None = None


class QueuedChunk(NamedTuple):
    """A new chunk for the queue, rendered as kombu would send it: its id, its prompt
    count, the list it goes on and the message."""

    chunk_id: str
    size: int
    queue_list: str
    message: bytes


class ChunkLease:
    """One delivery of one chunk to this worker: its attempt and its kombu delivery tag."""

    def __init__(
        self, book: LeaseBook, job: str, chunk_id: str, tag: str | None, attempt: int
    ) -> None:
        self.job = job
        self.chunk_id = chunk_id
        # The same in every delivery of a message (kombu sets it at publish); None when
        # the chunk did not come through kombu's Redis transport.
        self.tag = tag
        self.attempt = attempt
        # Writes made under this lease; Redis holds the same count (check (c) above).
        # Writes run one at a time, on the chunk's thread.
        self.writes = 0
        self.lost = threading.Event()
        self._book = book
        self._on_lost: list[Callable[[], None]] = []
        self._settled = False
        # Set just before the write that ends the attempt: from then on that write's
        # own check decides (a renewal racing it would find its own ack as a loss).
        self.ending = False

    @property
    def attempts_key(self) -> str:
        return keys.chunk_attempts(self.job, self.chunk_id)

    @property
    def writes_key(self) -> str:
        return keys.chunk_writes(self.job, self.chunk_id)

    @property
    def generated_key(self) -> str:
        return keys.chunk_generated(self.job, self.chunk_id)

    # --- losing it ---------------------------------------------------------------------

    def on_lost(self, callback: Callable[[], None]) -> None:
        """Run `callback` (from any thread) once the lease is known lost."""
        self._on_lost.append(callback)
        if self.lost.is_set():
            callback()

    def mark_lost(self, why: str) -> None:
        if self.lost.is_set():
            return
        self.lost.set()
        self._mark_settled()
        log.warning(
            "chunk %s of %s: lease lost (%s); its results from here on are dropped",
            self.chunk_id,
            self.job,
            why,
        )
        for callback in self._on_lost:
            callback()
        # At once (the heartbeat's renewal finds most losses), not when the chunk's
        # thread unwinds: a worker that dies before it puts the message back loses it.
        self.hand_back_if_forgotten(self._book.redis)

    def _mark_settled(self) -> None:
        """Celery must not ack or reject this delivery in Redis: regen has settled it."""
        if not self._settled:
            self._settled = True
            self._book.mark_settled(self.tag)

    # --- writing under the lease -------------------------------------------------------

    def write(
        self,
        r: redis.Redis,
        fill: Callable[[redis.client.Pipeline], None],
        prompt_id: str | None = None,
    ) -> bool:
        """Run `fill`'s commands in one MULTI if this delivery still holds the chunk.

        Raises LeaseLost when it does not. With `prompt_id`, writes nothing (and returns
        False) when that prompt is already settled: a retry whose first try landed but
        whose reply was lost. A Redis outage is waited out for up to one lease; past it
        the lease has run out anyway, and the error is raised.
        """
        return self._retrying(lambda: self._write_once(r, fill, prompt_id))

    def hand_off(self, r: redis.Redis, stream: str, results: Sequence[HandOff]) -> list[bool]:
        """Add results to the results stream, each atomically with its prompt's mark in
        the chunk's `generated` set (and a turn's checkpoint), in one script that checks
        the lease as `write` does; one round trip for the batch. Returns, per result,
        whether it was handed off now (False: it was already settled). Raises LeaseLost
        when this delivery no longer holds the chunk (nothing written). A Redis outage
        is waited out as `write` does."""
        lua_keys = [self.attempts_key, keys.KOMBU_UNACKED_INDEX, self.writes_key,
                    self.generated_key, stream]  # fmt: skip
        per_result: list[str | bytes | int] = []
        for result in results:
            at, field, answer = 0, "", b""
            if result.checkpoint is not None:
                lua_keys.append(result.checkpoint.key)
                at, field = len(lua_keys), result.checkpoint.field
                answer = result.checkpoint.answer or b""
            per_result += [result.prompt_id, result.encoded, at, field, answer]
        ttl = CHUNK_STATE_TTL_S

        def run() -> list[int]:
            # The count this delivery has written so far: the same in a retry.
            argv = [self.attempt, self.tag or "", self.writes, ttl, RESULT_FIELD, *per_result]
            return [int(x) for x in self._book.hand_off_script(keys=lua_keys, args=argv, client=r)]

        status, *flags = self._retrying(run)
        if status:
            self.mark_lost(LOST_WHY[status])
            raise LeaseLost(LOST_WHY[status])
        self.writes += 1
        return [flag == 1 for flag in flags]

    def give_back_unstarted(
        self, r: redis.Redis, prompt_ids: Sequence[str], new_chunks: Sequence[QueuedChunk]
    ) -> None:
        """Put prompts this delivery has not started back on the queue as `new_chunks`,
        marking them settled for this chunk, in one script that checks the lease as
        `write` does (docs/design/placement.md, "Only what can start soon"). Raises LeaseLost when
        this delivery no longer holds the chunk (nothing written); a Redis outage is
        waited out as `write` does."""
        lua_keys = [self.attempts_key, keys.KOMBU_UNACKED_INDEX, self.writes_key,
                    self.generated_key, keys.job_chunks(self.job)]  # fmt: skip
        per_chunk: list[str | bytes | int] = []
        for new in reversed(new_chunks):  # RPUSHed last first: BRPOP takes them in order
            lua_keys.append(new.queue_list)
            per_chunk += [new.chunk_id, new.size, new.message]

        def run() -> list[int]:
            argv = [self.attempt, self.tag or "", self.writes, CHUNK_STATE_TTL_S,
                    len(prompt_ids), *prompt_ids, *per_chunk]  # fmt: skip
            script = self._book.give_back_unstarted_script
            return [int(x) for x in script(keys=lua_keys, args=argv, client=r)]

        status = self._retrying(run)[0]
        if status:
            self.mark_lost(LOST_WHY[status])
            raise LeaseLost(LOST_WHY[status])
        self.writes += 1

    def _retrying(self, write: Callable[[], T]) -> T:
        """Run `write`, waiting out a Redis outage for up to one lease."""
        deadline = time.monotonic() + lease_s()
        failures = 0
        while True:
            try:
                return write()
            except OUTAGE_ERRORS as exc:
                if time.monotonic() > deadline:
                    raise
                delay = REDIS_RETRY.delay(failures)
                failures += 1
                log.warning(
                    "chunk %s: Redis unreachable (%s); retrying in %.1f s",
                    self.chunk_id,
                    exc,
                    delay,
                )
                time.sleep(delay)

    def _write_once(
        self,
        r: redis.Redis,
        fill: Callable[[redis.client.Pipeline], None],
        prompt_id: str | None,
    ) -> bool:
        with r.pipeline() as pipe:
            while True:
                try:
                    # A delivery that starts appends to the attempts list and resets
                    # the count: watching both makes the check below hold until EXEC.
                    pipe.watch(self.attempts_key, self.writes_key)
                    self._check(pipe)
                    if prompt_id is not None and pipe.sismember(self.generated_key, prompt_id):
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    # Before `fill`: an ack in it deletes the count with the chunk state.
                    pipe.set(self.writes_key, self.writes + 1, ex=CHUNK_STATE_TTL_S)
                    fill(pipe)
                    pipe.execute()
                    self.writes += 1
                    return True
                except redis.WatchError:
                    continue

    def _check(self, pipe: redis.client.Pipeline) -> None:
        writes = pipe.get(self.writes_key)
        if pipe.llen(self.attempts_key) != self.attempt + 1:
            why = LOST_WHY[1]
        elif self.tag is not None and pipe.zscore(keys.KOMBU_UNACKED_INDEX, self.tag) is None:
            why = LOST_WHY[2]
        elif writes is None or int(writes) not in (self.writes, self.writes + 1):
            why = LOST_WHY[3]
        else:
            # One more than this delivery counted: its last write landed, the reply lost.
            # Counted now, so a rollback that loses that write is seen too.
            self.writes = int(writes)
            return
        pipe.unwatch()
        self.mark_lost(why)
        raise LeaseLost(why)

    # --- settling the delivery ---------------------------------------------------------

    def finish(
        self, r: redis.Redis, worker: str, status: AttemptStatus = AttemptStatus.DONE
    ) -> None:
        """End the attempt and acknowledge the delivery (every prompt is settled)."""

        ack = r.register_script(ACK_LUA)
        lua_keys = [keys.KOMBU_UNACKED_INDEX, keys.KOMBU_UNACKED, self.generated_key,
                    self.writes_key]  # fmt: skip

        def fill(pipe: redis.client.Pipeline) -> None:
            self._end(pipe, worker, status)
            if self.tag is not None:
                ack(keys=lua_keys, args=[self.tag], client=pipe)

        self.ending = True
        self.write(r, fill)
        self._mark_settled()

    def give_back(
        self, r: redis.Redis, worker: str, status: AttemptStatus, error: str | None = None
    ) -> None:
        """End the attempt and expire the lease: the next sweep puts the chunk back on its
        queue (prompts already settled stay done)."""

        def fill(pipe: redis.client.Pipeline) -> None:
            self._end(pipe, worker, status, error)
            if self.tag is not None:
                pipe.zadd(keys.KOMBU_UNACKED_INDEX, {self.tag: 0}, xx=True)

        self.ending = True
        self.write(r, fill)
        self._mark_settled()

    def record_lost(self, r: redis.Redis, worker: str) -> None:
        """Say in the chunk's history that this attempt was dropped, not dead."""
        try:
            pipe = r.pipeline()
            self._end(pipe, worker, AttemptStatus.LOST)
            pipe.execute()
        except redis.RedisError as exc:  # only history: the chunk is another's now
            log.warning("chunk %s: could not record the lost attempt: %s", self.chunk_id, exc)

    def hand_back_if_forgotten(self, r: redis.Redis) -> bool:
        """Put the message back on its queue when Redis holds it nowhere; whether it did.

        A copy of Redis (a backup, a lagging replica) taken between kombu's BRPOP of this
        message and its record in `unacked` has the chunk neither queued nor delivered:
        restored, it holds it nowhere, and this delivery's lease is lost (its attempt is
        not in the copy), so without this its prompts would be in no place for good.
        This worker still has the message as popped (docs/design/delivery.md, Delivery protocol).
        """
        popped = self._book.popped_message(self.tag)
        if popped is None:
            return False
        source, raw = popped
        lua_keys: list[str | bytes] = [
            keys.KOMBU_UNACKED, self.attempts_key, keys.job_chunks(self.job), source
        ]  # fmt: skip
        try:
            back = self._book.hand_back_script(
                keys=lua_keys, args=[self.tag or "", self.attempt, self.chunk_id, raw], client=r
            )
        except redis.RedisError as exc:
            log.error("chunk %s: could not check whether Redis still holds it: %s",
                      self.chunk_id, exc)  # fmt: skip
            return False
        if back:
            log.warning(
                "chunk %s of %s: Redis holds it nowhere (restored from a copy taken as it "
                "was popped); put back on its queue",
                self.chunk_id,
                self.job,
            )
        return bool(back)

    def _end(
        self,
        pipe: redis.client.Pipeline,
        worker: str,
        status: AttemptStatus,
        error: str | None = None,
    ) -> None:
        # redis-py's stub types LSET's value as str only; bytes are sent as they are.
        pipe.lset(self.attempts_key, self.attempt, attempt_entry(worker, status, error))  # type: ignore[arg-type]
