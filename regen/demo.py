"""`regen demo`: the whole pipeline on one machine, with embedded defaults.

The embedded Redis, the bundled sample prompts, SmolLM2 on the CPU through the `local`
engine (or a real SGLang server), a generate worker and a tokenize worker as real
processes, a live view until every prompt is accounted for, then a summary and one record
shown decoded.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import Any

import redis
from rich.console import Console
from rich.live import Live

from regen.common import connection, defaults, jobspec, settings
from regen.common.celery_app import make_app
from regen.common.embedded_redis import EmbeddedRedis
from regen.common.ledger.places import count_places
from regen.demo_report import show_record, show_summary
from regen.ops.status_snapshot import snapshot
from regen.ops.status_view import render
from regen.producer.enqueue import Enqueuer
from regen.producer.progress import ProgressDisplay, summary
from regen.producer.spec import JobOptions, PreparedJob, prepare_job, save_job

# A live view is redrawn this often; workers are checked for life as often.
POLL_S = 1.0
# Fixed for the demo's small job (the bundled sample is under 40 prompts): small chunks,
# a small enqueue window, shards committed soon after the last result, and little free
# disk asked for.
CHUNK_SIZE = 8
HIGH_WATER_CHUNKS = 64
IDLE_COMMIT_S = 2
MIN_FREE_MB = 64


@dataclass
class DemoOptions:
    # The demo's job: its name, target model and sampling (see demo_job).
    job: JobOptions
    engine: str = defaults.DEMO_ENGINE
    servers: tuple[str, ...] = ()
    dataset: Path | None = None
    out_dir: Path = Path(defaults.OUT_DIR)
    redis_url: str | None = None
    timeout_s: float = defaults.DEMO_TIMEOUT_S


def demo_job(**target: Any) -> JobOptions:
    """A new job, named after the time, of `target` (JobOptions' model and sampling)."""
    return JobOptions(job=time.strftime("demo-%Y%m%d-%H%M%S"), chunk_size=CHUNK_SIZE, **target)


def sample_dataset() -> Path:
    """The bundled prompts: single and multi-turn, several row shapes, one duplicate and
    one bad row (so the demo shows dedupe and the input DLQ too)."""
    return Path(str(files("regen") / "data" / "demo_prompts.jsonl"))


class Workers:
    """The demo's worker processes, logging to files, stopped warm at the end. They get
    the Redis URL by environment (REGEN_REDIS_URL): arguments, a password in them
    included, are visible to every user of the host (`ps`, /proc/PID/cmdline)."""

    def __init__(self, log_dir: Path, redis_url: str) -> None:
        self._log_dir = log_dir
        self._redis_url = redis_url
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        log_dir.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, args: list[str]) -> None:
        log = open(self._log_dir / f"{name}.log", "wb")  # noqa: SIM115 (owned by the process)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", settings.REDIS_URL_VARIABLE: self._redis_url}
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "regen", *args], stdout=log, stderr=subprocess.STDOUT, env=env
        )

    def check(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self._log_dir / f"{name}.log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the {name} worker exited ({proc.returncode}):\n{tail}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()


def demo_redis(redis_url: str | None) -> tuple[str, EmbeddedRedis | None]:
    """The demo's Redis URL: the one given (option, else REGEN_REDIS_URL), else the
    embedded server's; with the embedded server when this call started it (the demo stops
    it at its end), None when it was given one or found the embedded one running."""
    url = redis_url or settings.current().redis_url
    if url:
        return url, None
    embedded = EmbeddedRedis.from_env()
    if embedded.running():
        return embedded.url, None
    return embedded.ensure_running(), embedded


def run_demo(options: DemoOptions, console: Console | None = None) -> Path:
    """Run the pipeline to the end; returns the job's shard folder. An embedded Redis
    the demo started is stopped at its end, so nothing it started outlives it."""
    console = console or Console()
    # The model's tokenizer first: a model that does not load starts nothing.
    prepared = prepare_job(options.job)
    url, started_redis = demo_redis(options.redis_url)
    try:
        return _run_demo(options, console, url, prepared)
    finally:
        if started_redis is not None:
            started_redis.stop()
            console.print(
                f"Stopped the embedded Redis this demo started (its data stays in "
                f"{started_redis.data_dir}; `regen redis start` serves it again).",
                soft_wrap=True,  # one line: the path stays whole
            )


def _run_demo(options: DemoOptions, console: Console, url: str, prepared: PreparedJob) -> Path:
    r = connection.client(url)
    job, model = options.job.job, options.job.model
    dataset = options.dataset or sample_dataset()
    console.print(
        f"[bold]regen demo[/]: job {job}, model {model}, engine "
        f"{options.engine}, Redis {connection.redact(url)}"
    )

    prepared = save_job(r, prepared)
    spec = prepared.spec
    with ProgressDisplay() as show:
        enqueuer = Enqueuer(
            r, make_app(url), prepared, high_water=HIGH_WATER_CHUNKS, on_progress=show
        )
        stats = enqueuer.run([dataset])
    console.print(summary(stats, job))

    workers = Workers(options.out_dir / "logs" / job, url)
    common_args = ["--jobs", job]
    engine_args = ["--engine", options.engine]
    if options.engine == "local":
        engine_args += ["--model", model]
    for server in options.servers:
        engine_args += ["--server", server]
    started = time.monotonic()
    try:
        workers.start("generate", ["worker", "generate", *engine_args, *common_args])
        workers.start(
            "tokenize",
            [
                "worker",
                "tokenize",
                "--out",
                str(options.out_dir),
                "--idle-commit",
                str(IDLE_COMMIT_S),
                "--min-free-mb",
                str(MIN_FREE_MB),
                *common_args,
            ],
        )
        _watch(r, spec, workers, console, started, options.timeout_s)
    finally:
        workers.stop()
    elapsed = time.monotonic() - started
    folder = options.out_dir / job
    show_summary(console, r, spec, folder, elapsed)
    show_record(console, folder, prepared.tokenizer)
    return folder


def _finished(r: redis.Redis, spec: jobspec.JobSpec) -> bool:
    """Every prompt of the job is in a shard or a DLQ, and nothing is left in between."""
    counts = count_places(r, spec)
    settled = counts.done + counts.dead_lettered + counts.purged
    return counts.total > 0 and settled == counts.total and counts.in_flight == 0


def _watch(
    r: redis.Redis,
    spec: jobspec.JobSpec,
    workers: Workers,
    console: Console,
    started: float,
    timeout_s: float,
) -> None:
    """The live `regen status` of the job until every prompt is accounted for."""
    with Live(console=console, auto_refresh=False) as live:
        while True:
            workers.check()
            live.update(render(snapshot(r, spec.name)), refresh=True)
            if _finished(r, spec):
                return
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the demo did not finish within {timeout_s:.0f} s")
            time.sleep(POLL_S)
