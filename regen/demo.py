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
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import redis
from rich.console import Console
from rich.live import Live

from regen.common import connection, jobspec
from regen.common.celery_app import make_app
from regen.demo_report import show_record, show_summary
from regen.ops.accounting import count_places
from regen.ops.status_snapshot import snapshot
from regen.producer.enqueue import Enqueuer
from regen.producer.progress import ProgressDisplay, summary
from regen.producer.spec import JobOptions, prepare_job
from regen.status_view import render

# A live view is redrawn this often; workers are checked for life as often.
POLL_S = 1.0


@dataclass
class DemoOptions:
    engine: str = "local"
    servers: list[str] = field(default_factory=list)
    model: str = "smollm2"
    trust_remote_code: bool = False
    thinking: bool | None = None
    max_new_tokens: int = 320
    # SmolLM2's recommended sampling; its generation_config leaves temperature at 1.0,
    # where a 135M model rambles into the token limit.
    temperature: float = 0.2
    top_p: float = 0.9
    dataset: Path | None = None
    out_dir: Path = Path("regen-out")
    redis_url: str | None = None
    timeout_s: float = 1800.0


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
        env = {**os.environ, "PYTHONUNBUFFERED": "1", connection.ENV_URL: self._redis_url}
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


def run_demo(options: DemoOptions, console: Console | None = None) -> Path:
    """Run the pipeline to the end; returns the job's shard folder."""
    console = console or Console()
    url = connection.resolve_url(options.redis_url)
    r = connection.client(url)
    job = time.strftime("demo-%Y%m%d-%H%M%S")
    dataset = options.dataset or sample_dataset()
    console.print(
        f"[bold]regen demo[/]: job {job}, model {options.model}, engine "
        f"{options.engine}, Redis {connection.redact(url)}"
    )

    prepared = prepare_job(
        JobOptions(
            job=job,
            model=options.model,
            trust_remote_code=options.trust_remote_code,
            thinking=options.thinking,
            max_new_tokens=options.max_new_tokens,
            temperature=options.temperature,
            top_p=options.top_p,
            chunk_size=8,
        )
    )
    spec = jobspec.save(r, prepared.spec)
    with ProgressDisplay() as show:
        stats = Enqueuer(r, make_app(url), prepared, high_water=64, on_progress=show).run([dataset])
    console.print(summary(stats, job))

    workers = Workers(options.out_dir / "logs" / job, url)
    common_args = ["--jobs", job]
    engine_args = ["--engine", options.engine]
    if options.engine == "local":
        engine_args += ["--model", options.model]
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
                "2",
                "--min-free-mb",
                "64",
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
