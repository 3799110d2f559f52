"""Running slots, the waiting queue and the accounting a benchmark reads back.

Like SGLang's scheduler: at most `capacity` requests run, the rest wait in FIFO order,
and a request arriving to a full waiting queue is refused (the caller answers 503).
`busy_slot_s` integrates the number of running requests over time, so
utilization = busy_slot_s / (capacity x wall time).
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

from tests.support.sglang_standin.aborts import wait_unless


class QueueFull(Exception):
    pass


class Slots:
    def __init__(self, capacity: int, max_queued: int | None) -> None:
        self.capacity = capacity
        self.max_queued = max_queued
        self.running = 0
        self.peak_running = 0
        self._waiting: deque[asyncio.Future[None]] = deque()
        self._busy_slot_s = 0.0
        self._since = time.monotonic()

    @property
    def queued(self) -> int:
        return len(self._waiting)

    def busy_slot_s(self) -> float:
        return self._busy_slot_s + self.running * (time.monotonic() - self._since)

    def _set_running(self, running: int) -> None:
        now = time.monotonic()
        self._busy_slot_s += self.running * (now - self._since)
        self._since = now
        self.running = running
        self.peak_running = max(self.peak_running, running)

    async def acquire(self, abort: asyncio.Event | None = None) -> bool:
        """Take a slot (True), or give up waiting for one when `abort` is set (False:
        SGLang's "Abort in waiting queue"; the slot, if just handed over, goes on)."""
        if self.running < self.capacity and not self._waiting:
            self._set_running(self.running + 1)
            return True
        if self.max_queued is not None and len(self._waiting) + 1 > self.max_queued:
            raise QueueFull("The request queue is full.")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.append(waiter)
        try:
            # release() hands its slot straight to us: `running` never dips, so a queued
            # request cannot be overtaken by one that arrives later.
            aborted = await wait_unless(abort, waiter)
        except asyncio.CancelledError:
            self._give_up(waiter)
            raise
        if aborted:
            self._give_up(waiter)
        return not aborted

    def _give_up(self, waiter: asyncio.Future[None]) -> None:
        """Leave the queue, passing on the slot if it was already handed to us."""
        if waiter.done() and not waiter.cancelled():
            self.release()
        elif waiter in self._waiting:
            self._waiting.remove(waiter)

    def release(self) -> None:
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return
        self._set_running(self.running - 1)
