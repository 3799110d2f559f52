"""How many chunks a generate worker holds: enough to keep its engine's slots full, and
no prompt more than it can start soon.

A prompt a worker holds but cannot start waits in the worker, not on the queue, where
another worker with a free slot (a faster server) could have taken it; at real answer
lengths such a prompt waits minutes (docs/design/limits.md, "Timers at real lengths"). So a
worker takes a new chunk only while its outstanding prompts (submitted, not finished)
are fewer than its engine's capacity (the in-flight limits of its healthy servers) plus
a small slack: the prompts its slots finish within REFILL_S at the rate it measures,
which covers a chunk's fetch, and at least MIN_SLACK. Over that it holds one chunk
fewer than it has, so a chunk that ends is not replaced until prompts run short again.

Celery's prefetch limit is the lever: kombu delivers while fewer chunks are held than
it, so the limit is set to what is held plus the chunks that cover the shortfall, or
one below what is held. bench/generate_utilization.py and bench/long_generations.py
measure the result.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

from celery import bootsteps

from regen.consumers.generate.chunk_context import ChunkContext

log = logging.getLogger("regen.generate")

ADJUST_INTERVAL_S = 0.5
# Prompts waiting in the worker cover the slots that free over this long: a chunk
# asked for arrives within it (one adjustment tick and a Redis round trip or two).
REFILL_S = 2.0
# At least this many wait, however slowly slots free (a first answer has no rate yet).
MIN_SLACK = 2
# And at most this many times the capacity, however fast they free.
MAX_SLACK_RATIO = 2.0
# After a delivery gave prompts back to other workers' idle slots (held_prompts.py) the
# worker keeps no slack this long: only its own freed slots take a chunk, so the peers,
# whose idle slots the give-back claimed, take the new chunks off the queue (they look
# every ADJUST_INTERVAL_S), not the giver (a prompt run again where it waited).
HOLD_OFF_S = 3.0


def slack(capacity: int, prompts_per_s: float, within_s: float = REFILL_S) -> int:
    """Prompts a worker keeps waiting beyond its engine's slots: those they free
    within `within_s`."""
    wanted = math.ceil(prompts_per_s * within_s)
    return max(MIN_SLACK, min(wanted, int(capacity * MAX_SLACK_RATIO)))


def keeps_slack(ctx: ChunkContext, peers_idle: bool, now: float) -> bool:
    """Whether the worker may hold prompts beyond its slots now: not while another
    worker has idle slots, nor for HOLD_OFF_S after it gave prompts back to one (the
    give-back claimed those slots, so they no longer show as idle here)."""
    return not peers_idle and now - ctx.gave_back_at >= HOLD_OFF_S


def chunk_limit(
    outstanding: int,
    capacity: int,
    held: int,
    prompts_per_s: float,
    chunk_size: int = 1,
    *,
    with_slack: bool = True,
) -> int:
    """The limit on chunks held, now holding `held` with `outstanding` prompts: more
    while they are fewer than capacity + slack, else one fewer than held (at least 1:
    Celery reads 0 as no limit). Without slack (`keeps_slack`: another worker has idle
    slots, or was just given prompts) a chunk is taken only for slots free here, since
    prompts waiting here are prompts an idle worker could be running. With no healthy
    server (capacity 0) nothing is taken (the queue gate has stopped consumption
    anyway)."""
    if capacity <= 0:
        return max(1, held)
    spare = slack(capacity, prompts_per_s) if with_slack else 0
    shortfall = capacity + spare - outstanding
    if shortfall > 0:
        return held + math.ceil(shortfall / max(chunk_size, 1))
    return max(1, held - 1)


def make_flow_control(
    ctx: ChunkContext,
    capacity: Callable[[], int],
    initial: int,
    ceiling: int,
    chunk_size: int,
    peers_idle: Callable[[], bool] = lambda: False,
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
            target = chunk_limit(
                ctx.outstanding, capacity(), ctx.chunks_held, ctx.prompts.rate(), chunk_size,
                with_slack=keeps_slack(ctx, peers_idle(), time.monotonic()),
            )  # fmt: skip
            target = min(target, ceiling)
            if target > qos.value:
                qos.increment_eventually(target - qos.value)
            elif target < qos.value:
                qos.decrement_eventually(qos.value - target)
            ctx.chunk_limit = qos.value

    return FlowControl
