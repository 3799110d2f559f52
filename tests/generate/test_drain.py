"""A generate worker's drain and a job's pause (consumers/generate/drain.py,
common/job_pause.py; docs/design/placement.md, "Drain and pause"): a SIGTERM moves every running
answer back to the queue with its tokens so far and the worker exits in seconds; a
second signal exits at once; `regen pause --now` frees a job's servers within seconds
and `regen resume` finishes it. Real workers, Redis and stand-ins: at the end every
prompt is answered once, each moved answer equal token for token to one server's, and
no decode thrown away where the answers could move."""

from __future__ import annotations

import dataclasses
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis

from regen.common import jobspec
from regen.common.celery_app import make_app
from regen.consumers.generate.drain import CUT_SHORT, QUIET_S, Drain
from regen.consumers.generate.worker import QueueState
from regen.producer.enqueue import Enqueuer
from regen.producer.spec import JobOptions, prepare_job, save_job
from tests.support.generate_harness import REPO, Worker, all_generated, enqueued_ids, results
from tests.support.helpers import wait_for, write_jsonl
from tests.support.redis_server import running_redis
from tests.support.sglang_standin import StandinHandle, run_standin

SLOTS = 32
# Answers of 400 tokens at 50 tokens/s: 8 s each, long enough to be cut mid-answer.
ANSWER_TOKENS = 400
PROMPTS = [f"[answer-length {ANSWER_TOKENS}] Question {i} about the tides." for i in range(48)]


def test_the_first_signal_drains_the_second_exits_and_a_slow_drain_is_cut() -> None:
    """The drain's signal handling on a fake exit: the first signal sets `draining`,
    and once nothing is held for QUIET_S the worker is stopped (Celery's warm
    shutdown); a second signal exits at once; a drain past its timeout exits."""
    exits: list[int] = []
    stops: list[float] = []
    exited = threading.Event()

    def exit_now(code: int) -> None:
        exits.append(code)
        exited.set()

    draining = threading.Event()
    holding = [True]
    drain = Drain(draining, 60, lambda: not holding[0], lambda: stops.append(time.monotonic()),
                  exit_now)  # fmt: skip
    drain.on_signal(signal.SIGTERM)
    assert draining.is_set() and exits == [] and stops == []
    time.sleep(0.5)
    assert stops == []  # deliveries still hold chunks
    quiet_from = time.monotonic()
    holding[0] = False
    wait_for(lambda: stops, timeout=10, what="the worker to be stopped")
    assert stops[0] - quiet_from >= QUIET_S
    drain.on_signal(signal.SIGTERM)
    assert exits == [CUT_SHORT]
    drain.exited()

    exits.clear()
    exited.clear()
    stuck = Drain(threading.Event(), 0.3, lambda: False, lambda: stops.append(0), exit_now)
    stuck.on_signal(signal.SIGINT)
    assert exited.wait(10) and exits == [CUT_SHORT] and len(stops) == 1

    exits.clear()
    done = Drain(threading.Event(), 0.3, lambda: False, lambda: None, exit_now)
    done.on_signal(signal.SIGTERM)
    done.exited()  # the worker stopped on its own: the timeout no longer applies
    time.sleep(0.6)
    assert exits == []


def test_a_paused_jobs_queue_is_not_consumed_and_comes_back_on_resume() -> None:
    state = QueueState({"regen.gen.a", "regen.gen.b"})
    state.healthy = True
    state.set_paused({"a": "now"}, {"regen.gen.a"})
    assert state.wanted() == {"regen.gen.b"} and state.pause("a") == "now"
    assert state.pause("b") is None
    state.set_paused({}, set())
    assert state.wanted() == {"regen.gen.a", "regen.gen.b"}


def enqueue(url: str, tmp_path: Path, job: str, **sampling: Any) -> jobspec.JobSpec:
    """Job `job` of PROMPTS in chunks of 8, answers of up to 1000 tokens, with extra
    sampling parameters (a penalty no job option sets)."""
    path = write_jsonl(tmp_path / f"{job}.jsonl", [{"prompt": p} for p in PROMPTS])
    prepared = prepare_job(JobOptions(job=job, model="smollm2", max_new_tokens=1000, chunk_size=8))
    spec = dataclasses.replace(prepared.spec, sampling={**prepared.spec.sampling, **sampling})
    prepared = dataclasses.replace(prepared, spec=spec)
    r = redis.Redis.from_url(url)
    save_job(r, prepared)
    Enqueuer(r, make_app(url), prepared, high_water=10_000).run([path])
    return spec


