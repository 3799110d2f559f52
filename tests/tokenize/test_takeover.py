"""Finding dead tokenize consumers and taking their results over, against a real Redis."""

from __future__ import annotations

import time

import pytest
import redis

from regen.common import keys, settings
from regen.consumers.tokenize.takeover import (
    MIN_IDLE_MS,
    claim_from,
    dead_consumers,
    delete_if_empty,
    own_left_over,
)

STREAM = keys.results_stream("t")
GROUP = keys.TOKENIZE_GROUP


def read_as(r: redis.Redis, consumer: str, count: int) -> list[bytes]:
    """What XREADGROUP hands `consumer`: the entries then pending for it."""
    reply = r.xreadgroup(GROUP, consumer, {STREAM: ">"}, count=count)
    return [entry_id for _, entries in reply for entry_id, _ in entries]


def consumers(r: redis.Redis) -> dict[str, int]:
    return {c["name"].decode(): c["pending"] for c in r.xinfo_consumers(STREAM, GROUP)}


@pytest.fixture
def stream(r: redis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(6):
        r.xadd(STREAM, {b"r": str(i).encode()})
    r.xgroup_create(STREAM, GROUP, id="0")
    monkeypatch.setenv("REGEN_HEARTBEAT_STALE_S", "0.2")
    settings.load()  # conftest reloads them from the environment after the test


@pytest.mark.usefixtures("stream")
def test_a_silent_consumer_without_a_live_heartbeat_is_taken_over_and_removed(
    r: redis.Redis,
) -> None:
    ghost = read_as(r, "ghost", 3)
    read_as(r, "alive", 3)
    r.xgroup_createconsumer(STREAM, GROUP, "stale")  # it beat once, no longer
    time.sleep(max(0.3, MIN_IDLE_MS / 1000 + 0.1))
    beats = {"alive": time.time(), "stale": time.time() - 1}
    # No heartbeat and silent, or a stale heartbeat: dead; "me" is the one asking.
    assert dead_consumers(r, STREAM, "me", beats) == ["ghost", "stale"]
    claimed = [eid for entries in claim_from(r, STREAM, "ghost", "me") for eid, _ in entries]
    assert claimed == ghost
    assert delete_if_empty(r, STREAM, "ghost") and delete_if_empty(r, STREAM, "stale")
    assert consumers(r) == {"alive": 3, "me": 3}


@pytest.mark.usefixtures("stream")
def test_a_consumer_with_entries_pending_keeps_its_name(r: redis.Redis) -> None:
    read_as(r, "slow", 2)
    assert not delete_if_empty(r, STREAM, "slow")
    assert consumers(r) == {"slow": 2}


@pytest.mark.usefixtures("stream")
def test_a_consumer_rereads_what_it_left_outside_its_open_shard(r: redis.Redis) -> None:
    mine = read_as(r, "me", 4)
    in_shard = {mine[0].decode(), mine[2].decode()}
    again = [eid for entries in own_left_over(r, STREAM, "me", in_shard) for eid, _ in entries]
    assert again == [mine[1], mine[3]]
