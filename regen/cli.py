"""`regen`: the command line: the group and `demo` are here; the other subcommands live in
cli_*.py modules (cli_status also holds verify, cli_plan also holds preflight)."""

from __future__ import annotations

import logging
import os

import click
import redis

from regen import (
    cli_demo,
    cli_dlq,
    cli_enqueue,
    cli_metrics,
    cli_pause,
    cli_plan,
    cli_recover,
    cli_redis,
    cli_shards,
    cli_status,
    cli_worker,
)
from regen.common import extras, settings
from regen.common.embedded_redis import PortTaken
from regen.common.sentinel_url import RedisUrlError


class _Regen(click.Group):
    """The `regen` group: a login Redis refuses, another Redis on the embedded port, or an
    optional extra a command needs and does not have, is a one-line error in every
    command."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except redis.AuthenticationError as exc:
            raise click.ClickException(
                f"Redis refused the login ({exc}): check the user and password in "
                "REGEN_REDIS_URL or --redis-url (redis://[USER]:PASSWORD@HOST:PORT/DB)"
            ) from None
        except RedisUrlError as exc:
            raise click.ClickException(f"REGEN_REDIS_URL or --redis-url: {exc}") from None
        except (extras.MissingExtra, PortTaken) as exc:
            raise click.ClickException(str(exc)) from None


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
    try:  # the command's settings, read now: a bad value stops it before it starts
        settings.load()
    except settings.SettingsError as exc:
        raise click.ClickException(str(exc)) from exc


main.add_command(cli_redis.redis_group)
main.add_command(cli_enqueue.enqueue)
main.add_command(cli_worker.worker_group)
main.add_command(cli_shards.shards_group)
main.add_command(cli_plan.plan)
main.add_command(cli_plan.preflight)
main.add_command(cli_dlq.dlq_group)
main.add_command(cli_status.status)
main.add_command(cli_pause.pause)
main.add_command(cli_pause.resume)
main.add_command(cli_status.verify)
main.add_command(cli_demo.demo)
main.add_command(cli_recover.recover)
main.add_command(cli_metrics.metrics_group)
