"""A fleet under Slurm (deploy/slurm/): the head script and a GPU job on a real one-node
Slurm cluster, the GPU job preempted mid-answer twice, once by its time limit and once by
`scancel --signal=TERM --batch`, and requeued each time (the head job once too); the job
ends with each prompt once in the shards.

The GPU job's server is the SGLang stand-in at a real-ish pace (50 tokens/s per answer,
16 answers at once, 300 to 600 tokens each), behind a small wrapper that saves what the
stand-in counted when the batch script stops it (after the worker): each run's
`/_stats` and `/_slot_log`, which say which answers were running at the signal and
whether any decoding was thrown away."""

from __future__ import annotations

import json
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from regen.common import dlq, jobspec, keys
from regen.common.ledger.job_ids import JobIds
from regen.consumers.tokenize.shard_files import iter_ids, shard_paths
from tests.support.generate_harness import REPO, VISIBILITY_TIMEOUT_S
from tests.support.helpers import job_ids, write_jsonl
from tests.support.redis_server import free_port, running_redis
from tests.support.slurm_cluster import slurm_cluster, unavailable

WHY_NOT = unavailable()
pytestmark = [
    pytest.mark.slow,
    # ~2 minutes alone, ~3 beside other tests on 2 cores: the suite's 300 s is too close.
    pytest.mark.timeout(600),
    pytest.mark.skipif(WHY_NOT is not None, reason=f"no Slurm cluster here: {WHY_NOT}"),
]

SLURM_DIR = REPO / "deploy" / "slurm"
JOB = "sl"
PROMPTS = [f"Tell me fact number {i} about the tides." for i in range(96)]
# 6 to 12 s per answer, ~54 s of decoding at 16 answers at once: enough that answers
# still run at the second preemption even when the time-limit signal comes as late as it
# can (below) and the worker ends the answers it runs before it exits (as it does
# without a drain).
STANDIN = ("--decode-tokens-per-s 50 --max-running-requests 16 "
           "--output-len-dist uniform:min=300,max=600")  # fmt: skip
# The time-limit preemption: a 1-minute limit (Slurm's smallest) and the batch shell's
# SIGTERM 10 s before it. Slurm checks limits every 30 s and sends the signal at the
# first check within 10 + 30 s of the end: 20 to 50 s into the run, after the server and
# the worker are up (~10 s) and mid-job. The kill comes at the first check past the
# limit, 30 s or more after the signal, so the drain is never cut short. (A larger N,
# e.g. @50, sends it at the run's first check, 0 to 30 s in: often before any answer.)
TIME_LIMIT = ("--time=1", "--signal=B:TERM@10")
# Runs the time limit may end before one of them is preempted mid-answer.
MAX_TIME_LIMIT_RUNS = 3
FLEET_TIMEOUT_S = 240

# The server command's wrapper: the stand-in as a child, and on SIGTERM (the batch script
# stops the server once the worker has exited) its counters saved before it stops.
WRAPPER = """
import json, os, signal, subprocess, sys, urllib.request

dumps, port, *args = sys.argv[1:]
standin = [sys.executable, "-m", "tests.support.sglang_standin", "--port", port, *args]
child = subprocess.Popen(standin)
direct = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def on_term(signum, frame):
    got = {}
    for route in ("_stats", "_slot_log"):
        try:
            with direct.open(f"http://127.0.0.1:{port}/{route}", timeout=10) as reply:
                got[route] = json.load(reply)
        except OSError:
            got[route] = None
    run = os.environ.get("SLURM_RESTART_COUNT", "0")
    with open(os.path.join(dumps, f"run-{run}.json"), "w") as f:
        json.dump(got, f)
    child.terminate()


signal.signal(signal.SIGTERM, on_term)
code = child.wait()
sys.exit(128 - code if code < 0 else code)  # as a shell says a signal
"""

# The batch scripts' log lines (deploy/slurm/*.sbatch, `log`).
LINE = r"^(?P<at>\S+) regen-slurm\[job \d+ run (?P<run>\d+)\]: "
TERM_LINE = re.compile(LINE + r"SIGTERM \(job (?P<state>\w+)\)", re.M)
WORKER_EXIT = re.compile(LINE + r"the worker exited \((?P<rc>\d+)\) (?P<s>\d+) s after", re.M)


@dataclass
class Signalled:
    """One SIGTERM the GPU job's batch shell took."""

    run: int
    at: float  # epoch seconds
    state: str  # the job's state then, as the script read it


