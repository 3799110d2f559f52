"""`regen status` and `regen verify` against a real run: a generate worker on the SGLang
stand-in and a tokenize worker, both real processes.

The run is frozen (SIGSTOP of the generate worker, no tokenize worker yet, or one with
nothing left to do) at chosen moments, so that where each prompt is can be computed
here, independently of the code under test, and compared with what status reports.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
import zstandard
from click.testing import CliRunner, Result

from regen.cli_status import status, verify
from regen.common import dlq, jobspec, keys
from regen.common.jobspec import JobSpec
from regen.common.ledger.commit_ledger import CommitLedger, Sample
from regen.common.ledger.job_ids import JobIds
from regen.common.queues import queue_lists
from regen.consumers.tokenize.shard_files import iter_records, shard_paths
from regen.ops.status_snapshot import window_rates
from tests.common.test_record import make_spec
from tests.support.generate_harness import REPO, Worker, enqueue_prompts
from tests.support.helpers import (
    committed_count,
    decode_message,
    drop_job_id,
    job_ids,
    queued_chunks,
    wait_for,
)
from tests.support.redis_server import RedisServer
from tests.support.sglang_standin.process import run_standin

JOB = "s"
NORMAL = [f"Tell me fact number {i} about the moon." for i in range(16)]  # ~40 tokens each
# Fits the job's 150-token limit, not the stand-in's context (95 + 48 > 110): HTTP 400.
REFUSED = "Summarize: " + "the quick brown fox " * 15
TOO_LONG = "Please repeat: " + "words " * 200  # ~234 tokens: refused at input
PROMPTS = [*NORMAL[:6], REFUSED, *NORMAL[6:], TOO_LONG]


def cli(command: Any, url: str, *args: str) -> Result:
    return CliRunner().invoke(command, ["--redis-url", url, *args], catch_exceptions=False)


def status_json(url: str) -> dict[str, Any]:
    result = cli(status, url, "--job", JOB, "--json")
    assert result.exit_code == 0, result.output
    (job,) = orjson.loads(result.output)["jobs"]
    return job  # type: ignore[no-any-return]


# --- computed here, not by regen -------------------------------------------------------


def _open_ids(r: redis.Redis, payload: dict[str, Any]) -> set[str]:
    done = {m.decode() for m in r.smembers(keys.chunk_generated(JOB, payload["chunk"]))}
    return {p["id"] for p in payload["prompts"]} - done


def held_chunks(r: redis.Redis) -> list[dict[str, Any]]:
    """Chunk payloads delivered to a worker and not acknowledged."""
    return [decode_message(orjson.dumps(orjson.loads(raw)[0]))
            for raw in r.hvals(keys.KOMBU_UNACKED)]  # fmt: skip


def truth(r: redis.Redis, spec: JobSpec) -> dict[str, int]:
    """Where the prompts are, read straight from Redis while nothing moves."""
    assert not r.hlen(keys.pending_shards(JOB)), "a shard is mid-commit"
    dead = [entry for stage in keys.STAGES for entry in r.hkeys(keys.dlq(JOB, stage))]
    in_flight = sum(len(_open_ids(r, c)) for c in held_chunks(r)) + r.xlen(keys.results_stream(JOB))
    return {
        "total": len(job_ids(r, JOB)),
        "waiting": sum(len(_open_ids(r, c)) for c in queued_chunks(r, spec.queue)),
        "in_flight": in_flight,
        "done": committed_count(r, JOB),
        "dead_lettered": sum(not e.startswith((b"row:", b"task:")) for e in dead),
        "purged": r.scard(keys.dlq_purged(JOB)),
        "unplaced": 0,
    }


def still(r: redis.Redis, spec: JobSpec) -> dict[str, int]:
    """The truth once two readings agree: a command sent just before a SIGSTOP lands."""
    readings = [truth(r, spec)]

    def settled() -> bool:
        readings.append(truth(r, spec))
        return readings[-1] == readings[-2]

    wait_for(settled, timeout=30, what="the frozen run to settle")
    return readings[-1]


# --- the run ------------------------------------------------------------------------------


def tokenize_worker(url: str, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "regen", "worker", "tokenize", "--out", str(out),
         "--redis-url", url, "--shard-rows", "5", "--idle-commit", "0.3", "--min-free-mb", "0"],
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


def finished(r: redis.Redis) -> bool:
    """Every prompt in a shard or a DLQ, and the tokenize worker's heartbeat (every 10 s)
    already shows it serving the job."""
    beats = [orjson.loads(raw) for raw in r.hvals(keys.WORKERS)]
    return (
        committed_count(r, JOB) == len(NORMAL)
        and not r.hlen(keys.KOMBU_UNACKED)
        and not r.xlen(keys.results_stream(JOB))
        and any(JOB in beat.get("jobs", {}) for beat in beats)
    )


def freeze_mid_chunk(worker: Worker, r: redis.Redis) -> None:
    """SIGSTOP the generate worker while it holds a chunk with prompts still generating
    and at least six results wait on the stream (two shards' worth)."""

    def mid_chunk() -> bool:
        held = held_chunks(r)
        return r.xlen(keys.results_stream(JOB)) >= 6 and any(_open_ids(r, c) for c in held)

    while True:
        wait_for(mid_chunk, timeout=120, what="results and a chunk half done")
        worker.process.send_signal(signal.SIGSTOP)
        if mid_chunk():
            return
        worker.process.send_signal(signal.SIGCONT)  # the chunk just ended: next one


@pytest.fixture(scope="module")
def run(redis_server: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """One run, observed at four moments: {moment: (status job, truth, verify result)}."""
    url = redis_server.url.rsplit("/", 1)[0] + "/2"  # a database of its own
    r = redis.Redis.from_url(url)
    r.flushdb()
    tmp = tmp_path_factory.mktemp("status-run")
    spec = enqueue_prompts(url, tmp, PROMPTS, job=JOB, chunk_size=4, max_prompt_tokens=150)
    seen: dict[str, Any] = {"url": url, "r": r, "out": tmp / "out"}

    def observe(moment: str) -> None:
        now = still(r, spec)
        seen[moment] = (status_json(url), now, cli(verify, url, "--job", JOB, "--json"))

    observe("before")
    tokenizer = None
    with run_standin(decode_tokens_per_s=10, output_len_dist="uniform:min=5,max=40",
                     context_length=110) as server:  # fmt: skip
        worker = Worker(url, tmp, "--engine", "sglang", "--server", server.url, "--jobs", JOB,
                        "--concurrency", "1", env={"REGEN_VISIBILITY_TIMEOUT": "300"})  # fmt: skip
        try:
            freeze_mid_chunk(worker, r)
            observe("generating")  # no tokenize worker yet: results wait on the stream
            tokenizer = tokenize_worker(url, seen["out"])
            wait_for(lambda: not r.xlen(keys.results_stream(JOB)) and r.hlen(keys.shards(JOB)),
                     timeout=120, what="the results so far in shards")  # fmt: skip
            observe("committed")  # the worker still holds its chunk
            worker.process.send_signal(signal.SIGCONT)
            seen["moving"] = []

            def check_while_moving() -> bool:
                done = finished(r)  # before the checks: they must pass on the final state too
                result = cli(verify, url, "--job", JOB, "--json")
                seen["moving"].append((result.exit_code, result.output, status_json(url)))
                return done

            wait_for(check_while_moving, timeout=180, what="the run to finish")
            observe("end")
            seen["table"] = cli(status, url).output
        finally:
            worker.process.send_signal(signal.SIGCONT)
            worker.stop()
            if tokenizer is not None:
                tokenizer.send_signal(signal.SIGTERM)
                tokenizer.wait(timeout=60)
    yield seen


# --- fast checks --------------------------------------------------------------------------


def test_rates_come_from_the_commit_samples_of_the_recent_window() -> None:
    samples = [Sample(1000.0, 10, 100), Sample(1400.0, 50, 500), Sample(1900.0, 90, 900)]
    # Baseline: the newest sample at least 600 s old (t=1400); now has 110 committed.
    assert window_rates(samples, Sample(2000.0, 110, 1100), 600) == (60 / 600, 600 / 600)
    # A job younger than the window is measured from its first commit.
    assert window_rates(samples[:2], Sample(1500.0, 50, 500), 600) == (40 / 500, 400 / 500)
    # One commit says how much, not how fast; none in the window means stopped.
    assert window_rates(samples[:1], Sample(1100.0, 10, 100), 600) is None
    assert window_rates(samples[:1], Sample(5000.0, 10, 100), 600) == (0.0, 0.0)


def test_status_flags_a_stale_worker_and_lists_no_jobs(redis_server: RedisServer) -> None:
    url = redis_server.url.rsplit("/", 1)[0] + "/1"
    r = redis.Redis.from_url(url)
    r.flushdb()
    beat = {"kind": "generate", "host": "gpu-7", "engine": "sglang", "healthy": True,
            "queues": [], "inflight": 0, "tokens_per_s": 0.0, "last_seen": time.time() - 3600,
            "engine_stats": {"servers": [{"url": "http://gpu-7:30000", "healthy": False,
                                          "inflight": 0}]}}  # fmt: skip
    r.hset(keys.WORKERS, "generate@gpu-7:1", orjson.dumps(beat))
    result = cli(status, url, "--json")
    assert result.exit_code == 0, result.output
    document = orjson.loads(result.output)
    assert document["jobs"] == []
    assert [w["stale"] for w in document["workers"]] == [True]
    table = cli(status, url).output
    assert "STALE" in table and "DOWN" in table and "no jobs" in table
    assert cli(status, url, "--watch").output == table  # not a terminal: drawn once
    assert cli(status, url, "--job", "nope").exit_code != 0


def test_a_chunk_kombu_is_delivering_is_counted_in_flight(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    """kombu's BRPOP takes a message off its queue and a later round trip puts it in
    `unacked` (as `[message, exchange, routing key]`, the message's text kept as it
    was): a count that falls in between is retaken, not reported as lost."""
    url = redis_server.url.rsplit("/", 1)[0] + "/3"
    r = redis.Redis.from_url(url)
    r.flushdb()
    spec = enqueue_prompts(url, tmp_path, NORMAL[:8], job=JOB)
    (queue,) = [name for name in queue_lists(spec.queue) if r.llen(name)]
    message = r.rpop(queue)
    assert message is not None
    tag = orjson.loads(message)["properties"]["delivery_tag"]
    assert status_json(url)["prompts"]["unplaced"] == 4  # a chunk in neither place

    delivered = threading.Timer(
        0.15,
        lambda: (
            r.pipeline()
            .zadd(keys.KOMBU_UNACKED_INDEX, {tag: time.time()})
            .hset(keys.KOMBU_UNACKED, tag, b'[%s, "", "%s"]' % (message, queue.encode()))
            .execute()
        ),
    )
    delivered.start()
    job = status_json(url)
    delivered.join()
    assert job["prompts"]["unplaced"] == 0 and job["prompts"]["in_flight"] == 4, job
    assert job["chunks"] == {"waiting": 1, "in_flight": 1}


def test_a_shard_finalized_twice_is_counted_once(redis_server: RedisServer) -> None:
    """Recovery can finalize a shard its owner already finalized."""
    r = redis.Redis.from_url(redis_server.url.rsplit("/", 1)[0] + "/1")
    r.flushdb()
    jobspec.save(r, make_spec(name=JOB))
    ledger = CommitLedger(r, JOB)
    ids = ["a" * 16, "b" * 16]
    _, claim = ledger.claim("shard-000001.jsonl.zst", "c1", ids)
    assert ledger.count() == (2, 2)  # claimed, not done yet
    row = orjson.dumps({"completion_tokens": 30, "compressed_bytes": 999})
    assert ledger.finalize(claim.shard, row, [], ids)
    assert ledger.finalize(claim.shard, row, [], ids)
    assert ledger.count() == (2, 0)
    assert r.hgetall(keys.job_counters(JOB)) == {
        keys.COMMITTED_INDEX.encode(): b"2",
        keys.COMMITTED_PROMPTS.encode(): b"2",
        keys.COMMITTED_OUTPUT_TOKENS.encode(): b"30",
        keys.COMMITTED_SHARD_BYTES.encode(): b"999",
    }
    (sample,) = r.lrange(keys.job_progress(JOB), 0, -1)
    when, prompts, tokens = orjson.loads(sample)
    assert (prompts, tokens) == (2, 30) and abs(when - time.time()) < 60


# --- the run --------------------------------------------------------------------------------


@pytest.mark.slow
def test_before_any_worker_everything_waits(run: dict) -> None:
    job, now, checked = run["before"]
    assert job["prompts"] == now
    assert now == {"total": 18, "waiting": 17, "in_flight": 0, "done": 0,
                   "dead_lettered": 1, "purged": 0, "unplaced": 0}  # fmt: skip
    assert job["chunks"] == {"waiting": 5, "in_flight": 0}
    assert job["dead_letters"]["input"] == {"prompt_too_long": 1}
    assert job["eta_s"] is None and job["rate"]["prompts_per_s"] is None
    assert any("no live generate worker" in flag for flag in job["flags"])
    assert checked.exit_code == 0, checked.output
    report = orjson.loads(checked.output)
    assert report["places"] == {"waiting": 17, "dead_lettered": 1, "missing": 0}


@pytest.mark.slow
def test_mid_run_counts_are_where_the_prompts_are(run: dict) -> None:
    job, now, checked = run["generating"]
    assert job["prompts"] == now
    assert job["chunks"]["in_flight"] == 1 and job["in_flight_parts"]["generating"] > 0
    assert job["in_flight_parts"]["results_pending"] >= 6 and now["done"] == 0
    assert any("no live tokenize worker" in flag for flag in job["flags"])
    assert checked.exit_code == 0, checked.output
    places = orjson.loads(checked.output)["places"]
    assert places["in_flight"] == now["in_flight"] and places["waiting"] == now["waiting"]

    job, now, checked = run["committed"]
    assert job["prompts"] == now
    assert now["done"] >= 6 and now["in_flight"] > 0 and now["in_flight"] == (
        job["in_flight_parts"]["generating"])  # fmt: skip
    assert job["shards"]["count"] >= 2 and job["committed"]["prompts"] == now["done"]
    assert job["rate"]["prompts_per_s"] > 0 and job["rate"]["output_tokens_per_s"] > 0
    assert job["eta_s"] > 0
    assert checked.exit_code == 0, checked.output
    report = orjson.loads(checked.output)
    assert report["places"]["done"] == now["done"] and report["shard_ids_read"] == now["done"]


@pytest.mark.slow
def test_at_the_end_everything_is_done_or_dead_lettered(run: dict) -> None:
    job, now, checked = run["end"]
    assert job["prompts"] == now
    assert now == {"total": 18, "waiting": 0, "in_flight": 0, "done": 16,
                   "dead_lettered": 2, "purged": 0, "unplaced": 0}  # fmt: skip
    dead = {"input": {"prompt_too_long": 1}, "generate": {"rejected_by_server": 1}}
    assert job["dead_letters"] == {**dead, "tokenize": {}}
    assert job["eta_s"] == 0 and job["flags"] == []
    shards = job["shards"]
    assert shards["count"] >= 4 and shards["bytes"] > 0 and shards["free_bytes"] > 0
    assert shards["dir"] == str((run["out"] / JOB).resolve())
    assert job["workers"] == {"generate": 1, "tokenize": 1, "left_to_faster": 0}
    assert checked.exit_code == 0, checked.output
    report = orjson.loads(checked.output)
    assert report["places"] == {"done": 16, "dead_lettered": 2, "missing": 0}
    assert report["dead_letters"] == dead
    assert report["shards_read"] == shards["count"] and report["shard_ids_read"] == 16
    table = run["table"]
    assert "16 done (88.9%)" in table and "rejected_by_server 1" in table
    assert "generate@" in table and "tokenize@" in table


@pytest.mark.slow
def test_verify_and_status_add_up_while_the_run_moves(run: dict) -> None:
    """Checked over and over while chunks, results and shards move under the reads."""
    moving = run["moving"]
    assert len(moving) >= 5, "the run ended before it could be watched"
    for exit_code, output, job in moving:
        assert exit_code == 0, output
        assert job["prompts"]["unplaced"] == 0, job
        assert sum(orjson.loads(output)["places"].values()) == 18
    # Something moved: the first check saw prompts still waiting or in flight.
    first = moving[0][2]["prompts"]
    assert first["waiting"] + first["in_flight"] > 0


def _first_shard(run: dict) -> Path:
    return shard_paths(run["out"] / JOB)[0]


@pytest.mark.slow
def test_verify_fails_on_an_id_in_two_shards(run: dict) -> None:
    record = next(iter_records(_first_shard(run)))
    planted = run["out"] / JOB / "shard-999999.jsonl.zst"
    planted.write_bytes(zstandard.ZstdCompressor().compress(orjson.dumps(record) + b"\n"))
    try:
        result = cli(verify, run["url"], "--job", JOB)
        assert result.exit_code == 1
        assert f"in_two_shards: {record['id']}: in shard-999999" in result.output
        assert "unlisted_shard: shard-999999.jsonl.zst" in result.output
        assert cli(verify, run["url"], "--job", JOB, "--no-shards").exit_code == 0
    finally:
        planted.unlink()


@pytest.mark.slow
def test_verify_fails_on_a_missing_id(run: dict) -> None:
    r = run["r"]
    JobIds(r, JOB).add(["00000000deadbeef"])
    try:
        result = cli(verify, run["url"], "--job", JOB, "--no-shards")
        assert result.exit_code == 1
        assert "missing: 00000000deadbeef" in result.output
    finally:
        drop_job_id(r, JOB, "00000000deadbeef")


@pytest.mark.slow
def test_verify_fails_on_a_committed_id_that_is_also_dead_lettered(run: dict) -> None:
    r = run["r"]
    pid = next(iter_records(_first_shard(run)))["id"]
    dlq.put(r, dlq.DeadLetter(entry_id=pid, job=JOB, stage="tokenize", reason="planted",
                              message="", prompt_id=pid))  # fmt: skip
    try:
        result = cli(verify, run["url"], "--job", JOB, "--no-shards")
        assert result.exit_code == 1
        assert f"done_and_dead_lettered: {pid}" in result.output
    finally:
        r.hdel(keys.dlq(JOB, "tokenize"), pid)


@pytest.mark.slow
def test_verify_fails_on_a_committed_id_missing_from_its_shard(run: dict, tmp_path: Path) -> None:
    shard = _first_shard(run)
    backup = tmp_path / shard.name
    shutil.copy(shard, backup)
    records = list(iter_records(shard))
    shard.write_bytes(zstandard.ZstdCompressor().compress(
        b"".join(orjson.dumps(rec) + b"\n" for rec in records[1:])))  # fmt: skip
    try:
        result = cli(verify, run["url"], "--job", JOB)
        assert result.exit_code == 1
        assert f"not_in_shard: {records[0]['id']}: committed to {shard.name}" in result.output
    finally:
        shutil.copy(backup, shard)
    assert cli(verify, run["url"], "--job", JOB).exit_code == 0


@pytest.mark.slow
def test_verify_fails_on_a_shard_cut_short(run: dict, tmp_path: Path) -> None:
    shard = _first_shard(run)
    backup = tmp_path / shard.name
    shutil.copy(shard, backup)
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    try:
        result = cli(verify, run["url"], "--job", JOB)
        assert result.exit_code == 1
        assert f"unreadable_shard: {shard.name}: after " in result.output
        assert "truncated" in result.output
    finally:
        shutil.copy(backup, shard)
    assert cli(verify, run["url"], "--job", JOB).exit_code == 0


@pytest.mark.slow
def test_a_purged_prompt_is_accounted_for(run: dict) -> None:
    r = run["r"]
    (entry_id,) = r.hkeys(keys.dlq(JOB, "generate"))
    raw = r.hget(keys.dlq(JOB, "generate"), entry_id)
    r.hdel(keys.dlq(JOB, "generate"), entry_id)
    try:
        lost = cli(verify, run["url"], "--job", JOB, "--no-shards")
        assert lost.exit_code == 1 and f"missing: {entry_id.decode()}" in lost.output
        r.sadd(keys.dlq_purged(JOB), entry_id)  # what `regen dlq purge` records
        result = cli(verify, run["url"], "--job", JOB, "--no-shards", "--json")
        assert result.exit_code == 0, result.output
        assert orjson.loads(result.output)["places"]["purged"] == 1
        prompts = status_json(run["url"])["prompts"]
        assert prompts["purged"] == 1 and prompts["unplaced"] == 0
    finally:
        r.srem(keys.dlq_purged(JOB), entry_id)
        r.hset(keys.dlq(JOB, "generate"), entry_id, raw)
