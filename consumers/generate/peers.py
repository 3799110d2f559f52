"""What the other generate workers can take: whether one consuming a queue has idle
slots, read from their heartbeats (`regen:workers`).

A worker holding prompts it has not started gives them back only when another worker
could start them sooner (docs/design.md, "Only what can start soon"): with no such
peer, a give-back would only put the prompts back for the same worker to take again,
a Redis script and a message rewrite per prompt for nothing (the one-server case).
Heartbeats are at most 10 s old, which is a fraction of one answer at real lengths.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import orjson
import redis

from regen.common import keys
from regen.common.connection import bytes_hash

# A heartbeat older than this is a worker gone or stuck: not a peer to hand work to.
FRESH_S = 30.0
# The fleet view is read at most this often per process (every chunk asks).
CACHE_S = 2.0


class PeerView:
    """The idle slots of the other live generate workers, by queue."""

    def __init__(self, r: redis.Redis, me: str, clock: Callable[[], float] = time.time) -> None:
        self._r = r
        self._me = me
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._idle: dict[str, int] = {}

    def idle_slots(self, queue: str) -> int:
        """Idle slots of the other live, healthy generate workers consuming `queue`."""
        with self._lock:
            now = self._clock()
            if now - self._read_at >= CACHE_S:
                self._idle = self._read(now)
                self._read_at = now
            return self._idle.get(queue, 0)

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
