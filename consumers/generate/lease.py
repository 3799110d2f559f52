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
local count of held messages (lease_celery.py). See docs/design.md, Delivery protocol.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from typing import NamedTuple, TypeVar

import orjson
import redis

from regen.common import defaults, keys, settings
from regen.common.backoff import Backoff
from regen.common.connection import OUTAGE_ERRORS
from regen.common.results import FIELD as RESULT_FIELD

log = logging.getLogger("regen.generate")
# Waits between tries of a write while Redis is unreachable.
REDIS_RETRY = Backoff(base_s=0.5, max_s=30.0, jitter=0.5)

Attempt = dict[str, object]
T = TypeVar("T")

# KEYS: unacked_index, then per lease its attempts list, write count and generated set.
# ARGV: now, state TTL, then per lease its delivery tag ('' = none) and attempt index.
# Renews the leases still held (and, when half gone, the TTL of their chunk's state);
# returns the 1-based positions of the leases lost.
_RENEW_LUA = """
local lost = {}
local ttl = tonumber(ARGV[2])
for i = 1, (#KEYS - 1) / 3 do
  local attempts, writes, generated = KEYS[3 * i - 1], KEYS[3 * i], KEYS[3 * i + 1]
  local tag = ARGV[2 * i + 1]
  local held = redis.call('LLEN', attempts) == tonumber(ARGV[2 * i + 2]) + 1
  if held and tag ~= '' then held = redis.call('ZSCORE', KEYS[1], tag) ~= false end
  if held then
    if tag ~= '' then redis.call('ZADD', KEYS[1], 'XX', ARGV[1], tag) end
    for _, key in ipairs({attempts, writes, generated}) do
      if redis.call('TTL', key) < ttl / 2 then redis.call('EXPIRE', key, ttl) end
    end
  else
    table.insert(lost, i)
  end
end
return lost
"""


# KEYS: unacked_index, unacked, the chunk's generated set, its write count; ARGV: the
# delivery tag. kombu's ack, and the end of the chunk's `generated` set (one id per
# prompt) and write count once it is acked: nothing redelivers an acked chunk (kombu's
# restore is a transaction watching `unacked`, which this HDEL changes), so they would
# only wait out their TTL. If the
# sweep restored the delivery after the lease check (its tag is gone from the index),
# the chunk is queued again and the set stays for its next delivery. The attempts list
# (one entry per delivery) stays for its TTL: the chunk's history (docs/design.md,
# Delivery protocol).
_ACK_LUA = """
local acked = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if acked == 1 then redis.call('DEL', KEYS[3], KEYS[4]) end
return acked
"""

# KEYS: attempts list, write count; ARGV: the attempt's JSON, state TTL.
# A delivery starts: its attempt appended, the chunk's write count set to 0 for it.
# Returns every attempt so far (this one last).
_START_LUA = """
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], 0, 'EX', ARGV[2])
return redis.call('LRANGE', KEYS[1], 0, -1)
"""

# KEYS: attempts list, unacked_index, write count, generated set, results stream, then
# the conversations' checkpoint keys (`--turns all`).
# ARGV: attempt index, delivery tag ('' = none), writes made, state TTL, the stream's
# field name, then per result: its prompt id, its encoded result, the position in KEYS
# of its checkpoint (0 = none), the checkpoint's field and the answer ('' deletes it).
# The lease check of `ChunkLease.write` and a batch of hand-offs in one atomic step: each
# result is added to the stream with its prompt's mark (and a turn's answer with it),
# unless the prompt was settled already (a retry whose first try landed). Returns
# {0, flag per result: 1 handed off, 0 already settled}, or {status} (_LOST_WHY) when
# this delivery does not hold the chunk (nothing written).
_HAND_OFF_LUA = """
if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[1]) + 1 then return {1} end
if ARGV[2] ~= '' and redis.call('ZSCORE', KEYS[2], ARGV[2]) == false then return {2} end
local writes = tonumber(redis.call('GET', KEYS[3]))
local made = tonumber(ARGV[3])
if writes ~= made and writes ~= made + 1 then return {3} end
redis.call('SET', KEYS[3], made + 1, 'EX', ARGV[4])
local flags = {0}
for i = 6, #ARGV, 5 do
  local fresh = redis.call('SADD', KEYS[4], ARGV[i])
  if fresh == 1 then
    redis.call('XADD', KEYS[5], '*', ARGV[5], ARGV[i + 1])
    local at = tonumber(ARGV[i + 2])
    if at > 0 and ARGV[i + 4] == '' then
      redis.call('DEL', KEYS[at])
    elseif at > 0 then
      redis.call('HSET', KEYS[at], ARGV[i + 3], ARGV[i + 4])
      redis.call('EXPIRE', KEYS[at], ARGV[4])
    end
  end
  table.insert(flags, fresh)
end
redis.call('EXPIRE', KEYS[4], ARGV[4])
return flags
"""
_LOST_WHY = {
    1: "a later delivery of the chunk started",
    2: "its delivery went back to the queue",
    3: "Redis lost writes of this delivery (restored from an older copy)",
}

