"""`regen enqueue`: create or extend a job and push its prompts onto the generate queue."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

import click

from regen.common import connection, defaults, gc_tuning, jobspec, keys
from regen.options import int_option, job_options, prepare_job_or_fail, redis_url_option

if TYPE_CHECKING:
    from collections.abc import Callable

    from regen.producer.enqueue_stats import EnqueueStats
    from regen.producer.spec import JobOptions

# JobOptions' fields that only `enqueue` sets; `plan` counts with the target's alone.
JOB = click.option("--job", required=True, envvar="REGEN_JOB", help="Job name (created if new).")
ENQUEUE_ONLY = (
    int_option(
        "--chunk-size",
        default=defaults.CHUNK_SIZE,
        help="Prompts per chunk (the unit of work).",
    ),
    click.option(
        "--temperature",
        type=click.FloatRange(min=0),
        help="Default: the model's generation_config.",
    ),
    click.option("--top-p", type=click.FloatRange(0, 1)),
    click.option("--top-k", type=int),
    click.option("--min-p", type=click.FloatRange(0, 1)),
    click.option("--queue", help="Generate queue (default regen.generate.JOB)."),
    int_option(
        "--expected-prompts",
        default=defaults.EXPECTED_PROMPTS,
        help=(
            "Prompts (turns, with --turns all) a new job will hold: sizes its Redis "
            "indexes, which stay compact up to ~2-4x this. Ignored for an existing job."
        ),
    ),
)


class _Stopped(Exception):
    """SIGTERM reached `regen enqueue --follow`."""


def _stop_following(signum: int, frame: object) -> None:
    raise _Stopped


@click.command()
@click.argument("datasets", nargs=-1, required=True, type=click.Path(exists=True))
@job_options(JOB, *ENQUEUE_ONLY)
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    help="Read only the first N rows of the datasets (in order).",
)
@int_option(
    "--high-water",
    default=defaults.HIGH_WATER_CHUNKS,
    envvar="REGEN_HIGH_WATER",
    help="Block while the job has this many chunks waiting in Redis.",
)
@int_option(
    "--order-window",
    minimum=0,
    default=defaults.ORDER_WINDOW,
    envvar="REGEN_ORDER_WINDOW",
    help=(
        "Queue the prompts of each window of N rows longest dataset answer first, so a "
        "job does not end on a long answer started last; 0 keeps the file's order."
    ),
)
@click.option(
    "--follow",
    is_flag=True,
    help=(
        "After publishing, stay with the job until every prompt is committed or "
        "dead-lettered, queueing again what a failure lost (a chunk lost in kombu's "
        "window, a Redis restored behind the disk). Without it the command returns once "
        "the job is published."
    ),
)
@redis_url_option
def enqueue(
    datasets: tuple[str, ...],
    options: JobOptions,
    limit: int | None,
    high_water: int,
    order_window: int,
    follow: bool,
    redis_url: str | None,
) -> None:
    """Enqueue DATASETS (JSONL, .jsonl.zst/.gz, JSON arrays, Parquet) into job --job.

    Safe to rerun: prompts already in the job are skipped, and after a crash the same
    command continues where it stopped. With --follow it heals the job until it is done
    (docs/design/exactly-once.md, "Healing").
    """
    # Imported here: transformers takes seconds to import, `regen --help` should not.
    from regen.common.celery_app import make_app
    from regen.producer.enqueue import Enqueuer, expand_datasets
    from regen.producer.outages import run_through_outages, wait_out_outages
    from regen.producer.progress import ProgressDisplay, nothing_to_generate, summary
    from regen.producer.spec import save_job

    prepared = prepare_job_or_fail(options)
    url = connection.resolve_url(redis_url)
    r = connection.client(url)
    try:
        # The stored spec: an existing job keeps the prompt-text rule it was made with.
        # A Redis restarting or failing over as the command starts is waited out.
        prepared = wait_out_outages(lambda: save_job(r, prepared), "storing the job's spec")
    except jobspec.JobSpecMismatch as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"job {options.job}: model {options.model}, queue {prepared.spec.queue}, "
        f"Redis {connection.redact(url)}",
        err=True,
    )
    enqueuer_app = make_app(url)
    files = expand_datasets(list(datasets))
    gc_tuning.tune_for_throughput()  # start-up is done: the tokenizer is loaded

    def publish(also_on_progress: Callable[[], object] = lambda: None) -> EnqueueStats:
        """One enqueue pass over the files, through Redis outages, with its summary."""
        with ProgressDisplay() as progress:

            def on_progress(stats: EnqueueStats) -> None:
                progress(stats)
                also_on_progress()

            stats = run_through_outages(
                lambda: Enqueuer(
                    r,
                    enqueuer_app,
                    prepared,
                    high_water=high_water,
                    order_window=order_window,
                    on_progress=on_progress,
                ),
                files,
                limit=limit,
            )
        click.echo(summary(stats, options.job))
        return stats

    if follow:
        from regen.producer.healer import Follower

        # A long pass keeps the job followed.
        follower = Follower(
            r, options.job, lambda: publish(follower.beat_if_due), lambda: save_job(r, prepared)
        )
        click.echo(f"job {options.job}: following it until every prompt has a place", err=True)
        # Stopped as a service is (SIGTERM): a clean exit, its key gone at once so that
        # `regen status` says the job is unfollowed. Anywhere is safe to stop at: the
        # enqueue resumes from Redis (docs/design/producer.md, Atomic publish).
        signal.signal(signal.SIGTERM, _stop_following)
        try:
            follower.run()
        except _Stopped:
            r.delete(keys.job_follower(options.job))
            click.echo(f"job {options.job}: stopped following it; rerun the same command "
                       "to follow it again", err=True)  # fmt: skip
            return
        click.echo(f"job {options.job}: every prompt has a place; {follower.requeued} "
                   "prompt(s) found in no place were queued again")  # fmt: skip
        return
    stats = publish()
    if not r.hlen(keys.job_chunks(options.job)):  # no chunk ever published: nothing runs
        click.echo(nothing_to_generate(stats, options.job, len(files)), err=True)
