"""Worker heartbeats: each worker writes a small JSON record that `regen status` reads."""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, cast

import orjson
import redis

from regen.common import keys, settings
from regen.common.connection import OUTAGE_ERRORS

log = logging.getLogger("regen.heartbeat")


class RateMeter:
    """Counts events (tokens, prompts) and reports their rate over a recent window."""

    def __init__(self, window_s: float = 60.0) -> None:
        self._window_s = window_s
        self._events: deque[tuple[float, float]] = deque()
        self._total = 0.0
        self._lock = threading.Lock()

    def add(self, amount: float = 1.0) -> None:
        now = time.monotonic()
        with self._lock:
            self._events.append((now, amount))
            self._total += amount
            self._trim(now)

    def _trim(self, now: float) -> None:
        while self._events and self._events[0][0] < now - self._window_s:
            self._events.popleft()

    @property
    def total(self) -> float:
        return self._total

    def rate(self) -> float:
        now = time.monotonic()
        with self._lock:
            self._trim(now)
            if not self._events:
                return 0.0
            span = max(now - self._events[0][0], 1.0)
            return sum(amount for _, amount in self._events) / span


def worker_name(kind: str) -> str:
    return f"{kind}@{socket.gethostname()}:{os.getpid()}"


def last_seen(r: redis.Redis) -> dict[str, float]:
    """Worker name -> the time of its last heartbeat, for every worker with a record (a
    cleanly stopped worker has none; a dead one's stays)."""
    beats = cast("dict[bytes, bytes]", r.hgetall(keys.WORKERS))
    return {
        name.decode(): float(orjson.loads(raw).get("last_seen", 0)) for name, raw in beats.items()
    }


# A beat asked for early (`Heartbeat.wake`) comes at least this long after the last.
WOKEN_BEAT_GAP_S = 1.0


class Heartbeat(threading.Thread):
    """Writes `snapshot()` under the worker's name every interval until stopped.

    `renew`, when given, runs first at every beat (a generate worker renews the leases of
    the chunks it holds), so whatever the record says was alive was renewed too.
    """

    def __init__(
        self,
        r: redis.Redis,
        name: str,
        snapshot: Callable[[], dict[str, Any]],
        interval_s: float | None = None,
        renew: Callable[[], None] | None = None,
    ) -> None:
        """`interval_s`: between beats; None: a quarter of the stale age, at most 10 s."""
        super().__init__(name="regen-heartbeat", daemon=True)
        self._r = r
        self._name = name
        self._snapshot = snapshot
        self._interval_s = (
            settings.current().heartbeat_interval_s if interval_s is None else interval_s
        )
        self._renew = renew
        self._stop_event = threading.Event()
        self._woken = threading.Event()
        self.started_at = time.time()

    def beat(self) -> None:
        if self._renew is not None:
            self._renew()
        record = {
            "name": self._name,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": self.started_at,
            "last_seen": time.time(),
            **self._snapshot(),
        }
        self._r.hset(keys.WORKERS, self._name, orjson.dumps(record))

    def run(self) -> None:
        while not self._stop_event.is_set():
            try:
                self.beat()
            except OUTAGE_ERRORS as exc:  # said once a beat, without a traceback
                log.warning("heartbeat failed: Redis unreachable (%s)", exc)
            except Exception:  # a heartbeat error must never stop the worker
                log.exception("heartbeat failed")
            beaten = time.monotonic()
            self._woken.wait(self._interval_s)
            self._woken.clear()
            # Woken early: at most one beat a WOKEN_BEAT_GAP_S.
            self._stop_event.wait(max(0.0, WOKEN_BEAT_GAP_S - (time.monotonic() - beaten)))

    def wake(self) -> None:
        """Beat now (within WOKEN_BEAT_GAP_S of the last beat): what the record says
        changed in a way others act on (a generate worker's slots fell idle)."""
        self._woken.set()

    def stop(self) -> None:
        """Stop beating and remove the record: a cleanly stopped worker is not stale."""
        self._stop_event.set()
        self._woken.set()
        with contextlib.suppress(redis.RedisError):
            self._r.hdel(keys.WORKERS, self._name)
