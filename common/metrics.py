"""Prometheus metrics of the regen workers (`--metrics-port`, env REGEN_METRICS_PORT).

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
from typing import TYPE_CHECKING, Any

import redis
from celery import states
from celery.signals import task_postrun
from prometheus_client import CollectorRegistry, Counter, Info, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regen.common import jobspec, keys
from regen.common.celery_app import GENERATE_TASK

if TYPE_CHECKING:  # typing only: common never imports the stages at run time
    from regen.consumers.generate.chunk_runner import ChunkContext
    from regen.consumers.tokenize.consumer import ConsumerState

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


class GenerateCollector(Collector):
    """A generate worker's progress and its engine's view of each server."""

    def __init__(self, ctx: ChunkContext, engine_healthy: Callable[[], bool]) -> None:
        self._ctx = ctx
        self._engine_healthy = engine_healthy

    def collect(self) -> Iterator[Metric]:
        ctx = self._ctx
        yield CounterMetricFamily(
            "regen_generate_prompts",
            "Prompts generated and handed to the tokenize stage by this worker.",
            value=ctx.prompts.total,
        )
        yield CounterMetricFamily(
            "regen_generate_output_tokens",
            "Tokens generated (completion tokens) in the prompts handed off.",
            value=ctx.tokens.total,
        )
        yield GaugeMetricFamily(
            "regen_generate_inflight_prompts",
            "Prompts of the chunks this worker holds that are not finished yet.",
            value=ctx.inflight,
        )
        yield GaugeMetricFamily(
            "regen_generate_engine_healthy",
            "1 while the engine has a healthy server, i.e. the worker consumes chunks.",
            value=int(self._engine_healthy()),
        )
        yield from _server_metrics(ctx.runner.engine.stats().get("servers", []))


def _server_metrics(servers: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per-server series from the SGLang engine's stats (other engines have no servers)."""
    if not servers:
        return
    labels = ["server"]
    healthy = GaugeMetricFamily(
        "regen_sglang_server_healthy",
        "1 when the server passed its last health probe.",
        labels=labels,
    )
    inflight = GaugeMetricFamily(
        "regen_sglang_server_inflight",
        "Requests this worker has in flight on the server.",
        labels=labels,
    )
    completed = CounterMetricFamily(
        "regen_sglang_server_requests_completed", "Requests the server completed.", labels=labels
    )
    failures = CounterMetricFamily(
        "regen_sglang_server_failures",
        "Failed requests by kind (each is retried; only a refusal dead-letters a prompt).",
        labels=["server", "kind"],
    )
    for server in servers:
        url = server["url"]  # redacted by the engine: no credentials reach the metrics
        healthy.add_metric([url], int(server["healthy"]))
        inflight.add_metric([url], server["inflight"])
        completed.add_metric([url], server["completed"])
        for kind, count in sorted(server["failures_by_kind"].items()):
            failures.add_metric([url, kind], count)
    yield from (healthy, inflight, completed, failures)


class ChunkOutcomes:
    """Counts finished chunks from Celery's task_postrun signal (no state keeps them)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.chunks = Counter(
            "regen_generate_chunks",
            "Chunks this worker finished: acked (every prompt handed off or dead-lettered) "
            "or returned (given back to the queue, e.g. the engine stayed unavailable).",
            ["outcome"],
            registry=registry,
        )
        self.dead_lettered = Counter(
            "regen_generate_dead_lettered_prompts",
            "Prompts this worker dead-lettered: refused by a healthy server, or of a chunk "
            "past its attempts.",
            registry=registry,
        )
        for outcome in ("acked", "returned"):
            self.chunks.labels(outcome)

    def on_postrun(
        self, sender: Any = None, state: str | None = None, retval: Any = None, **_: Any
    ) -> None:
        if getattr(sender, "name", None) != GENERATE_TASK:
            return
        if state == states.SUCCESS:  # acks_late: a task that returns is acknowledged
            self.chunks.labels("acked").inc()
            if isinstance(retval, dict):
                self.dead_lettered.inc(retval.get("dead_lettered", 0))
        elif state == states.REJECTED:  # the task gives a chunk back with Reject(requeue)
            self.chunks.labels("returned").inc()
        else:
            self.chunks.labels(str(state).lower()).inc()


class TokenizeCollector(Collector):
    """A tokenize consumer's records, shards and dead letters per job, and its disk guard."""

    def __init__(self, state: ConsumerState) -> None:
        self._state = state

    def collect(self) -> Iterator[Metric]:
        state = self._state
        # The consumer thread adds writers while we read: copy first (atomic in CPython).
        writers = dict(state.writers)
        job = ["job"]
        records = CounterMetricFamily(
            "regen_tokenize_records_written",
            "Records written into shard files, including any dropped before the commit (an "
            "abandoned shard, or ids another shard committed first).",
            labels=job,
        )
        tokens = CounterMetricFamily(
            "regen_tokenize_record_tokens", "Tokens (prompt + completion) in them.", labels=job
        )
        duplicates = CounterMetricFamily(
            "regen_tokenize_duplicates", "Results dropped as already in a shard.", labels=job
        )
        shards = CounterMetricFamily(
            "regen_tokenize_shards_committed", "Shards renamed into place.", labels=job
        )
        dead = CounterMetricFamily(
            "regen_tokenize_dead_lettered",
            "Results dead-lettered by a record check, by reason.",
            labels=["job", "reason"],
        )
        open_rows = GaugeMetricFamily(
            "regen_tokenize_open_shard_rows", "Records in the shard being written.", labels=job
        )
        for name, writer in sorted(writers.items()):
            counters = writer.counters
            records.add_metric([name], counters.records)
            tokens.add_metric([name], counters.tokens)
            duplicates.add_metric([name], counters.duplicates)
            shards.add_metric([name], counters.shards)
            for reason, count in sorted(dict(counters.by_reason).items()):
                dead.add_metric([name, reason], count)
            open_rows.add_metric([name], writer.open_rows)
        yield from (records, tokens, duplicates, shards, dead, open_rows)
        yield GaugeMetricFamily(
            "regen_tokenize_paused_for_disk",
            "1 while writing is paused because the shard disk is short of space.",
            value=int(state.paused_for_disk),
        )
        yield GaugeMetricFamily(
            "regen_tokenize_free_disk_bytes",
            "Free bytes on the shard disk at the last check.",
            value=state.free_bytes,
        )


class WorkerMetrics:
    """One worker's registry and, once served, its HTTP endpoint."""

    def __init__(self, name: str, kind: str, redis_url: str) -> None:
        self.registry = CollectorRegistry()
        self._closers: list[Callable[[], None]] = []
        self._server: Any = None
        Info("regen_worker", "This worker.", registry=self.registry).info(
            {"name": name, "kind": kind}
        )
        r = redis.Redis.from_url(
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


def generate_metrics(
    name: str, redis_url: str, ctx: ChunkContext, engine_healthy: Callable[[], bool]
) -> WorkerMetrics:
    metrics = WorkerMetrics(name, "generate", redis_url)
    metrics.add(GenerateCollector(ctx, engine_healthy))
    outcomes = ChunkOutcomes(metrics.registry)
    # A strong reference: Celery keeps weak ones by default and would drop a bound method.
    task_postrun.connect(outcomes.on_postrun, weak=False)
    metrics.on_close(lambda: task_postrun.disconnect(outcomes.on_postrun))
    return metrics


def tokenize_metrics(name: str, redis_url: str, state: ConsumerState) -> WorkerMetrics:
    metrics = WorkerMetrics(name, "tokenize", redis_url)
    metrics.add(TokenizeCollector(state))
    return metrics
