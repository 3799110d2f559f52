"""Job-wide Prometheus metrics, served by one process (`regen metrics serve`): per job
its progress, dead letters, ETA, shard bytes and the disk left for them, plus the fleet's
live workers per host and Redis memory (docs/design/limits.md, Monitoring).

Generate workers come and go, so nothing here depends on which of them is up: every
number is read from Redis, as `regen status` reads it (ops/status_snapshot.py), and the
two agree by construction. A read is O(window) per job (common/ledger/places.py): counters,
the chunks now waiting or in flight, the DLQs' reasons, never the job's ids. Reads are
cached for `refresh_s`: a scrape serves the last reading, and however many Prometheus
servers scrape, Redis is read at most once per interval.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from regen.common import connection, defaults
from regen.common.heartbeat import worker_name
from regen.common.metrics import REDIS_TIMEOUT_S, WorkerMetrics
from regen.ops import status_snapshot

log = logging.getLogger("regen.metrics")

# The places a prompt can be (common/ledger/places.py), as `regen status` names them.
PLACES = ("waiting", "in_flight", "done", "dead_lettered", "purged")


@dataclass(frozen=True)
class Reading:
    """One read of Redis: the status document and Redis's memory figures."""

    status: dict[str, Any]
    used_memory: int
    maxmemory: int


def read(r: redis.Redis, window_s: float) -> Reading:
    memory = r.info("memory")
    return Reading(
        status=status_snapshot.snapshot(r, window_s=window_s),
        used_memory=int(memory["used_memory"]),
        maxmemory=int(memory.get("maxmemory", 0)),
    )


def remaining_shard_bytes(job: dict[str, Any]) -> float | None:
    """Shard bytes the rest of the job will write: the prompts not yet done at the bytes
    per prompt committed so far. `regen plan` estimates the same from a synthetic record
    before the job; once shards exist, their own ratio is the better figure. None before
    the first shard."""
    committed = job["committed"]["prompts"]
    if not committed:
        return None
    prompts = job["prompts"]
    remaining = prompts["total"] - prompts["done"] - prompts["dead_lettered"] - prompts["purged"]
    return max(remaining, 0) * job["shards"]["bytes"] / committed


class JobCollector(Collector):
    """Every job's metrics from one cached reading of Redis."""

    def __init__(
        self,
        r: redis.Redis,
        refresh_s: float = defaults.JOB_METRICS_REFRESH_S,
        window_s: float = defaults.STATUS_RATE_WINDOW_S,
        clock: Any = time.monotonic,
    ) -> None:
        self._r = r
        self._refresh_s = refresh_s
        self._window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._reading: Reading | None = None

    def reading(self) -> Reading | None:
        with self._lock:  # concurrent scrapes wait for one read instead of each reading
            now = self._clock()
            if now - self._read_at >= self._refresh_s:
                self._read_at = now
                try:
                    self._reading = read(self._r, self._window_s)
                except redis.RedisError as exc:
                    log.warning("metrics: cannot read the jobs from Redis: %s", exc)
                    self._reading = None  # unknown is not zero: leave the series out
            return self._reading

    def collect(self) -> Iterator[Metric]:
        reading = self.reading()
        if reading is None:
            return
        yield from _job_metrics(reading.status["jobs"])
        yield from _worker_metrics(reading.status["workers"])
        yield GaugeMetricFamily(
            "regen_redis_used_memory_bytes", "Memory Redis uses (INFO used_memory).",
            value=reading.used_memory,
        )  # fmt: skip
        yield GaugeMetricFamily(
            "regen_redis_maxmemory_bytes",
            "Redis's memory limit (maxmemory); 0 when it has none.",
            value=reading.maxmemory,
        )


