"""`regen enqueue`: create or extend a job and push its prompts onto the generate queue."""

from __future__ import annotations

import click

from regen.common import connection, defaults, jobspec, keys
from regen.options import prepare_job_or_fail, redis_url_option, target_options


@click.command()
@click.argument("datasets", nargs=-1, required=True, type=click.Path(exists=True))
@click.option("--job", required=True, envvar="REGEN_JOB", help="Job name (created if new).")
@target_options
@click.option(
    "--chunk-size",
    type=click.IntRange(min=1),
    default=defaults.CHUNK_SIZE,
    show_default=True,
    help="Prompts per chunk (the unit of work).",
)
@click.option(
    "--temperature",
    type=click.FloatRange(min=0),
    default=None,
    help="Default: the model's generation_config.",
)
@click.option("--top-p", type=click.FloatRange(0, 1), default=None)
@click.option("--top-k", type=int, default=None)
@click.option("--min-p", type=click.FloatRange(0, 1), default=None)
@click.option("--queue", default=None, help="Generate queue (default regen.generate.JOB).")
@click.option(
    "--limit",
    type=click.IntRange(min=0),
    default=None,
    help="Read only the first N rows of the datasets (in order).",
)
@click.option(
    "--high-water",
    type=click.IntRange(min=1),
    default=defaults.HIGH_WATER_CHUNKS,
    show_default=True,
    envvar="REGEN_HIGH_WATER",
    help="Block while the job has this many chunks waiting in Redis.",
)
@redis_url_option
def enqueue(
    datasets: tuple[str, ...],
    job: str,
    model: str,
    tokenizer: str | None,
    trust_remote_code: bool,
    chunk_size: int,
    max_new_tokens: int,
    temperature: float | None,
    top_p: float | None,
    top_k: int | None,
    min_p: float | None,
    thinking: bool | None,
    chat_template_kwargs: dict,
    system_prompt: str | None,
    max_prompt_tokens: int | None,
    context_length: int | None,
    max_row_bytes: int | None,
    queue: str | None,
    limit: int | None,
    high_water: int,
    redis_url: str | None,
) -> None:
    """Enqueue DATASETS (JSONL, .jsonl.zst/.gz, JSON arrays, Parquet) into job --job.

    Safe to rerun: prompts already in the job are skipped, and after a crash the same
    command continues where it stopped.
    """
    # Imported here: transformers takes seconds to import, `regen --help` should not.
    from regen.common.celery_app import make_app
    from regen.producer.enqueue import Enqueuer, expand_datasets
    from regen.producer.progress import ProgressDisplay, nothing_to_generate, summary
    from regen.producer.spec import JobOptions

    options = JobOptions(
        job=job,
        model=model,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        thinking=thinking,
        chat_template_kwargs=chat_template_kwargs,
        system_prompt=system_prompt,
        chunk_size=chunk_size,
        max_prompt_tokens=max_prompt_tokens,
        context_length=context_length,
        max_row_bytes=max_row_bytes,
        queue=queue,
    )
    prepared = prepare_job_or_fail(options)
    url = connection.resolve_url(redis_url)
    r = connection.client(url)
    try:
        jobspec.save(r, prepared.spec)
    except jobspec.JobSpecMismatch as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(
        f"job {job}: model {model}, queue {prepared.spec.queue}, Redis {connection.redact(url)}",
        err=True,
    )
    enqueuer_app = make_app(url)
    files = expand_datasets(list(datasets))
    with ProgressDisplay() as progress:
        enqueuer = Enqueuer(r, enqueuer_app, prepared, high_water=high_water, on_progress=progress)
        stats = enqueuer.run(files, limit=limit)
    click.echo(summary(stats, job))
    if not r.hlen(keys.job_chunks(job)):  # no chunk ever published: nothing will run
        click.echo(nothing_to_generate(stats, job, len(files)), err=True)
