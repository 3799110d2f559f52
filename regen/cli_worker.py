"""`regen worker generate|tokenize`: the consumer processes.

Each command receives its options as one object: `WorkerOptions` (with its
`EngineOptions`) for generate, `TokenizeOptions` (with its `ShardPolicy`) for tokenize.
Options are named after those objects' fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from regen.common import defaults
from regen.common.record import ON_TRUNCATED
from regen.consumers.generate.engines import AUTO, BUILTIN
from regen.options import (
    F,
    ShardsLocation,
    csv_list,
    int_option,
    json_object,
    options_object,
    pop_fields,
    redis_url_option,
    seconds_option,
    tunable,
)

if TYPE_CHECKING:
    from regen.consumers.generate.worker import WorkerOptions
    from regen.consumers.tokenize.consumer import TokenizeOptions

MIB = 1024 * 1024


def metrics_port_option(func: F) -> F:
    return click.option(
        "--metrics-port",
        type=click.IntRange(1, 65535),
        envvar="REGEN_METRICS_PORT",
        help="Serve Prometheus metrics at :PORT/metrics (env REGEN_METRICS_PORT; default off).",
    )(func)


def _mebibytes(ctx: click.Context, param: click.Parameter, value: int) -> int:
    return value * MIB


class InflightLimit(click.ParamType):
    """`auto`, or a fixed number of requests >= 1."""

    name = "auto|N"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        if isinstance(value, int) or value == AUTO:
            return value
        if str(value).isdigit() and int(value) >= 1:
            return int(value)
        self.fail(f"{value!r} is neither 'auto' nor a whole number >= 1", param, ctx)


@click.group("worker")
def worker_group() -> None:
    """Run a stage's worker process."""


def _worker_options(**values: Any) -> WorkerOptions:
    from regen.consumers.generate.engines import EngineOptions
    from regen.consumers.generate.worker import WorkerOptions

    engine_options = EngineOptions(**pop_fields(values, EngineOptions))
    return WorkerOptions(engine_options=engine_options, **values)


@worker_group.command("generate")
@options_object(
    "options",
    _worker_options,
    tunable(
        "--engine",
        default=defaults.ENGINE,
        envvar="REGEN_ENGINE",
        help=f"One of {', '.join(BUILTIN)}, or package.module:factory.",
    ),
    click.option(
        "--server",
        "servers",
        multiple=True,
        callback=csv_list,
        envvar="REGEN_SERVERS",
        help="SGLang server URL (repeat, or comma-separate, for several).",
    ),
    click.option(
        "--sglang-api-key",
        envvar="REGEN_SGLANG_API_KEY",
        help="The servers' --api-key (set REGEN_SGLANG_API_KEY: ps shows command lines).",
    ),
    click.option(
        "--sglang-admin-api-key",
        envvar="REGEN_SGLANG_ADMIN_API_KEY",
        help=(
            "The servers' --admin-api-key, which their /abort_request takes: without it "
            "such servers' running answers never move (set REGEN_SGLANG_ADMIN_API_KEY)."
        ),
    ),
    click.option(
        "--model",
        help="Model of an in-process engine, and the jobs to serve (default: the jobs').",
    ),
    click.option(
        "--max-inflight",
        type=InflightLimit(),
        help=(
            "Requests in flight per SGLang server: 'auto' (the default for --engine sglang) "
            "moves each server's limit by its /metrics, N keeps N. In-flight requests of "
            f"sglang-engine (default {defaults.MAX_INFLIGHT_PER_SERVER}); the batch size of "
            f"the local engine (default {defaults.LOCAL_BATCH_SIZE})."
        ),
    ),
    int_option(
        "--max-inflight-cap",
        default=defaults.MAX_INFLIGHT_CAP,
        help="Most requests in flight per server under --max-inflight auto.",
    ),
    seconds_option(
        "--request-timeout",
        "request_timeout_s",
        default=defaults.REQUEST_TIMEOUT_S,
        help="Seconds per request.",
    ),
    click.option(
        "--jobs",
        multiple=True,
        callback=csv_list,
        help="Serve only these jobs (default: every job, including new ones).",
    ),
    click.option("--queues", multiple=True, callback=csv_list, help="Consume these queues too."),
    int_option(
        "--concurrency",
        minimum=0,
        default=defaults.CONCURRENCY,
        show_default="enough to keep the engine full",
        help="Chunks held at once.",
    ),
    seconds_option(
        "--drain-timeout",
        "drain_timeout_s",
        default=defaults.DRAIN_TIMEOUT_S,
        help=(
            "On SIGTERM or SIGINT the worker moves its running answers back to the queue "
            "with their tokens so far and exits within this (a second signal: at once)."
        ),
    ),
    int_option(
        "--max-attempts",
        default=defaults.MAX_CHUNK_ATTEMPTS,
        help="Deliveries of a chunk before it is dead-lettered.",
    ),
    tunable("--device", default=defaults.DEVICE, help="Local engine device."),
    int_option(
        "--tp-size",
        default=defaults.TP_SIZE,
        help="Tensor parallelism of the in-process SGLang engine.",
    ),
    click.option(
        "--sglang-args",
        callback=json_object,
        metavar="JSON",
        help=(
            "More sglang.Engine (ServerArgs) arguments for sglang-engine, e.g. "
            '\'{"mem_fraction_static": 0.85, "context_length": 65536}\'.'
        ),
    ),
    click.option(
        "--trust-remote-code",
        is_flag=True,
        help="Let an in-process engine run the model's own code (Kimi needs it).",
    ),
    tunable("--loglevel", default=defaults.LOGLEVEL),
    metrics_port_option,
    redis_url_option,
)
def generate(options: WorkerOptions) -> None:
    """Generate completions for queued chunks with ENGINE (one worker per GPU host)."""
    from regen.consumers.generate.engines import require_engine_extra
    from regen.consumers.generate.worker import run_worker

    try:
        require_engine_extra(options.engine)  # before Redis is reached or started
        run_worker(options)
    except ValueError as exc:
        raise click.ClickException(str(exc)) from exc