@dataclass
class Setup:
    url: str
    r: redis.Redis
    spec: jobspec.JobSpec
    server: StandinHandle


@contextmanager
def a_job_on_one_server(
    tmp_path: Path, standin: dict[str, Any] | None = None, **sampling: Any
) -> Iterator[Setup]:
    with (
        running_redis(tmp_path / "redis") as redis_server,
        run_standin(max_running_requests=SLOTS, decode_tokens_per_s=50,
                    answer_length_from_prompt=True, continuations_dir=str(tmp_path / "cont"),
                    **(standin or {})) as server,
    ):  # fmt: skip
        spec = enqueue(redis_server.url, tmp_path, "g", **sampling)
        yield Setup(redis_server.url, redis.Redis.from_url(redis_server.url), spec, server)


def worker(setup: Setup, tmp_path: Path, *args: str) -> Worker:
    return Worker(setup.url, tmp_path, "--engine", "sglang", "--server", setup.server.url,
                  "--max-inflight", str(SLOTS), "--jobs", "g", *args)  # fmt: skip


def all_slots_busy(setup: Setup) -> None:
    wait_for(lambda: setup.server.stats()["running"] == SLOTS, timeout=120,
             what="every slot to run an answer")  # fmt: skip
    time.sleep(3)  # some 150 tokens into each 400-token answer


def exit_after_sigterm(w: Worker) -> tuple[int, float]:
    """SIGTERM to the worker's main process (as `docker stop` sends it): its exit
    status and how long it took."""
    start = time.monotonic()
    w.process.send_signal(signal.SIGTERM)
    code = w.process.wait(timeout=60)
    return code, time.monotonic() - start


def finished_once(setup: Setup) -> list[Any]:
    """Wait for the job; every prompt answered exactly once. The results."""
    wait_for(lambda: all_generated(setup.r, setup.spec), timeout=240, what="the job")
    got = results(setup.r, "g")
    assert sorted(x.id for x in got) == sorted(enqueued_ids(setup.r, "g"))
    return got


def one_servers_answer(server: StandinHandle, result: Any) -> list[int]:
    body = {"input_ids": result.prompt_ids, "sampling_params": result.sampling,
            "rid": f"{result.id}-whole"}  # fmt: skip
    ids: list[int] = server.generate(body).json()["output_ids"]
    return ids


@pytest.mark.slow
def test_a_sigterm_moves_every_running_answer_back_and_exits_in_seconds(tmp_path: Path) -> None:
    """32 answers running, some 3 s into 8 s: SIGTERM. The worker hands each back with
    its tokens so far and exits 0 well inside the drain timeout (the old worker waited
    for every answer, or lost them all to Slurm's SIGKILL). A worker started again on the
    same server continues them: every prompt once, each moved answer the one a server
    gives whole, no decode thrown away or repeated."""
    with a_job_on_one_server(tmp_path) as setup:
        first = worker(setup, tmp_path)
        all_slots_busy(setup)
        code, took = exit_after_sigterm(first)
        assert code == 0, first.log()
        assert took < 15, f"the drain took {took:.1f} s"
        stats = setup.server.stats()
        assert stats["moved_total"] + stats.get("moved_at_end_total", 0) >= SLOTS - 1, stats
        assert stats["aborted_total"] == 0, stats  # no answer cut by a client going away
        assert "draining" in first.log()
        with worker(setup, tmp_path):
            got = finished_once(setup)
        stats = setup.server.stats()
        assert stats["aborted_total"] == 0 and stats["repeated_total"] == 0, stats
        moved = [x for x in got if x.resumed_tokens]
        assert len(moved) >= SLOTS - 1, [x.resumed_tokens for x in got]
        with run_standin(answer_length_from_prompt=True) as instant:  # the same answers
            for x in moved:
                assert x.output_ids == one_servers_answer(instant, x)
                assert len(x.output_ids) == ANSWER_TOKENS + 1


