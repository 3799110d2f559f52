"""Prometheus metrics of the regen workers (`--metrics-port`, env REGEN_METRICS_PORT):
what every worker serves (its registry and endpoint, the DLQ sizes); each stage adds its
own collector (consumers/generate/metrics.py, consumers/tokenize/metrics.py).

Most numbers already live in a worker's own state: the generate worker's ChunkContext
and engine stats, the tokenize consumer's JobWriter counters. Collectors read them when
Prometheus scrapes, so the stage code carries no metrics calls and a scrape agrees with
the heartbeat `regen status` shows. Only chunk outcomes, which no state keeps, are
counted as they happen, from a Celery signal at the edge of the task.

Each worker serves its own registry, never prometheus_client's global one, so one
process (a test) can run several.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from itertools import product
from typing import Any

import redis
from prometheus_client import CollectorRegistry, Info, start_http_server
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regen.common import connection, jobspec, keys

log = logging.getLogger("regen.metrics")

# DLQ sizes are read from Redis at most this often, however many scrapers ask.
DLQ_CACHE_S = 10.0
# A scrape must not hang on a half-open Redis connection: the metrics client gives up.
REDIS_TIMEOUT_S = 2.0


class MetricsPortError(ValueError):
    """The metrics endpoint cannot listen on the port asked for."""


class _Guarded(Collector):
    """A collector whose failure is logged and drops only its own metrics from a scrape."""

    def __init__(self, inner: Collector) -> None:
        self._inner = inner

    def collect(self) -> Iterable[Metric]:
        try:
            return list(self._inner.collect())
        except Exception:
            log.exception("metrics collector %s failed", type(self._inner).__name__)
            return []


class DlqCollector(Collector):
    """`regen_dlq_entries{job,stage}` and `regen_redis_up`, the DLQ sizes cached for ttl_s."""

    def __init__(self, r: redis.Redis, ttl_s: float = DLQ_CACHE_S) -> None:
        self._r = r
        self._ttl_s = ttl_s
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._counts: dict[tuple[str, str], int] | None = None

    def _refresh(self) -> dict[tuple[str, str], int] | None:
        with self._lock:  # concurrent scrapes wait for one read instead of each reading
            now = time.monotonic()
            if now - self._read_at >= self._ttl_s:
                self._read_at = now
                try:
                    jobs = jobspec.list_jobs(self._r)
                    pipe = self._r.pipeline(transaction=False)
                    for job, stage in product(jobs, keys.STAGES):
                        pipe.hlen(keys.dlq(job, stage))
                    self._counts = dict(
                        zip(product(jobs, keys.STAGES), pipe.execute(), strict=True)
                    )
                except redis.RedisError as exc:
                    log.warning("metrics: cannot read DLQ sizes from Redis: %s", exc)
                    self._counts = None
            return self._counts

    def collect(self) -> Iterator[Metric]:
        counts = self._refresh()
        yield GaugeMetricFamily(
            "regen_redis_up",
            "1 when the last read of the DLQ sizes from Redis succeeded.",
            value=int(counts is not None),
        )
        if counts is None:
            return  # unknown is not zero: leave the series out
        family = GaugeMetricFamily(
            "regen_dlq_entries",
            "Entries in each job's dead-letter queues (job-wide: every worker reports the "
            "same value).",
            labels=["job", "stage"],
        )
        for (job, stage), count in sorted(counts.items()):
            family.add_metric([job, stage], count)
        yield family


class WorkerMetrics:
    """One worker's registry and, once served, its HTTP endpoint."""

    def __init__(self, name: str, kind: str, redis_url: str) -> None:
        self.registry = CollectorRegistry()
        self._closers: list[Callable[[], None]] = []
        self._server: Any = None
        Info("regen_worker", "This worker.", registry=self.registry).info(
            {"name": name, "kind": kind}
        )
        r = connection.client(
            redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
        )
        self._closers.append(r.close)
        self.add(DlqCollector(r))

    def add(self, collector: Collector) -> None:
        self.registry.register(_Guarded(collector))

    def on_close(self, closer: Callable[[], None]) -> None:
        self._closers.append(closer)

    def serve(self, port: int, addr: str = "0.0.0.0") -> int:
        """Serve /metrics on `port` (0: any free port) from a daemon thread; the port."""
        try:
            self._server, _thread = start_http_server(port, addr, self.registry)
        except OSError as exc:
            self.close()
            raise MetricsPortError(f"cannot serve metrics on port {port}: {exc.strerror}") from exc
        bound = int(self._server.server_port)
        log.info("metrics on http://%s:%d/metrics", addr, bound)
        return bound

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        for closer in reversed(self._closers):
            closer()
        self._closers.clear()