# KEYS: unacked, the chunk's attempts list, the job's chunks hash, the list the message
# was popped from. ARGV: delivery tag, this delivery's attempt index, chunk id, the
# message as popped. A delivery whose lease was lost puts its message back (RPUSH: the
# tail BRPOP took it from) only when Redis holds it nowhere: not in `unacked` (held, or
# waiting for the sweep), the attempts list without this delivery's start (so Redis is
# behind it: it was neither acked nor restored since), the chunk published (a copy
# taken before its publish lost its ids too: the producer publishes it again), and the
# message not on its list (found by its bytes, else by its tag, a UUID: a copy kombu
# restored carries the redelivered flag; the scan runs only when all else says
# forgotten). Returns 1 when put back.
_HAND_BACK_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('LLEN', KEYS[2]) > tonumber(ARGV[2]) then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 0 then return 0 end
if redis.call('LPOS', KEYS[4], ARGV[4]) then return 0 end
for _, queued in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
  if string.find(queued, ARGV[1], 1, true) then return 0 end
end
redis.call('RPUSH', KEYS[4], ARGV[4])
return 1
"""


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


def _attempt(worker: str, status: str, error: str | None = None) -> bytes:
    return orjson.dumps({"worker": worker, "time": time.time(), "status": status, "error": error})


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
        ttl = defaults.CHUNK_STATE_TTL_S

        def run() -> list[int]:
            # The count this delivery has written so far: the same in a retry.
            argv = [self.attempt, self.tag or "", self.writes, ttl, RESULT_FIELD, *per_result]
            return [int(x) for x in self._book.hand_off_script(keys=lua_keys, args=argv, client=r)]

        status, *flags = self._retrying(run)
        if status:
            self.mark_lost(_LOST_WHY[status])
            raise LeaseLost(_LOST_WHY[status])
        self.writes += 1
        return [flag == 1 for flag in flags]

    def _retrying(self, write: Callable[[], T]) -> T:
        """Run `write`, waiting out a Redis outage for up to one lease."""
        deadline = time.monotonic() + settings.current().visibility_timeout_s
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
                    pipe.set(self.writes_key, self.writes + 1, ex=defaults.CHUNK_STATE_TTL_S)
                    fill(pipe)
                    pipe.execute()
                    self.writes += 1
                    return True
                except redis.WatchError:
                    continue

    def _check(self, pipe: redis.client.Pipeline) -> None:
        writes = pipe.get(self.writes_key)
        if pipe.llen(self.attempts_key) != self.attempt + 1:
            why = _LOST_WHY[1]
        elif self.tag is not None and pipe.zscore(keys.KOMBU_UNACKED_INDEX, self.tag) is None:
            why = _LOST_WHY[2]
        elif writes is None or int(writes) not in (self.writes, self.writes + 1):
            why = _LOST_WHY[3]
        else:
            # One more than this delivery counted: its last write landed, the reply lost.
            # Counted now, so a rollback that loses that write is seen too.
            self.writes = int(writes)
            return
        pipe.unwatch()
        self.mark_lost(why)
        raise LeaseLost(why)

    # --- settling the delivery ---------------------------------------------------------

    def finish(self, r: redis.Redis, worker: str, status: str = "done") -> None:
        """End the attempt and acknowledge the delivery (every prompt is settled)."""

        ack = r.register_script(_ACK_LUA)
        lua_keys = [keys.KOMBU_UNACKED_INDEX, keys.KOMBU_UNACKED, self.generated_key,
                    self.writes_key]  # fmt: skip

        def fill(pipe: redis.client.Pipeline) -> None:
            self._end(pipe, worker, status)
            if self.tag is not None:
                ack(keys=lua_keys, args=[self.tag], client=pipe)

        self.ending = True
        self.write(r, fill)
        self._mark_settled()

    def give_back(self, r: redis.Redis, worker: str, status: str, error: str | None = None) -> None:
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
            self._end(pipe, worker, "lost")
            pipe.execute()
        except redis.RedisError as exc:  # only history: the chunk is another's now
            log.warning("chunk %s: could not record the lost attempt: %s", self.chunk_id, exc)

    def hand_back_if_forgotten(self, r: redis.Redis) -> bool:
        """Put the message back on its queue when Redis holds it nowhere; whether it did.

        A copy of Redis (a backup, a lagging replica) taken between kombu's BRPOP of this
        message and its record in `unacked` has the chunk neither queued nor delivered:
        restored, it holds it nowhere, and this delivery's lease is lost (its attempt is
        not in the copy), so without this its prompts would be in no place for good.
        This worker still has the message as popped (docs/design.md, Delivery protocol).
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
        self, pipe: redis.client.Pipeline, worker: str, status: str, error: str | None = None
    ) -> None:
        # redis-py's stub types LSET's value as str only; bytes are sent as they are.
        pipe.lset(self.attempts_key, self.attempt, _attempt(worker, status, error))  # type: ignore[arg-type]