def read_signals(log: str) -> list[Signalled]:
    return [
        Signalled(int(m["run"]), datetime.fromisoformat(m["at"]).timestamp(), m["state"])
        for m in TERM_LINE.finditer(log)
    ]


def running_at(slot_log: list[dict[str, Any]], at: float) -> int:
    """Answers a server's slot log shows decoding at `at` (epoch seconds)."""
    return sum(
        1
        for entry in slot_log
        if entry["start"] <= at and (entry["end"] is None or entry["end"] > at)
    )


@dataclass
class Fleet:
    r: redis.Redis
    out: Path
    generate_log: str
    head_log: str
    generate_job: dict[str, str]
    head_job: dict[str, str]
    # The runs of the GPU job (SLURM_RESTART_COUNT): the one its time limit preempted
    # mid-answer (runs before it were signalled before any answer ran), the one
    # `scancel --batch` preempted, and the last, which the test cancelled at the end.
    time_limit_run: int
    scancel_run: int
    # Per server run: /_stats and /_slot_log when the batch script stopped it (the last
    # run's, read while it still served, before the job was cancelled).
    counted: dict[int, dict[str, Any]] = field(default_factory=dict)

    @property
    def last_run(self) -> int:
        return self.scancel_run + 1

    @property
    def signals(self) -> list[Signalled]:
        return read_signals(self.generate_log)

    def worker_exit(self, run: int) -> tuple[int, int] | None:
        """(exit code, seconds after SIGTERM) of run `run`'s worker, as the script saw it."""
        for m in WORKER_EXIT.finditer(self.generate_log):
            if int(m["run"]) == run:
                return int(m["rc"]), int(m["s"])
        return None

    def running_at_signal(self, run: int) -> int:
        """Answers run `run`'s server was decoding when its batch shell got SIGTERM."""
        at = next(s.at for s in self.signals if s.run == run)
        return running_at(self.counted[run]["_slot_log"], at)


def get(port: int, route: str) -> Any:
    with httpx.Client(trust_env=False, timeout=10) as client:
        response = client.get(f"http://127.0.0.1:{port}/{route}")
        response.raise_for_status()
        return response.json()


def running_answers(port: int) -> tuple[int, int] | None:
    """(pid, answers running) of the stand-in on `port`, or None while none answers."""
    try:
        stats = get(port, "_stats")
    except httpx.HTTPError:
        return None
    return int(stats["pid"]), int(stats["running"])


