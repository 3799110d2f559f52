"""One asyncio loop per worker process that owns the engine.

Celery runs chunks on worker threads; every thread hands its prompts to this loop, so a
single engine (one HTTP connection pool, one model in memory) serves all chunks, and the
engine's own in-flight limit spans chunk boundaries: while the slow tail of one chunk
finishes, prompts of the next chunks already run.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from typing import Any, TypeVar

from regen.consumers.generate.engine import Engine

T = TypeVar("T")


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
