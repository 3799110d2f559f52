"""`regen recover`: rebuild a job's ledger in Redis from its shard folder."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from regen.common import connection, jobspec, keys
from regen.options import ShardsLocation, redis_url_option

if TYPE_CHECKING:
    from regen.consumers.tokenize.recover import Recovery

# Names listed in a line; the rest are counted.
_NAMED = 5


def _names(names: list[str]) -> str:
    more = f" and {len(names) - _NAMED} more" if len(names) > _NAMED else ""
    return ", ".join(names[:_NAMED]) + more if names else "none"


@click.command()
@click.option("--job", required=True, help="The job to recover.")
@click.option(
    "--out",
    "out_dir",
    required=True,
    type=ShardsLocation(),
    help="The tokenize worker's --out (a folder or a bucket URL): the job's shards are in OUT/JOB.",
)
@redis_url_option
def recover(job: str, out_dir: Path | str, redis_url: str | None) -> None:
    """Rebuild the job's committed index, shard list, shard counter and epoch in Redis
    from its shards, after Redis came back behind the disk (restored from an older copy,
    a failover to a lagging replica); then run the job's `regen enqueue` command again.
    Safe to rerun. Exit status 1 when the shards hold what it cannot mend (an unreadable
    shard, an id in two shards)."""
    from regen.consumers.tokenize.operator_view import job_folder
    from regen.consumers.tokenize.recover import recover as recover_job

    try:
        keys.check_job_name(job)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--job") from exc
    folder = job_folder(out_dir, job)
    if not folder.readable_here():
        raise click.ClickException(f"no folder {folder}: give the tokenize worker's --out")
    r = connection.client(connection.resolve_url(redis_url))
    report = recover_job(r, job, folder)
    _print(report)
    if job not in jobspec.list_jobs(r):
        click.echo("  the job's spec is gone too: its `regen enqueue` command stores it again")
    if not report.ok:
        raise SystemExit(1)


def _print(report: Recovery) -> None:
    click.echo(f"job {report.job}: ledger rebuilt from {report.shards_on_disk} shard(s) in "
               f"{report.folder}")  # fmt: skip
    if report.shards_restored or report.ids_restored:
        click.echo(f"  Redis had lost {len(report.shards_restored)} shard(s) "
                   f"({_names(report.shards_restored)}) and {report.ids_restored} committed "
                   "id(s): restored")  # fmt: skip
    else:
        click.echo("  Redis had lost nothing: it knew every shard on disk")
    if report.missing_requeued:
        click.echo(f"  {report.missing_requeued} id(s) in no place (their chunk lost) taken out "
                   "of the job's ids: the job's enqueue queues them again")  # fmt: skip
    if report.ids_moved:
        click.echo(f"  {report.ids_moved} id(s) moved off shards that are not on disk")
    if report.manifest_lines_rebuilt:
        click.echo(f"  manifest lines rebuilt: {_names(report.manifest_lines_rebuilt)}")
    click.echo(f"  claims released (never placed): {_names(report.claims_released)}; "
               f"left to their writers: {_names(report.claims_left)}")  # fmt: skip
    click.echo(f"  shard counter {report.seq[0]} -> {report.seq[1]}, "
               f"epoch {report.epoch[0]} -> {report.epoch[1]}")  # fmt: skip
    if report.turns_resumed:
        click.echo(f"  {report.turns_resumed} committed turn(s) of "
                   f"{report.conversations_resumed} conversation(s) in the chunks Redis holds "
                   "marked generated, their answers checkpointed from the shards: the "
                   "conversations resume after them")  # fmt: skip
    if report.answers_saved:
        click.echo(f"  answers of {report.answers_saved} committed turn(s) of "
                   f"{report.conversations_saved} conversation(s) whose chunk Redis lost saved: "
                   "the job's enqueue resumes those conversations after them")  # fmt: skip
    click.echo(f"  enqueue cursors dropped ({report.cursors_dropped}): run the job's "
               "`regen enqueue` command again; it re-reads every file and queues only the "
               "prompts with no record and no dead letter")  # fmt: skip
    click.echo("  tokenize workers take the job up again within 30 s")
    for pid, kept, other in report.duplicates[:_NAMED]:
        click.echo(f"  PROBLEM in_two_shards: {pid} in {kept} and {other} (kept in {kept})")
    for shard, error in report.unreadable:
        click.echo(f"  PROBLEM unreadable_shard: {shard}: {error}")
    if not report.ok:
        click.echo("FAILED: the shards hold problems recovery cannot mend; "
                   "`regen shards verify` lists them", err=True)  # fmt: skip
