"""Settings read from the environment: every `REGEN_*` variable regen's code reads, read
here and nowhere else, into one frozen, validated `Settings`.

A process reads them once, at first use; the CLI reads them as a command starts, so a
bad value stops the command with an error naming the variable before anything runs (and
a command a test runs in-process sees the environment the test set). Every default is
in common.defaults. Command-line options that fall back to a variable (click's `envvar`,
e.g. REGEN_JOB, REGEN_OUT) belong to the CLI and are not read here.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from regen.common import defaults


class SettingsError(ValueError):
    """An environment variable holds a value regen cannot use."""


@dataclass(frozen=True)
class Settings:
    # State folder: the embedded Redis's data, caches (converted tokenizers, weights).
    home: Path = field(default=Path(defaults.HOME))
    embedded_port: int = defaults.EMBEDDED_REDIS_PORT
    # The Redis of a command given no --redis-url; None: the embedded one.
    redis_url: str | None = None
    # For a sentinel:// redis_url: the primary's name and the sentinels' own password.
    redis_sentinel_master: str | None = defaults.REDIS_SENTINEL_MASTER
    redis_sentinel_password: str | None = defaults.REDIS_SENTINEL_PASSWORD
    # Every process on one broker must agree on it (common.celery_app).
    visibility_timeout_s: int = defaults.VISIBILITY_TIMEOUT_S
    restore_interval_s: float = defaults.UNACKED_RESTORE_INTERVAL_S
    restore_throttle: int = defaults.UNACKED_RESTORE_THROTTLE
    heartbeat_stale_s: float = defaults.HEARTBEAT_STALE_AFTER_S
    shard_lease_s: float = defaults.SHARD_CLAIM_S
    # `regen enqueue --follow`: between passes, and the grace before ids in no place are
    # queued again (common.defaults).
    follow_poll_s: float = defaults.FOLLOW_POLL_S
    follow_grace_s: float = defaults.FOLLOW_GRACE_S
    # The named point where a crash test makes this process kill itself (crashpoints).
    crashpoint: str | None = None

    def __post_init__(self) -> None:
        for variable, (name, _) in VARIABLES.items():
            value = getattr(self, name)
            if name in _POSITIVE and not value > 0:
                raise SettingsError(f"{variable} must be above 0, not {value}")
        if not 1 <= self.embedded_port <= 65535:
            raise SettingsError(f"REGEN_EMBEDDED_PORT must be a TCP port, not {self.embedded_port}")

    @property
    def heartbeat_interval_s(self) -> float:
        """Beats come several times per stale period, so a live worker never looks stale."""
        return min(defaults.HEARTBEAT_INTERVAL_MAX_S, self.heartbeat_stale_s / 4)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> Settings:
        """The settings `environ` gives; an unset or empty variable leaves the default."""
        values = {}
        for variable, (name, parse) in VARIABLES.items():
            raw = environ.get(variable)
            if raw:
                values[name] = _parse(variable, parse, raw)
        return cls(**values)


# The variable that gives a process its Redis URL; child processes get it this way, so a
# password never shows in their command line.
REDIS_URL_VARIABLE = "REGEN_REDIS_URL"

# Every variable read, with the field it sets and how its text is read.
VARIABLES: dict[str, tuple[str, Callable[[str], Any]]] = {
    "REGEN_HOME": ("home", Path),
    "REGEN_EMBEDDED_PORT": ("embedded_port", int),
    REDIS_URL_VARIABLE: ("redis_url", str),
    "REGEN_REDIS_SENTINEL_MASTER": ("redis_sentinel_master", str),
    "REGEN_REDIS_SENTINEL_PASSWORD": ("redis_sentinel_password", str),
    "REGEN_VISIBILITY_TIMEOUT": ("visibility_timeout_s", int),
    "REGEN_RESTORE_INTERVAL": ("restore_interval_s", float),
    "REGEN_RESTORE_THROTTLE": ("restore_throttle", int),
    "REGEN_HEARTBEAT_STALE_S": ("heartbeat_stale_s", float),
    "REGEN_SHARD_LEASE_S": ("shard_lease_s", float),
    "REGEN_FOLLOW_POLL_S": ("follow_poll_s", float),
    "REGEN_FOLLOW_GRACE_S": ("follow_grace_s", float),
    "REGEN_CRASHPOINT": ("crashpoint", str),
}
_POSITIVE = {"visibility_timeout_s", "restore_interval_s", "restore_throttle",
             "heartbeat_stale_s", "shard_lease_s", "follow_poll_s", "follow_grace_s"}  # fmt: skip
_KINDS: dict[Callable[[str], Any], str] = {int: "an integer", float: "a number"}


def _parse(variable: str, parse: Callable[[str], Any], raw: str) -> Any:
    try:
        return parse(raw)
    except ValueError:
        raise SettingsError(f"{variable}={raw!r} is not {_KINDS.get(parse, 'valid')}") from None


_current: Settings | None = None


def load(environ: Mapping[str, str] = os.environ) -> Settings:
    """Read the environment, and make that this process's settings."""
    global _current
    _current = Settings.from_env(environ)
    return _current


def current() -> Settings:
    """This process's settings: read from the environment at first use."""
    return _current if _current is not None else load()
