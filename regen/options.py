"""Options shared by several commands."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import click

F = TypeVar("F", bound=Callable[..., Any])


def redis_url_option(func: F) -> F:
    return click.option(
        "--redis-url",
        envvar="REGEN_REDIS_URL",
        default=None,
        metavar="URL",
        help="redis://[:password@]host:port/db or rediss:// for TLS "
        "(env REGEN_REDIS_URL; default: the embedded Redis).",
    )(func)