def wait_until(condition: Callable[[], bool], what: str, check: Callable[[], None]) -> None:
    """Poll `condition`, calling `check` (which raises on a broken fleet) each time."""
    deadline = time.monotonic() + FLEET_TIMEOUT_S
    while not condition():
        check()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {FLEET_TIMEOUT_S} s waiting for {what}")
        time.sleep(0.25)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """The whole run, once for the module's tests: its logs, the jobs as Slurm has them
    and what each server run counted."""
    tmp = tmp_path_factory.mktemp("slurm-fleet")
    out, dumps = tmp / "out", tmp / "dumps"
    dumps.mkdir()
    dataset = write_jsonl(tmp / "tides.jsonl", [{"prompt": p} for p in PROMPTS])
    wrapper = tmp / "standin_wrapper.py"
    wrapper.write_text(WRAPPER)
    port = free_port()
    with running_redis(tmp / "redis") as redis_server, slurm_cluster(tmp / "slurm") as cluster:
        r = redis.Redis.from_url(redis_server.url)
        env = {
            "REGEN_REDIS_URL": redis_server.url,
            "REGEN_OUT": str(out),
            "REGEN_BIN": str(Path(sys.executable).with_name("regen")),
            "PYTHONPATH": str(REPO),
            "HF_HUB_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            # Every process on the Redis shares the chunk lease; a killed worker's chunk
            # comes back within a test (generate_harness).
            "REGEN_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT_S),
            "REGEN_RESTORE_INTERVAL": "1",
            "REGEN_RESTORE_THROTTLE": "1",
            "REGEN_SERVER_PORT": str(port),
            "REGEN_SERVER_CMD": f"{sys.executable} {wrapper} {dumps} $REGEN_SERVER_PORT "
            f"{STANDIN} --continuations-dir {tmp / 'continuations'}",
            # The stand-in's 16 slots, not auto's 256 requests (most of them waiting).
            "REGEN_WORKER_ARGS": "--max-inflight 16",
            # Free ports: other test processes may run on this host. A shard committed
            # 2 s after the last result, and a follower that looks every second, end the
            # job in seconds once the last answer is in (10 s and 30 s by default).
            "REGEN_TOKENIZE_ARGS": f"--metrics-port {free_port()} --idle-commit 2",
            "REGEN_FOLLOW_POLL_S": "1",
            "REGEN_METRICS_ARGS": f"--host 127.0.0.1 --port {free_port()}",
        }
        logs = {"head": tmp / "head.log", "generate": tmp / "generate.log"}
        head = cluster.sbatch(
            f"--chdir={REPO}", f"--output={logs['head']}", str(SLURM_DIR / "head.sbatch"),
            str(dataset), "--job", JOB, "--model", "smollm2", "--max-new-tokens", "1000",
            "--chunk-size", "4", env=env,
        )  # fmt: skip
        generate: int | None = None

        def log(name: str) -> str:
            path = logs[name]
            return path.read_text(errors="replace") if path.exists() else ""

        def diagnostics() -> str:
            return (
                f"--- head.log\n{log('head')[-4000:]}\n--- generate.log\n"
                f"{log('generate')[-8000:]}\n{cluster.logs(1500)}"
            )

        def check() -> None:
            """Fail at once, with the logs, if a job ended by itself."""
            states = {cluster.job(job)["JobState"] for job in (head, generate) if job}
            if states & {"FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"}:
                raise AssertionError(f"a job ended: {states}\n{diagnostics()}")

        def restarts() -> int:
            return int(cluster.job(generate)["Restarts"]) if generate else 0

        def restarted_after(run: int) -> bool:
            return restarts() > run

        def counted(run: int) -> dict[str, Any]:
            return dict(json.loads((dumps / f"run-{run}.json").read_text()))

        try:
            # The GPU job once the head is quiet (the whole job enqueued), so that its
            # server and worker start in seconds, well before the time-limit signal.
            def enqueued() -> bool:
                try:
                    return bool(JobIds(r, JOB).count() == len(PROMPTS))
                except jobspec.JobSpecError:  # not created yet
                    return False

            wait_until(enqueued, "the enqueue", check)
            generate = cluster.sbatch(
                f"--chdir={REPO}", f"--output={logs['generate']}", *TIME_LIMIT,
                str(SLURM_DIR / "generate.sbatch"), env=env,
            )  # fmt: skip
            # The time limit preempts each run and the script requeues the job, until a
            # signal finds answers running (on a loaded host the first may come before
            # the worker has started any).
            run = 0
            while True:
                wait_until(partial(restarted_after, run), f"the time limit to end run {run}", check)
                at = next(s.at for s in read_signals(log("generate")) if s.run == run)
                if running_at(counted(run)["_slot_log"], at) or run == MAX_TIME_LIMIT_RUNS - 1:
                    break
                run += 1
            time_limit_run = run
            # The later runs without a limit: only the test preempts them.
            cluster.run("scontrol", "update", f"JobId={generate}", "TimeLimit=UNLIMITED")
            before = counted(run)["_stats"]["pid"]

            # The next run preempted as Slurm does (`--signal=B:` and
            # preempt_send_user_signal signal the batch shell alone), mid-answer.
            def decoding_again() -> bool:
                seen = running_answers(port)
                return seen is not None and seen[0] != before and seen[1] > 0

            wait_until(decoding_again, "the requeued run to decode", check)
            time.sleep(2)  # mid-answer: each answer takes 6 to 12 s
            cluster.run("scancel", "--signal=TERM", "--batch", str(generate))
            scancel_run = time_limit_run + 1
            wait_until(lambda: restarts() > scancel_run, "the scancel --batch preemption", check)

            # The head job preempted too, while the last GPU run starts: it drains its
            # processes and comes back, and its follower resumes the job.
            cluster.run("scancel", "--signal=TERM", "--batch", str(head))
            wait_until(lambda: cluster.job(head)["Restarts"] == "1", "the head's requeue", check)

            # The last run finishes the job; the head job ends when its follower does.
            wait_until(lambda: cluster.job(head)["JobState"] == "COMPLETED",
                       "the job to finish (the head job to complete)", check)  # fmt: skip
            last = {route: get(port, route) for route in ("_stats", "_slot_log")}
            (dumps / "last.json").write_text(json.dumps(last))  # kept for a post-mortem
            cluster.run("scancel", str(generate))  # a plain cancel: no requeue
            wait_until(lambda: cluster.job(generate)["JobState"] == "CANCELLED",
                       "the GPU job to end", lambda: None)  # fmt: skip
        except BaseException:
            print(diagnostics())
            raise
        fleet = Fleet(
            r=r,
            out=out,
            generate_log=log("generate"),
            head_log=log("head"),
            generate_job=cluster.job(generate),
            head_job=cluster.job(head),
            time_limit_run=time_limit_run,
            scancel_run=scancel_run,
        )
        fleet.counted = {run: counted(run) for run in range(fleet.last_run)}
        fleet.counted[fleet.last_run] = last
        yield fleet


