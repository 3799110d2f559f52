"""The tokenize stage's own recovery (consumers/tokenize/self_recovery.py): workers that
find Redis behind a job's shards at once rebuild its ledger once, under a lock."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import redis

from regen.common import jobspec, keys
from regen.consumers.tokenize.job_folder import LocalFolder
from regen.consumers.tokenize.recover import Recovery
from regen.consumers.tokenize.self_recovery import RecoveryLock, recover_behind
from tests.support.helpers import committed_count, make_result, wait_for, write_jsonl
from tests.support.tokenize_harness import InProcess, options, push
from tests.tokenize.test_redis_restore import JOB, dump_all, enqueue_args, regen, restore_all


def behind_the_disk(redis_url: str, r: redis.Redis, tmp_path: Path, tok: Any) -> LocalFolder:
    """A job with three shards on disk in a Redis restored from a copy taken after the
    first: its folder."""
    rows = [{"prompt": f"Question {i}: what is {i} plus {i}?"} for i in range(12)]
    dataset = write_jsonl(tmp_path / "q.jsonl", rows)
    assert regen(redis_url, *enqueue_args(dataset)).exit_code == 0
    spec = jobspec.load(r, JOB)
    results = [make_result(tok, spec, i) for i in range(12)]
    out = tmp_path / "out"
    with InProcess(r, options(out, claim_idle_s=600), "c1"):
        push(r, results[:4])
        wait_for(lambda: r.hlen(keys.shards(JOB)) == 1, what="a first shard")
        copy = dump_all(r)
        push(r, results[4:8])
        wait_for(lambda: r.hlen(keys.shards(JOB)) == 2, what="a second shard")
        push(r, results[8:])
        wait_for(lambda: committed_count(r, JOB) == 12 and not r.hlen(keys.pending_shards(JOB)),
                 what="all committed")  # fmt: skip
    restore_all(r, copy)
    return LocalFolder(out / JOB)


def test_workers_finding_redis_behind_at_once_recover_it_once(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    folder = behind_the_disk(redis_url, r, tmp_path, smollm2_tokenizer)
    assert committed_count(r, JOB) == 4
    start = threading.Barrier(4)
    reports: list[Recovery | None] = []

    def worker(name: str) -> None:
        start.wait()
        reports.append(recover_behind(r, JOB, folder, name))

    threads = [threading.Thread(target=worker, args=(f"tokenize@h:{i}",)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    ran = [report for report in reports if report is not None]
    assert len(ran) == 1, reports
    assert ran[0].ids_restored == 8
    assert int(r.get(keys.job_epoch(JOB)) or 0) == 2, "the epoch raised once"
    assert committed_count(r, JOB) == 12
    assert not r.exists(keys.job_behind(JOB)) and not r.exists(keys.job_recover_lock(JOB))


def test_a_held_lock_leaves_the_job_to_its_holder_and_the_flag_set(
    redis_url: str, r: redis.Redis, tmp_path: Path, smollm2_tokenizer: Any
) -> None:
    folder = behind_the_disk(redis_url, r, tmp_path, smollm2_tokenizer)
    other = RecoveryLock(r, JOB, "tokenize@other:1", ttl_s=0.3)
    assert other.acquire()
    assert recover_behind(r, JOB, folder, "tokenize@h:1") is None
    assert r.exists(keys.job_behind(JOB)), "the follower keeps waiting"
    assert committed_count(r, JOB) == 4
    # Renewed while its holder lives: held through three times its expiry.
    deadline = time.monotonic() + 0.9
    while time.monotonic() < deadline:
        assert r.exists(keys.job_recover_lock(JOB)), "renewed while held"
    other.release()
    report = recover_behind(r, JOB, folder, "tokenize@h:1")
    assert report is not None and report.ids_restored == 8
    assert not r.exists(keys.job_behind(JOB))
    assert recover_behind(r, JOB, folder, "tokenize@h:2") is None, "nothing left to do"
