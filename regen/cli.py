"""`regen`: the command line. Each subcommand lives in a module of its own."""

from __future__ import annotations

import logging
import os

import click

from regen import cli_enqueue, cli_redis, cli_shards, cli_worker


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
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
def demo() -> None:
    """Run the whole pipeline on embedded defaults (not yet available)."""
    raise click.ClickException(
        "not yet: the demo lands with the generate and tokenize stages "
        "(see README); `regen enqueue` works today"
    )


main.add_command(cli_redis.redis_group)
main.add_command(cli_enqueue.enqueue)
main.add_command(cli_worker.worker_group)
main.add_command(cli_shards.shards_group)
