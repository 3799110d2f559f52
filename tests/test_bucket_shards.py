"""Shards in object storage, end to end against a real S3 HTTP API (moto's server in its
own process): the tokenize stage writing `--out s3://...` exactly once, killed at each
commit point and under a rolled-back Redis, and every reader reading the bucket."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import datasets
import orjson
import pytest
import redis
from click.testing import CliRunner

from regen.cli import main
from regen.common import jobspec, keys
from regen.consumers.tokenize.job_folder import BucketJobFolder, folder_at
from regen.consumers.tokenize.job_writer import ShardPolicy
from regen.consumers.tokenize.shard_files import iter_records
from regen.producer.job_ids import JobIds
from tests.helpers import committed_count, make_result, wait_for
from tests.s3_server import S3Server, s3_server
from tests.test_redis_restore import dump_all, restore_all
from tests.test_tokenize_stage import (
    HEARTBEAT_STALE_S,
    REPO,
    SHARD_LEASE_S,
    InProcess,
    options,
    push,
    settled,
)

JOB = "t"


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    with s3_server() as server:
        yield server


@pytest.fixture
def out(s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> str:
    """A fresh bucket's `--out`, with the store's environment and a spool of the test's."""
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("REGEN_SPOOL_DIR", str(tmp_path / "spool"))
    monkeypatch.chdir(tmp_path)  # a local folder named `s3:` would appear here
    return f"s3://{s3.new_bucket()}/runs/out"


@pytest.fixture
def spec(r: redis.Redis) -> jobspec.JobSpec:
    from regen.producer.spec import JobOptions, prepare_job

    prepared = prepare_job(JobOptions(job=JOB, model="smollm2", max_new_tokens=64))
    return jobspec.save(r, prepared.spec)


def bucket_ids(out: str) -> list[str]:
    folder = folder_at(f"{out}/{JOB}")
    return [record["id"] for shard in folder.shards() for record in iter_records(shard)]


def regen(redis_url: str, *args: str) -> Any:
    return CliRunner().invoke(main, [*args, "--redis-url", redis_url])


def test_shards_land_in_the_bucket_once_and_every_reader_reads_them(
    redis_url: str, r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any,
    out: str, tmp_path: Path,
) -> None:  # fmt: skip
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(60)]
    JobIds(r, JOB).add([result.id for result in results])  # as its enqueue would have
    push(r, results)
    push(r, results[:20])  # delivered twice (a chunk that ran twice)
    with InProcess(r, options(out), "c1"):  # type: ignore[arg-type]
        wait_for(lambda: settled(r, JOB, 60), what="all results committed")

    assert sorted(bucket_ids(out)) == sorted(result.id for result in results)
    folder = folder_at(f"{out}/{JOB}")
    assert isinstance(folder, BucketJobFolder)
    assert len(folder.manifest().shards) >= 3  # 25-row shards
    assert not (tmp_path / "s3:").exists(), "written to a local folder named s3:"
    assert not [p for p in (tmp_path / "spool").rglob("*") if p.is_file()], "temp files left"
    # Where the tokenize stage wrote, as verify and status find it.
    where = orjson.loads(r.hget(keys.TOKENIZE_OUTPUTS, JOB) or b"{}")["dir"]
    assert where == f"{out}/{JOB}"

    verified = regen(redis_url, "verify", "--job", JOB)
    assert verified.exit_code == 0, verified.output
    assert "shard files not read" not in verified.output
    files = regen(redis_url, "shards", "verify", out)
    assert files.exit_code == 0, files.output
    stats = CliRunner().invoke(main, ["shards", "stats", f"{out}/{JOB}", "--json"])
    assert stats.exit_code == 0, stats.output
    assert orjson.loads(stats.output)["rows"] == 60
    exported = tmp_path / "train.jsonl"
    export = CliRunner().invoke(main, ["shards", "export", out, "--format", "specforge",
                                       "--out", str(exported)])  # fmt: skip
    assert export.exit_code == 0, export.output
    assert len(exported.read_bytes().splitlines()) == 60
    hf = CliRunner().invoke(main, ["shards", "export", out, "--format", "hf", "--out",
                                   str(tmp_path / "ds")])  # fmt: skip
    assert hf.exit_code == 0, hf.output
    dataset = datasets.load_from_disk(str(tmp_path / "ds"))  # as a trainer loads it
    assert sorted(dataset["id"]) == sorted(result.id for result in results)


def test_provenance_is_written_once_beside_the_shards(out: str) -> None:
    folder = folder_at(f"{out}/{JOB}")
    assert folder.read_provenance() is None
    folder.write_provenance({"job": JOB, "model": "first"})
    folder.write_provenance({"job": JOB, "model": "second writer"})
    assert folder.read_provenance() == {"job": JOB, "model": "first"}


