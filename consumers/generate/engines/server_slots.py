"""How many requests an SGLang server runs at once, as its /metrics show it: what a
worker's flow control may count on being started soon (flow_control.py).

An in-flight limit (`--max-inflight auto` starts at 256 and sheds only as requests
drain) can be far above a server's running slots; requests beyond them wait in the
server's queue, and at real answer lengths they wait minutes that a faster server could
have used (docs/design/limits.md, "Timers at real lengths"). So while a server has a queue,
what it runs is its slots (or what its KV cache fits): the most it ran lately with a
queue. Before it was ever seen with a queue, it is trusted for GROWTH times the most it
was seen running, at least START: a slow start that finds the slots within a few polls
and overshoots them by at most half. Once a queue showed them, a worker sends no more
than the slots (docs/design/placement.md, "Only what can start soon"), so the queue goes and its
readings age out; then the server is probed only PROBE over what it runs or ran with a
queue, not half as many again, each time the window empties. Before the first reading
of a server whose /metrics will be read (`--max-inflight auto`), it is trusted for START
too: a worker's first chunk arrives before that reading, and trusting the in-flight
limit then (256) sent a whole job's worth of prompts into one server's queue before a
second worker joined. A server without /metrics is trusted for its limit.
"""

from __future__ import annotations

import math
from collections import deque

START = 16
GROWTH = 1.5
# Readings kept: a server's slots do not change, but what its KV cache fits does.
WINDOW_S = 60.0
# Once its slots are known, a server is probed for more (a KV cache that fits more
# now) this share over them at a time, at least one request.
PROBE = 0.1


class SlotEstimate:
    def __init__(self) -> None:
        self._readings: deque[tuple[float, float, bool]] = deque()  # (when, running, queue?)
        self._awaited = False
        # What it ran at once when a queue last showed (None: never seen with a queue).
        self._slots: int | None = None

    def expect_readings(self) -> None:
        """The server's /metrics will be read: until then, trust it for START."""
        self._awaited = True

    def no_readings(self) -> None:
        """Its /metrics did not answer usably: without readings, trust its limit."""
        self._awaited = False

    def observe(self, running: float, queued: float, now: float) -> None:
        self._readings.append((now, running, queued > 0))
        if queued > 0:
            self._slots = max(1, math.ceil(running))
        while self._readings and self._readings[0][0] < now - WINDOW_S:
            self._readings.popleft()

    def estimate(self) -> int | None:
        """Requests the server runs at once; None (its limit) without readings, unless
        they are awaited."""
        if not self._readings:
            return START if self._awaited else None
        saturated = [running for _, running, queue in self._readings if queue]
        if saturated:
            return max(1, math.ceil(max(saturated)))
        seen = max(running for _, running, _ in self._readings)
        grown = max(START, math.ceil(seen * GROWTH))
        if self._slots is not None:
            # Slots known once, the queue gone because the worker sends no more than
            # them: probe a few over, not half as many again (a third of them would wait
            # in this server's queue, where no other worker reaches them).
            probe = max(1, math.ceil(self._slots * PROBE))
            grown = min(grown, max(math.ceil(seen), self._slots) + probe)
        return grown
