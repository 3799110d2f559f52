"""What the other generate workers can take: whether one consuming a queue has idle
slots, read from their heartbeats (`regen:workers`).

A worker holding prompts it has not started gives them back only when another worker
could start them sooner (docs/design.md, "Only what can start soon"): with no such
peer, a give-back would only put the prompts back for the same worker to take again,
a Redis script and a message rewrite per prompt for nothing (the one-server case).
A worker beats at once (at most once a second) when its slots fall idle with nothing
waiting in it, so its idle slots are seen within a couple of seconds, not at its next
regular beat (up to 10 s): at 40 s answers, 10 s is a quarter of a slot's work.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import orjson
import redis

from regen.common import defaults, keys
from regen.common.connection import bytes_hash

# A heartbeat older than this is a worker gone or stuck: not a peer to hand work to.
FRESH_S = 30.0
# The fleet view is read at most this often per process (every delivery with waiting
# prompts asks, several times a second).
CACHE_S = 1.0
# Slots this worker gave prompts back for count as taken for this long: until every
# peer has beaten since (heartbeats are at most HEARTBEAT_INTERVAL_MAX_S apart) and the
# view is read again. Without it each look at the same stale beat gives back more.
CLAIM_S = defaults.HEARTBEAT_INTERVAL_MAX_S + CACHE_S


class PeerView:
    """The idle slots of the other live generate workers, by queue."""

    def __init__(self, r: redis.Redis, me: str, clock: Callable[[], float] = time.time) -> None:
        self._r = r
        self._me = me
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._idle: dict[str, int] = {}
        self._claims: list[tuple[float, str, int]] = []  # (when, queue, slots)

    def idle_slots(self, queue: str) -> int:
        """Idle slots of the other live, healthy generate workers consuming `queue`,
        less those this worker recently gave prompts back for."""
        with self._lock:
            return self._unclaimed(queue)

    def claim(self, queue: str, wanted: int) -> int:
        """Claim up to `wanted` of the idle slots on `queue` for prompts about to be
        given back; how many. Read and claimed under one lock, so two deliveries of this
        worker do not both give prompts for the same slots."""
        with self._lock:
            slots = min(wanted, self._unclaimed(queue))
            if slots > 0:
                self._claims.append((self._clock(), queue, slots))
            return slots

    def _unclaimed(self, queue: str) -> int:
        now = self._clock()
        if now - self._read_at >= CACHE_S:
            self._idle = self._read(now)
            self._read_at = now
        self._claims = [c for c in self._claims if now - c[0] < CLAIM_S]
        claimed = sum(slots for _, q, slots in self._claims if q == queue)
        return max(0, self._idle.get(queue, 0) - claimed)

    def _read(self, now: float) -> dict[str, int]:
        idle: dict[str, int] = {}
        for name, raw in bytes_hash(self._r.hgetall(keys.WORKERS)).items():
            if name.decode() == self._me:
                continue
            beat = orjson.loads(raw)
            fresh = now - float(beat.get("last_seen", 0)) < FRESH_S
            if beat.get("kind") != "generate" or not beat.get("healthy") or not fresh:
                continue
            for queue in beat.get("queues", []):
                idle[queue] = idle.get(queue, 0) + int(beat.get("idle_slots", 0))
        return idle
