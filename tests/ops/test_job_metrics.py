"""Job-wide metrics (`regen metrics serve`): what a scrape says matches `regen status`
and the Redis it reads, and Redis is read once per refresh, not once per scrape."""

from __future__ import annotations

import time
from pathlib import Path

import orjson
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from regen.common import dlq, keys
from regen.common.quality_flags import FLAGS
from regen.ops import status_snapshot
from regen.ops.job_metrics import JobCollector, remaining_shard_bytes
from tests.support.generate_harness import enqueue_prompts

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(registry: CollectorRegistry) -> Samples:
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(generate_latest(registry).decode())
        for sample in family.samples
    }


def value(samples: Samples, metric: str, /, **labels: str) -> float | None:
    return samples.get((metric, frozenset(labels.items())))


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(host: str, kind: str, age_s: float, **extra: object) -> bytes:
    return orjson.dumps(
        {"kind": kind, "host": host, "last_seen": time.time() - age_s, "queues": [], **extra}
    )


def test_a_scrape_reports_each_job_as_status_does_and_reads_redis_once_per_refresh(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    prompts = [f"Question {i}: what is {i} plus {i}?" for i in range(10)]
    spec = enqueue_prompts(redis_url, tmp_path, prompts, job="m", chunk_size=4)
    dlq.put(r, dlq.DeadLetter(entry_id="p1", job="m", stage="generate", reason="too_long",
                              message="m", prompt_id="p1"))  # fmt: skip
    dlq.put(r, dlq.DeadLetter(entry_id="row:x", job="m", stage="input", reason="empty",
                              message="m"))  # fmt: skip
    r.hset(keys.WORKERS, mapping={
        "generate@gpu-1:1": beat("gpu-1", "generate", 1, queues=[spec.queue]),
        "generate@gpu-1:2": beat("gpu-1", "generate", 1, queues=[spec.queue]),
        "generate@gpu-2:1": beat("gpu-2", "generate", 3600),  # died: its heartbeat stays
        "tokenize@cpu-1:1": beat("cpu-1", "tokenize", 1, jobs={"m": {}}),
    })  # fmt: skip
    clock = FakeClock()
    registry = CollectorRegistry()
    registry.register(JobCollector(r, refresh_s=15, clock=clock))
    samples = scrape(registry)

    status = status_snapshot.snapshot(r)["jobs"][0]
    job = {"job": "m"}
    assert value(samples, "regen_job_prompts_enqueued", **job) == 10 == status["prompts"]["total"]
    assert value(samples, "regen_job_prompts", job="m", place="waiting") == 10
    for place in ("in_flight", "done", "purged"):
        assert value(samples, "regen_job_prompts", job="m", place=place) == 0
    # The generate dead letter is a prompt's; the input one (a bad row) is not.
    assert value(samples, "regen_job_prompts", job="m", place="dead_lettered") == 1
    assert value(samples, "regen_job_unplaced_prompts", **job) == status["prompts"]["unplaced"]
    dead = {"job": "m", "stage": "generate", "reason": "too_long"}
    assert value(samples, "regen_job_dead_lettered_prompts", **dead) == 1
    assert value(samples, "regen_job_dead_letters_without_prompt", job="m", reason="empty") == 1
    assert value(samples, "regen_job_chunks", job="m", place="waiting") == 3  # 4 + 4 + 2
    assert value(samples, "regen_job_chunks", job="m", place="in_flight") == 0
    assert value(samples, "regen_job_committed_prompts_total", **job) == 0
    # Every quality flag has its series from the start, at 0 before any record.
    for flag in FLAGS:
        assert value(samples, "regen_job_flagged_records_total", job="m", flag=flag) == 0
    assert value(samples, "regen_job_shard_bytes", **job) == 0
    assert value(samples, "regen_job_workers", job="m", kind="generate") == 2
    assert value(samples, "regen_job_workers", job="m", kind="tokenize") == 1
    # No rate yet, and no shard to measure bytes per prompt: unknown, not zero.
    assert value(samples, "regen_job_eta_seconds", **job) is None
    assert value(samples, "regen_job_remaining_shard_bytes", **job) is None
    workers = {"host": "gpu-1", "kind": "generate", "state": "live"}
    assert value(samples, "regen_workers", **workers) == 2
    assert value(samples, "regen_workers", host="gpu-2", kind="generate", state="stale") == 1
    assert value(samples, "regen_workers", host="cpu-1", kind="tokenize", state="live") == 1
    info = r.info("memory")
    used = value(samples, "regen_redis_used_memory_bytes")
    assert used is not None and used > 0
    assert value(samples, "regen_redis_maxmemory_bytes") == info["maxmemory"]

    # Within the refresh interval a scrape serves the last reading; after it, a new one.
    r.delete(keys.dlq("m", "generate"))
    assert value(scrape(registry), "regen_job_prompts", job="m", place="dead_lettered") == 1
    clock.now += 15
    assert value(scrape(registry), "regen_job_prompts", job="m", place="dead_lettered") == 0


def test_an_unreachable_redis_leaves_the_job_series_out() -> None:
    dead = redis.Redis(port=1, socket_connect_timeout=0.5)
    registry = CollectorRegistry()
    registry.register(JobCollector(dead, refresh_s=0))
    samples = scrape(registry)
    assert not [name for name, _ in samples if name.startswith(("regen_job", "regen_redis"))]


def test_remaining_shard_bytes_are_the_open_prompts_at_the_bytes_per_prompt_so_far() -> None:
    job = {
        "prompts": {"total": 1000, "done": 200, "dead_lettered": 30, "purged": 20},
        "committed": {"prompts": 200},
        "shards": {"bytes": 2_000_000},
    }
    assert remaining_shard_bytes(job) == 750 * 10_000
    assert remaining_shard_bytes({**job, "committed": {"prompts": 0}}) is None
    finished = {**job, "prompts": {"total": 200, "done": 200, "dead_lettered": 0, "purged": 0}}
    assert remaining_shard_bytes(finished) == 0
