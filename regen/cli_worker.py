"""`regen worker generate|tokenize`: the consumer processes."""

from __future__ import annotations

from typing import Any

import click

from regen.common import defaults
from regen.consumers.generate.engines import BUILTIN, EngineOptions
from regen.options import F, json_object, redis_url_option


def _csv(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> list[str]:
    return [item for raw in value for item in raw.split(",") if item]


def metrics_port_option(func: F) -> F:
    return click.option(
        "--metrics-port",
        type=click.IntRange(1, 65535),
        default=None,
        envvar="REGEN_METRICS_PORT",
        help="Serve Prometheus metrics at :PORT/metrics (env REGEN_METRICS_PORT; default off).",
    )(func)


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
    default=None,
    help=(
        f"Requests in flight per SGLang server or in-process engine (default "
        f"{defaults.MAX_INFLIGHT_PER_SERVER}); the batch size of the local engine "
        f"(default {defaults.LOCAL_BATCH_SIZE})."
    ),
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
@click.option(
    "--sglang-args",
    callback=json_object,
    default=None,
    metavar="JSON",
    help=(
        "More sglang.Engine (ServerArgs) arguments for sglang-engine, e.g. "
        '\'{"mem_fraction_static": 0.85, "context_length": 65536}\'.'
    ),
)
@click.option(
    "--trust-remote-code",
    is_flag=True,
    help="Let an in-process engine run the model's own code (Kimi needs it).",
)
@click.option("--loglevel", default="INFO", show_default=True)
@metrics_port_option
@redis_url_option
def generate(
    engine: str,
    servers: list[str],
    model: str | None,
    max_inflight: int | None,
    request_timeout: float,
    jobs: list[str],
    queues: list[str],
    concurrency: int,
    max_attempts: int,
    device: str,
    tp_size: int,
    sglang_args: dict[str, Any],
    trust_remote_code: bool,
    loglevel: str,
    metrics_port: int | None,
    redis_url: str | None,
) -> None:
    """Generate completions for queued chunks with ENGINE (one worker per GPU host)."""
    from regen.consumers.generate.worker import WorkerOptions, run_worker

    try:
        engine_options = EngineOptions(
            servers=servers,
            model=model,
            max_inflight=max_inflight,
            request_timeout_s=request_timeout,
            trust_remote_code=trust_remote_code,
            device=device,
            tp_size=tp_size,
            sglang_args=sglang_args,
        )
        run_worker(
            WorkerOptions(
                redis_url=redis_url,
                engine=engine,
                engine_options=engine_options,
                jobs=jobs,
                queues=queues,
                concurrency=concurrency,
                max_attempts=max_attempts,
                loglevel=loglevel,
                metrics_port=metrics_port,
            )
        )
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc


@worker_group.command("tokenize")
@click.option(
    "--out",
    "out_dir",
    default=defaults.OUT_DIR,
    show_default=True,
    envvar="REGEN_OUT",
    type=click.Path(file_okay=False),
    help="Shards go to OUT/JOB/.",
)
@click.option("--jobs", multiple=True, callback=_csv, help="Only these jobs (default: all).")
@click.option(
    "--shard-mb",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Roll over to a new shard at this many MB (uncompressed).",
)
@click.option(
    "--shard-rows",
    type=click.IntRange(min=1),
    default=100_000,
    show_default=True,
    help="Roll over at this many records.",
)
@click.option(
    "--max-shard-age",
    type=click.FloatRange(min=1),
    default=300.0,
    show_default=True,
    help="Commit an open shard after this many seconds.",
)
@click.option(
    "--idle-commit",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Commit an open shard when no result came for this many seconds.",
)
@click.option(
    "--on-truncated",
    type=click.Choice(["keep", "drop", "dlq"]),
    default="dlq",
    show_default=True,
    help="What to do with answers cut at max_new_tokens.",
)
@click.option(
    "--drift-check/--no-drift-check",
    default=True,
    show_default=True,
    help="Compare each record with a re-render of the chat template.",
)
@click.option(
    "--min-free-mb",
    type=click.IntRange(min=0),
    default=2048,
    show_default=True,
    envvar="REGEN_MIN_FREE_MB",
    help="Pause while the shard disk has less free.",
)
@click.option(
    "--claim-idle",
    type=click.FloatRange(min=1),
    default=900.0,
    show_default=True,
    help="Take over results another consumer held this many seconds.",
)
@metrics_port_option
@redis_url_option
def tokenize(
    out_dir: str,
    jobs: list[str],
    shard_mb: int,
    shard_rows: int,
    max_shard_age: float,
    idle_commit: float,
    on_truncated: str,
    drift_check: bool,
    min_free_mb: int,
    claim_idle: float,
    metrics_port: int | None,
    redis_url: str | None,
) -> None:
    """Write token-exact records of generated results into OUT/JOB/shard-*.jsonl.zst."""
    from pathlib import Path

    from regen.common.metrics import MetricsPortError
    from regen.consumers.tokenize.consumer import TokenizeOptions
    from regen.consumers.tokenize.job_writer import ShardPolicy
    from regen.consumers.tokenize.shard_files import UnwritableFolder
    from regen.consumers.tokenize.worker import run_worker as run_tokenize

    policy = ShardPolicy(
        max_rows=shard_rows,
        max_bytes=shard_mb * 1024 * 1024,
        max_age_s=max_shard_age,
        idle_s=idle_commit,
    )
    options = TokenizeOptions(
        out_dir=Path(out_dir),
        jobs=jobs,
        policy=policy,
        on_truncated=on_truncated,
        drift_check=drift_check,
        min_free_bytes=min_free_mb * 1024 * 1024,
        claim_idle_s=claim_idle,
    )
    try:
        run_tokenize(redis_url, options, metrics_port=metrics_port)
    except (MetricsPortError, UnwritableFolder) as exc:
        raise click.ClickException(str(exc)) from exc
