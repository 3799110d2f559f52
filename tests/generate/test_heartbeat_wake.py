"""A heartbeat asked for early (`Heartbeat.wake`: a generate worker's slots fell idle)
comes within a second or so, not at the next regular beat, and never more often than
WOKEN_BEAT_GAP_S."""

from __future__ import annotations

import time

import orjson
import redis

from regen.common import keys
from regen.common.heartbeat import WOKEN_BEAT_GAP_S, Heartbeat
from regen.consumers.generate.placement.idle_beat import IdleBeat
from tests.support.helpers import wait_for


def test_a_woken_heartbeat_beats_at_once_but_not_more_than_once_a_gap(r: redis.Redis) -> None:
    beats = []

    def snapshot() -> dict[str, object]:
        beats.append(time.monotonic())
        return {"kind": "generate"}

    heartbeat = Heartbeat(r, "generate@test:1", snapshot, interval_s=600.0)
    heartbeat.start()
    try:
        # The record is written after the snapshot is taken: wait for the record.
        wait_for(lambda: r.hexists(keys.WORKERS, "generate@test:1"), timeout=10,
                 what="the first beat")  # fmt: skip
        assert orjson.loads(r.hget(keys.WORKERS, "generate@test:1"))["kind"] == "generate"
        assert len(beats) == 1
        woken_at = time.monotonic()
        for _ in range(5):  # several wakes at once: one early beat
            heartbeat.wake()
        wait_for(lambda: len(beats) == 2, timeout=10, what="the early beat")
        assert beats[1] - beats[0] >= WOKEN_BEAT_GAP_S - 0.05
        assert beats[1] - woken_at < WOKEN_BEAT_GAP_S + 2.0  # not the 600 s interval
        time.sleep(WOKEN_BEAT_GAP_S * 1.5)
        assert len(beats) == 2, "no beat without a wake"
    finally:
        heartbeat.stop()
        heartbeat.join(timeout=10)
    assert not heartbeat.is_alive() and r.hget(keys.WORKERS, "generate@test:1") is None


def test_idle_slots_that_change_without_a_prompt_finishing_wake_the_heartbeat(
    r: redis.Redis,
) -> None:
    """Slots fall idle with no prompt finishing (the slow start's estimate grows from 16
    to 24 on an idle server): the record says so within a look and a gap, not at the
    next regular beat; while they stay the same, no beat."""
    idle = {"slots": 0}
    heartbeat = Heartbeat(r, "generate@test:2", lambda: {"idle_slots": idle["slots"]},
                          interval_s=600.0)  # fmt: skip
    watch = IdleBeat(lambda: idle["slots"], heartbeat.wake, look_s=0.1)

    def recorded() -> int | None:
        raw = r.hget(keys.WORKERS, "generate@test:2")
        return None if raw is None else int(orjson.loads(raw)["idle_slots"])

    heartbeat.start()
    watch.start()
    try:
        wait_for(lambda: recorded() == 0, timeout=10, what="the first beat")
        first = orjson.loads(r.hget(keys.WORKERS, "generate@test:2"))["last_seen"]
        time.sleep(WOKEN_BEAT_GAP_S * 1.5)
        assert orjson.loads(r.hget(keys.WORKERS, "generate@test:2"))["last_seen"] == first
        changed_at = time.monotonic()
        idle["slots"] = 8
        wait_for(lambda: recorded() == 8, timeout=10, what="the beat after the change")
        assert time.monotonic() - changed_at < WOKEN_BEAT_GAP_S + 2.0  # not the 600 s
    finally:
        watch.stop()
        heartbeat.stop()
        watch.join(timeout=10)
        heartbeat.join(timeout=10)
