"""The suite's own Redis: tests run in parallel processes, so a port can be taken between
free_port() and redis-server binding it; a test must never talk to another test's Redis."""

from __future__ import annotations

from pathlib import Path

import pytest
import redis

from tests.support.redis_server import PortTaken, RedisServer, running_redis


def test_a_port_held_by_another_redis_is_refused_not_shared(tmp_path: Path) -> None:
    with running_redis(tmp_path / "first") as first:
        with pytest.raises(PortTaken):
            RedisServer(data_dir=tmp_path / "second", port=first.port).start()
        assert redis.Redis.from_url(first.url).ping()  # the first one is untouched


def test_on_free_port_starts_its_own_server(tmp_path: Path) -> None:
    server = RedisServer.on_free_port(tmp_path / "own")
    try:
        assert server.process is not None
        info = redis.Redis.from_url(server.url).info("server")
        assert int(info["process_id"]) == server.process.pid
    finally:
        server.kill()
