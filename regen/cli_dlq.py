"""`regen dlq list|show|requeue|purge|export`: inspect and resolve dead letters.

An ID is an entry id: the prompt id, `row:...` for a dataset row that gave no prompt,
`task:...` for a message on a generate queue that was no chunk for it. Without --job,
every job in this Redis; without --stage, all three stages (input, generate, tokenize).
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import orjson
import redis

from regen.common import connection, dlq, jobspec, keys
from regen.options import options_object, redis_url_option

if TYPE_CHECKING:
    from regen.ops.requeue import RequeueReport


@dataclass(frozen=True)
class Scope:
    """The entries a command acts on (--job, --stage, --reason) and their Redis."""

    job: str | None
    stages: tuple[str, ...]
    reasons: tuple[str, ...]
    redis_url: str | None

    def connect(self) -> tuple[str, redis.Redis]:
        url = connection.resolve_url(self.redis_url)
        return url, connection.client(url)

    def selection(self, r: redis.Redis) -> dlq.Selection:
        return dlq.Selection(
            jobs=(self.job,) if self.job else tuple(jobspec.list_jobs(r)),
            stages=self.stages or keys.STAGES,
            reasons=frozenset(self.reasons),
        )


def _scope(**values: Any) -> Scope:
    scope = Scope(**values)
    if scope.job is not None:
        try:
            keys.check_job_name(scope.job)
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--job") from exc
    return scope


# Every command takes them, and gets one `scope: Scope`.
scope_options = options_object(
    "scope",
    _scope,
    click.option("--job", envvar="REGEN_JOB", help="Only this job."),
    click.option(
        "--stage",
        "stages",
        multiple=True,
        type=click.Choice(keys.STAGES),
        help="Only this stage (repeatable).",
    ),
    click.option("--reason", "reasons", multiple=True, help="Only this reason (repeatable)."),
    redis_url_option,
)


def _chosen(
    r: redis.Redis, ids: tuple[str, ...], all_: bool, selection: dlq.Selection
) -> tuple[Iterable[dlq.DeadLetter], list[str]]:
    """The entries named by IDs or by --all (within the selection), and the IDs not found."""
    if ids and all_:
        raise click.UsageError("give entry IDs or --all, not both")
    if all_:
        return dlq.select(r, selection), []
    if not ids:
        raise click.UsageError("give entry IDs, or --all (narrowed by --job/--stage/--reason)")
    found = {entry_id: dlq.find(r, entry_id, selection) for entry_id in dict.fromkeys(ids)}
    missing = [entry_id for entry_id, letters in found.items() if not letters]
    return [letter for letters in found.values() for letter in letters], missing


def _when(timestamp: float) -> str:
    return datetime.datetime.fromtimestamp(timestamp).strftime("%Y-%m-%d %H:%M:%S")


@click.group("dlq")
def dlq_group() -> None:
    """Inspect, requeue, purge and export dead letters (prompts a stage could not do)."""


@dlq_group.command("list")
@scope_options
@click.option("--json", "as_json", is_flag=True, help="One JSON object per entry (no payload).")
@click.option("--limit", type=click.IntRange(min=1), help="Show at most N entries.")
def list_entries(
    scope: Scope,
    as_json: bool,
    limit: int | None,
) -> None:
    """List entries, oldest first, with a count per reason."""
    _, r = scope.connect()
    # Summaries only: payloads (prompt ids, results) can be large.
    rows = sorted(
        (letter.summary() for letter in dlq.select(r, scope.selection(r))),
        key=lambda row: row["time"],
    )
    shown = rows[:limit] if limit else rows
    if as_json:
        for row in shown:
            click.echo(orjson.dumps(row).decode())
        return
    _print_table(shown)
    by_reason: dict[str, int] = {}
    for row in rows:
        by_reason[row["reason"]] = by_reason.get(row["reason"], 0) + 1
    counts = ", ".join(f"{reason} {n:,}" for reason, n in sorted(by_reason.items()))
    more = f" (showing {len(shown):,})" if len(shown) < len(rows) else ""
    click.echo(f"{len(rows):,} entries{more}" + (f": {counts}" if counts else ""))


def _print_table(rows: list[dict[str, Any]]) -> None:
    if not rows:
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(box=None, header_style="bold")
    for name in ("id", "job", "stage", "reason", "att", "worker", "time"):
        table.add_column(name, no_wrap=True)
    table.add_column("message", overflow="ellipsis", no_wrap=True, max_width=80)
    for row in rows:
        table.add_row(
            row["entry_id"], row["job"], row["stage"], row["reason"], str(row["attempts"]),
            row["worker"], _when(row["time"]), row["message"].replace("\n", " "),
        )  # fmt: skip
    console = Console()
    if not console.is_terminal:  # piped: no width to fit, so cut nothing but messages
        console.width = 240
    console.print(table)


@dlq_group.command()
@click.argument("entry_id", metavar="ID")
@scope_options
def show(
    entry_id: str,
    scope: Scope,
) -> None:
    """Print an entry in full (pretty JSON; token id lists on one line)."""
    _, r = scope.connect()
    letters = dlq.find(r, entry_id, scope.selection(r))
    if not letters:
        raise click.ClickException(f"no dead letter {entry_id!r}")
    if len(letters) > 1:
        click.echo(f"{entry_id} is in {len(letters)} DLQs:", err=True)
    for letter in letters:
        click.echo(_pretty(orjson.loads(letter.to_json())))


def _pretty(value: Any, depth: int = 0) -> str:
    """Indented JSON, except that lists of numbers (token ids) stay on one line."""
    pad, inner = "  " * depth, "  " * (depth + 1)
    if isinstance(value, dict) and value:
        items = [f"{inner}{orjson.dumps(k).decode()}: {_pretty(v, depth + 1)}"
                 for k, v in value.items()]  # fmt: skip
        return "{\n" + ",\n".join(items) + f"\n{pad}}}"
    if isinstance(value, list) and value and not all(_is_number(v) for v in value):
        items = [inner + _pretty(v, depth + 1) for v in value]
        return "[\n" + ",\n".join(items) + f"\n{pad}]"
    return orjson.dumps(value).decode()


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _parse_sets(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> dict:
    from regen.ops.requeue import RequeueError, parse_overrides

    try:
        return parse_overrides(value)
    except RequeueError as exc:
        raise click.BadParameter(str(exc)) from exc


@dlq_group.command()
@click.argument("ids", nargs=-1, metavar="[ID]...")
@click.option("--all", "all_", is_flag=True, help="Every entry of the selection.")
@scope_options
@click.option(
    "--set",
    "overrides",
    multiple=True,
    callback=_parse_sets,
    metavar="KEY=VALUE",
    help="Sampling param for the new generation, VALUE as JSON (repeatable), "
    "e.g. --set max_new_tokens=8192.",
)
@click.option(
    "--regenerate",
    is_flag=True,
    help="Generate tokenize entries again (from their stored prompt) instead of "
    "re-checking their stored result.",
)
def requeue(
    ids: tuple[str, ...],
    all_: bool,
    scope: Scope,
    overrides: dict[str, Any],
    regenerate: bool,
) -> None:
    """Send entries back into their stage.

    A generate entry (and an input entry refused as too long, once it fits) becomes a
    prompt of a new chunk, with --set params merged over the job's. A tokenize entry's
    result is re-checked by the tokenize stage (or generated again with --regenerate).
    An entry leaves the DLQ in the same Redis step that queues it, so a requeue killed
    midway loses nothing; run it again for the rest. An id that fails again comes back
    with its new reason.
    """
    from regen.common.celery_app import make_app
    from regen.ops.requeue import RequeueError, Requeuer, RequeueReport

    url, r = scope.connect()
    selection = scope.selection(r)
    letters, missing = _chosen(r, ids, all_, selection)
    app = make_app(url)
    requeuers: dict[str, Requeuer] = {}
    try:
        with contextlib.ExitStack() as stack:
            for letter in letters:
                if letter.job not in requeuers:
                    spec = jobspec.load(r, letter.job)
                    requeuer = Requeuer(r, app, spec, overrides, regenerate=regenerate)
                    requeuers[letter.job] = stack.enter_context(requeuer)
                requeuers[letter.job].add(letter)
    except (jobspec.JobSpecError, RequeueError) as exc:
        raise click.ClickException(str(exc)) from exc
    total = RequeueReport()
    for requeuer in requeuers.values():
        total.merge(requeuer.report)
    _print_report(total, missing)
    if missing or (ids and total.skipped):
        raise SystemExit(1)


def _print_report(report: RequeueReport, missing: list[str]) -> None:
    click.echo(
        f"requeued {report.prompts:,} prompt(s) in {report.chunks:,} new chunk(s) to the "
        f"generate stage; {report.rechecked:,} result(s) back to the tokenize stage"
    )
    if report.gone:
        click.echo(f"{report.gone:,} left the DLQ meanwhile (requeued or purged elsewhere)")
    by_why: dict[str, list[str]] = {}
    for entry_id, why in report.skipped:
        by_why.setdefault(why, []).append(entry_id)
    for why, entry_ids in by_why.items():
        examples = ", ".join(entry_ids[:3]) + (", ..." if len(entry_ids) > 3 else "")
        click.echo(f"left in the DLQ: {len(entry_ids):,} ({examples}): {why}", err=True)
    for entry_id in missing:
        click.echo(f"not in the DLQ: {entry_id}", err=True)


@dlq_group.command()
@click.argument("ids", nargs=-1, metavar="[ID]...")
@click.option("--all", "all_", is_flag=True, help="Every entry of the selection.")
@scope_options
@click.option("--yes", is_flag=True, help="Really delete (without it, only count).")
def purge(
    ids: tuple[str, ...],
    all_: bool,
    scope: Scope,
    yes: bool,
) -> None:
    """Delete entries for good (counted in the job's `dlq_purged` counter)."""
    _, r = scope.connect()
    letters, missing = _chosen(r, ids, all_, scope.selection(r))
    for entry_id in missing:
        click.echo(f"not in the DLQ: {entry_id}", err=True)
    if not yes:
        n = sum(1 for _ in letters)
        raise click.ClickException(f"would purge {n:,} entries; add --yes to do it")
    click.echo(f"purged {dlq.purge(r, letters):,} entries")
    if missing:
        raise SystemExit(1)


@dlq_group.command()
@click.argument("file", type=click.Path(dir_okay=False, allow_dash=True, path_type=Path))
@scope_options
def export(
    file: Path,
    scope: Scope,
) -> None:
    """Write the entries, in full, as JSONL to FILE ('-' for stdout)."""
    _, r = scope.connect()
    rows = 0
    with click.open_file(str(file), "wb", atomic=str(file) != "-") as out:
        for letter in dlq.select(r, scope.selection(r)):
            out.write(letter.to_json() + b"\n")
            rows += 1
    click.echo(f"wrote {rows:,} entries to {file}", err=True)
