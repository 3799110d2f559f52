"""`--max-inflight auto` at work: one task per server reads its /metrics every
ADMISSION_POLL_S and lets its AdmissionController (admission.py) set the pool's limit.

A server without usable metrics (404, not SGLang's names) gets the fixed default, and
is asked again less often, so a server restarted with `--enable-metrics` is picked up.
A server that is down is not polled: its health watcher owns that news.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from regen.common import defaults
from regen.consumers.generate.engines.admission import (
    AdmissionController,
    AdmissionPolicy,
    MetricsUnavailable,
    parse_metrics,
)
from regen.consumers.generate.engines.sglang_pool import ServerPool, ServerState, cancel_and_wait

log = logging.getLogger(__name__)

# GET /metrics of one server: (HTTP status, body).
FetchMetrics = Callable[[ServerState], Awaitable[tuple[int, bytes]]]


class AdmissionPoller:
    def __init__(
        self,
        pool: ServerPool,
        policy: AdmissionPolicy,
        fetch: FetchMetrics,
        *,
        interval_s: float = defaults.ADMISSION_POLL_S,
        fallback_interval_s: float = defaults.ADMISSION_FALLBACK_POLL_S,
    ) -> None:
        self._pool = pool
        self._fetch = fetch
        self._interval_s = interval_s
        self._fallback_interval_s = fallback_interval_s
        self.controllers = {s: AdmissionController(policy) for s in pool.servers}
        for server, controller in self.controllers.items():
            pool.set_limit(server, controller.limit, controller.reason)
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._poll(s)) for s in self._pool.servers]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)

    async def _poll(self, server: ServerState) -> None:
        controller = self.controllers[server]
        while True:
            fixed = controller.reason.startswith("fixed:")
            await asyncio.sleep(self._fallback_interval_s if fixed else self._interval_s)
            if not server.healthy:
                continue
            try:
                await self.poll_once(server)
            except Exception:  # a poller must outlive any one bad reading
                log.exception("reading /metrics of %s crashed", server.label)

    async def poll_once(self, server: ServerState) -> bool:
        """Read the server's metrics once and move its limit; True if it moved."""
        controller = self.controllers[server]
        try:
            status, body = await self._fetch(server)
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False  # a blip: the limit stays; a dead server is the watcher's news
        if status != 200:
            moved = controller.unavailable(f"HTTP {status}")
        else:
            try:
                load = parse_metrics(body.decode("utf-8", errors="replace"))
            except MetricsUnavailable as exc:
                moved = controller.unavailable(str(exc))
            else:
                moved = controller.observe(load, server.inflight, time.monotonic())
        if moved:
            limit, reason = controller.limit, controller.reason
            self._pool.set_limit(server, limit, reason)
            log.info("in-flight limit of %s: %d (%s)", server.label, limit, reason)
        return moved