class LeaseBook:
    """The chunks this worker holds: renewed with every heartbeat."""

    def __init__(self, r: redis.Redis) -> None:
        self.redis = r  # a lost lease's hand-back (ChunkLease.hand_back_if_forgotten)
        self._lock = threading.Lock()
        self._held: dict[int, ChunkLease] = {}
        self._settled: Counter[str | None] = Counter()
        # Delivery tag -> (the list it was popped from, the message as popped), for the
        # messages this worker holds: what a lost lease puts back if Redis forgot it.
        self._popped: dict[str, tuple[bytes, bytes]] = {}
        self._renew = r.register_script(_RENEW_LUA)
        self._start = r.register_script(_START_LUA)
        self.hand_off_script = r.register_script(_HAND_OFF_LUA)
        self.hand_back_script = r.register_script(_HAND_BACK_LUA)

    def start(
        self, job: str, chunk_id: str, tag: str | None, worker: str
    ) -> tuple[ChunkLease, list[Attempt]]:
        """Record a delivery's attempt and hold its lease; returns it with every attempt
        so far. An attempt stays "started" unless it ends, so started attempts other
        than this one are deliveries whose worker died (or still runs elsewhere)."""
        lua_keys = [keys.chunk_attempts(job, chunk_id), keys.chunk_writes(job, chunk_id)]
        argv: list[bytes | int] = [_attempt(worker, "started"), defaults.CHUNK_STATE_TTL_S]
        history = self._start(keys=lua_keys, args=argv)
        lease = ChunkLease(self, job, chunk_id, tag, len(history) - 1)
        with self._lock:
            self._held[id(lease)] = lease
        return lease, [orjson.loads(h) for h in history]

    def release(self, lease: ChunkLease) -> None:
        """Stop renewing: the chunk's run is over, settled or not (an unsettled one
        comes back when its lease runs out)."""
        with self._lock:
            self._held.pop(id(lease), None)

    @property
    def held(self) -> int:
        with self._lock:
            return len(self._held)

    def renew(self) -> None:
        """Move every held lease's score to now; mark those another delivery took."""
        with self._lock:
            leases = list(self._held.values())
        if not leases:
            return
        lua_keys = [keys.KOMBU_UNACKED_INDEX]
        args: list[str | int | float] = [time.time(), defaults.CHUNK_STATE_TTL_S]
        for lease in leases:
            lua_keys += [lease.attempts_key, lease.writes_key, lease.generated_key]
            args += [lease.tag or "", lease.attempt]
        for position in self._renew(keys=lua_keys, args=args):
            lost = leases[int(position) - 1]
            if lost.ending:
                continue
            lost.mark_lost("its delivery was restored or redelivered while this worker was away")
            self.release(lost)

    # --- the messages held, as popped -------------------------------------------------

    def popped(self, tag: str, source: bytes, raw: bytes) -> None:
        """kombu delivered the message `raw`, popped from the list `source` (screen.py)."""
        with self._lock:
            self._popped[tag] = (source, raw)

    def forget_popped(self, tag: str | None) -> None:
        """The delivery is acknowledged or rejected: nothing of it to put back."""
        with self._lock:
            self._popped.pop(tag or "", None)

    def popped_message(self, tag: str | None) -> tuple[bytes, bytes] | None:
        with self._lock:
            return self._popped.get(tag or "")

    # --- what Celery must leave alone --------------------------------------------------

    def mark_settled(self, tag: str | None) -> None:
        with self._lock:
            self._settled[tag] += 1

    def take_settled(self, tag: str | None) -> bool:
        """Whether regen settled this delivery itself (then Celery must not ack or
        reject it in Redis); asked once per delivery."""
        with self._lock:
            if self._settled[tag] <= 0:
                return False
            self._settled[tag] -= 1
            if not self._settled[tag]:
                del self._settled[tag]
            return True