def _job_metrics(jobs: list[dict[str, Any]]) -> Iterator[Metric]:
    job = ["job"]
    enqueued = GaugeMetricFamily(
        "regen_job_prompts_enqueued", "Prompts enqueued in the job (its ids).", labels=job
    )
    places = GaugeMetricFamily(
        "regen_job_prompts",
        "The job's prompts by place: waiting, in_flight (generating, or a result not yet "
        "in a shard), done (in a shard), dead_lettered, purged.",
        labels=["job", "place"],
    )
    unplaced = GaugeMetricFamily(
        "regen_job_unplaced_prompts",
        "Prompts in no place by these counts: 0 unless something is wrong (regen verify).",
        labels=job,
    )
    chunks = GaugeMetricFamily(
        "regen_job_chunks", "Chunks waiting on the queue or held by a worker.",
        labels=["job", "place"],
    )  # fmt: skip
    committed = CounterMetricFamily(
        "regen_job_committed_prompts", "Prompts committed to shards.", labels=job
    )
    tokens = CounterMetricFamily(
        "regen_job_committed_output_tokens",
        "Output (completion) tokens of the prompts committed to shards.",
        labels=job,
    )
    flagged = CounterMetricFamily(
        "regen_job_flagged_records",
        "Committed records with each quality flag (a record may have several).",
        labels=["job", "flag"],
    )
    eta = GaugeMetricFamily(
        "regen_job_eta_seconds",
        "Seconds until every prompt is done at the recent rate (regen status --window); "
        "absent while there is no rate yet.",
        labels=job,
    )
    dead = GaugeMetricFamily(
        "regen_job_dead_lettered_prompts",
        "Prompts in the job's DLQs by stage and reason.",
        labels=["job", "stage", "reason"],
    )
    other = GaugeMetricFamily(
        "regen_job_dead_letters_without_prompt",
        "DLQ entries of no prompt (a dataset row that gave none, a malformed chunk).",
        labels=["job", "reason"],
    )
    shards = GaugeMetricFamily("regen_job_shards", "Shards in place.", labels=job)
    shard_bytes = GaugeMetricFamily(
        "regen_job_shard_bytes", "Bytes of the shards in place.", labels=job
    )
    remaining = GaugeMetricFamily(
        "regen_job_remaining_shard_bytes",
        "Shard bytes the prompts not yet done will need, at the bytes per prompt of the "
        "shards so far; absent before the first shard.",
        labels=job,
    )
    free = GaugeMetricFamily(
        "regen_job_free_disk_bytes",
        "Free bytes on the disk the job's shards are written to; absent when unknown.",
        labels=job,
    )
    paused = GaugeMetricFamily(
        "regen_job_paused",
        "1 while the job is paused (`regen pause`): no worker takes its prompts.",
        labels=job,
    )
    workers = GaugeMetricFamily(
        "regen_job_workers",
        "Live workers serving the job: generate ones consuming its queue, tokenize ones "
        "with it open.",
        labels=["job", "kind"],
    )
    for status in jobs:
        name = status["job"]
        prompts = status["prompts"]
        enqueued.add_metric([name], prompts["total"])
        for place in PLACES:
            places.add_metric([name, place], prompts[place])
        unplaced.add_metric([name], prompts["unplaced"])
        for place, count in status["chunks"].items():
            chunks.add_metric([name, place], count)
        committed.add_metric([name], status["committed"]["prompts"])
        tokens.add_metric([name], status["committed"]["output_tokens"])
        for flag, count in status["committed"]["flagged"].items():
            flagged.add_metric([name, flag], count)
        if status["eta_s"] is not None:
            eta.add_metric([name], status["eta_s"])
        for stage, reasons in status["dead_letters"].items():
            for reason, count in sorted(reasons.items()):
                dead.add_metric([name, stage, reason], count)
        for reason, count in sorted(status["dead_letters_without_prompt"].items()):
            other.add_metric([name, reason], count)
        shards.add_metric([name], status["shards"]["count"])
        shard_bytes.add_metric([name], status["shards"]["bytes"])
        left = remaining_shard_bytes(status)
        if left is not None:
            remaining.add_metric([name], left)
        if status["shards"]["free_bytes"] is not None:
            free.add_metric([name], status["shards"]["free_bytes"])
        for kind, count in status["workers"].items():
            workers.add_metric([name, kind], count)
        paused.add_metric([name], int(status["paused"]))
    yield from (enqueued, places, unplaced, chunks, committed, tokens, flagged, eta, dead, other)
    yield from (shards, shard_bytes, remaining, free, workers, paused)


def _worker_metrics(beats: list[dict[str, Any]]) -> Iterator[Metric]:
    """Workers per host and kind: live, or stale (a heartbeat left by a worker that died:
    one that stops cleanly removes it)."""
    counts = Counter(
        (beat.get("host", "?"), beat.get("kind", "?"), "stale" if beat["stale"] else "live")
        for beat in beats
    )
    family = GaugeMetricFamily(
        "regen_workers",
        "Workers with a heartbeat, by host, kind and state (live, or stale: died or stuck).",
        labels=["host", "kind", "state"],
    )
    for labels, count in sorted(counts.items()):
        family.add_metric(list(labels), count)
    yield family


def job_metrics(redis_url: str, refresh_s: float = defaults.JOB_METRICS_REFRESH_S) -> WorkerMetrics:
    """The registry `regen metrics serve` serves: the DLQ sizes every worker has, and the
    job-wide metrics above."""
    metrics = WorkerMetrics(worker_name("metrics"), "metrics", redis_url)
    r = connection.client(
        redis_url, socket_timeout=REDIS_TIMEOUT_S, socket_connect_timeout=REDIS_TIMEOUT_S
    )
    metrics.on_close(r.close)
    metrics.add(JobCollector(r, refresh_s=refresh_s))
    return metrics
