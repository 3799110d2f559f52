"""Flow control: the chunks a generate worker holds follow its engine's demand."""

from __future__ import annotations

from consumers.generate.flow import chunk_limit_change


def test_more_chunks_when_the_engine_would_run_short() -> None:
    # 128 slots, 40 prompts outstanding, every allowed chunk in hand: take one more.
    assert chunk_limit_change(outstanding=40, capacity=128, held=3, limit=3) == 1


def test_no_more_while_a_granted_chunk_is_still_on_its_way() -> None:
    assert chunk_limit_change(outstanding=40, capacity=128, held=2, limit=3) == 0


def test_fewer_chunks_when_far_more_prompts_wait_than_slots() -> None:
    assert chunk_limit_change(outstanding=300, capacity=128, held=6, limit=6) == -1
    assert chunk_limit_change(outstanding=300, capacity=128, held=1, limit=1) == 0


def test_steady_between_the_bounds_and_idle_without_capacity() -> None:
    assert chunk_limit_change(outstanding=200, capacity=128, held=4, limit=4) == 0
    assert chunk_limit_change(outstanding=0, capacity=0, held=0, limit=2) == 0
