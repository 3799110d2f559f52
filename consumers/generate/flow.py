"""How many chunks a generate worker holds: enough to keep its engine full, no more.

A chunk's prompts finish over time and its slowest one holds it open; with a long-tailed
spread of answer lengths most held chunks are mostly done. A fixed number of chunks
therefore either starves the server (tails) or hoards the queue. Instead the worker
watches its outstanding prompts (submitted, not finished) against the engine's
capacity and moves Celery's prefetch limit one chunk at a time: up while fewer prompts
are outstanding than the engine has slots, down while more than twice as many are.
bench/generate_utilization.py measures the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from consumers.generate.chunk_runner import ChunkContext

log = logging.getLogger("regen.generate")

ADJUST_INTERVAL_S = 0.5
# Outstanding prompts are kept between LOW and HIGH times the engine's capacity.
LOW, HIGH = 1.0, 2.0


def chunk_limit_change(outstanding: int, capacity: int, held: int, limit: int) -> int:
    """+1, -1 or 0: how to move the limit on chunks held (`limit`, now holding `held`)."""
    if capacity <= 0:
        return 0  # no healthy server: the queue gate has stopped consumption anyway
    if outstanding < capacity * LOW and held >= limit:
        return 1
    if outstanding > capacity * HIGH and limit > 1:
        return -1
    return 0


def make_flow_control(
    ctx: ChunkContext, capacity: Callable[[], int], initial: int, ceiling: int
) -> type[bootsteps.StartStopStep]:
    class FlowControl(bootsteps.StartStopStep):
        """Moves the consumer's prefetch limit on its own loop (kombu is not thread-safe)."""

        requires = ("celery.worker.consumer.tasks:Tasks",)

        def start(self, consumer: Any) -> None:
            # Celery starts at one chunk per thread; begin lower and let demand raise it.
            consumer.qos.value = initial
            consumer.qos.update()
            consumer.timer.call_repeatedly(ADJUST_INTERVAL_S, self.adjust, (consumer,))

        def adjust(self, consumer: Any) -> None:
            qos = consumer.qos
            step = chunk_limit_change(ctx.inflight, capacity(), ctx.chunks_held, qos.value)
            if step > 0 and qos.value < ceiling:
                qos.increment_eventually()
            elif step < 0:
                qos.decrement_eventually()
            ctx.chunk_limit = qos.value

    return FlowControl
