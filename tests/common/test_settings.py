"""Settings from the environment: read in one place, validated, with errors that name the
variable; the CLI refuses a bad value before a command runs."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from regen.cli import main
from regen.common import defaults
from regen.common.settings import Settings, SettingsError


def test_unset_or_empty_variables_give_the_defaults() -> None:
    settings = Settings.from_env({"REGEN_HOME": "", "REGEN_SHARD_LEASE_S": ""})
    assert settings == Settings()
    assert settings.home == Path(defaults.HOME)
    assert settings.visibility_timeout_s == defaults.VISIBILITY_TIMEOUT_S
    assert settings.redis_url is None and settings.crashpoint is None
    assert settings.heartbeat_interval_s == defaults.HEARTBEAT_INTERVAL_MAX_S


def test_every_variable_is_read_and_parsed() -> None:
    settings = Settings.from_env({
        "REGEN_HOME": "/var/lib/regen", "REGEN_EMBEDDED_PORT": "7000",
        "REGEN_REDIS_URL": "redis://h:1/0", "REGEN_VISIBILITY_TIMEOUT": "300",
        "REGEN_RESTORE_INTERVAL": "0.5", "REGEN_RESTORE_THROTTLE": "2",
        "REGEN_HEARTBEAT_STALE_S": "3", "REGEN_SHARD_LEASE_S": "4",
        "REGEN_CRASHPOINT": "tokenize.mid_shard",
    })  # fmt: skip
    assert settings == Settings(
        home=Path("/var/lib/regen"), embedded_port=7000, redis_url="redis://h:1/0",
        visibility_timeout_s=300, restore_interval_s=0.5, restore_throttle=2,
        heartbeat_stale_s=3.0, shard_lease_s=4.0, crashpoint="tokenize.mid_shard",
    )  # fmt: skip
    assert settings.heartbeat_interval_s == 0.75  # a quarter of a short stale age


@pytest.mark.parametrize(
    ("variable", "value", "words"),
    [
        ("REGEN_VISIBILITY_TIMEOUT", "4h", "REGEN_VISIBILITY_TIMEOUT='4h' is not an integer"),
        ("REGEN_SHARD_LEASE_S", "soon", "REGEN_SHARD_LEASE_S='soon' is not a number"),
        ("REGEN_HEARTBEAT_STALE_S", "0", "REGEN_HEARTBEAT_STALE_S must be above 0"),
        ("REGEN_RESTORE_THROTTLE", "-1", "REGEN_RESTORE_THROTTLE must be above 0"),
        ("REGEN_EMBEDDED_PORT", "70000", "REGEN_EMBEDDED_PORT must be a TCP port"),
    ],
)
def test_a_bad_value_is_refused_naming_the_variable(
    variable: str, value: str, words: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(SettingsError, match=words.replace("(", r"\(")):
        Settings.from_env({variable: value})
    # The CLI reads the settings as a command starts: it stops with the error, at once.
    monkeypatch.setenv(variable, value)
    result = CliRunner().invoke(main, ["redis", "status"])
    assert result.exit_code == 1 and words in result.output, result.output


def test_settings_are_validated_when_built_directly() -> None:
    with pytest.raises(SettingsError, match="REGEN_SHARD_LEASE_S must be above 0"):
        Settings(shard_lease_s=0)
