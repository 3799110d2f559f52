"""`regen`: the command line. Each subcommand lives in a module of its own."""

from __future__ import annotations

import logging
import os

import click
import redis

from regen import (
    cli_dlq,
    cli_enqueue,
    cli_plan,
    cli_recover,
    cli_redis,
    cli_shards,
    cli_status,
    cli_worker,
)
from regen.options import redis_url_option


class _Regen(click.Group):
    """The `regen` group: a login Redis refuses is a one-line error in every command."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except redis.AuthenticationError as exc:
            raise click.ClickException(
                f"Redis refused the login ({exc}): check the user and password in "
                "REGEN_REDIS_URL or --redis-url (redis://[USER]:PASSWORD@HOST:PORT/DB)"
            ) from None


@click.group(
    cls=_Regen,
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.option("-v", "--verbose", count=True, help="More log output (-vv for debug).")
def main(verbose: int) -> None:
    """Regenerate assistant responses with a target LLM into token-exact drafter training
    records.

    Every command takes --redis-url (or REGEN_REDIS_URL); without either, regen starts or
    reuses an embedded Redis under REGEN_HOME (default ./.regen).
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG), format="%(asctime)s %(name)s %(message)s")
    # Model hubs are never reached at run time: every model and tokenizer is a local path.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@main.command()
@click.option(
    "--engine",
    type=click.Choice(["local", "sglang"]),
    default="local",
    show_default=True,
    help="local: SmolLM2 on this machine; sglang: --server.",
)
@click.option("--server", "servers", multiple=True, help="SGLang server URL (--engine sglang).")
@click.option(
    "--model",
    default="smollm2",
    show_default=True,
    help="The model (its tokenizer renders the prompts).",
)
@click.option(
    "--trust-remote-code", is_flag=True, help="Let the tokenizer run its own code (Kimi)."
)
@click.option(
    "--thinking/--no-thinking",
    default=None,
    help="The chat template's thinking switch (default: the template's own).",
)
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=320, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0), default=0.2, show_default=True)
@click.option("--top-p", type=click.FloatRange(0, 1), default=0.9, show_default=True)
@click.option(
    "--dataset",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Default: the bundled sample of varied prompts.",
)
@click.option(
    "--out", "out_dir", default="regen-out", show_default=True, type=click.Path(file_okay=False)
)
@redis_url_option
def demo(
    engine: str,
    servers: tuple[str, ...],
    model: str,
    trust_remote_code: bool,
    thinking: bool | None,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    dataset: str | None,
    out_dir: str,
    redis_url: str | None,
) -> None:
    """Run the whole pipeline end to end on embedded defaults, then show a record."""
    from pathlib import Path

    from regen.demo import DemoOptions, run_demo

    if engine == "sglang" and not servers:
        raise click.UsageError("--engine sglang needs --server URL")
    run_demo(
        DemoOptions(
            engine=engine,
            servers=list(servers),
            model=model,
            trust_remote_code=trust_remote_code,
            thinking=thinking,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            dataset=Path(dataset) if dataset else None,
            out_dir=Path(out_dir),
            redis_url=redis_url,
        )
    )


main.add_command(cli_redis.redis_group)
main.add_command(cli_enqueue.enqueue)
main.add_command(cli_worker.worker_group)
main.add_command(cli_shards.shards_group)
main.add_command(cli_plan.plan)
main.add_command(cli_plan.preflight)
main.add_command(cli_dlq.dlq_group)
main.add_command(cli_status.status)
main.add_command(cli_status.verify)
main.add_command(cli_recover.recover)
