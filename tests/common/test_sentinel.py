"""Redis Sentinel URLs: parsed once for regen's clients and Celery's broker, passwords kept
out of output, and a client that follows the primary through a real failover."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import redis
from click.testing import CliRunner

from regen.cli import main
from regen.common import connection, settings
from regen.common.celery_app import make_app
from regen.common.sentinel_url import RedisUrlError, SentinelUrl, parse
from tests.support.helpers import wait_for
from tests.support.sentinel_cluster import MASTER, sentinel_cluster

SECRET = "s3cret-Pa55word"


def test_a_sentinel_url_gives_every_sentinel_one_database_and_the_password() -> None:
    parsed = parse(f"sentinel://:{SECRET}@h1:26379;sentinel://h2:26380;h3/2")
    assert parsed == SentinelUrl(
        sentinels=(("h1", 26379), ("h2", 26380), ("h3", 26379)), db=2, password=SECRET
    )
    # kombu reads the login and database off the first entry only: each entry has them.
    assert parsed.broker_url() == (
        f"sentinel://:{SECRET}@h1:26379/2;sentinel://:{SECRET}@h2:26380/2;"
        f"sentinel://:{SECRET}@h3:26379/2"
    )
    assert parse("sentinel://h1").db == 0


@pytest.mark.parametrize(
    "url",
    [
        "sentinel://h1/1;sentinel://h2/2",  # two databases
        "sentinel://:a@h1;sentinel://:b@h2",  # two passwords
        "sentinel://h1;redis://h2",  # a non-sentinel entry
        "sentinel://h1:port",
        "sentinel://h1/x",
    ],
)
def test_a_sentinel_url_regen_cannot_use_is_refused(url: str) -> None:
    with pytest.raises(RedisUrlError):
        parse(url)


def test_redact_hides_the_password_of_every_sentinel_entry() -> None:
    url = f"sentinel://:{SECRET}@h1:26379;sentinel://user:{SECRET}@h2:26380/3"
    assert connection.redact(url) == "sentinel://:***@h1:26379;sentinel://user:***@h2:26380/3"
    assert SECRET not in connection.redact(url)


def test_a_sentinel_url_without_a_master_name_is_one_clear_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("REGEN_REDIS_SENTINEL_MASTER", raising=False)
    url = f"sentinel://:{SECRET}@127.0.0.1:1;sentinel://127.0.0.1:2"
    result = CliRunner().invoke(main, ["status", "--redis-url", url])
    assert result.exit_code == 1
    assert result.output.count("\n") == 1, result.output
    assert "REGEN_REDIS_SENTINEL_MASTER" in result.output
    assert SECRET not in result.output


def test_celery_gets_the_sentinel_transport_and_the_master_name(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("REGEN_REDIS_SENTINEL_MASTER", "primary-a")
    monkeypatch.setenv("REGEN_REDIS_SENTINEL_PASSWORD", "sentinel-pw")
    settings.load()
    app = make_app("sentinel://h1:26379;sentinel://h2:26379/4")
    assert app.conf.broker_url == "sentinel://h1:26379/4;sentinel://h2:26379/4"
    options = app.conf.broker_transport_options
    assert options["master_name"] == "primary-a"
    assert options["sentinel_kwargs"]["password"] == "sentinel-pw"


@pytest.mark.slow
def test_a_client_follows_the_primary_through_a_failover(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("REGEN_REDIS_SENTINEL_MASTER", MASTER)
    settings.load()
    with sentinel_cluster(tmp_path) as cluster:
        r = connection.client(cluster.url(db=1))
        r.set("k", "before")
        assert redis.Redis(port=cluster.primary.port, db=1).get("k") == b"before"
        wait_for(cluster.replica_in_sync, what="the replica in sync")
        cluster.primary.kill()
        outages = 0
        deadline = time.monotonic() + 60
        while True:  # as the long-running loops do: an outage is waited out
            try:
                r.set("k", "after")
                break
            except connection.OUTAGE_ERRORS:
                outages += 1
                assert time.monotonic() < deadline, "no new primary within 60 s"
                time.sleep(0.2)
        assert outages, "the write went through without noticing the failover"
        assert cluster.master_port() == cluster.replica.port
        assert redis.Redis(port=cluster.replica.port, db=1).get("k") == b"after"
