"""`regen shards stats|verify|export`: read what the tokenize stage wrote.

DIR is a job folder (`OUT/JOB`, with `manifest.jsonl`) or a folder of job folders, on
local disk or in a bucket (`s3://bucket/prefix`, `gs://`, `az://`).
These commands read shards, no tokenizer; `verify` also compares them with Redis when it
can reach it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click
import orjson

from regen.common import extras
from regen.common.quality_flags import DEFAULT_DROP_FLAGS, FLAGS
from regen.consumers.tokenize.operator_view import READ_ERRORS
from regen.options import ShardsLocation, redis_url_option

_DIR = ShardsLocation(exists=True)
# What reading a damaged shard raises; verify says what is wrong with it.
# A shard that does not decompress or parse, or a record missing a field.
_UNREADABLE = (*READ_ERRORS, KeyError, TypeError)
# Pairs of shards with copies an export names; the rest are counted.
_LISTED_COPIES = 10


@click.group("shards")
def shards_group() -> None:
    """Inspect, verify and export tokenized shards."""


@shards_group.command()
@click.argument("directory", type=_DIR)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job.")
def stats(directory: Path | str, as_json: bool) -> None:
    """Rows, tokens, finish reasons, drift and completion lengths per job."""
    from regen.ops.shards_inspect import stats as job_stats

    try:
        results = job_stats(directory)
    except _UNREADABLE as exc:
        raise click.ClickException(f"unreadable shard ({exc}); run `regen shards verify`") from exc
    if not results:
        raise click.ClickException(f"no job folders in {directory}")
    for job in results:
        if as_json:
            click.echo(orjson.dumps(job.to_dict()).decode())
            continue
        click.echo(f"job {job.job}")
        click.echo(f"  shards       {job.shards:,} ({job.bytes:,} bytes, "
                   f"{job.uncompressed_bytes:,} uncompressed)")  # fmt: skip
        click.echo(f"  rows         {job.rows:,}")
        click.echo(f"  tokens       {job.prompt_tokens:,} prompt, "
                   f"{job.completion_tokens:,} completion")  # fmt: skip
        reasons = ", ".join(f"{k} {v:,}" for k, v in sorted(job.finish_reasons.items()))
        click.echo(f"  finish       {reasons or '-'}")
        click.echo(f"  drift        {job.drift:,} of {job.drift_checked:,} checked")
        click.echo("  completion lengths (tokens: rows)")
        for bucket, count in job.histogram_rows():
            click.echo(f"    {bucket:>13}  {count:,}")


@shards_group.command()
@click.argument("directory", type=_DIR)
@click.option("--no-redis", is_flag=True, help="Check the files alone.")
@redis_url_option
def verify(directory: Path | str, no_redis: bool, redis_url: str | None) -> None:
    """Check checksums, sizes, the manifest, every record's schema, masks and counts,
    and that no record (job and id) is in two shards or twice in one, across every job
    folder of DIRECTORY; with Redis reachable (--redis-url, or the
    embedded one when it runs), also that Redis knows every shard and each id's shard,
    for each job it holds. Exit status 1 on any problem."""
    from regen.ops.shards_inspect import job_folders
    from regen.ops.shards_inspect import verify as verify_shards

    found = verify_shards(directory)
    if not no_redis:
        found += _against_redis(directory, redis_url)
    for problem in found:
        click.echo(str(problem))
    problems = [problem for problem in found if not problem.warning]
    if problems:
        click.echo(f"{len(problems)} problem(s)", err=True)
        raise SystemExit(1)
    click.echo(f"ok: {len(job_folders(directory))} job(s) verified")


def _reachable_redis(redis_url: str | None, without: str) -> tuple[Any, str] | None:
    """A client of the Redis given (--redis-url), else of the embedded one when it runs,
    and its URL; None, saying so after `without`, when there is none or it does not
    answer."""
    import redis

    from regen.common import connection, settings
    from regen.common.embedded_redis import EmbeddedRedis, PortTaken

    url = redis_url or settings.current().redis_url
    if url is None:
        embedded = EmbeddedRedis.from_env()
        try:
            url = embedded.url if embedded.running() else None
        except PortTaken as exc:  # someone else's Redis: it holds none of our jobs
            click.echo(f"{without}: {exc}")
            return None
    if url is None:
        click.echo(f"{without}: no Redis given (--redis-url) and none embedded running")
        return None
    r = connection.client(url)
    try:
        r.ping()
    except redis.ConnectionError as exc:
        click.echo(f"{without}: Redis at {connection.redact(url)} unreachable ({exc})")
        return None
    return r, url


def _against_redis(directory: Path | str, redis_url: str | None) -> list[Any]:
    """Problems of the job folders against the ledgers of a reachable Redis."""
    from regen.common import connection, jobspec
    from regen.consumers.tokenize.operator_view import CommitLedger
    from regen.ops.reconcile_shards import compare_folder
    from regen.ops.shards_inspect import Problem, job_folders

    reachable = _reachable_redis(redis_url, "files checked alone")
    if reachable is None:
        return []
    r, url = reachable
    jobs = set(jobspec.list_jobs(r))
    problems = []
    for folder in job_folders(directory):
        if folder.name not in jobs:
            click.echo(f"{folder.name}: no such job in Redis at {connection.redact(url)}; "
                       "files checked alone")  # fmt: skip
            continue

        def report(kind: str, subject: str, detail: str, job: str = folder.name) -> None:
            problems.append(Problem(job, subject, kind, detail))

        try:
            ledger = CommitLedger(r, folder.name)
        except jobspec.JobSpecError as exc:
            click.echo(f"{folder.name}: {exc}; files checked alone")
            continue
        compare_folder(ledger, folder.name, folder, report)
    return problems


@shards_group.command()
@click.argument("directory", type=_DIR)
@click.option(
    "--format",
    "fmt",
    default="conversations",
    show_default=True,
    help="conversations: {id, conversations} text JSONL (SpecForge's regenerate script). "
    "specforge: {id, input_ids, loss_mask} JSONL for SpecForge's data.prompts_path. "
    "speculators: ids, mask and metadata JSONL for speculators' prepare_data.py --data. "
    "hf: a `datasets` folder (save_to_disk) for datasets.load_from_disk.",
)
@click.option(
    "--out",
    required=True,
    type=click.Path(path_type=Path),
    help="The file to write (the folder, for hf).",
)
@click.option(
    "--jobs",
    default="",
    help="Comma-separated job folder names of DIR to merge (default: every job).",
)
@click.option(
    "--max-length",
    type=click.IntRange(min=1),
    help="Records longer than this many tokens are dropped (or cut, with --truncate).",
)
@click.option(
    "--truncate",
    is_flag=True,
    help="Cut records over --max-length to it instead of dropping them (dropping is the "
    "default: a cut answer loses its end-of-turn token).",
)
@click.option(
    "--drop",
    "drop_flags",
    default=",".join(DEFAULT_DROP_FLAGS),
    show_default=True,
    help="Comma-separated quality flags whose records are left out, or `none`: "
    f"{', '.join(FLAGS)}. Truncated answers are kept by default: every token is still "
    "the target's own.",
)
@click.option(
    "--min-loss-tokens",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="Drop records with fewer trained (loss_mask 1) tokens, after any cut.",
)
@click.option("--shuffle", is_flag=True, help="Shuffle the records (deterministic by --seed).")
@click.option("--seed", type=int, default=0, show_default=True, help="The --shuffle seed.")
@click.option(
    "--split",
    "heldout",
    type=click.FloatRange(min=0, max=1, max_open=True),
    default=0.0,
    help="Hold out this fraction of the records, chosen by id, into a second output.",
)
@click.option(
    "--split-out",
    type=click.Path(path_type=Path),
    help="Where the held-out records go (default: OUT with .heldout before its suffix).",
)
@click.option("--no-redis", is_flag=True, help="Read the files alone (no dead-letter counts).")
@redis_url_option
def export(
    directory: Path | str,
    fmt: str,
    out: Path,
    jobs: str,
    max_length: int | None,
    truncate: bool,
    drop_flags: str,
    min_loss_tokens: int,
    shuffle: bool,
    seed: int,
    heldout: float,
    split_out: Path | None,
    no_redis: bool,
    redis_url: str | None,
) -> None:
    """Write the records as files training tools read; prints a one-line summary.

    Each output carries the jobs' provenance; `--format hf` writes a dataset card
    (README.md) too, with the jobs' dead letters when their Redis is reachable."""
    # Checked by ExportOptions, which knows the formats: importing them here would load
    # pyarrow on every `regen` command.
    from regen.common import dlq
    from regen.ops.export import ExportError, ExportOptions, select_jobs
    from regen.ops.export import export as export_records
    from regen.ops.export_sinks import require_datasets

    try:
        if fmt == "hf":
            require_datasets()  # before anything is read or written
        options = ExportOptions(
            format=fmt,
            jobs=tuple(name for name in jobs.split(",") if name),
            max_length=max_length,
            truncate=truncate,
            drop_flags=tuple(flag for flag in drop_flags.split(",") if flag not in ("", "none")),
            min_loss_tokens=min_loss_tokens,
            seed=seed if shuffle else None,
            heldout=heldout,
        )
        dead_letters = None
        if fmt == "hf" and not no_redis:
            reachable = _reachable_redis(redis_url, "the dataset card counts no dead letters")
            if reachable is not None:
                names = [job.name for job in select_jobs(directory, options.jobs)]
                dead_letters = dlq.reasons(reachable[0], names)
        summary = export_records(
            directory, out, options, heldout_out=split_out, dead_letters=dead_letters
        )
    except ExportError as exc:
        raise click.ClickException(str(exc)) from exc
    except _UNREADABLE as exc:
        raise click.ClickException(f"unreadable shard ({exc}); run `regen shards verify`") from exc
    click.echo(summary.line())
    if summary.card_without_picture:
        click.echo(
            "warning: the dataset card has no histogram picture (matplotlib not installed: "
            f"{extras.install_hint('export')}); it lists the answer lengths as a table",
            err=True,
        )
    for first, copy, count, example in summary.duplicates[:_LISTED_COPIES]:
        click.echo(
            f"warning: {count:,} ids of {first} also in {copy} (e.g. {example}): exported "
            "once, from the first",
            err=True,
        )
    if len(summary.duplicates) > _LISTED_COPIES:
        more = len(summary.duplicates) - _LISTED_COPIES
        click.echo(f"warning: {more:,} more shards hold copies", err=True)
    if summary.duplicates:
        click.echo("warning: a shard or folder is there twice; `regen shards verify` "
                   "lists every shard with copies", err=True)  # fmt: skip
