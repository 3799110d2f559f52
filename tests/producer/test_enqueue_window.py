"""The producer's window and crash safety: backpressure keeps Redis flat, and a producer
killed with SIGKILL and restarted enqueues exactly the full set of chunks."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import jobspec
from regen.common.celery_app import make_app
from regen.common.queues import queue_lists
from regen.producer.enqueue import Enqueuer, EnqueueStats
from regen.producer.spec import JobOptions, prepare_job
from tests.support.helpers import decode_message, user_rows, write_jsonl

REPO = Path(__file__).resolve().parents[2]


class Drainer(threading.Thread):
    """Takes chunks off the queue the way a worker would, at a set pace."""

    def __init__(self, r: redis.Redis, queue: str, pause_s: float) -> None:
        super().__init__(daemon=True)
        self._r = r
        self._lists = queue_lists(queue)
        self._pause_s = pause_s
        self.chunks: list[dict[str, Any]] = []
        self.max_queued = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            queued = sum(self._r.llen(name) for name in self._lists)
            self.max_queued = max(self.max_queued, queued)
            raw = self._r.rpop(self._lists[0])
            if raw is not None:
                self.chunks.append(decode_message(raw))
            time.sleep(self._pause_s)

    def drain_rest(self) -> None:
        self.stop.set()
        self.join()
        while (raw := self._r.rpop(self._lists[0])) is not None:
            self.chunks.append(decode_message(raw))


def test_backpressure_holds_redis_memory_flat(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    chunk_size, high_water = 8, 4
    window = chunk_size * high_water
    # 20 windows of prompts, each heavy enough that payloads dominate Redis memory.
    path = write_jsonl(tmp_path / "big.jsonl", user_rows(20 * window, pad=120))
    prepared = prepare_job(JobOptions(job="w", model="smollm2", max_new_tokens=32,
                                      chunk_size=chunk_size))  # fmt: skip
    jobspec.save(r, prepared.spec)
    baseline = r.info("memory")["used_memory"]
    peak = baseline
    throttled = []

    def on_progress(stats: EnqueueStats) -> None:
        throttled.append(stats.throttled)

    enqueuer = Enqueuer(r, make_app(redis_url), prepared, high_water=high_water,
                        on_progress=on_progress)  # fmt: skip
    drainer = Drainer(r, prepared.spec.queue, pause_s=0.02)
    drainer.start()
    producer = threading.Thread(target=enqueuer.run, args=([path],))
    producer.start()
    while producer.is_alive():
        peak = max(peak, r.info("memory")["used_memory"])
        time.sleep(0.01)
    drainer.drain_rest()
    # What stays once the queue is empty: the job's bookkeeping (ids, chunk table,
    # cursors), and ~0.5 MB that Redis 7.0 keeps allocated outside any key here (every
    # key's MEMORY USAGE adds up to ~15 KB; not explained yet). The window is what the
    # peak held above that.
    after = r.info("memory")["used_memory"]

    prompts = [p for c in drainer.chunks for p in c["prompts"]]
    assert len(prompts) == 20 * window
    payload_bytes = sum(len(str(p)) for p in prompts)
    # The whole dataset would add ~payload_bytes; the window is a twentieth of it.
    assert peak - after < payload_bytes / 5, (peak - after, payload_bytes)
    # And no payload stays behind: the job's bookkeeping is a fraction of its payloads.
    assert after - baseline < payload_bytes / 2, (after - baseline, payload_bytes)
    assert drainer.max_queued <= high_water
    assert any(throttled), "the producer never had to wait for room"


def _start_producer(path: Path, url: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-m", "regen", "enqueue", str(path), "--job", "k", "--model", "smollm2",
         "--max-new-tokens", "32", "--chunk-size", "4", "--high-water", "3",
         "--redis-url", url],
        env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.slow
def test_producer_killed_mid_run_enqueues_exactly_the_full_set(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    rows = user_rows(160)
    rows += rows[:20]  # exact duplicates must collapse across the crashes too
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    drainer = Drainer(r, "regen.generate.k", pause_s=0.03)
    drainer.start()
    for kill_after_chunks in (6, 15, 27):
        producer = _start_producer(path, redis_url)
        deadline = time.monotonic() + 120
        while len(drainer.chunks) < kill_after_chunks:
            assert producer.poll() is None, producer.stderr.read().decode()  # type: ignore[union-attr]
            assert time.monotonic() < deadline
            time.sleep(0.005)
        producer.send_signal(signal.SIGKILL)
        producer.wait()
    producer = _start_producer(path, redis_url)
    _, err = producer.communicate(timeout=300)
    assert producer.returncode == 0, err.decode()
    drainer.drain_rest()

    chunk_ids = [c["chunk"] for c in drainer.chunks]
    prompt_ids = [p["id"] for c in drainer.chunks for p in c["prompts"]]
    assert len(chunk_ids) == len(set(chunk_ids)), "a chunk was enqueued twice"
    assert len(prompt_ids) == len(set(prompt_ids)), "a prompt was enqueued twice"
    expected = {p["id"] for c in _all_chunks_in_one_go(tmp_path, path) for p in c["prompts"]}
    assert set(prompt_ids) == expected and len(expected) == 160


def _all_chunks_in_one_go(tmp_path: Path, path: Path) -> list[dict[str, Any]]:
    """The prompts an uninterrupted run enqueues, in a Redis of its own."""
    from tests.support.redis_server import running_redis

    with running_redis(tmp_path / "reference-redis") as server:
        r = redis.Redis.from_url(server.url)
        prepared = prepare_job(JobOptions(job="k", model="smollm2", max_new_tokens=32,
                                          chunk_size=4))  # fmt: skip
        jobspec.save(r, prepared.spec)
        Enqueuer(r, make_app(server.url), prepared, high_water=10_000).run([path])
        return [decode_message(raw) for raw in r.lrange(prepared.spec.queue, 0, -1)]