def test_a_preempted_gpu_job_comes_back_and_decodes_no_answer_twice(fleet: Fleet) -> None:
    """Two preemptions mid-answer, each a SIGTERM the batch shell forwards to the worker
    and a requeue by the script itself; the job completes with every prompt in exactly
    one shard record. The worker drains on SIGTERM: it hands each running answer back
    with its tokens so far (SGLang's /abort_request) and exits 0 well inside the
    signal's 60 s; the next run continues those answers. No server threw decoding away
    (a request whose client went away) or decoded an answer again from its start. One
    test, so that a parallel run builds the fleet once."""
    runs = list(range(fleet.last_run + 1))
    # A signal per run: the time limit's (one run, or more if one came before any answer
    # ran), scancel --batch's, each while the job ran (so the script requeued it), then
    # the plain cancel at the end (no requeue).
    signals = fleet.signals
    assert [s.run for s in signals] == runs, fleet.generate_log
    assert all(s.state in ("RUNNING", "SIGNALING") for s in signals[:-1]), fleet.generate_log
    assert signals[-1].state not in ("RUNNING", "SIGNALING"), fleet.generate_log
    assert fleet.generate_log.count("requeued: the job runs again") == fleet.last_run
    assert fleet.generate_job["Restarts"] == str(fleet.last_run)
    assert fleet.generate_job["JobState"] == "CANCELLED"
    # Each preemption came while the server decoded answers, and the worker got it.
    for run in (fleet.time_limit_run, fleet.scancel_run):
        assert fleet.running_at_signal(run) > 0, f"run {run} was not preempted mid-answer"
        assert fleet.worker_exit(run) is not None, fleet.generate_log
    # The head job came back from its preemption (each process stopped, requeued) and
    # ended by itself: its follower saw every prompt settled.
    assert fleet.head_job["Restarts"] == "1", fleet.head_log
    assert "requeued: the follower resumes" in fleet.head_log
    assert fleet.head_job["JobState"] == "COMPLETED", fleet.head_log
    assert fleet.head_job["ExitCode"] == "0:0", fleet.head_log
    assert "the job is done" in fleet.head_log
    # Every prompt exactly once in the shards, none dead-lettered.
    counts = Counter(pid for path in shard_paths(fleet.out / JOB) for pid in iter_ids(path))
    assert len(counts) == len(PROMPTS)
    assert max(counts.values()) == 1, "an id twice in the shards"
    assert set(counts) == job_ids(fleet.r, JOB)
    assert not any(dlq.count(fleet.r, JOB, stage) for stage in keys.STAGES)
    for run in (fleet.time_limit_run, fleet.scancel_run):
        code, seconds = fleet.worker_exit(run) or (None, None)
        assert code == 0 and seconds is not None and seconds <= 30, (
            f"run {run}: the worker exited ({code}) {seconds} s after SIGTERM"
        )
        # The answers running at the signal were handed back (those that ended in the
        # drain's first moment excepted), not finished there.
        stats = fleet.counted[run]["_stats"]
        assert stats["moved_total"] > 0, (run, stats)
    counted = [fleet.counted[run] for run in sorted(fleet.counted)]
    assert sum(c["_stats"]["aborted_total"] for c in counted) == 0
    assert sum(c["_stats"]["repeated_total"] for c in counted) == 0
    # Across the runs too: a prompt's answer completed once, by whichever server ended
    # it (`prompt` is the prompt's hash, the same in every process).
    completed = Counter(
        entry["prompt"]
        for c in counted
        for entry in c["_slot_log"]
        if entry["outcome"] == "completed"
    )
    assert len(completed) == len(PROMPTS) and max(completed.values()) == 1
