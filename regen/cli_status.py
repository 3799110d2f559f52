"""`regen status` and `regen verify`: where every job stands, cheaply or id by id."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson
import redis

from regen.common import connection, defaults, jobspec
from regen.options import ShardsLocation, redis_url_option

if TYPE_CHECKING:
    from regen.common.ledger.places import Reconciliation

WATCH_INTERVAL_S = 2.0
# Wide enough for a job's one-line rows when the output is not a terminal (a log, a pipe).
PIPE_WIDTH = 140


def _client(redis_url: str | None, job: str | None) -> redis.Redis:
    """A client, after checking that `job` (default: every job) exists and that this
    regen reads its spec (an older regen's job layout is refused here, with the reason)."""
    r = connection.client(connection.resolve_url(redis_url))
    jobs = jobspec.list_jobs(r)
    if job is not None and job not in jobs:
        raise click.ClickException(
            f"no job named {job!r} in this Redis (jobs: {', '.join(jobs) or 'none'})"
        )
    for name in [job] if job is not None else jobs:
        try:
            jobspec.load(r, name)
        except jobspec.JobSpecError as exc:
            raise click.ClickException(str(exc)) from exc
    return r


@click.command()
@click.option("--job", default=None, help="Only this job (default: every job).")
@click.option("--watch", is_flag=True, help="Redraw every 2 s on a terminal; Ctrl-C stops.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON document and exit.")
@click.option(
    "--window",
    type=click.FloatRange(min=10),
    default=defaults.STATUS_RATE_WINDOW_S,
    show_default=True,
    help="Seconds of recent progress that rates and the ETA are measured over.",
)
@redis_url_option
def status(
    job: str | None, watch: bool, as_json: bool, window: float, redis_url: str | None
) -> None:
    """Per job: prompts waiting, in flight, done and dead-lettered, rates, ETA and shards;
    per worker: its engine, servers, load and last heartbeat."""
    from rich.console import Console
    from rich.live import Live

    from regen.ops.status_snapshot import snapshot
    from regen.ops.status_view import render

    r = _client(redis_url, job)

    def take() -> dict[str, Any]:
        return snapshot(r, job, window)

    if as_json:
        click.echo(orjson.dumps(take(), option=orjson.OPT_INDENT_2).decode())
        return
    console = Console()
    if not console.is_terminal:
        console.width = PIPE_WIDTH
    if not (watch and console.is_terminal):
        console.print(render(take()))
        return
    with Live(render(take()), console=console, auto_refresh=False) as live:
        try:
            while True:
                time.sleep(WATCH_INTERVAL_S)
                live.update(render(take()), refresh=True)
        except KeyboardInterrupt:
            pass


@click.command()
@click.option("--job", required=True, help="The job to reconcile.")
@click.option("--no-shards", is_flag=True, help="Check Redis only; do not read shard files.")
@click.option(
    "--shards-dir",
    type=ShardsLocation(),
    default=None,
    help="The job's shard folder as seen here, or its bucket URL (default: where its "
    "tokenize worker wrote).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the reconciliation as JSON.")
@redis_url_option
def verify(
    job: str,
    no_shards: bool,
    shards_dir: Path | str | None,
    as_json: bool,
    redis_url: str | None,
) -> None:
    """Reconcile every enqueued prompt id: done in a shard, in flight, waiting, or
    dead-lettered, each exactly once; with the shard files' ids against the committed
    index. Exit status 1 on any missing, duplicated or misplaced id."""
    from regen.consumers.tokenize.operator_view import folder_at
    from regen.ops.reconcile import reconcile

    r = _client(redis_url, job)
    folder = None if shards_dir is None else folder_at(shards_dir)
    report = reconcile(r, jobspec.load(r, job), folder, read_shards=not no_shards)
    if as_json:
        click.echo(orjson.dumps(report.to_dict(), option=orjson.OPT_INDENT_2).decode())
    else:
        _print_report(report)
    if not report.ok:
        raise SystemExit(1)


def _print_report(report: Reconciliation) -> None:
    click.echo(f"job {report.job}: {report.enqueued:,} prompt ids enqueued")
    for place in ("done", "in_flight", "waiting", "dead_lettered", "purged", "missing"):
        line = f"  {place.replace('_', ' '):<14}{report.places[place]:>10,}"
        if place == "dead_lettered" and report.dead_letters:
            line += "   " + " · ".join(
                f"{stage}: " + ", ".join(f"{k} {v:,}" for k, v in sorted(reasons.items()))
                for stage, reasons in report.to_dict()["dead_letters"].items()
            )
        click.echo(line)
    for note, count in sorted(report.notes.items()):
        click.echo(f"  note: {count:,} {note.replace('_', ' ')} (allowed: at-least-once delivery)")
    if report.shards_note:
        click.echo(f"  {report.shards_note}")
    else:
        click.echo(f"  shards: {report.shards_read:,} files, {report.shard_ids_read:,} ids read")
    for warning in report.warnings:
        click.echo(f"  warning: {warning}")
    for kind, subject, detail in report.problems:
        click.echo(f"  PROBLEM {kind}: {subject}: {detail}")
    for kind, count in sorted(report.problem_counts.items()):
        listed = sum(1 for k, _, _ in report.problems if k == kind)
        if count > listed:
            click.echo(f"  ... and {count - listed:,} more {kind}")
    if report.problem_counts["missing"]:
        click.echo("  missing ids (their chunk was lost) are queued again by the job's "
                   "`regen enqueue --follow`; by hand: regen recover --job "
                   f"{report.job} --out OUT, then the job's own regen enqueue")  # fmt: skip
    if report.ok:
        click.echo("ok: every enqueued id is in exactly one place")
    else:
        total = sum(report.problem_counts.values())
        click.echo(f"FAILED: {total:,} inconsistenc{'y' if total == 1 else 'ies'}", err=True)