@pytest.mark.slow
def test_answers_that_cannot_move_start_again_and_are_counted(tmp_path: Path) -> None:
    """With frequency_penalty set, a continuation would forget the tokens the penalty
    counted: nothing is handed over (the same rule keeps a slow worker's answers where
    they are at a job's end, held_prompts._why_answers_stay); the drain stops those
    answers and gives their prompts back from scratch, says so and counts them.
    Nothing is lost or answered twice."""
    with a_job_on_one_server(tmp_path, frequency_penalty=0.5) as setup:
        first = worker(setup, tmp_path)
        all_slots_busy(setup)
        code, took = exit_after_sigterm(first)
        assert code == 0 and took < 15, first.log()
        assert setup.server.stats()["moved_total"] == 0
        assert "could not move with their tokens so far" in first.log()
        with worker(setup, tmp_path):
            got = finished_once(setup)
        assert not any(x.resumed_tokens for x in got)


@pytest.mark.slow
def test_a_second_signal_or_the_timeout_cuts_a_drain_short_and_leases_recover_the_rest(
    tmp_path: Path,
) -> None:
    """A server slow to take the aborts (30 s) holds the drain: a second SIGTERM exits
    at once, and a drain past --drain-timeout exits by itself, both with status 1. The
    chunks held come back when their leases end: every prompt answered once."""
    with a_job_on_one_server(tmp_path, standin={"abort_reply_delay_s": 30}) as setup:
        first = worker(setup, tmp_path)
        all_slots_busy(setup)
        first.process.send_signal(signal.SIGTERM)
        # A signal sent before the first is handled merges with it (POSIX keeps one
        # pending signal of a kind): the second comes once the drain has begun.
        wait_for(lambda: "draining" in first.log(), timeout=10, what="the drain to begin")
        first.process.send_signal(signal.SIGTERM)
        assert first.process.wait(timeout=10) == CUT_SHORT, first.log()
        second = worker(setup, tmp_path, "--drain-timeout", "3")
        all_slots_busy(setup)
        code, took = exit_after_sigterm(second)
        assert code == CUT_SHORT and 3 <= took < 10, (code, took)
        assert "the drain ran past 3 s" in second.log()
        with worker(setup, tmp_path):
            finished_once(setup)


def regen(url: str, *args: str) -> str:
    run = subprocess.run(
        [sys.executable, "-m", "regen", *args, "--redis-url", url],
        capture_output=True, text=True, timeout=60, cwd=REPO,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    return run.stdout


@pytest.mark.slow
def test_pause_now_frees_every_server_within_seconds_and_resume_finishes(tmp_path: Path) -> None:
    """Two workers, each on its own server, run the job: `regen pause g --now` and within
    10 s no request of it runs anywhere; the status says paused. `regen resume g`: the
    job finishes, every prompt once, nothing decoded twice or thrown away."""
    cont = str(tmp_path / "cont")
    options = {"max_running_requests": 16, "decode_tokens_per_s": 50,
               "answer_length_from_prompt": True, "continuations_dir": cont}  # fmt: skip
    with (
        running_redis(tmp_path / "redis") as redis_server,
        run_standin(**options) as one,
        run_standin(**options) as two,
    ):
        url = redis_server.url
        spec = enqueue(url, tmp_path, "g")
        r = redis.Redis.from_url(url)
        common = ["--engine", "sglang", "--max-inflight", "16", "--jobs", "g"]
        with (
            Worker(url, tmp_path, *common, "--server", one.url),
            Worker(url, tmp_path, *common, "--server", two.url),
        ):
            servers = (one, two)
            wait_for(lambda: all(s.stats()["running"] == 16 for s in servers), timeout=120,
                     what="both servers full")  # fmt: skip
            paused_at = time.monotonic()
            assert "paused" in regen(url, "pause", "g", "--now")
            wait_for(lambda: all(s.stats()["running"] == 0 for s in servers), timeout=10,
                     what="no request of the paused job on any server")  # fmt: skip
            assert time.monotonic() - paused_at < 10
            assert "paused --now" in regen(url, "status", "--job", "g")
            time.sleep(3)  # a paused job stays off the servers
            assert all(s.stats()["running"] == 0 for s in servers)
            assert "resumed" in regen(url, "resume", "g")
            wait_for(lambda: all_generated(r, spec), timeout=240, what="the job")
        got = results(r, "g")
        assert sorted(x.id for x in got) == sorted(enqueued_ids(r, "g"))
        assert any(x.resumed_tokens for x in got)
        for server in servers:
            stats = server.stats()
            assert stats["aborted_total"] == 0 and stats["repeated_total"] == 0, stats
