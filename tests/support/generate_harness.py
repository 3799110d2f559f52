"""Run real generate workers (Celery subprocesses) against a real Redis in tests."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import orjson
import redis

from regen.common import dlq, jobspec, keys
from regen.common.celery_app import make_app
from regen.common.ledger.job_ids import JobIds
from regen.common.queues import queued_chunks
from regen.common.results import GeneratedResult
from regen.producer.enqueue import Enqueuer
from regen.producer.spec import JobOptions, prepare_job, save_job
from tests.support.helpers import job_ids, write_jsonl
from tests.support.redis_server import running_redis
from tests.support.sglang_standin.process import StandinHandle, run_standin

REPO = Path(__file__).resolve().parents[2]
# The chunk lease, shortened from 100 s so that a killed worker's chunk comes back within
# a test (8 s + the 1 s sweep); its worker renews it every 2 s (a quarter of it).
VISIBILITY_TIMEOUT_S = 8
# Short chat prompts, each with its own answer, for the generate-stage tests.
PROMPTS = [f"Tell me fact number {i} about the moon." for i in range(12)]


def enqueue_prompts(
    url: str, tmp_path: Path, prompts: list[str], job: str = "g", **options: Any
) -> jobspec.JobSpec:
    """Job `job` of `prompts`, with `options` (JobOptions)."""
    path = write_jsonl(tmp_path / f"{job}.jsonl", [{"prompt": p} for p in prompts])
    options.setdefault("max_new_tokens", 48)
    options.setdefault("chunk_size", 4)
    prepared = prepare_job(JobOptions(job=job, model="smollm2", **options))
    r = redis.Redis.from_url(url)
    save_job(r, prepared)  # the spec and provenance, as `regen enqueue` stores them
    Enqueuer(r, make_app(url), prepared, high_water=10_000).run([path])
    return prepared.spec


@contextmanager
def job_on_a_small_server(
    tmp_path: Path, prompts: list[str], chunk_size: int
) -> Iterator[tuple[str, StandinHandle, redis.Redis, jobspec.JobSpec]]:
    """A Redis of its own, a stand-in of 4 slots answering 20 tokens at 50 tokens/s, and
    job "g" of `prompts` enqueued: (Redis URL, server, client, spec)."""
    with (
        running_redis(tmp_path / "redis") as redis_server,
        run_standin(max_running_requests=4, decode_tokens_per_s=50,
                    output_len_dist="fixed:n=20") as server,
    ):  # fmt: skip
        spec = enqueue_prompts(redis_server.url, tmp_path, prompts, chunk_size=chunk_size)
        yield redis_server.url, server, redis.Redis.from_url(redis_server.url), spec


class GroupProcess:
    """A subprocess in its own process group, as on a host of its own, its output in a
    log file: `regen ARGV` with the test's PYTHONPATH and `env` over the environment."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "regen", *argv],
                env={**os.environ, "PYTHONPATH": str(REPO), **env},
                stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip

    def signal_group(self, sig: int) -> None:
        os.killpg(self.process.pid, sig)

    def kill(self) -> None:
        """SIGKILL its whole process group, as a host that dies takes every process."""
        if self.process.poll() is None:
            self.signal_group(signal.SIGKILL)
        self.process.wait()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.kill()

    def log(self) -> str:
        """The whole log: a search must not miss a line that a long traceback pushed out."""
        return self.log_path.read_text(errors="replace")


class Worker(GroupProcess):
    """`regen worker KIND ...` (generate unless told), its log in a file."""

    def __init__(self, url: str, log_dir: Path, *args: str, env: dict[str, str] | None = None,
                 kind: str = "generate"):  # fmt: skip
        self.kind = kind
        leases = {
            "REGEN_VISIBILITY_TIMEOUT": str(VISIBILITY_TIMEOUT_S),
            "REGEN_RESTORE_INTERVAL": "1", "REGEN_RESTORE_THROTTLE": "1",
        }  # fmt: skip
        super().__init__(
            ["worker", kind, "--redis-url", url, *args],
            log_dir / f"worker-{len(list(log_dir.glob('worker-*')))}.log",
            {**leases, **(env or {})},
        )

    @property
    def name(self) -> str:
        """Its worker name, as in its heartbeat and its chunks' attempts."""
        return f"{self.kind}@{socket.gethostname()}:{self.process.pid}"

    def __enter__(self) -> Worker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def results(r: redis.Redis, job: str) -> list[GeneratedResult]:
    return [GeneratedResult.from_fields(fields)
            for _, fields in r.xrange(keys.results_stream(job))]  # fmt: skip


def result_ids(r: redis.Redis, job: str) -> set[str]:
    return {res.id for res in results(r, job)}


def all_acked(r: redis.Redis, spec: jobspec.JobSpec) -> bool:
    """No chunk waiting in the queue and none delivered but unacknowledged."""
    return queued_chunks(r, spec.queue) == 0 and r.hlen("unacked") == 0


def attempts(r: redis.Redis, job: str, chunk_id: str) -> list[dict[str, Any]]:
    """The chunk's deliveries: {worker, time, status, error} each, in order."""
    return [orjson.loads(raw) for raw in r.lrange(keys.chunk_attempts(job, chunk_id), 0, -1)]


def chunks_held_by(r: redis.Redis, job: str, worker: str) -> set[str]:
    """Chunks whose latest delivery is still running in `worker`."""
    held = set()
    for raw in r.hkeys(keys.job_chunks(job)):
        history = attempts(r, job, raw.decode())
        if history and history[-1]["worker"] == worker and history[-1]["status"] == "started":
            held.add(raw.decode())
    return held


def enqueued_ids(r: redis.Redis, job: str) -> set[str]:
    return job_ids(r, job)


def all_generated(r: redis.Redis, spec: jobspec.JobSpec) -> bool:
    """Every enqueued prompt has a result and every chunk is acknowledged."""
    results = result_ids(r, spec.name)
    # The id count first (one HGET): the id set reads every bucket of the job's index,
    # 16,384 HGETALLs at the default --expected-prompts, too much load on the workers'
    # Redis for a condition the tests poll every 50 ms.
    if len(results) != JobIds(r, spec.name).count():
        return False
    return results == enqueued_ids(r, spec.name) and all_acked(r, spec)


def deaths_until_dead_lettered(
    r: redis.Redis, job: str, start_worker: Callable[[], Worker], timeout: float = 240
) -> int:
    """Start workers one after another until the job's generate DLQ has a letter; how
    many of them died of a signal (a poison chunk kills each worker that takes it)."""
    deaths = 0
    deadline = time.monotonic() + timeout
    while dlq.count(r, job, "generate") == 0:
        assert time.monotonic() < deadline, "never dead-lettered"
        worker = start_worker()
        while worker.process.poll() is None and dlq.count(r, job, "generate") == 0:
            time.sleep(0.1)
        deaths += worker.process.returncode is not None and worker.process.returncode < 0
        worker.stop()
    return deaths