def test_a_bucket_that_refuses_writes_is_one_line_at_start(
    redis_url: str, s3: S3Server, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name, value in s3.env.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("REGEN_SPOOL_DIR", str(tmp_path / "spool"))
    result = CliRunner().invoke(main, ["worker", "tokenize", "--out", "s3://regen-nobucket/out",
                                       "--redis-url", redis_url])  # fmt: skip
    assert result.exit_code != 0
    assert "cannot write shards to s3://regen-nobucket/out" in result.output
    assert s3.env["AWS_SECRET_ACCESS_KEY"] not in result.output


def _worker(
    redis_url: str, out: str, crashpoint: str | None = None, spool: Path | None = None
) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "REGEN_SHARD_LEASE_S": str(SHARD_LEASE_S),
           "REGEN_HEARTBEAT_STALE_S": str(HEARTBEAT_STALE_S)}  # fmt: skip
    if spool is not None:
        env["REGEN_SPOOL_DIR"] = str(spool)
    env.pop("REGEN_CRASHPOINT", None)
    if crashpoint:
        env["REGEN_CRASHPOINT"] = crashpoint
    return subprocess.Popen(
        [sys.executable, "-m", "regen", "worker", "tokenize", "--out", out,
         "--redis-url", redis_url, "--shard-rows", "25", "--idle-commit", "0.3",
         "--min-free-mb", "0", "--claim-idle", "3"],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize(
    "crashpoint",
    ["tokenize.mid_shard", "tokenize.after_claim", "tokenize.after_rename",
     "tokenize.after_place"],
)  # fmt: skip
def test_a_tokenizer_killed_mid_commit_to_a_bucket_loses_and_duplicates_nothing(
    redis_url: str, r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any,
    out: str, crashpoint: str,
) -> None:  # fmt: skip
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(70)]
    push(r, results)
    doomed = _worker(redis_url, out, crashpoint=crashpoint)
    doomed.wait(timeout=120)
    assert doomed.returncode == -signal.SIGKILL, doomed.stderr.read().decode()  # type: ignore[union-attr]
    push(r, results[:10])  # redelivered results arrive meanwhile too
    survivor = _worker(redis_url, out)
    try:
        wait_for(lambda: settled(r, JOB, 70), timeout=120, what="recovery and commit")
    finally:
        if survivor.poll() is None:
            survivor.send_signal(signal.SIGTERM)
            survivor.wait(timeout=60)
    assert sorted(bucket_ids(out)) == sorted(result.id for result in results)
    files = regen(redis_url, "shards", "verify", out)
    assert files.exit_code == 0, files.output


def test_a_rolled_back_redis_is_healed_from_the_bucket_and_nothing_is_overwritten(
    redis_url: str, r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any, out: str
) -> None:
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(16)]
    JobIds(r, JOB).add([result.id for result in results])
    first = options(out, policy=ShardPolicy(max_rows=4, max_age_s=30, idle_s=0.3))
    with InProcess(r, first, "c1"):  # type: ignore[arg-type]
        push(r, results[:4])
        wait_for(lambda: r.hlen(keys.shards(JOB)) == 1, what="a first shard")
        copy = dump_all(r)  # a backup, or a replica that lagged
        push(r, results[4:12])
        wait_for(lambda: settled(r, JOB, 12), what="three shards committed")
    folder = folder_at(f"{out}/{JOB}")
    before = {shard.name: shard.size() for shard in folder.shards()}
    assert len(before) == 3
    restore_all(r, copy)  # Redis knows one shard of the three in the bucket

    with InProcess(r, first, "c2"):  # type: ignore[arg-type]
        wait_for(lambda: committed_count(r, JOB) == 12, what="the ledger rebuilt from the bucket")
        push(r, results[12:])  # new work after the rollback: a new shard number
        wait_for(lambda: settled(r, JOB, 16), what="the new results committed")
    after = {shard.name: shard.size() for shard in folder.shards()}
    assert {name: after[name] for name in before} == before, "a committed object was replaced"
    assert len(after) == 4
    assert sorted(bucket_ids(out)) == sorted(result.id for result in results)
    verified = regen(redis_url, "verify", "--job", JOB)
    assert verified.exit_code == 0, verified.output


@pytest.mark.slow
def test_workers_with_spools_of_their_own_share_a_bucket_each_record_once(
    redis_url: str, r: redis.Redis, spec: jobspec.JobSpec, smollm2_tokenizer: Any,
    out: str, tmp_path: Path,
) -> None:  # fmt: skip
    """Three tokenize workers as on three hosts (a spool each; nothing shared but Redis
    and the bucket), with duplicates racing between them."""
    results = [make_result(smollm2_tokenizer, spec, i) for i in range(150)]
    workers = [_worker(redis_url, out, spool=tmp_path / f"host-{i}") for i in range(3)]
    try:
        for start in range(0, 150, 15):
            push(r, results[start : start + 15])
            push(r, results[start : start + 5])
        wait_for(lambda: settled(r, JOB, 150), timeout=180, what="the workers done")
    finally:
        for worker in workers:
            if worker.poll() is None:
                worker.send_signal(signal.SIGTERM)
                worker.wait(timeout=60)
    ids = bucket_ids(out)
    assert len(ids) == len(set(ids)) == 150
    opened = [host.name for host in sorted(tmp_path.glob("host-*")) if any(host.rglob(JOB))]
    assert opened == ["host-0", "host-1", "host-2"], "a worker never took the job up"
    files = regen(redis_url, "shards", "verify", out)
    assert files.exit_code == 0, files.output
