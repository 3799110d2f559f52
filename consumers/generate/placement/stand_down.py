"""Leaving a job's last prompts to faster servers (docs/design/placement.md, "Faster servers take
the end").

A prompt started on a slow server near a job's end holds the job's end: at 80 ms per
token a 4,000-token answer runs 320 s there, where a server four times faster, whose
slots free every second or so, would have started it within its backlog and run it in
80 s. So a worker whose peers on a queue decode faster stops taking the queue's prompts
once those peers would finish all that is queued sooner than a long answer would run
here:

    queued prompts < T x (1/v - 1/u) x long/mean

T: the faster peers' throughput when full (their slots times their per-request speed,
tokens/s); v: this worker's per-request speed, u: theirs (slot-weighted); long/mean: the
LONG_QUANTILE answer over the mean one (answer_stats.py). The left side over T/mean is
how long the faster peers take to start what is queued; the right side over T/mean, how
much later a long answer ends here than there. Nothing is thrown away: the worker takes
no new chunk of the queue (the queue gate drops it, and its heartbeat stops listing it,
so no peer gives prompts back for its idle slots), starts none of the prompts it holds
and gives them back (held_prompts.py); what it runs finishes. With no faster peer (one
server, or a fleet of one speed) the bound is 0 and nothing changes.

Queued prompts are read as queued chunks times the job's chunk size: an upper bound (a
chunk given back holds fewer), so the reading errs towards the worker staying. While a
producer publishes the job's rows it refills the queue to its high-water mark whatever
is left of the job: no stand-down then (producer/publishing_mark.py). A worker that left
a queue stays away until a producer publishes the job's rows again or no faster peer is
left (dead, unhealthy, or gone to another job): the prompts it gives back as it leaves
fill the queue again, in small chunks that would read as whole ones, and reading them
as new work took the queue back a second later (the bench's first run: 20 prompts run
by the worker that gave them back).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence

import redis

from regen.common import keys
from regen.common.queues import publishing, queued_chunks
from regen.consumers.generate.placement.answer_stats import AnswerStats
from regen.consumers.generate.placement.peers import PeerRoom, PeerView

log = logging.getLogger("regen.generate")

# A peer counts as faster only when its requests decode this much faster: two servers of
# one kind measure within a few percent of each other, and must never stand each other
# down.
FASTER = 1.25
# How often the worker looks: once a second, a few commands whatever the job's size.
LOOK_S = 1.0


def leave_below(faster: Sequence[PeerRoom], my_tps: float, long_over_mean: float) -> float:
    """The queued prompts below which `faster` peers finish them all sooner than a long
    answer would run on a server decoding `my_tps` per request (0: no faster peer)."""
    slots = sum(p.slots for p in faster)
    throughput = sum(p.slots * (p.decode_tps or 0.0) for p in faster)
    if slots <= 0 or throughput <= 0 or my_tps <= 0:
        return 0.0
    their_tps = throughput / slots
    return max(0.0, throughput * (1 / my_tps - 1 / their_tps) * long_over_mean)


class StandDown(threading.Thread):
    """Decides, once every LOOK_S, which of the worker's queues it leaves to faster
    peers; `left()` and `leaves()` read the last decision."""

    def __init__(
        self,
        r: redis.Redis,
        peers: PeerView,
        answers: AnswerStats,
        queues: Callable[[], set[str]],
        chunk_size: Callable[[str], int],
    ) -> None:
        """`queues()`: those the worker would consume; `chunk_size(job)`: the job's."""
        super().__init__(name="regen-stand-down", daemon=True)
        self._r = r
        self._peers = peers
        self._answers = answers
        self._queues = queues
        self._chunk_size = chunk_size
        self._lock = threading.Lock()
        self._left: set[str] = set()
        self._stop_event = threading.Event()

    def left(self) -> set[str]:
        with self._lock:
            return set(self._left)

    def leaves(self, queue: str) -> bool:
        with self._lock:
            return queue in self._left

    def run(self) -> None:
        while not self._stop_event.wait(LOOK_S):
            try:
                self.look()
            except redis.RedisError as exc:
                # Out of reach: take every queue, as a worker without this would.
                log.warning("stand-down look failed (%s); taking every queue", exc)
                with self._lock:
                    self._left = set()

    def stop(self) -> None:
        self._stop_event.set()

    def look(self) -> None:
        """Decide for each queue the worker consumes whether it leaves it now."""
        my_tps = self._answers.decode_tps()
        long_over_mean = self._answers.long_over_mean()
        bounds: dict[str, float] = {}  # not measured yet: nothing to compare
        if my_tps is not None and long_over_mean is not None:
            bounds = self._bounds(my_tps, long_over_mean)
        with self._lock:
            before, self._left = self._left, set(bounds)
        for queue in sorted(set(bounds) - before):
            # bench/long_generations.py reads these two lines off the workers' logs.
            log.info("leaving the last prompts of %s to faster servers (under %.0f queued)",
                     queue, bounds[queue])  # fmt: skip
        for queue in sorted(before - set(bounds)):
            log.info("taking %s again", queue)

    def _bounds(self, my_tps: float, long_over_mean: float) -> dict[str, float]:
        """The queues to leave now, each with the bound it is left under."""
        bounds = {}
        for queue in sorted(self._queues()):
            faster = self._peers.faster(queue, my_tps * FASTER)
            bound = leave_below(faster, my_tps, long_over_mean)
            if bound > 0 and self._leaves(queue, bound):
                bounds[queue] = bound
        return bounds

    def _leaves(self, queue: str, bound: float) -> bool:
        job = keys.job_of_queue(queue)
        if job is None or publishing(self._r, job):
            return False
        if self.leaves(queue):
            # Stays left: the queue grows by the prompts this worker gave back as it
            # left, prompts already counted, in chunks of at most 8 that would read as
            # whole ones.
            return True
        return queued_chunks(self._r, queue) * self._chunk_size(job) < bound
