"""The repetition detector (common/repetition.py) on made token sequences; its rates on
real text are measured by bench/repetition.py."""

from __future__ import annotations

import random

from regen.common.repetition import MAX_PERIOD, MIN_SPAN, WINDOW, tail_loop

VOCAB = 150_000


def prose(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(n)]


def looped(rng: random.Random, lead: int, period: int, tokens: int) -> list[int]:
    unit = prose(rng, period)
    return prose(rng, lead) + [unit[i % period] for i in range(tokens)]


def test_clean_text_has_no_loop() -> None:
    rng = random.Random(1)
    assert tail_loop(prose(rng, 4000)) is None
    assert tail_loop([]) is None
    assert tail_loop(prose(rng, MIN_SPAN - 1)) is None


def test_a_loop_at_the_end_is_found_with_its_period() -> None:
    rng = random.Random(2)
    for period in (1, 3, 17, 250, 1000):
        ids = looped(rng, 500, period, max(6 * period, 200) + period // 2)  # cut mid-copy
        loop = tail_loop(ids)
        assert loop is not None, period
        assert loop.period == period
        assert loop.repeats >= 6


def test_a_loop_whose_copies_vary_a_little_is_found() -> None:
    rng = random.Random(3)
    ids = looped(rng, 300, 40, 600)
    for i in range(300, len(ids)):
        if rng.random() < 0.05:
            ids[i] = rng.randrange(VOCAB)
    loop = tail_loop(ids)
    assert loop is not None and loop.period == 40


def test_too_few_copies_or_too_short_a_run_is_not_a_loop() -> None:
    rng = random.Random(4)
    # Three copies of a paragraph: an answer restating its draft, not a loop.
    assert tail_loop(looped(rng, 500, 100, 300)) is None
    # One token 63 times: a ruler line.
    assert tail_loop(prose(rng, 500) + [7] * (MIN_SPAN - 1)) is None
    assert tail_loop(prose(rng, 500) + [7] * MIN_SPAN) is not None


def test_a_loop_the_model_left_is_not_flagged() -> None:
    rng = random.Random(5)
    assert tail_loop(looped(rng, 200, 10, 400) + prose(rng, 300)) is None


def test_periods_past_the_bound_are_not_looked_for() -> None:
    rng = random.Random(6)
    period = MAX_PERIOD + 100
    assert tail_loop(looped(rng, 0, period, 4 * period)[-WINDOW:]) is None
