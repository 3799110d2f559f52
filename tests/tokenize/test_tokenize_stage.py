"""The tokenize stage against a real Redis: exactly-once shards, crashes, disk guard."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from rich.console import Console

from regen.common import dlq, jobspec, keys, provenance
from regen.common.ledger.commit_ledger import CommitLedger
from regen.consumers.tokenize import consumer as tokenize_consumer
from regen.consumers.tokenize import job_writer
from regen.consumers.tokenize.consumer import free_bytes
from regen.consumers.tokenize.shard_files import iter_records, read_manifest, shard_paths
from regen.ops.shards_inspect import verify
from regen.ops.status_snapshot import job_status
from regen.ops.status_view import job_table
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import make_result, wait_for
from tests.support.tokenize_harness import (
    HEARTBEAT_STALE_S,
    REPO,
    InProcess,
    options,
    push,
    settled,
    stop_worker,
    tokenize_worker,
)


@pytest.fixture
def spec(r: redis.Redis) -> jobspec.JobSpec:
    prepared = prepare_job(JobOptions(job="t", model="smollm2", max_new_tokens=64))
    return jobspec.save(r, prepared.spec)


def shard_ids(folder: Path) -> list[str]:
    return [rec["id"] for shard in shard_paths(folder)
            for rec in iter_records(shard)]  # fmt: skip


@pytest.fixture
def out(tmp_path: Path) -> Path:
    return tmp_path / "out"


def test_records_are_token_exact_and_written_once(
    r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, out: Path
) -> None:
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(60)]
    push(r, results)
    push(r, results[:20])  # the same results delivered again (a chunk that ran twice)
    with InProcess(r, options(out), "c1"):
        wait_for(lambda: settled(r, "t", 60), what="all results committed")

    folder = out / "t"
    records = {rec["id"]: rec for shard in shard_paths(folder) for rec in iter_records(shard)}
    assert Counter(shard_ids(folder)).most_common(1)[0][1] == 1 and len(records) == 60
    for result in results:
        record = records[result.id]
        assert record["input_ids"] == result.prompt_ids + result.output_ids
        assert record["loss_mask"] == [0] * len(result.prompt_ids) + [1] * len(result.output_ids)
        assert record["messages"][-1] == {"role": "assistant", "content": result.text}
    assert len(read_manifest(folder).shards) >= 3  # 25-row shards
    assert verify(folder) == []
    pending = r.xpending(keys.results_stream("t"), keys.TOKENIZE_GROUP)
    assert pending["pending"] == 0


def test_a_failing_check_dead_letters_only_that_result(
    r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, out: Path
) -> None:
    good = [make_result(smollm2_tokenizer, spec, i) for i in range(5)]
    bad = make_result(smollm2_tokenizer, spec, 99)
    bad = type(bad)(**{**bad.__dict__, "text": "something the ids do not say"})
    push(r, [*good[:2], bad, *good[2:]])
    with InProcess(r, options(out), "c1"):
        wait_for(lambda: settled(r, "t", 6), what="results settled")
    assert sorted(shard_ids(out / "t")) == sorted(g.id for g in good)
    (letter,) = list(dlq.entries(r, "t", "tokenize"))
    assert letter.prompt_id == bad.id and letter.reason == "text_mismatch"


@pytest.mark.slow
@pytest.mark.parametrize(
    "crashpoint",
    ["tokenize.mid_shard", "tokenize.after_claim", "tokenize.after_rename",
     "tokenize.after_place"],
)  # fmt: skip
def test_a_tokenizer_killed_at_any_point_loses_and_duplicates_nothing(
    redis_url: str, r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any,
    out: Path, tmp_path: Path, crashpoint: str,
) -> None:  # fmt: skip
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(70)]
    push(r, results)
    doomed = tokenize_worker(redis_url, out, crashpoint=crashpoint)
    doomed.wait(timeout=120)
    assert doomed.returncode == -signal.SIGKILL, doomed.stderr.read().decode()  # type: ignore[union-attr]
    push(r, results[:10])  # redelivered results arrive meanwhile too

    survivor = tokenize_worker(redis_url, out)
    try:
        wait_for(lambda: settled(r, "t", 70), timeout=120, what="recovery and commit")
    finally:
        stop_worker(survivor)
    folder = out / "t"
    ids = shard_ids(folder)
    assert sorted(ids) == sorted(res.id for res in results), "lost or duplicated ids"
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "temporary files left"
    assert verify(folder) == []


def _consumer(proc: subprocess.Popen[bytes]) -> str:
    return f"tokenize@{socket.gethostname()}:{proc.pid}"


@pytest.mark.slow
def test_a_consumer_killed_twice_has_its_results_taken_over_by_heartbeat(
    redis_url: str, r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, out: Path
) -> None:
    """With the default --claim-idle (900 s): only the dead consumers' stale heartbeats
    can hand their results to the survivor within the test."""
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(80)]
    dead = []
    for batch in (results[:40], results[40:]):
        push(r, batch)
        doomed = tokenize_worker(redis_url, out, crashpoint="tokenize.mid_shard", extra=())
        doomed.wait(timeout=120)
        assert doomed.returncode == -signal.SIGKILL, doomed.stderr.read().decode()  # type: ignore[union-attr]
        dead.append(_consumer(doomed))
    beats = {name: orjson.loads(r.hget(keys.WORKERS, name))["last_seen"] for name in dead}
    stream = keys.results_stream("t")

    def group() -> dict[str, int]:
        return {c["name"].decode(): c["pending"]
                for c in r.xinfo_consumers(stream, keys.TOKENIZE_GROUP)}  # fmt: skip

    assert sum(group().get(name, 0) for name in dead) > 0, "nothing left to take over"
    started = time.time()
    survivor = tokenize_worker(redis_url, out, extra=())
    try:
        wait_for(lambda: not set(dead) & set(group()), timeout=90,
                 what="the dead consumers' results taken over")  # fmt: skip
        taken_at = time.time()
        wait_for(lambda: settled(r, "t", 80), timeout=120, what="all results committed")
    finally:
        stop_worker(survivor)
    # Dead = a heartbeat older than the stale time; looked for every quarter of it, once
    # the survivor runs (its start, with the tokenizer load, gets the slack).
    due = max(started, *(beat + HEARTBEAT_STALE_S for beat in beats.values()))
    assert taken_at - due <= HEARTBEAT_STALE_S / 4 + 20, taken_at - due
    assert sorted(shard_ids(out / "t")) == sorted(res.id for res in results)
    assert verify(out / "t") == []


@pytest.mark.slow
def test_two_consumers_share_a_job_without_loss_or_duplicates(
    redis_url: str, r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any,
    out: Path, tmp_path: Path,
) -> None:  # fmt: skip
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(200)]
    workers = [tokenize_worker(redis_url, out) for _ in range(2)]
    try:
        for start in range(0, 200, 20):
            push(r, results[start : start + 20])
            push(r, results[start : start + 5])  # duplicates race between the consumers
        wait_for(lambda: settled(r, "t", 200), timeout=180, what="both consumers done")
    finally:
        for worker in workers:
            stop_worker(worker)
    ids = shard_ids(out / "t")
    assert len(ids) == len(set(ids)) == 200
    beats = r.hgetall(keys.WORKERS)
    assert not beats, "stopped workers must remove their heartbeats"
    assert verify(out / "t") == []


def test_low_disk_pauses_the_stage_and_it_resumes(
    r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, out: Path
) -> None:
    out.mkdir()
    threshold = free_bytes(out) - 64 * 1024**2
    with InProcess(r, options(out, min_free_bytes=threshold), "c1") as running:
        ballast = out / "ballast"
        with open(ballast, "wb") as fh:  # take 256 MB: free space drops below threshold
            os.posix_fallocate(fh.fileno(), 0, 256 * 1024**2)
        wait_for(lambda: running.consumer.state.paused_for_disk, what="the disk pause")
        push(r, [make_result(smollm2_tokenizer, spec, i) for i in range(30)])
        # Paused: nothing is read or written while space is short.
        assert not running.consumer.state.writers.get("t") or not shard_paths(out / "t")
        assert r.xlen(keys.results_stream("t")) == 30
        ballast.unlink()
        wait_for(lambda: settled(r, "t", 30), what="the stage to resume and commit")
    assert sorted(shard_ids(out / "t")) == sorted(
        make_result(smollm2_tokenizer, spec, i).id for i in range(30)
    )


def test_an_unwritable_out_folder_is_one_clear_line(redis_url: str, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    done = subprocess.run(
        [sys.executable, "-m", "regen", "worker", "tokenize", "--out", str(blocker / "out"),
         "--redis-url", redis_url],
        env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
    assert (
        done.stderr.strip() == f"Error: cannot write shards to {blocker / 'out'}: Not a directory"
    )


def test_quality_flags_are_counted_once_per_committed_record(
    r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, out: Path
) -> None:
    loop = " and so on" * 40
    answers = ["", "", "", f"Counting{loop}", f"Counting{loop}"] + [None] * 25
    results = [make_result(smollm2_tokenizer, spec, i, answer) for i, answer in enumerate(answers)]
    push(r, results)
    push(r, results[:10])  # delivered again: still one record and one count each
    made_by = {"job": "t", "model": "smollm2", "regen_version": "test"}
    provenance.save(r, made_by)
    with InProcess(r, options(out), "c1"):
        wait_for(lambda: settled(r, "t", 30), what="all results committed")

    flagged = CommitLedger(r, "t").totals().flags
    assert flagged == {"empty": 3, "thinking_only": 0, "truncated": 0, "repetition": 2,
                       "bad_tool_call": 0}  # fmt: skip
    manifests = Counter[str]()
    for info in read_manifest(out / "t").shards.values():
        manifests.update(info.flags)
    assert dict(manifests) == {"empty": 3, "repetition": 2}
    assert provenance.read_file(out / "t") == made_by  # beside the shards
    status = job_status(r, spec, [], window_s=60)
    assert status["committed"]["flagged"] == flagged
    console = Console(width=200, record=True)
    console.print(job_table(status))
    assert "empty 3 (10.0%) · repetition 2 (6.7%)" in console.export_text()


def test_a_job_served_by_two_sglang_versions_says_so(
    r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, out: Path
) -> None:
    import dataclasses

    from regen.ops.reconcile import reconcile

    versions = ["0.5.6"] * 4 + ["0.5.23"] * 6
    results = [
        dataclasses.replace(make_result(smollm2_tokenizer, spec, i), server_version=version)
        for i, version in enumerate(versions)
    ]
    push(r, results)
    with InProcess(r, options(out), "c1"):
        wait_for(lambda: settled(r, "t", 10), what="all results committed")
    records = [rec for shard in shard_paths(out / "t") for rec in iter_records(shard)]
    assert Counter(rec["server_version"] for rec in records) == {"0.5.6": 4, "0.5.23": 6}
    manifests = Counter[str]()
    for info in read_manifest(out / "t").shards.values():
        manifests.update(info.server_versions)
    assert manifests == {"0.5.6": 4, "0.5.23": 6}
    status = job_status(r, spec, [], window_s=60)
    assert status["committed"]["server_versions"] == {"0.5.6": 4, "0.5.23": 6}
    warning = ("servers of more than one SGLang version generated this job: "
               "0.5.23 (6 records), 0.5.6 (4 records)")  # fmt: skip
    assert warning in status["flags"]
    assert reconcile(r, spec, out / "t", read_shards=False).warnings == [warning]


def test_a_worker_whose_template_differs_refuses_the_job_and_status_says_so(
    r: redis.Redis, smollm2_tokenizer: Any, out: Path
) -> None:
    """The fingerprint covers the chat template: a host whose tokenizer renders otherwise
    than the job's cannot change the job mid-way; it refuses it, and status and verify
    name the worker and why."""
    import dataclasses

    from regen.common import tokenizer_refusals
    from regen.ops.reconcile import reconcile

    prepared = prepare_job(JobOptions(job="t", model="smollm2", max_new_tokens=64))
    other = jobspec.save(r, dataclasses.replace(prepared.spec, tokenizer_fingerprint="0" * 16))
    push(r, [make_result(smollm2_tokenizer, other, 1)])
    with InProcess(r, options(out), "c1") as running:
        wait_for(lambda: tokenizer_refusals.read(r, "t"), what="the refusal recorded")
        name = running.consumer.name
    (why,) = tokenizer_refusals.read(r, "t").values()
    assert "differs from the job's" in why and "0" * 16 in why
    expected = f"worker {name} refuses this job: {why}"
    live = [{"name": name, "stale": False, "kind": "tokenize", "jobs": {}}]
    assert expected in job_status(r, other, live, window_s=60)["flags"]
    assert expected not in job_status(r, other, [], window_s=60)["flags"]  # gone: not said
    assert expected in reconcile(r, other, out / "t", read_shards=False).warnings
    assert not (out / "t").exists() or not list((out / "t").glob("shard-*"))


def test_a_claim_redis_loses_before_its_shard_is_placed_places_nothing(
    r: redis.Redis,
    spec: jobspec.JobSpec,
    smollm2_tokenizer: Any,
    out: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Redis comes back from a copy taken before a writer's claim while the writer is
    between its claim and placing the shard (a chaos CI seed, under load). Placing then
    would put on disk ids Redis has free, and stop the job as behind the disk until an
    operator ran `regen recover` again. The writer checks its claim first: it places
    nothing, and writes those results again under a new claim."""
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(10)]
    push(r, results)
    ledger = CommitLedger(r, "t")
    lost: list[str] = []
    real_hit = job_writer.crashpoints.hit

    def claim_lost_once(point: str) -> None:
        if point == "tokenize.after_claim" and not lost:
            for claim in ledger.pending().values():  # as the older copy has it: no claim
                ledger.release(claim)
                lost.append(claim.shard)
        real_hit(point)

    monkeypatch.setattr(job_writer.crashpoints, "hit", claim_lost_once)
    with InProcess(r, options(out), "c1"):
        wait_for(lambda: settled(r, "t", 10), timeout=60, what="all results committed")
    folder = out / "t"
    assert lost and lost[0] not in {path.name for path in shard_paths(folder)}
    assert sorted(shard_ids(folder)) == sorted(res.id for res in results)
    assert ledger.unknown_shards([path.name for path in shard_paths(folder)]) == []
    assert verify(folder) == []


class SteppedClock:
    """The consumer module's `time`: monotonic() moves only when the test says."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def time(self) -> float:  # wall-clock reads (heartbeats' ages) stay real
        return time.time()


def test_a_worker_busy_with_one_job_takes_up_a_new_one_within_seconds(
    r: redis.Redis, spec: jobspec.JobSpec, out: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = SteppedClock()
    monkeypatch.setattr(tokenize_consumer, "time", clock)
    consumer = tokenize_consumer.TokenizeConsumer(r, options(out), "c1")
    consumer.step()
    assert set(consumer.state.writers) == {"t"}
    second = prepare_job(JobOptions(job="second", model="smollm2", max_new_tokens=64))
    jobspec.save(r, second.spec)
    # Well inside the recovery pass's interval (30 s at the product's shard lease), which
    # is when a worker that had a job used to look for new ones.
    clock.now += tokenize_consumer.JOB_DISCOVERY_S
    assert tokenize_consumer.JOB_DISCOVERY_S * 5 < tokenize_consumer.RECOVER_INTERVAL_S
    consumer.step()
    assert set(consumer.state.writers) == {"t", "second"}
