"""`regen enqueue` through a Redis outage (producer/outages.py), on a fake clock: it waits
with backoff, resumes in a fresh enqueuer, and its summary adds up every resumed run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import redis

from regen.producer.enqueue_stats import EnqueueStats
from regen.producer.outages import REDIS_RETRY, run_through_outages
from tests.support.helpers import user_rows, write_jsonl
from tests.support.redis_server import RedisServer, free_port

REPO = Path(__file__).resolve().parents[2]


class ScriptedEnqueuer:
    """Reads `rows` rows, then fails with `error` (None: finishes)."""

    def __init__(self, rows: int, error: Exception | None) -> None:
        self.stats = EnqueueStats()
        self.rows, self.error = rows, error

    def run(self, datasets: list[Path], limit: int | None = None) -> EnqueueStats:
        self.stats.rows_read = self.stats.enqueued = self.rows
        if self.error is not None:
            raise self.error
        return self.stats


def scripted(*steps: tuple[int, Exception | None]) -> Any:
    queue = list(steps)

    def make() -> ScriptedEnqueuer:
        return ScriptedEnqueuer(*queue.pop(0))

    return make


def test_an_outage_is_waited_out_and_the_counts_of_every_run_add_up() -> None:
    slept: list[float] = []
    down, slow = redis.ConnectionError("primary gone"), redis.TimeoutError("still down")
    make = scripted((0, down), (0, slow), (0, down), (5, down), (3, None))
    stats = run_through_outages(make, [], sleep=slept.append)
    assert (stats.rows_read, stats.enqueued) == (8, 8)
    assert len(slept) == 4
    # The wait grows while no run gets anywhere, up to the backoff's ceiling...
    assert slept[2] >= REDIS_RETRY.ceiling(2) * (1 - REDIS_RETRY.jitter)
    assert max(slept) <= REDIS_RETRY.max_s
    # ...and a run that read rows (Redis was back) starts it again from the shortest.
    assert slept[3] <= REDIS_RETRY.ceiling(0)


def test_a_wrong_command_is_not_an_outage() -> None:
    make = scripted((1, redis.ResponseError("WRONGTYPE")), (1, None))
    with pytest.raises(redis.ResponseError):
        run_through_outages(make, [], sleep=lambda s: None)


def test_enqueue_started_while_redis_is_down_waits_for_it(tmp_path: Path) -> None:
    """A follower (or any enqueue) started during a Redis restart or failover stores its
    spec once Redis answers, instead of dying with a traceback (the chaos harness's
    failover seeds hit it: `follower exited 1`, MasterNotFoundError in save_job)."""
    port = free_port()
    path = write_jsonl(tmp_path / "rows.jsonl", user_rows(6))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    producer = subprocess.Popen(
        [sys.executable, "-m", "regen", "enqueue", str(path), "--job", "o", "--model",
         "smollm2", "--max-new-tokens", "8", "--redis-url", f"redis://127.0.0.1:{port}/0"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        # Redis comes up only once the command has found it down and waits for it.
        assert producer.stdout is not None
        seen = ""
        while "Redis unreachable" not in seen:
            line = producer.stdout.readline()  # EOF ("") once the command exits
            assert line, f"the command exited without waiting for Redis:\n{seen}"
            seen += line
        server = RedisServer(data_dir=tmp_path / "redis", port=port).start()
        try:
            out, _ = producer.communicate(timeout=120)
            assert producer.returncode == 0, out
            assert "Traceback" not in out
            assert redis.Redis.from_url(server.url).exists("regen:job:o:spec")
        finally:
            server.kill()
    finally:
        producer.kill()
