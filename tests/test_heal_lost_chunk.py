"""A generate worker SIGKILLed inside kombu's window (it popped a chunk; kombu never
recorded it in `unacked`) with `regen enqueue --follow` running: the job settles by
itself, every prompt once, `regen verify` exits 0, and no operator command runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from regen.common import keys
from tests.generate_harness import REPO, Worker
from tests.helpers import wait_for, write_jsonl
from tests.sglang_standin.process import run_standin
from tests.test_redis_restore import (
    JOB,
    TokenizeWorker,
    enqueue_args,
    job_settled,
    regen,
    shard_id_counts,
)

KILL_IN_WINDOW = Path(__file__).parent / "kombu_window"


@pytest.mark.slow
def test_a_chunk_lost_in_kombus_window_is_queued_again_by_the_follower(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    prompts = [f"Tell me fact number {i} about the moon." for i in range(24)]
    dataset = write_jsonl(tmp_path / "moon.jsonl", [{"prompt": p} for p in prompts])
    out = tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(REPO), "REGEN_REDIS_URL": redis_url,
           "REGEN_FOLLOW_POLL_S": "1", "REGEN_FOLLOW_GRACE_S": "3"}  # fmt: skip
    follow_log = tmp_path / "follow.log"
    with open(follow_log, "wb") as log:
        follower = subprocess.Popen([sys.executable, "-m", "regen", *enqueue_args(dataset),
                                     "--follow"], env=env, stdout=log, stderr=log)  # fmt: skip
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
            follower.wait(timeout=240)
            assert follower.returncode == 0, follow_log.read_text(errors="replace")
        assert job_settled(r)
    finally:
        if follower.poll() is None:
            follower.kill()
        for worker in workers:
            worker.kill()
        tokenize.stop()
    followed = follow_log.read_text(errors="replace")
    assert "in no place for" in followed and "queueing them again" in followed, followed
    verified = regen(redis_url, "verify", "--job", JOB, "--shards-dir", str(out / JOB))
    assert verified.exit_code == 0, verified.output
    counts = shard_id_counts(out / JOB)
    assert len(counts) == len(prompts) and max(counts.values()) == 1, "every prompt once"
    assert not r.exists(keys.job_follower(JOB)), "the follower left when done"
