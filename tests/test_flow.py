"""Flow control: the chunks a generate worker holds follow its engine's demand."""

from __future__ import annotations

from regen.consumers.generate.flow import HIGH, LOW, chunk_limit_change

CAPACITY = 128
SHORT = int(CAPACITY * LOW) - 40  # outstanding prompts a little below the low mark
OVER = int(CAPACITY * HIGH) + 1


def test_more_chunks_when_the_engine_would_run_short() -> None:
    # Every allowed chunk in hand and too few prompts outstanding: take one more.
    assert chunk_limit_change(SHORT, CAPACITY, held=3, limit=3, chunk_size=64) == 1


def test_a_cold_start_takes_the_chunks_that_fill_the_slots_at_once() -> None:
    expected = int(512 * LOW) // 64
    assert chunk_limit_change(0, 512, held=2, limit=2, chunk_size=64) == expected


def test_no_more_while_a_granted_chunk_is_still_on_its_way() -> None:
    assert chunk_limit_change(SHORT, CAPACITY, held=2, limit=3, chunk_size=64) == 0


def test_fewer_chunks_when_far_more_prompts_wait_than_slots() -> None:
    assert chunk_limit_change(OVER, CAPACITY, held=6, limit=6) == -1
    assert chunk_limit_change(OVER, CAPACITY, held=1, limit=1) == 0


def test_steady_between_the_marks_and_idle_without_capacity() -> None:
    between = int(CAPACITY * (LOW + HIGH) / 2)
    assert chunk_limit_change(between, CAPACITY, held=4, limit=4) == 0
    assert chunk_limit_change(0, 0, held=0, limit=2) == 0
