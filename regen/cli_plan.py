"""`regen plan` (what a job will cost) and `regen preflight` (is the target ready)."""

from __future__ import annotations

from pathlib import Path

import click
import orjson

from regen.common import defaults
from regen.options import prepare_job_or_fail, target_options, tokenizer_options

_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@click.command()
@click.argument("datasets", nargs=-1, required=True, type=click.Path(exists=True))
@target_options
@click.option(
    "--mean-output-tokens",
    type=click.FloatRange(min=1),
    default=None,
    help="Expected mean answer length (default: max_new_tokens, an upper bound).",
)
@click.option(
    "--output-tokens-per-s",
    type=click.FloatRange(min=0, min_open=True),
    default=None,
    help="One server's output throughput under load (SGLang's gen_throughput); "
    "default 800, a guess.",
)
@click.option(
    "--servers",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="Servers sharing the job: the generation time is divided among them.",
)
@click.option("--job", default="plan", envvar="REGEN_JOB", help="Job name put in the records.")
@click.option(
    "--sample",
    type=click.IntRange(min=0),
    default=None,
    help="Tokenize a random sample of N unique prompts and scale up (default 10000; "
    "0 tokenizes every prompt). Counting rows is always exact.",
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the sample.")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    default=defaults.OUT_DIR,
    envvar="REGEN_OUT",
    show_default=True,
    help="Where the shards will go: its free space is checked.",
)
@click.option("--strict", is_flag=True, help="Exit 1 when there is a warning (e.g. no room).")
@_json_option
def plan(
    datasets: tuple[str, ...],
    model: str,
    tokenizer: str | None,
    trust_remote_code: bool,
    max_new_tokens: int,
    mean_output_tokens: float | None,
    output_tokens_per_s: float | None,
    servers: int,
    thinking: bool | None,
    chat_template_kwargs: dict,
    system_prompt: str | None,
    max_prompt_tokens: int | None,
    context_length: int | None,
    max_row_bytes: int | None,
    job: str,
    sample: int | None,
    seed: int,
    out: Path,
    strict: bool,
    as_json: bool,
) -> None:
    """Count the prompts and tokens of DATASETS and estimate generation time and disk.

    Reads the datasets as `regen enqueue` would (same shapes, dedupe, template and
    limits) without touching Redis.
    """
    # Imported here: transformers takes seconds to import, `regen --help` should not.
    from regen.producer import plan as planning
    from regen.producer.enqueue import expand_datasets
    from regen.producer.prompt_scan import DEFAULT_SAMPLE
    from regen.producer.spec import JobOptions

    options = JobOptions(
        job=job,
        model=model,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        max_new_tokens=max_new_tokens,
        thinking=thinking,
        chat_template_kwargs=chat_template_kwargs,
        system_prompt=system_prompt,
        max_prompt_tokens=max_prompt_tokens,
        context_length=context_length,
        max_row_bytes=max_row_bytes,
    )
    prepared = prepare_job_or_fail(options)
    result = planning.build_plan(
        expand_datasets(list(datasets)),
        prepared,
        tokens_per_s=output_tokens_per_s,
        servers=servers,
        mean_output_tokens=mean_output_tokens,
        sample=DEFAULT_SAMPLE if sample is None else (sample or None),
        seed=seed,
        out=out,
    )
    if as_json:
        click.echo(orjson.dumps(result.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(result.to_text())
    if strict and result.warnings:
        raise SystemExit(1)


@click.command()
@tokenizer_options
@_json_option
def preflight(
    model: str,
    tokenizer: str | None,
    trust_remote_code: bool,
    chat_template_kwargs: dict,
    as_json: bool,
) -> None:
    """Check the target's tokenizer and chat template before a job: it loads, renders with
    thinking on and off, and has an end-of-turn and a mask token. Exits 1 on a failure."""
    from regen.preflight import run_preflight

    report = run_preflight(
        model,
        tokenizer=tokenizer,
        trust_remote_code=trust_remote_code,
        chat_template_kwargs=chat_template_kwargs,
    )
    if as_json:
        click.echo(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2).decode())
    else:
        click.echo(report.to_text())
    if not report.ok:
        raise SystemExit(1)
