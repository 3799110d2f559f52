"""`regen plan` (what a job will cost) and `regen preflight` (is the target ready)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import click

from regen.common import defaults
from regen.options import (
    ShardsLocation,
    int_option,
    job_options,
    prepare_job_or_fail,
    print_json_or_text,
    tokenizer_options,
    tunable,
)

if TYPE_CHECKING:
    from regen.producer.spec import JobOptions

_json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON.")


@click.command()
@click.argument("datasets", nargs=-1, required=True, type=click.Path(exists=True))
@job_options(
    click.option("--job", default="plan", envvar="REGEN_JOB", help="Job name put in the records.")
)
@click.option(
    "--mean-output-tokens",
    type=click.FloatRange(min=1),
    help="Expected mean answer length (default: max_new_tokens, an upper bound).",
)
@click.option(
    "--output-tokens-per-s",
    type=click.FloatRange(min=0, min_open=True),
    help="One server's output throughput under load (SGLang's gen_throughput); "
    f"default {defaults.PLAN_TOKENS_PER_S:.0f}, a guess.",
)
@int_option(
    "--servers",
    default=defaults.PLAN_SERVERS,
    help="Servers sharing the job: the generation time is divided among them.",
)
@click.option(
    "--sample",
    type=click.IntRange(min=0),
    help=f"Tokenize a random sample of N unique prompts and scale up (default "
    f"{defaults.PLAN_SAMPLE}; 0 tokenizes every prompt). Counting rows is always exact.",
)
@tunable("--seed", type=int, default=defaults.PLAN_SEED, help="Seed of the sample.")
@tunable(
    "--out",
    type=ShardsLocation(),
    default=defaults.OUT_DIR,
    envvar="REGEN_OUT",
    help="Where the shards will go: its free space is checked (not for object storage).",
)
@click.option("--strict", is_flag=True, help="Exit 1 when there is a warning (e.g. no room).")
@_json_option
def plan(
    datasets: tuple[str, ...],
    options: JobOptions,
    mean_output_tokens: float | None,
    output_tokens_per_s: float | None,
    servers: int,
    sample: int | None,
    seed: int,
    out: Path | str,
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

    prepared = prepare_job_or_fail(options)
    result = planning.build_plan(
        expand_datasets(list(datasets)),
        prepared,
        tokens_per_s=output_tokens_per_s,
        servers=servers,
        mean_output_tokens=mean_output_tokens,
        sample=defaults.PLAN_SAMPLE if sample is None else (sample or None),
        seed=seed,
        out=out,
    )
    print_json_or_text(result, as_json)
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
    print_json_or_text(report, as_json)
    if not report.ok:
        raise SystemExit(1)
