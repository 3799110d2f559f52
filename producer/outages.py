"""`regen enqueue` through a Redis outage or failover: wait it out and resume.

The producer is built to be rerun: cursors, chunk ids and prompt ids are in Redis, and
each publish is one script, so a run cut off at any instant and started again continues
where it stopped, enqueueing nothing twice (docs/design/producer.md, Atomic publish). A Redis outage
(restart, a Sentinel failover: docs/operations.md) is therefore waited out by starting
the run again in-process, as a supervisor would, instead of exiting.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from regen.common.backoff import REDIS_RETRY
from regen.common.connection import OUTAGE_ERRORS, raise_if_refused
from regen.producer.enqueue import Enqueuer
from regen.producer.enqueue_stats import EnqueueStats

log = logging.getLogger("regen.enqueue")
T = TypeVar("T")
# Counts that add up across the resumed runs; the others describe the last one.
_SUMMED = ("rows_read", "enqueued", "duplicates", "rejected", "chunks", "already_settled",
           "conversations_resumed")  # fmt: skip


def run_through_outages(
    make: Callable[[], Enqueuer],
    datasets: list[Path],
    limit: int | None = None,
    sleep: Callable[[float], None] = time.sleep,
) -> EnqueueStats:
    """Run a fresh `make()` over the datasets until one finishes; the stats of all the
    runs together (the rows a resumed run skips were counted by the one before)."""
    runs: list[EnqueueStats] = []
    failures = 0
    while True:
        enqueuer: Enqueuer | None = None
        try:
            enqueuer = make()  # its Celery producer connects: inside the outage's reach
            stats = enqueuer.run(datasets, limit=limit)
            break
        except OUTAGE_ERRORS as exc:
            raise_if_refused(exc)
            if enqueuer is not None:
                runs.append(enqueuer.stats)
                if enqueuer.stats.rows_read:
                    failures = 0  # it got somewhere: Redis was back
            delay = REDIS_RETRY.delay(failures)
            failures += 1
            log.warning("Redis unreachable (%s); resuming in %.1f s", exc, delay)
            sleep(delay)
    last = stats
    for name in _SUMMED:
        setattr(last, name, sum(getattr(run, name) for run in [*runs, stats]))
    return last


def wait_out_outages(
    call: Callable[[], T], what: str, sleep: Callable[[float], None] = time.sleep
) -> T:
    """`call()`, called again with backoff while Redis is unreachable: for the steps
    around a run (storing the spec at start-up, a follower's first pass) that a Redis
    restart or failover may hit as well. `call` must be safe to repeat."""
    failures = 0
    while True:
        try:
            return call()
        except OUTAGE_ERRORS as exc:
            raise_if_refused(exc)
            delay = REDIS_RETRY.delay(failures)
            failures += 1
            log.warning("Redis unreachable (%s) while %s; trying again in %.1f s",
                        exc, what, delay)  # fmt: skip
            sleep(delay)
