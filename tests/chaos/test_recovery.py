"""Recovery from dead, frozen and cut-off processes: real workers, really killed.

Knobs shortened from their defaults, so each test stays within a minute or so:
- the chunk lease (REGEN_VISIBILITY_TIMEOUT) is 8 s instead of 100 s, and kombu's sweep
  runs every 1 s instead of 10 s (tests/support/generate_harness.py): the bound a dead worker's
  chunks come back within is then 9 s instead of 110 s; renewals stay at four a lease;
- output lengths and decode speeds make a chunk run for two leases or more, so a chunk
  still held by a live worker would show a second delivery if leases did not hold.
"""

from __future__ import annotations

import contextlib
import signal
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson
import pytest
import redis
from click.testing import CliRunner

from regen.cli_status import verify
from regen.common import dlq, keys
from regen.common.jobspec import JobSpec
from regen.common.ledger.job_ids import JobIds
from tests.support.generate_harness import (
    PROMPTS,
    VISIBILITY_TIMEOUT_S,
    Worker,
    all_generated,
    attempts,
    chunks_held_by,
    enqueue_prompts,
    enqueued_ids,
    results,
)
from tests.support.helpers import committed_count, wait_for
from tests.support.redis_server import running_redis
from tests.support.sglang_standin.process import StandinHandle, run_standin

pytestmark = pytest.mark.slow

SWEEP_S = 1
# A loaded 2-core machine needs room for a worker to start and for the polls.
SLACK_S = 15


def generate_worker(url: str, tmp_path: Path, server: str, *options: str) -> Worker:
    return Worker(url, tmp_path, "--engine", "sglang", "--server", server, "--jobs", "g", *options)


def last_beat(r: redis.Redis, worker: Worker) -> float:
    return float(orjson.loads(r.hget(keys.WORKERS, worker.name))["last_seen"])


@contextlib.contextmanager
def started_job(
    url: str, tmp_path: Path, **standin: Any
) -> Iterator[tuple[JobSpec, StandinHandle, Worker]]:
    """Job "g" (PROMPTS in chunks of 4), a stand-in server, and a first worker on it.

    The first worker holds at most 2 chunks (`--concurrency 2`), so once it holds 2 it
    asks kombu for no other: a worker killed while kombu moves a chunk it popped into
    `unacked` loses that chunk (kombu's window), which only the job's follower heals
    (tests/generate/test_heal_lost_chunk.py), and none runs here. A third chunk popped just as
    the test killed the worker left the job unfinished (a CI run, 2 cores under load)."""
    spec = enqueue_prompts(url, tmp_path, PROMPTS, chunk_size=4)
    with run_standin(**standin) as server:
        yield spec, server, generate_worker(url, tmp_path, server.url, "--concurrency", "2")


def wait_taken_over(r: redis.Redis, chunks: set[str], by: Worker) -> None:
    """Until the latest delivery of each chunk is `by`'s."""
    wait_for(lambda: all(attempts(r, "g", c)[-1]["worker"] == by.name for c in chunks),
             timeout=120, what=f"the chunks {sorted(chunks)} to reach {by.name}")  # fmt: skip


def each_id_once(r: redis.Redis) -> bool:
    counts = Counter(res.id for res in results(r, "g"))
    if len(counts) != JobIds(r, "g").count():  # one HGET before reading every id bucket
        return False
    return set(counts) == enqueued_ids(r, "g") and set(counts.values()) == {1}


