"""A generate worker SIGKILLed inside kombu's window (it popped a chunk; kombu never
recorded it in `unacked`) with `regen enqueue --follow` running: the job settles by
itself, every prompt once, `regen verify` exits 0, and no operator command runs."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import redis

from regen.common import keys
from tests.support.generate_harness import REPO, GroupProcess, Worker
from tests.support.helpers import wait_for, write_jsonl
from tests.support.sglang_standin.process import run_standin
from tests.tokenize.test_redis_restore import (
    JOB,
    TokenizeWorker,
    enqueue_args,
    job_settled,
    regen,
    shard_id_counts,
)

KILL_IN_WINDOW = Path(__file__).resolve().parents[1] / "support" / "kombu_window"


@pytest.mark.slow
def test_a_chunk_lost_in_kombus_window_is_queued_again_by_the_follower(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    prompts = [f"Tell me fact number {i} about the moon." for i in range(24)]
    dataset = write_jsonl(tmp_path / "moon.jsonl", [{"prompt": p} for p in prompts])
    out = tmp_path / "out"
    follower = start_follower(redis_url, dataset, tmp_path)
    tokenize = TokenizeWorker(redis_url, out, tmp_path / "tokenize.log")
    workers: list[Worker] = []
    try:
        wait_for(lambda: r.exists(keys.job_follower(JOB)), timeout=60, what="the follower")
        with run_standin(decode_tokens_per_s=200, output_len_dist="fixed:n=8") as sglang:
            args = ("--engine", "sglang", "--server", sglang.url, "--jobs", JOB)
            doomed = Worker(redis_url, tmp_path, *args,
                            env={"PYTHONPATH": f"{REPO}{os.pathsep}{KILL_IN_WINDOW}"})  # fmt: skip
            workers.append(doomed)
            doomed.process.wait(timeout=120)  # killed at its first pop's unacked record
            assert doomed.process.returncode == -9
            workers.append(Worker(redis_url, tmp_path, *args))
            follower.process.wait(timeout=240)
            assert follower.process.returncode == 0, follower.log()
        assert job_settled(r)
    finally:
        follower.kill()
        for worker in workers:
            worker.kill()
        tokenize.stop()
    followed = follower.log()
    assert "in no place for" in followed and "queueing them again" in followed, followed
    assert_verified_once(redis_url, out, len(prompts))
    assert not r.exists(keys.job_follower(JOB)), "the follower left when done"


def start_follower(redis_url: str, dataset: Path, tmp_path: Path) -> GroupProcess:
    """`regen enqueue DATASET --follow`, with the follower's poll and grace cut to
    seconds so that a lost chunk is queued again within the test."""
    env = {"REGEN_REDIS_URL": redis_url, "REGEN_FOLLOW_POLL_S": "1",
           "REGEN_FOLLOW_GRACE_S": "3"}  # fmt: skip
    return GroupProcess([*enqueue_args(dataset), "--follow"], tmp_path / "follow.log", env)


def assert_verified_once(redis_url: str, out: Path, prompts: int) -> None:
    """`regen verify` passes and the shards hold each of the job's prompts once."""
    verified = regen(redis_url, "verify", "--job", JOB, "--shards-dir", str(out / JOB))
    assert verified.exit_code == 0, verified.output
    counts = shard_id_counts(out / JOB)
    assert len(counts) == prompts and max(counts.values()) == 1, "every prompt once"


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP): state T in /proc."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "T"


@pytest.mark.slow
def test_a_worker_stopped_in_kombus_window_that_wakes_after_the_requeue_writes_nothing_twice(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    prompts = [f"Tell me fact number {i} about the sun." for i in range(16)]
    dataset = write_jsonl(tmp_path / "sun.jsonl", [{"prompt": p} for p in prompts])
    out = tmp_path / "out"
    follower = start_follower(redis_url, dataset, tmp_path)
    tokenize = TokenizeWorker(redis_url, out, tmp_path / "tokenize.log")
    workers: list[Worker] = []
    try:
        wait_for(lambda: r.exists(keys.job_follower(JOB)), timeout=60, what="the follower")
        with run_standin(decode_tokens_per_s=200, output_len_dist="fixed:n=8") as sglang:
            args = ("--engine", "sglang", "--server", sglang.url, "--jobs", JOB)
            sleeper = Worker(redis_url, tmp_path, *args,
                             env={"PYTHONPATH": f"{REPO}{os.pathsep}{KILL_IN_WINDOW}",
                                  "REGEN_TEST_KOMBU_WINDOW": "stop"})  # fmt: skip
            workers.append(sleeper)
            wait_for(lambda: stopped(sleeper.process.pid), timeout=120,
                     what="the worker stopped inside kombu's window")  # fmt: skip
            workers.append(Worker(redis_url, tmp_path, *args))
            follower.process.wait(timeout=240)  # the chunk was queued again under its id and ran
            assert follower.process.returncode == 0, follower.log()
            assert "queueing them again" in follower.log()
            sleeper.signal_group(signal.SIGCONT)  # it wakes, records the old message, runs it
            wait_for(lambda: job_settled(r) and sleeper_done(r), timeout=180,
                     what="the woken worker's delivery settled")  # fmt: skip
            assert sleeper.process.poll() is None, "the woken worker goes on"
    finally:
        follower.kill()
        for worker in workers:
            worker.kill()
        tokenize.stop()
    assert_verified_once(redis_url, out, len(prompts))


def sleeper_done(r: redis.Redis) -> bool:
    """Nothing held in `unacked` any more: the woken worker acked the old message."""
    return not r.hlen(keys.KOMBU_UNACKED)
