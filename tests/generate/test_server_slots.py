"""What a server runs at once, from its /metrics: what flow control may count on being
started soon (consumers/generate/engines/server_slots.py)."""

from __future__ import annotations

import math

from regen.consumers.generate.engines.server_slots import (
    GROWTH,
    PROBE,
    START,
    WINDOW_S,
    SlotEstimate,
)
from regen.consumers.generate.engines.sglang_pool import ServerState


def test_no_reading_trusts_the_limit() -> None:
    server = ServerState("http://a", "http://a", cap=256)
    assert server.slots.estimate() is None and server.startable() == 256


def test_before_the_first_awaited_reading_a_slow_start() -> None:
    """With `--max-inflight auto` the first chunk comes before the first /metrics
    reading: START, not the limit of 256; a server whose /metrics fail gets its limit."""
    server = ServerState("http://a", "http://a", cap=256)
    server.slots.expect_readings()
    assert server.startable() == START
    server.slots.no_readings()
    assert server.startable() == 256


def test_a_slow_start_then_the_slots_a_queue_reveals() -> None:
    server = ServerState("http://a", "http://a", cap=256)
    server.slots.observe(0, 0, now=0.0)
    assert server.startable() == START
    server.slots.observe(16, 0, now=1.0)
    assert server.startable() == int(16 * GROWTH)
    server.slots.observe(32, 4, now=2.0)  # a queue: 32 is what it runs
    assert server.startable() == 32
    server.slots.observe(32, 0, now=3.0)  # a moment without a queue changes nothing
    assert server.startable() == 32


def test_old_readings_age_out_and_the_limit_still_bounds() -> None:
    estimate = SlotEstimate()
    estimate.observe(32, 10, now=0.0)
    estimate.observe(20, 0, now=WINDOW_S + 1)  # its KV cache fits fewer now
    assert estimate.estimate() == 30
    server = ServerState("http://a", "http://a", cap=8)
    server.slots.observe(32, 10, now=0.0)
    assert server.startable() == 8


def test_known_slots_are_probed_a_little_once_their_queue_ages_out() -> None:
    """A worker sends no more than the 32 slots a queue showed, so the queue goes; once
    those readings age out the server is counted for 32 and a tenth, not 48 (16 more
    requests in its queue every minute, out of other workers' reach)."""
    estimate = SlotEstimate()
    estimate.observe(32, 4, now=0.0)
    for t in range(1, int(WINDOW_S) + 5):
        estimate.observe(32, 0, now=float(t))
    assert estimate.estimate() == 32 + max(1, math.ceil(32 * PROBE))
    estimate.observe(35, 1, now=WINDOW_S + 6)  # a KV cache that fits more: found
    assert estimate.estimate() == 35
