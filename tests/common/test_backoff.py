"""The one backoff formula: doubling from the base up to the cap, jitter within bounds."""

from __future__ import annotations

import pytest

from regen.common.backoff import Backoff


def test_the_ceiling_doubles_from_the_base_up_to_the_cap() -> None:
    backoff = Backoff(base_s=0.5, max_s=3.0)
    assert [backoff.ceiling(n) for n in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    assert backoff.ceiling(10_000) == 3.0  # a long streak never overflows


@pytest.mark.parametrize(("jitter", "low"), [(1.0, 0.0), (0.5, 2.0), (0.0, 4.0)])
def test_jitter_draws_within_its_share_of_the_ceiling(jitter: float, low: float) -> None:
    backoff = Backoff(base_s=1.0, max_s=60.0, jitter=jitter)
    delays = [backoff.delay(2) for _ in range(500)]
    assert all(low <= d <= 4.0 for d in delays)
    assert (max(delays) - min(delays) > 1.0) == (jitter > 0)


def test_a_backoff_that_cannot_wait_is_refused() -> None:
    for bad in ({"base_s": 0, "max_s": 1}, {"base_s": 1, "max_s": 1, "jitter": 2}):
        with pytest.raises(ValueError, match="backoff needs"):
            Backoff(**bad)
