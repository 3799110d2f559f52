"""`regen shards stats|verify|export`: read what the tokenize stage wrote.

DIR is a job folder (`OUT/JOB`, with `manifest.jsonl`) or a folder of job folders.
These commands only read shards: no Redis, no tokenizer.
"""

from __future__ import annotations

from pathlib import Path

import click
import orjson
import zstandard

_DIR = click.Path(exists=True, file_okay=False, path_type=Path)


@click.group("shards")
def shards_group() -> None:
    """Inspect, verify and export tokenized shards."""


@shards_group.command()
@click.argument("directory", type=_DIR)
@click.option("--json", "as_json", is_flag=True, help="One JSON object per job.")
def stats(directory: Path, as_json: bool) -> None:
    """Rows, tokens, finish reasons, drift and completion lengths per job."""
    from regen.ops.shards_inspect import stats as job_stats

    try:
        results = job_stats(directory)
    except (zstandard.ZstdError, orjson.JSONDecodeError, KeyError, TypeError) as exc:
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
def verify(directory: Path) -> None:
    """Check checksums, sizes, the manifest, every record's schema, masks and counts,
    and that no id appears twice in a job. Exit status 1 on any problem."""
    from regen.ops.shards_inspect import job_folders
    from regen.ops.shards_inspect import verify as verify_shards

    problems = verify_shards(directory)
    for problem in problems:
        click.echo(str(problem))
    if problems:
        click.echo(f"{len(problems)} problem(s)", err=True)
        raise SystemExit(1)
    click.echo(f"ok: {len(job_folders(directory))} job(s) verified")


@shards_group.command()
@click.argument("directory", type=_DIR)
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["conversations"]),
    default="conversations",
    show_default=True,
    help="conversations: SpecForge's {id, conversations} JSONL.",
)
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=Path))
def export(directory: Path, fmt: str, out: Path) -> None:
    """Write the records as training JSONL for other tools."""
    from regen.ops.shards_inspect import export as export_records

    rows = export_records(directory, out, format=fmt)
    click.echo(f"wrote {rows:,} rows to {out}")
