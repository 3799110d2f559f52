"""`regen worker generate|tokenize`: the consumer processes."""

from __future__ import annotations

import click

from common import defaults
from consumers.generate.engines import BUILTIN, EngineOptions
from regen.options import redis_url_option


def _csv(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    return [item for raw in value for item in raw.split(",") if item]


@click.group("worker")
def worker_group() -> None:
    """Run a stage's worker process."""


@worker_group.command("generate")
@click.option(
    "--engine",
    default="sglang",
    show_default=True,
    envvar="REGEN_ENGINE",
    help=f"One of {', '.join(BUILTIN)}, or package.module:factory.",
)
@click.option(
    "--server",
    "servers",
    multiple=True,
    callback=_csv,
    envvar="REGEN_SERVERS",
    help="SGLang server URL (repeat, or comma-separate, for several).",
)
@click.option(
    "--model",
    default=None,
    help="Model of an in-process engine, and the jobs to serve (default: the jobs').",
)
@click.option(
    "--max-inflight",
    type=click.IntRange(min=1),
    default=defaults.MAX_INFLIGHT_PER_SERVER,
    show_default=True,
    help="Requests in flight per server (batch size for the local engine).",
)
@click.option(
    "--request-timeout",
    type=click.FloatRange(min=1),
    default=defaults.REQUEST_TIMEOUT_S,
    show_default=True,
    help="Seconds per request.",
)
@click.option(
    "--jobs",
    multiple=True,
    callback=_csv,
    help="Serve only these jobs (default: every job, including new ones).",
)
@click.option("--queues", multiple=True, callback=_csv, help="Consume these queues too.")
@click.option(
    "--concurrency",
    type=click.IntRange(min=0),
    default=0,
    help="Chunks held at once (default: enough to keep the engine full).",
)
@click.option(
    "--max-attempts",
    type=click.IntRange(min=1),
    default=defaults.MAX_CHUNK_ATTEMPTS,
    show_default=True,
    help="Deliveries of a chunk before it is dead-lettered.",
)
@click.option("--device", default="auto", show_default=True, help="Local engine device.")
@click.option(
    "--tp-size",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Tensor parallelism of the in-process SGLang engine.",
)
@click.option("--trust-remote-code", is_flag=True)
@click.option("--loglevel", default="INFO", show_default=True)
@redis_url_option
def generate(engine: str, servers: list[str], model: str | None, max_inflight: int,
             request_timeout: float, jobs: list[str], queues: list[str], concurrency: int,
             max_attempts: int, device: str, tp_size: int, trust_remote_code: bool,
             loglevel: str, redis_url: str | None) -> None:  # fmt: skip
    """Generate completions for queued chunks with ENGINE (one worker per GPU host)."""
    from consumers.generate.worker import WorkerOptions, run_worker

    try:
        engine_options = EngineOptions(
            servers=servers, model=model, max_inflight=max_inflight,
            request_timeout_s=request_timeout, trust_remote_code=trust_remote_code,
            device=device, tp_size=tp_size,
        )  # fmt: skip
        run_worker(WorkerOptions(
            redis_url=redis_url, engine=engine, engine_options=engine_options, jobs=jobs,
            queues=queues, concurrency=concurrency, max_attempts=max_attempts,
            loglevel=loglevel,
        ))  # fmt: skip
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc
