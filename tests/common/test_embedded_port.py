"""The embedded Redis's port (#29): what a test or a command sees does not depend on
another Redis running on the machine, and the demo leaves no Redis of its own behind."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from click.testing import CliRunner

from regen.cli import main
from regen.common import defaults, settings
from regen.common.embedded_redis import EmbeddedRedis
from regen.demo import demo_redis
from tests.ops.test_shards_inspect import make_record, write_shard
from tests.support.generate_harness import REPO
from tests.support.redis_server import free_port, running_redis

# The tests of tests/ops/test_shards_inspect.py whose commands look for the embedded Redis
# (`regen shards verify` without --no-redis): they failed with "port 6399 is taken by
# another Redis" while a `regen demo` left its Redis running.
PORT_SENSITIVE = "cut_short_is_unreadable or cli_verify_exit_codes"


def answers(port: int) -> bool:
    with contextlib.closing(socket.socket()) as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


@contextlib.contextmanager
def redis_left_on_the_default_port(home: Path) -> Iterator[None]:
    """A Redis on the default embedded port, daemonized as `regen demo` used to leave
    it; when something already answers there, that is the case to test, left alone."""
    server = EmbeddedRedis(home=home.absolute(), port=defaults.EMBEDDED_REDIS_PORT)
    if answers(server.port):
        yield
        return
    server.ensure_running(quiet=True)
    try:
        yield
    finally:
        server.stop()


def test_the_session_has_an_embedded_port_of_its_own() -> None:
    configured = settings.current().embedded_port
    assert configured != defaults.EMBEDDED_REDIS_PORT
    assert not answers(configured)
    with pytest.raises(OSError):  # held: no test's own Redis can be given it
        socket.create_server(("127.0.0.1", configured)).close()


@pytest.mark.slow
def test_a_redis_left_on_the_default_port_changes_no_test(tmp_path: Path) -> None:
    # Both tests failed here before the session had a port of its own (tests/conftest.py)
    # and before verify checked files alone beside another Redis (regen/cli_shards.py).
    env = {key: value for key, value in os.environ.items() if not key.startswith("REGEN_")}
    with redis_left_on_the_default_port(tmp_path / "demo-home"):
        assert answers(defaults.EMBEDDED_REDIS_PORT)
        done = subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
             "tests/ops/test_shards_inspect.py", "-k", PORT_SENSITIVE],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "2 passed" in done.stdout


def test_verify_checks_files_alone_beside_another_redis_on_the_embedded_port(
    tmp_path: Path, regen_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    job = tmp_path / "out" / "job-a"
    write_shard(job, 1, [make_record("a")])
    monkeypatch.delenv("REGEN_REDIS_URL", raising=False)
    with running_redis(tmp_path / "other") as other:
        monkeypatch.setenv("REGEN_EMBEDDED_PORT", str(other.port))
        checked = CliRunner().invoke(main, ["shards", "verify", str(job)])
    assert checked.exit_code == 0, checked.output
    assert f"files checked alone: port {other.port} is taken by another Redis" in checked.output
    assert "ok: 1 job(s) verified" in checked.output


def test_a_command_beside_another_redis_on_the_embedded_port_says_so_in_one_line(
    tmp_path: Path, regen_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("REGEN_REDIS_URL", raising=False)
    with running_redis(tmp_path / "other") as other:
        monkeypatch.setenv("REGEN_EMBEDDED_PORT", str(other.port))
        result = CliRunner().invoke(main, ["status"])
    assert result.exit_code == 1
    assert result.output.startswith(f"Error: port {other.port} is taken by another Redis")
    assert "REGEN_EMBEDDED_PORT" in result.output and len(result.output.splitlines()) == 1


@pytest.fixture
def own_embedded(regen_home: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[EmbeddedRedis]:
    """The embedded Redis of this test's REGEN_HOME, on a port of its own; stopped after."""
    monkeypatch.setenv("REGEN_EMBEDDED_PORT", str(free_port()))
    monkeypatch.delenv("REGEN_REDIS_URL", raising=False)
    settings.load()
    server = EmbeddedRedis.from_env()
    try:
        yield server
    finally:
        server.stop()


def test_the_demo_stops_an_embedded_redis_it_started(own_embedded: EmbeddedRedis) -> None:
    url, started = demo_redis(None)
    assert url == own_embedded.url and own_embedded.running()
    assert started == own_embedded  # run_demo stops it when it ends (tests/ops/test_demo.py)


def test_the_demo_leaves_a_running_embedded_redis_running(own_embedded: EmbeddedRedis) -> None:
    own_embedded.ensure_running(quiet=True)
    assert demo_redis(None) == (own_embedded.url, None)


def test_the_demo_given_a_redis_starts_none(own_embedded: EmbeddedRedis) -> None:
    assert demo_redis("redis://127.0.0.1:1/0") == ("redis://127.0.0.1:1/0", None)
    assert not own_embedded.running()
