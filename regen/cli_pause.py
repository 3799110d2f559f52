"""`regen pause` and `regen resume`: stop a job's generation and let it go on
(common/job_pause.py; docs/design/placement.md, "Drain and pause")."""

from __future__ import annotations

import click

from regen.common import connection, job_pause, jobspec
from regen.options import redis_url_option


@click.command()
@click.argument("job")
@click.option(
    "--now",
    is_flag=True,
    help=(
        "Also move the job's running answers back to the queue, each with its tokens so "
        "far: within seconds no server runs the job (its GPUs are free)."
    ),
)
@redis_url_option
def pause(job: str, now: bool, redis_url: str | None) -> None:
    """Stop generating JOB: every generate worker takes none of its prompts and gives back
    those it holds unstarted; running answers finish (or, with --now, move back to the
    queue). Workers keep serving other jobs. `regen resume JOB` lets them take it again."""
    r = connection.client(connection.resolve_url(redis_url))
    try:
        job_pause.pause(r, job, now=now)
    except jobspec.JobSpecError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(
        f"job {job} paused"
        + (": running answers go back to the queue within seconds" if now else "")
        + f"; `regen resume {job}` to go on"
    )


@click.command()
@click.argument("job")
@redis_url_option
def resume(job: str, redis_url: str | None) -> None:
    """Let the generate workers take JOB's prompts again after `regen pause`: answers
    moved back to the queue go on from their tokens so far."""
    r = connection.client(connection.resolve_url(redis_url))
    try:
        was_paused = job_pause.resume(r, job)
    except jobspec.JobSpecError as exc:
        raise click.ClickException(str(exc)) from None
    click.echo(f"job {job} resumed" if was_paused else f"job {job} was not paused")