def _tokenize_options(**values: Any) -> TokenizeOptions:
    from regen.consumers.tokenize.consumer import TokenizeOptions
    from regen.consumers.tokenize.job_writer import ShardPolicy

    return TokenizeOptions(policy=ShardPolicy(**pop_fields(values, ShardPolicy)), **values)


@worker_group.command("tokenize")
@options_object(
    "options",
    _tokenize_options,
    tunable(
        "--out",
        "out_dir",
        default=defaults.OUT_DIR,
        envvar="REGEN_OUT",
        type=ShardsLocation(),
        help="Shards go to OUT/JOB/: a local folder, or object storage (s3://bucket/prefix, "
        "gs://, az://; credentials and endpoint from the environment: AWS_* with "
        "AWS_ENDPOINT_URL, AZURE_STORAGE_* with AZURE_STORAGE_ENDPOINT, GOOGLE_*; temp files "
        "in REGEN_SPOOL_DIR).",
    ),
    click.option(
        "--jobs", multiple=True, callback=csv_list, help="Only these jobs (default: all)."
    ),
    int_option(
        "--shard-mb",
        "max_bytes",
        default=defaults.SHARD_MAX_BYTES // MIB,
        callback=_mebibytes,
        help="Roll over to a new shard at this many MB (uncompressed).",
    ),
    int_option(
        "--shard-rows",
        "max_rows",
        default=defaults.SHARD_MAX_ROWS,
        help="Roll over at this many records.",
    ),
    seconds_option(
        "--max-shard-age",
        "max_age_s",
        default=defaults.SHARD_MAX_AGE_S,
        help="Commit an open shard after this many seconds.",
    ),
    seconds_option(
        "--idle-commit",
        "idle_s",
        minimum=0.1,
        default=defaults.SHARD_IDLE_S,
        help=(
            "Commit an open shard when no result came for this many seconds (a job with "
            "nothing left to generate has its last shard committed at once)."
        ),
    ),
    tunable(
        "--on-truncated",
        type=click.Choice(ON_TRUNCATED),
        default=defaults.ON_TRUNCATED,
        help="What to do with answers cut at max_new_tokens.",
    ),
    tunable(
        "--drift-check/--no-drift-check",
        default=defaults.DRIFT_CHECK,
        help="Compare each record with a re-render of the chat template.",
    ),
    int_option(
        "--min-free-mb",
        "min_free_bytes",
        minimum=0,
        default=defaults.MIN_FREE_BYTES // MIB,
        callback=_mebibytes,
        envvar="REGEN_MIN_FREE_MB",
        help="Pause while the shard disk has less free.",
    ),
    seconds_option(
        "--claim-idle",
        "claim_idle_s",
        default=defaults.CLAIM_IDLE_S,
        help="Take over results another consumer held this many seconds.",
    ),
)
@metrics_port_option
@redis_url_option
def tokenize(options: TokenizeOptions, metrics_port: int | None, redis_url: str | None) -> None:
    """Write token-exact records of generated results into shard files under OUT/JOB."""
    from regen.common.metrics import MetricsPortError
    from regen.consumers.tokenize.shard_files import UnwritableFolder
    from regen.consumers.tokenize.worker import run_worker as run_tokenize

    try:
        run_tokenize(redis_url, options, metrics_port=metrics_port)
    except (MetricsPortError, UnwritableFolder) as exc:
        raise click.ClickException(str(exc)) from exc
