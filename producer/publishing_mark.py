"""A key that says a producer is publishing a job's rows, set while `regen enqueue`
reads them and kept alive by the producer's own loop.

While it is set, the job's queue is not all that is left of the job: the producer
refills it up to its high-water mark. A generate worker that leaves a job's last
prompts to faster servers (consumers/generate/placement/stand_down.py) must not take a throttled
producer's queue for the job's end. A producer that dies leaves the key to expire.
"""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable

import redis

from regen.common import keys

# The key outlives a producer by at most this long; renewed every RENEW_S, so a row
# loop that stalls on one large window (reading and ordering 8,192 rows) keeps it.
TTL_S = 60
RENEW_S = 10.0


class PublishingMark:
    """The job's publishing key, renewed at most every RENEW_S by `renew_if_due`."""

    def __init__(
        self, r: redis.Redis, job: str, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._r = r
        self._key = keys.job_publishing(job)
        self._clock = clock
        self._renewed = float("-inf")

    def renew_if_due(self) -> None:
        now = self._clock()
        if now - self._renewed >= RENEW_S:
            self._r.set(self._key, socket.gethostname(), ex=TTL_S)
            self._renewed = now

    def clear(self) -> None:
        """The producer is done; Redis out of reach leaves the key to expire."""
        with contextlib.suppress(redis.RedisError):
            self._r.delete(self._key)
        self._renewed = float("-inf")
