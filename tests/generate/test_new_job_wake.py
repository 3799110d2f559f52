"""A generate worker that finds its jobs itself takes a new job's queue when the job's
spec is stored (its announcement, consumers/generate/new_jobs.py), not at the watcher's
next poll of the job registry. Real Redis, a real SGLang engine on a stand-in."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from regen.consumers.generate import worker
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.engine_loop import EngineRunner
from regen.consumers.generate.engines import EngineOptions, make_engine
from regen.consumers.generate.worker import QueueState, Watcher, WorkerOptions
from tests.support.generate_harness import PROMPTS, enqueue_prompts
from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import run_standin

# Far above the test's deadlines: only the announcement can explain a quick discovery.
POLL_S = 600.0


@pytest.fixture
def watcher(
    redis_url: str, r: redis.Redis, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Watcher, QueueState]]:
    monkeypatch.setattr(worker, "WATCH_INTERVAL_S", POLL_S)
    with run_standin() as server:
        options = EngineOptions(servers=[server.url])
        runner = EngineRunner(make_engine("sglang", options))
        state = QueueState(set())
        watcher = Watcher(
            WorkerOptions(redis_url=redis_url, engine="sglang", engine_options=options),
            ChunkContext(redis=r, runner=runner),
            state,
        )
        watcher.start()
        try:
            wait_for(lambda: state.checked, timeout=30, what="the first poll")
            yield watcher, state
        finally:
            watcher.stop()
            watcher.join(timeout=10)
            runner.close()
    assert not watcher.is_alive()


def test_a_new_job_is_taken_at_its_announcement_not_at_the_next_poll(
    redis_url: str, tmp_path: Path, watcher: tuple[Watcher, QueueState]
) -> None:
    _, state = watcher
    assert state.wanted() == set()  # no job at the first poll
    first = enqueue_prompts(redis_url, tmp_path, PROMPTS[:2], job="first")
    wait_for(lambda: state.wanted() == {first.queue}, timeout=10, what="the first job's queue")
    second = enqueue_prompts(redis_url, tmp_path, PROMPTS[:2], job="second")
    wait_for(lambda: state.wanted() == {first.queue, second.queue}, timeout=10,
             what="the second job's queue")  # fmt: skip


def test_a_lost_subscription_leaves_the_poll_and_comes_back(
    redis_url: str, r: redis.Redis, tmp_path: Path, watcher: tuple[Watcher, QueueState]
) -> None:
    """Redis drops the watcher's pub/sub connection: the watcher subscribes again, and
    the next new job is still announced."""
    _, state = watcher
    killed = 0
    for client in r.client_list():
        if "subscribe" in client.get("cmd", "") or int(client.get("sub", 0)):
            r.client_kill_filter(_id=client["id"])
            killed += 1
    assert killed == 1
    wait_for(lambda: r.pubsub_numsub(worker_channel())[0][1] == 1, timeout=10,
             what="subscribed again")  # fmt: skip
    job = enqueue_prompts(redis_url, tmp_path, PROMPTS[:2], job="after")
    wait_for(lambda: state.wanted() == {job.queue}, timeout=10, what="the job's queue")


def worker_channel() -> str:
    from regen.common import keys

    return keys.NEW_JOBS_CHANNEL
