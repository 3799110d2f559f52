"""`regen enqueue` through a Redis outage (producer/outages.py), on a fake clock: it waits
with backoff, resumes in a fresh enqueuer, and its summary adds up every resumed run."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import redis

from regen.producer.enqueue_stats import EnqueueStats
from regen.producer.outages import REDIS_RETRY, run_through_outages


class ScriptedEnqueuer:
    """Reads `rows` rows, then fails with `error` (None: finishes)."""

    def __init__(self, rows: int, error: Exception | None) -> None:
        self.stats = EnqueueStats()
        self.rows, self.error = rows, error

    def run(self, datasets: list[Path], limit: int | None = None) -> EnqueueStats:
        self.stats.rows_read = self.stats.enqueued = self.rows
        if self.error is not None:
            raise self.error
        return self.stats


def scripted(*steps: tuple[int, Exception | None]) -> Any:
    queue = list(steps)

    def make() -> ScriptedEnqueuer:
        return ScriptedEnqueuer(*queue.pop(0))

    return make


def test_an_outage_is_waited_out_and_the_counts_of_every_run_add_up() -> None:
    slept: list[float] = []
    down, slow = redis.ConnectionError("primary gone"), redis.TimeoutError("still down")
    make = scripted((0, down), (0, slow), (0, down), (5, down), (3, None))
    stats = run_through_outages(make, [], sleep=slept.append)
    assert (stats.rows_read, stats.enqueued) == (8, 8)
    assert len(slept) == 4
    # The wait grows while no run gets anywhere, up to the backoff's ceiling...
    assert slept[2] >= REDIS_RETRY.ceiling(2) * (1 - REDIS_RETRY.jitter)
    assert max(slept) <= REDIS_RETRY.max_s
    # ...and a run that read rows (Redis was back) starts it again from the shortest.
    assert slept[3] <= REDIS_RETRY.ceiling(0)


def test_a_wrong_command_is_not_an_outage() -> None:
    make = scripted((1, redis.ResponseError("WRONGTYPE")), (1, None))
    with pytest.raises(redis.ResponseError):
        run_through_outages(make, [], sleep=lambda s: None)
