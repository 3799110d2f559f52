"""Exponential backoff, the one formula behind every wait-and-retry in regen: a request
an SGLang server failed, a server that refused work, a down server's health probe, an
engine that is unavailable, and a process waiting out a Redis outage (REDIS_RETRY).

The n-th wait (n from 0) is at most `base_s * 2**n`, capped at `max_s`; `jitter` is the
share of it drawn at random, so a fleet of retries does not stampede: 1.0 waits anywhere
up to the ceiling ("full jitter"), 0.5 at least half of it, 0 exactly the ceiling.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# 2**60 times any base is past every cap; a longer streak would only overflow a float.
_MAX_EXPONENT = 60


@dataclass(frozen=True)
class Backoff:
    base_s: float
    max_s: float
    jitter: float = 1.0

    def __post_init__(self) -> None:
        if not (self.base_s > 0 and self.max_s > 0 and 0 <= self.jitter <= 1):
            raise ValueError("backoff needs base_s and max_s above 0 and jitter in [0, 1]")

    def ceiling(self, attempt: int) -> float:
        """The longest wait after `attempt` earlier failures."""
        return min(self.max_s, self.base_s * 2 ** min(attempt, _MAX_EXPONENT))

    def delay(self, attempt: int) -> float:
        """How long to wait after `attempt` earlier failures."""
        return self.ceiling(attempt) * random.uniform(1 - self.jitter, 1)


# Waits between tries while Redis is unreachable, in every process (a chunk's write under
# its lease, a tokenize commit, the producer's publish and follow passes).
REDIS_RETRY = Backoff(base_s=0.5, max_s=30.0, jitter=0.5)
