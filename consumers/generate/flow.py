"""How many chunks a generate worker holds: enough to keep its engine full, no more.

A chunk's prompts finish over time and its slowest one holds it open; with a long-tailed
spread of answer lengths most held chunks are mostly done. A fixed number of chunks
therefore either starves the server (tails) or hoards the queue. Instead the worker
watches its outstanding prompts (submitted, not finished) against the engine's
capacity and moves Celery's prefetch limit: up by the chunks that cover the shortfall
while fewer than LOW times its slots are outstanding and every allowed chunk is held,
down one chunk at a time while more than HIGH times its slots are.
bench/generate_utilization.py measures the result.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from regen.consumers.generate.context import ChunkContext

log = logging.getLogger("regen.generate")

ADJUST_INTERVAL_S = 0.5
# Outstanding prompts are kept between LOW and HIGH times the engine's capacity: above
# 1, so prompts wait in the worker for each slot that frees (a chunk takes a moment to
# arrive), and a HIGH well above LOW, so the limit does not oscillate.
LOW, HIGH = 1.5, 3.0


def chunk_limit_change(
    outstanding: int, capacity: int, held: int, limit: int, chunk_size: int = 1
) -> int:
    """How to move the limit on chunks held (`limit`, now holding `held`): up by the
    chunks that cover the shortfall (a fast ramp at start), down by one."""
    if capacity <= 0:
        return 0  # no healthy server: the queue gate has stopped consumption anyway
    shortfall = capacity * LOW - outstanding
    if shortfall > 0 and held >= limit:
        return max(1, int(shortfall // max(chunk_size, 1)))
    if outstanding > capacity * HIGH and limit > 1:
        return -1
    return 0


def make_flow_control(
    ctx: ChunkContext, capacity: Callable[[], int], initial: int, ceiling: int, chunk_size: int
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
            step = chunk_limit_change(
                ctx.inflight, capacity(), ctx.chunks_held, qos.value, chunk_size
            )
            if step > 0:
                qos.increment_eventually(min(step, ceiling - qos.value))
            elif step < 0:
                qos.decrement_eventually()
            ctx.chunk_limit = qos.value

    return FlowControl
