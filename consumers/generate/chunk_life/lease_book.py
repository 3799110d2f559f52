"""The chunks a generate worker holds: each delivery's start (its attempt recorded, its
lease taken), the renewal of every lease with each heartbeat, and what Celery must leave
alone (deliveries regen settled itself; messages as popped, for a lost lease's hand-back).
One book per worker process (chunk_context.py); a lease's own writes are lease.py's.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

import orjson
import redis

from regen.common import keys
from regen.consumers.generate.chunk_life.lease import ChunkLease
from regen.consumers.generate.chunk_life.outcome import AttemptStatus
from regen.consumers.generate.chunk_life.state import (
    CHUNK_STATE_TTL_S,
    GIVE_BACK_UNSTARTED_LUA,
    HAND_BACK_LUA,
    HAND_OFF_LUA,
    RENEW_LUA,
    START_LUA,
    Attempt,
    attempt_entry,
)


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
        self._renew = r.register_script(RENEW_LUA)
        self._start = r.register_script(START_LUA)
        self.hand_off_script = r.register_script(HAND_OFF_LUA)
        self.hand_back_script = r.register_script(HAND_BACK_LUA)
        self.give_back_unstarted_script = r.register_script(GIVE_BACK_UNSTARTED_LUA)

    def start(
        self, job: str, chunk_id: str, tag: str | None, worker: str
    ) -> tuple[ChunkLease, list[Attempt]]:
        """Record a delivery's attempt and hold its lease; returns it with every attempt
        so far. An attempt stays "started" unless it ends, so started attempts other
        than this one are deliveries whose worker died (or still runs elsewhere)."""
        lua_keys = [keys.chunk_attempts(job, chunk_id), keys.chunk_writes(job, chunk_id)]
        argv: list[bytes | int] = [attempt_entry(worker, AttemptStatus.STARTED), CHUNK_STATE_TTL_S]
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
        args: list[str | int | float] = [time.time(), CHUNK_STATE_TTL_S]
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
        """kombu delivered the message `raw`, popped from the list `source` (kombu_screen.py)."""
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
