"""What a generate worker's recent answers say about its server: how fast one request
decodes there, and how much longer than the mean its long answers run.

Its heartbeat carries the speed, so that a worker on a slow server can see that a
faster peer would finish a job's last prompts sooner (stand_down.py); the long answers'
ratio sizes how early it leaves them.
"""

from __future__ import annotations

import threading
from collections import deque

from regen.consumers.generate.engines.sglang_pool import SPEED_MIN_TOKENS

# The answers looked at: recent enough to follow a server that slows or speeds up, many
# enough for a stable 90th percentile.
WINDOW = 256
# Neither figure is given from fewer answers than this (a first answer or two say little).
MIN_ANSWERS = 8
# The long answer a stand-down plans for: this quantile of the recent answers' lengths.
LONG_QUANTILE = 0.9


class AnswerStats:
    """The output tokens and latency of this worker's last WINDOW answers."""

    def __init__(self, window: int = WINDOW) -> None:
        self._answers: deque[tuple[int, float]] = deque(maxlen=window)
        self._lock = threading.Lock()

    def add(self, tokens: int, seconds: float) -> None:
        with self._lock:
            self._answers.append((tokens, seconds))

    def decode_tps(self) -> float | None:
        """Output tokens per second of one request (its queue wait included), over the
        recent answers long enough to tell (SPEED_MIN_TOKENS: a shorter one's latency is
        mostly the request's overhead); None until there are MIN_ANSWERS of them."""
        with self._lock:
            timed = [(t, s) for t, s in self._answers if t >= SPEED_MIN_TOKENS and s > 0]
        if len(timed) < MIN_ANSWERS:
            return None
        return sum(t for t, _ in timed) / sum(s for _, s in timed)

    def long_over_mean(self) -> float | None:
        """The LONG_QUANTILE answer length over the mean one (1 where all are alike);
        None until there are MIN_ANSWERS answers."""
        with self._lock:
            lengths = sorted(t for t, _ in self._answers)
        if len(lengths) < MIN_ANSWERS:
            return None
        mean = sum(lengths) / len(lengths)
        if mean <= 0:
            return None
        long = lengths[min(len(lengths) - 1, int(LONG_QUANTILE * len(lengths)))]
        return max(1.0, long / mean)
