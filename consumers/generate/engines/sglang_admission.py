"""`--max-inflight auto` at work: one task per server reads its /metrics every
ADMISSION_POLL_S and lets its AdmissionController (admission_policy.py) set the pool's limit.

A server without usable metrics (404, not SGLang's names) gets the fixed default, and
is asked again less often, so a server restarted with `--enable-metrics` is picked up.
That is said once, as a WARNING naming the server and the fallback, when the server is
first found so (and again only after its metrics came back and went again): SGLang
serves /metrics only with `--enable-metrics`, and an operator who meant auto to steer
must learn it did not, without a line every 30 s.
A server that is down is not polled: its health watcher owns that news.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable

import aiohttp

from regen.common import defaults
from regen.consumers.generate.engines.admission_policy import (
    AdmissionController,
    AdmissionPolicy,
    MetricsUnavailable,
    ServerLoad,
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
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self._pool = pool
        self._fetch = fetch
        self._interval_s = interval_s
        self._fallback_interval_s = fallback_interval_s
        self._sleep = sleep  # a test's fake clock
        self.controllers = {s: AdmissionController(policy) for s in pool.servers}
        for server, controller in self.controllers.items():
            pool.set_limit(server, controller.limit, controller.reason)
        self._tasks: list[asyncio.Task[None]] = []
        # Servers whose last reading had no usable metrics (each was warned about once).
        self._without_metrics: set[ServerState] = set()

    def start(self) -> None:
        if not self._tasks:
            self._tasks = [asyncio.create_task(self._poll(s)) for s in self._pool.servers]

    async def close(self) -> None:
        await cancel_and_wait(self._tasks)

    async def _poll(self, server: ServerState) -> None:
        while True:
            fixed = server in self._without_metrics
            await self._sleep(self._fallback_interval_s if fixed else self._interval_s)
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
        why = ""
        try:
            load = _load(status, body)
        except MetricsUnavailable as exc:
            why = str(exc)
            moved = controller.unavailable(why)
            news = server not in self._without_metrics
            self._without_metrics.add(server)
        else:
            moved, news = controller.observe(load, server.inflight, time.monotonic()), False
            self._without_metrics.discard(server)
        if moved:
            self._pool.set_limit(server, controller.limit, controller.reason)
        if news:
            log.warning(
                "%s has no usable /metrics (%s; SGLang serves them only when started with "
                "--enable-metrics): --max-inflight auto cannot steer there and keeps the "
                "fixed limit of %d in flight, asking again every %g s",
                server.label,
                why,
                controller.limit,
                self._fallback_interval_s,
            )
        elif moved:
            log.info(
                "in-flight limit of %s: %d (%s)", server.label, controller.limit, controller.reason
            )
        return moved


def _load(status: int, body: bytes) -> ServerLoad:
    """One /metrics reply read; raises MetricsUnavailable when it cannot steer."""
    if status != 200:
        raise MetricsUnavailable(f"HTTP {status}")
    return parse_metrics(body.decode("utf-8", errors="replace"))
