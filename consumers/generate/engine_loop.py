"""One asyncio loop per worker process that owns the engine.

Celery runs chunks on worker threads; every thread hands its prompts to this loop, so a
single engine (one HTTP connection pool, one model in memory) serves all chunks, and the
engine's own in-flight limit spans chunk boundaries: while the slow tail of one chunk
finishes, prompts of the next chunks already run.
"""

from __future__ import annotations

import asyncio
import functools
import queue
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from regen.consumers.generate.engine import Engine

T = TypeVar("T")


@dataclass(frozen=True)
class Outcome(Generic[T]):
    """How one coroutine of a batch ended: its result, or the exception it raised."""

    index: int
    result: T | None
    error: BaseException | None


class Batch(Generic[T]):
    """Coroutines started on the engine loop together, each one's outcome put on
    `finished` as it ends.

    A chunk's prompts go to the loop this way rather than one run_coroutine_threadsafe
    each: that costs a wake-up of the loop, a concurrent Future (with its lock and
    condition) and two chained callbacks per prompt, a good part of a short prompt's CPU
    (bench/cpu_per_prompt.py).
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._tasks: dict[int, asyncio.Task[T]] = {}
        self.finished: queue.SimpleQueue[Outcome[T]] = queue.SimpleQueue()

    def cancel(self) -> None:
        """Cancel those still running (from any thread); each reports CancelledError."""
        self._loop.call_soon_threadsafe(self._cancel)

    def cancel_one(self, index: int) -> None:
        """Cancel the coroutine of outcome `index` (from any thread); it reports
        CancelledError unless it ended first."""
        self._loop.call_soon_threadsafe(self._cancel, index)

    def extend(self, coros: list[Coroutine[Any, Any, T]], first_index: int) -> None:
        """Start more coroutines in the batch (from any thread), their outcomes indexed
        from `first_index` on (the caller counts what it started)."""
        self._loop.call_soon_threadsafe(self._start, coros, first_index)

    # --- on the loop -----------------------------------------------------------------
    def _start(self, coros: list[Coroutine[Any, Any, T]], first_index: int = 0) -> None:
        for index, coro in enumerate(coros, start=first_index):
            task = self._loop.create_task(coro)
            task.add_done_callback(functools.partial(self._report, index))
            self._tasks[index] = task

    def _report(self, index: int, task: asyncio.Task[T]) -> None:
        if task.cancelled():
            self.finished.put(Outcome(index, None, asyncio.CancelledError()))
        elif (error := task.exception()) is not None:
            self.finished.put(Outcome(index, None, error))
        else:
            self.finished.put(Outcome(index, task.result(), None))

    def _cancel(self, index: int | None = None) -> None:
        tasks = self._tasks.values() if index is None else [self._tasks[index]]
        for task in tasks:
            task.cancel()


class EngineRunner:
    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="regen-engine", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule a coroutine on the engine loop from any thread."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop)

    def start_batch(self, coros: list[Coroutine[Any, Any, T]]) -> Batch[T]:
        """Schedule coroutines on the engine loop from any thread, with one wake-up of
        the loop; the batch's `finished` queue gives their outcomes as they end (callbacks
        run in order, so a cancel() made after this call finds every task started)."""
        batch: Batch[T] = Batch(self._loop)
        self._loop.call_soon_threadsafe(batch._start, coros)
        return batch

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        return self.submit(coro).result(timeout)

    def close(self) -> None:
        if self._loop.is_closed():
            return
        try:
            self.call(self.engine.close(), timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)
