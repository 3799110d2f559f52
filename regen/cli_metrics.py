"""`regen metrics serve`: the job-wide Prometheus metrics, from one process."""

from __future__ import annotations

import signal
import threading

import click

from regen.common import connection, defaults
from regen.options import redis_url_option


@click.group("metrics")
def metrics_group() -> None:
    """Prometheus metrics of every job (workers serve their own with --metrics-port)."""


@metrics_group.command()
@click.option(
    "--port",
    type=click.IntRange(1, 65535),
    default=defaults.JOB_METRICS_PORT,
    show_default=True,
    envvar="REGEN_METRICS_PORT",
    help="Serve /metrics on this port (env REGEN_METRICS_PORT).",
)
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option(
    "--refresh",
    "refresh_s",
    type=click.FloatRange(min=1),
    default=defaults.JOB_METRICS_REFRESH_S,
    show_default=True,
    help="Seconds between reads of Redis, however often Prometheus scrapes.",
)
@redis_url_option
def serve(port: int, host: str, refresh_s: float, redis_url: str | None) -> None:
    """Serve every job's progress, dead letters, ETA, shard bytes and free disk, the
    workers per host and Redis memory, read from Redis as `regen status` reads them, until
    SIGTERM or Ctrl-C. Run one per Redis: the numbers are job-wide."""
    from regen.common.metrics import MetricsPortError
    from regen.ops.job_metrics import job_metrics

    metrics = job_metrics(connection.resolve_url(redis_url), refresh_s=refresh_s)
    try:
        bound = metrics.serve(port, host)
    except MetricsPortError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(f"job metrics on http://{host}:{bound}/metrics")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        stop.wait()
    finally:
        metrics.close()
