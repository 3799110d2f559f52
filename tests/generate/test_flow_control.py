"""Flow control: a generate worker holds the chunks its engine can start soon, no more
(consumers/generate/placement/flow_control.py)."""

from __future__ import annotations

from regen.consumers.generate.placement.flow_control import MIN_SLACK, REFILL_S, chunk_limit, slack

CAPACITY = 32


def test_a_cold_start_takes_the_chunks_that_fill_the_slots_at_once() -> None:
    # 32 slots + the minimum slack, in chunks of 8: 5 chunks on top of the 2 held.
    assert chunk_limit(0, CAPACITY, held=2, prompts_per_s=0.0, chunk_size=8) == 2 + 5


def test_a_freed_slot_with_nothing_waiting_takes_one_more_chunk() -> None:
    assert chunk_limit(CAPACITY - 1, CAPACITY, held=4, prompts_per_s=0.8, chunk_size=8) == 5


def test_prompts_that_would_wait_stay_on_the_queue() -> None:
    """At real lengths (32 slots finishing 0.8 answers/s) a worker with its slots full and
    a couple of prompts waiting takes nothing, and holds one chunk fewer than it has, so
    a chunk that ends is not replaced."""
    waiting = slack(CAPACITY, 0.8)
    assert waiting == MIN_SLACK
    assert chunk_limit(CAPACITY + waiting, CAPACITY, held=5, prompts_per_s=0.8, chunk_size=8) == 4
    assert chunk_limit(CAPACITY + 40, CAPACITY, held=1, prompts_per_s=0.8, chunk_size=64) == 1


def test_the_slack_covers_the_slots_that_free_while_a_chunk_arrives() -> None:
    # Short answers: 128 slots finishing 100 prompts/s; the waiting prompts cover REFILL_S.
    assert slack(128, 100.0) == int(100 * REFILL_S)
    assert chunk_limit(128 + 150, 128, held=3, prompts_per_s=100.0, chunk_size=64) == 4
    # However fast, no more than twice the capacity waits.
    assert slack(128, 10_000.0) == 256


def test_no_healthy_server_takes_nothing_more() -> None:
    assert chunk_limit(0, 0, held=0, prompts_per_s=0.0) == 1
    assert chunk_limit(10, 0, held=3, prompts_per_s=5.0) == 3