def test_a_dead_hosts_chunks_come_back_within_the_lease_and_a_live_ones_stay(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    # 45 tokens at 3 tokens/s: every chunk runs ~15 s, almost two leases.
    standin = {"decode_tokens_per_s": 3, "output_len_dist": "fixed:n=45"}
    with started_job(redis_url, tmp_path, **standin) as (spec, server, doomed):
        wait_for(lambda: len(chunks_held_by(r, "g", doomed.name)) >= 2, timeout=120,
                 what="the doomed worker to hold chunks")  # fmt: skip
        held = chunks_held_by(r, "g", doomed.name)
        doomed.kill()  # the host dies: SIGKILL of the whole process group
        died_beat = last_beat(r, doomed)
        with generate_worker(redis_url, tmp_path, server.url) as fresh:
            wait_taken_over(r, held, by=fresh)
            back_after = time.time() - died_beat
            wait_for(lambda: all_generated(r, spec), timeout=180, what="the job to finish")
    assert back_after <= VISIBILITY_TIMEOUT_S + SWEEP_S + SLACK_S, back_after
    assert each_id_once(r), "a chunk ran twice at once"
    for chunk in r.hkeys(keys.job_chunks("g")):
        history = attempts(r, "g", chunk.decode())
        mine = [h["status"] for h in history if h["worker"] == fresh.name]
        # One delivery to the live worker, however long it ran: never a second one.
        assert mine == ["done"], history
        assert all(h["status"] == "started" for h in history if h["worker"] == doomed.name)
    assert dlq.count(r, "g", "generate") == 0


def test_a_frozen_worker_that_comes_back_drops_the_chunks_it_lost(
    redis_url: str, r: redis.Redis, tmp_path: Path
) -> None:
    standin = {"decode_tokens_per_s": 4, "output_len_dist": "uniform:min=5,max=45"}
    with started_job(redis_url, tmp_path, **standin) as (spec, server, frozen):

        def mid_chunk() -> bool:
            held = chunks_held_by(r, "g", frozen.name)
            return bool(held) and any(res.chunk in held for res in results(r, "g"))

        wait_for(mid_chunk, timeout=120, what="a chunk half done")
        frozen.signal_group(signal.SIGSTOP)
        held = chunks_held_by(r, "g", frozen.name)
        before = {res.id for res in results(r, "g") if res.worker == frozen.name}
        try:
            with generate_worker(redis_url, tmp_path, server.url) as other:
                wait_taken_over(r, held, by=other)
                frozen.signal_group(signal.SIGCONT)

                def over() -> bool:  # the job done, and nothing left running in `frozen`
                    return all_generated(r, spec) and not chunks_held_by(r, "g", frozen.name)

                wait_for(over, timeout=180, what="the job to finish")
        finally:
            frozen.signal_group(signal.SIGCONT)
            frozen.stop()
    stale = {res.id for res in results(r, "g") if res.worker == frozen.name and res.chunk in held}
    assert stale <= before, "the frozen worker handed off results of chunks it had lost"
    assert each_id_once(r)
    for chunk in held:
        statuses = [h["status"] for h in attempts(r, "g", chunk) if h["worker"] == frozen.name]
        assert statuses == ["lost"], statuses
    assert frozen.process.returncode == 0 and "lease lost" in frozen.log()


def test_redis_killed_and_restarted_stops_no_worker(tmp_path: Path) -> None:
    prompts = [f"Question {i} about lakes" for i in range(40)]
    out = tmp_path / "out"
    with (
        running_redis(tmp_path / "redis") as redis_server,
        run_standin(decode_tokens_per_s=10, output_len_dist="uniform:min=5,max=40") as server,
    ):
        url = redis_server.url
        r = redis.Redis.from_url(url)
        enqueue_prompts(url, tmp_path, prompts, chunk_size=4)
        workers = [  # two chunks at a time: the job lasts long enough for three kills
            generate_worker(url, tmp_path, server.url, "--concurrency", "2"),
            Worker(url, tmp_path, "--out", str(out), "--shard-rows", "5", "--idle-commit",
                   "0.3", "--min-free-mb", "0", kind="tokenize"),
        ]  # fmt: skip

        def committed() -> int:
            exits = [w.process.poll() for w in workers]
            tails = "\n".join(w.log()[-3000:] for w in workers)
            assert exits == [None, None], f"a worker exited: {exits}\n{tails}"
            return committed_count(r, "g")

        try:
            for kill in range(3):
                reached = committed()

                def ready() -> bool:  # both workers at work since the last restart
                    return committed() > reached and bool(  # noqa: B023
                        chunks_held_by(r, "g", workers[0].name)
                    )

                wait_for(ready, timeout=120, what=f"progress and a chunk held, kill {kill + 1}")
                redis_server.kill()  # SIGKILL; restarted on the same AOF and port
                time.sleep(1)
                redis_server.start()
                # The port was free for a second: make sure no other test's Redis took it.
                ours = str(redis_server.data_dir.resolve())
                assert r.config_get("dir")["dir"] == ours, "another Redis took the port"
            wait_for(lambda: committed() == len(prompts) and not r.hlen(keys.KOMBU_UNACKED),
                     timeout=180, what="the job to finish")  # fmt: skip
        finally:
            for worker in workers:
                worker.stop()
        result = CliRunner().invoke(verify, ["--redis-url", url, "--job", "g"])
    assert result.exit_code == 0, result.output
    generate_log = workers[0].log()
    assert "Unrecoverable" not in generate_log and "kill_job" not in generate_log
