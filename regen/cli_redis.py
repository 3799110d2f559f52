"""`regen redis start|stop|status`: the embedded Redis."""

from __future__ import annotations

import click

from regen.common.embedded_redis import EmbeddedRedis


@click.group("redis")
def redis_group() -> None:
    """Manage the embedded Redis (REGEN_HOME, REGEN_EMBEDDED_PORT)."""


@redis_group.command()
def start() -> None:
    """Start the embedded Redis, or report the one already running."""
    server = EmbeddedRedis.from_env()
    if server.running():
        click.echo(f"embedded Redis already running at {server.url} (data in {server.data_dir})")
        return
    server.ensure_running(quiet=True)
    click.echo(f"embedded Redis started at {server.url} (data in {server.data_dir})")


@redis_group.command()
def stop() -> None:
    """Stop the embedded Redis (its data stays on disk)."""
    server = EmbeddedRedis.from_env()
    if server.stop():
        click.echo(f"embedded Redis at {server.url} stopped")
    else:
        click.echo("embedded Redis is not running")


@redis_group.command()
def status() -> None:
    """Say whether the embedded Redis runs, and where."""
    server = EmbeddedRedis.from_env()
    state = "running" if server.running() else "stopped"
    click.echo(f"embedded Redis {state}: {server.url} (data in {server.data_dir})")
