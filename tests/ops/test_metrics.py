"""Worker metrics: what a scrape of /metrics says matches what the workers did."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis
from prometheus_client.parser import text_string_to_metric_families

from regen.common import dlq, jobspec, keys
from regen.common.metrics import DlqCollector, WorkerMetrics
from regen.consumers.generate.chunk_life import LeaseBook
from regen.consumers.tokenize.consumer import TokenizeConsumer, TokenizeOptions
from regen.consumers.tokenize.job_writer import ShardPolicy
from regen.consumers.tokenize.metrics import tokenize_metrics
from regen.producer.spec import JobOptions, prepare_job
from tests.support.generate_harness import (
    REPO,
    Worker,
    all_acked,
    attempts,
    enqueue_prompts,
    results,
)
from tests.support.helpers import committed_count, make_result, wait_for
from tests.support.sglang_standin.process import free_port, run_standin

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int) -> Samples:
    response = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10, trust_env=False)
    response.raise_for_status()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def value(samples: Samples, metric: str, /, **labels: str) -> float | None:
    return samples.get((metric, frozenset(labels.items())))


def try_scrape(port: int) -> Samples | None:
    try:
        return scrape(port)
    except httpx.HTTPError:
        return None


def letter(job: str, stage: str, entry: str) -> dlq.DeadLetter:
    return dlq.DeadLetter(entry_id=entry, job=job, stage=stage, reason="test", message="m")


@pytest.fixture
def served(redis_url: str) -> Iterator[tuple[WorkerMetrics, int]]:
    metrics = WorkerMetrics("test@host:1", "test", redis_url)
    port = metrics.serve(0, "127.0.0.1")
    yield metrics, port
    metrics.close()


def test_dlq_sizes_are_read_per_job_and_stage_and_cached(
    r: redis.Redis, redis_url: str, served: tuple[WorkerMetrics, int]
) -> None:
    prepared = prepare_job(JobOptions(job="d", model="smollm2"))
    jobspec.save(r, prepared.spec)
    dlq.put(r, letter("d", "generate", "a"))
    _, port = served
    first = scrape(port)
    assert value(first, "regen_dlq_entries", job="d", stage="generate") == 1
    assert value(first, "regen_dlq_entries", job="d", stage="tokenize") == 0
    assert value(first, "regen_redis_up") == 1
    assert value(first, "regen_worker_info", name="test@host:1", kind="test") == 1
    dlq.put(r, letter("d", "generate", "b"))
    # Within the cache window a scrape does not read Redis again.
    assert value(scrape(port), "regen_dlq_entries", job="d", stage="generate") == 1


def test_an_unreachable_redis_reports_down_without_failing_the_scrape() -> None:
    collector = DlqCollector(redis.Redis(port=free_port(), socket_connect_timeout=1), ttl_s=0)
    names = {family.name: family for family in collector.collect()}
    assert names["regen_redis_up"].samples[0].value == 0
    assert "regen_dlq_entries" not in names  # unknown, not zero


def test_a_failing_collector_drops_only_its_own_metrics(
    served: tuple[WorkerMetrics, int],
) -> None:
    class Broken:
        def collect(self) -> Any:
            raise RuntimeError("engine stats unavailable")

    metrics, port = served
    metrics.add(Broken())
    assert value(scrape(port), "regen_redis_up") == 1


def test_tokenize_metrics_count_records_duplicates_shards_and_dead_letters(
    r: redis.Redis, redis_url: str, smollm2_tokenizer: Any, tmp_path: Path
) -> None:
    spec = jobspec.save(r, prepare_job(JobOptions(job="t", model="smollm2")).spec)
    good = [make_result(smollm2_tokenizer, spec, i) for i in range(30)]
    bad = make_result(smollm2_tokenizer, spec, 99)
    bad = type(bad)(**{**bad.__dict__, "text": "something the ids do not say"})
    for result in [*good, bad]:
        r.xadd(keys.results_stream("t"), result.to_fields())
    options = TokenizeOptions(
        out_dir=tmp_path / "out",
        policy=ShardPolicy(max_rows=25, idle_s=0.3),
        min_free_bytes=0,
        block_ms=100,
        claim_idle_s=2.0,
    )
    consumer = TokenizeConsumer(r, options, "c1")
    metrics = tokenize_metrics("c1", redis_url, consumer.state)
    port = metrics.serve(0, "127.0.0.1")
    stop = threading.Event()
    thread = threading.Thread(target=consumer.run, args=(stop,))
    thread.start()

    def stream_empty() -> bool:
        return r.xlen(keys.results_stream("t")) == 0

    try:
        wait_for(lambda: committed_count(r, "t") == 30 and stream_empty(),
                 what="every result committed or dead-lettered")  # fmt: skip
        for result in good[:3]:  # delivered again after their shard is in place
            r.xadd(keys.results_stream("t"), result.to_fields())
        wait_for(stream_empty, what="the duplicates dropped")
        samples = scrape(port)
    finally:
        stop.set()
        thread.join(timeout=60)
        metrics.close()
    job = {"job": "t"}
    assert value(samples, "regen_tokenize_records_written_total", **job) == 30
    tokens = sum(len(g.prompt_ids) + len(g.output_ids) for g in good)
    assert value(samples, "regen_tokenize_record_tokens_total", **job) == tokens
    assert value(samples, "regen_tokenize_duplicates_total", **job) == 3
    assert value(samples, "regen_tokenize_shards_committed_total", **job) == r.hlen(
        keys.shards("t")
    )
    assert value(samples, "regen_tokenize_shards_committed_total", **job) == 2  # 25 + 5 rows
    reason = {"job": "t", "reason": "text_mismatch"}
    assert value(samples, "regen_tokenize_dead_lettered_total", **reason) == 1
    assert value(samples, "regen_dlq_entries", job="t", stage="tokenize") == 1
    assert value(samples, "regen_tokenize_open_shard_rows", **job) == 0
    assert value(samples, "regen_tokenize_paused_for_disk") == 0
    assert value(samples, "regen_worker_info", name="c1", kind="tokenize") == 1


@pytest.mark.slow
def test_the_tokenize_command_serves_metrics(redis_url: str, tmp_path: Path) -> None:
    port = free_port()
    command = [sys.executable, "-m", "regen", "worker", "tokenize", "--redis-url", redis_url,
               "--out", str(tmp_path / "out"), "--min-free-mb", "0",
               "--metrics-port", str(port)]  # fmt: skip
    log = tmp_path / "tokenize.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(command, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: try_scrape(port) is not None, what=f"metrics on {port}")
        samples = scrape(port)
    finally:
        process.send_signal(signal.SIGTERM)
        code = process.wait(timeout=60)
    assert code == 0, log.read_text()
    assert value(samples, "regen_tokenize_paused_for_disk") == 0
    assert value(samples, "regen_redis_up") == 1
    assert any(name == "regen_worker_info" and dict(labels)["kind"] == "tokenize"
               for name, labels in samples)  # fmt: skip


@pytest.mark.slow
def test_generate_metrics_match_the_results_stream(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    prompts = [f"Tell me fact number {i} about the sea." for i in range(11)]
    long_prompt = "Please repeat: " + "words " * 400  # refused by the server's context
    spec = enqueue_prompts(redis_url, tmp_path, [*prompts, long_prompt])
    port = free_port()
    with run_standin(context_length=300) as server, Worker(
        redis_url, tmp_path, "--engine", "sglang", "--server", server.url, "--jobs", "g",
        "--metrics-port", str(port),
    ):  # fmt: skip
        wait_for(lambda: all_acked(r, spec) and len(results(r, "g")) == len(prompts),
                 timeout=120, what="every chunk acked")  # fmt: skip
        wait_for(lambda: value(scrape(port), "regen_generate_inflight_prompts") == 0,
                 what="no prompt in flight")  # fmt: skip
        samples = scrape(port)
    got = results(r, "g")
    chunks = r.hlen(keys.job_chunks("g"))
    assert value(samples, "regen_generate_prompts_total") == len(prompts)
    assert value(samples, "regen_generate_output_tokens_total") == sum(
        res.completion_tokens for res in got
    )
    assert value(samples, "regen_generate_chunks_total", outcome="acked") == chunks
    assert value(samples, "regen_generate_chunks_total", outcome="returned") == 0
    assert value(samples, "regen_generate_dead_lettered_prompts_total") == 1
    assert value(samples, "regen_dlq_entries", job="g", stage="generate") == 1
    assert value(samples, "regen_generate_engine_healthy") == 1
    assert value(samples, "regen_sglang_server_healthy", server=server.url) == 1
    assert value(samples, "regen_sglang_server_inflight", server=server.url) == 0
    # --max-inflight auto (the default): 12 prompts never use 256, so it has not moved.
    limit = value(samples, "regen_sglang_server_inflight_limit", server=server.url,
                  reason="start: fixed default")  # fmt: skip
    assert limit == 256
    assert value(samples, "regen_sglang_server_requests_completed_total", server=server.url) == len(
        prompts
    )


@pytest.mark.slow
def test_a_delivery_whose_chunk_another_took_counts_dropped_not_acked(
    redis_url: str, tmp_path: Path
) -> None:
    """A delivery that finds its lease lost (another delivery holds the chunk, as after a
    freeze past the lease) writes nothing more and its task returns normally: counted
    from Celery's task_postrun, it was `acked`. Its chunk comes back when the lease of
    the delivery that took it lapses, and runs once to its end."""
    r = redis.Redis.from_url(redis_url)
    spec = enqueue_prompts(redis_url, tmp_path, ["Tell me a long story."], chunk_size=1,
                           max_new_tokens=1200)  # fmt: skip
    (chunk_id,) = [c.decode() for c in r.hkeys(keys.job_chunks("g"))]
    port = free_port()
    with run_standin(decode_tokens_per_s=50, output_len_dist="fixed:n=1000") as server, Worker(
        redis_url, tmp_path, "--engine", "sglang", "--server", server.url, "--jobs", "g",
        "--metrics-port", str(port),
    ):  # fmt: skip
        wait_for(lambda: r.llen(keys.chunk_attempts("g", chunk_id)) == 1, timeout=60,
                 what="the delivery started")  # fmt: skip
        (tag,) = [t.decode() for t in r.hkeys(keys.KOMBU_UNACKED)]
        # A second delivery of the same message takes the chunk and never renews it.
        LeaseBook(r).start("g", chunk_id, tag, "a worker frozen since")

        def dropped() -> float | None:
            return value(try_scrape(port) or {}, "regen_generate_chunks_total", outcome="dropped")

        wait_for(lambda: dropped() == 1, timeout=60, what="the drop counted")
        wait_for(lambda: all_acked(r, spec) and len(results(r, "g")) == 1, timeout=120,
                 what="the chunk run again to its end")  # fmt: skip
        samples = scrape(port)
    assert value(samples, "regen_generate_chunks_total", outcome="dropped") == 1
    assert value(samples, "regen_generate_chunks_total", outcome="acked") == 1
    assert [a["status"] for a in attempts(r, "g", chunk_id)][:2] == ["lost", "started"]
