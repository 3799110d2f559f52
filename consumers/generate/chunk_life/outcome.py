"""How a chunk's attempt is recorded and how a delivery ends, each an enum beside the
code that moves it (as rq keeps a job's states in rq/job.py).

`AttemptStatus` is an entry of the chunk's attempts list in Redis (state.py): its
values are stored, so they never change. `DeliveryEnd` is what one delivery came to;
the Celery task maps it to an action on the message (tasks.py) and the worker's metrics
count it (metrics.py, through the delivery's hooks).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class AttemptStatus(str, Enum):
    STARTED = "started"  # running, or its worker died (policy.attempts_spent counts it)
    DONE = "done"  # every prompt settled, the delivery acknowledged
    DEAD_LETTERED = "dead_lettered"  # past the attempt cap: its open prompts dead-lettered
    RETURNED = "returned"  # given back to the queue, not the chunk's fault
    FAILED = "failed"  # given back after an error: counts toward the attempt cap
    LOST = "lost"  # another delivery holds the chunk: this one wrote nothing more


class DeliveryEnd(str, Enum):
    ACKED = "acked"  # every prompt handed off or dead-lettered: Celery acknowledges
    RETURNED = "returned"  # given back (a drain, no healthy server): Celery requeues
    FAILED = "failed"  # an unexpected error or a Redis outage: requeued after a pause
    DROPPED = "dropped"  # the lease was lost: another delivery holds the chunk


@dataclass(frozen=True)
class Delivery:
    """One delivery's end, with its prompts' counts."""

    end: DeliveryEnd
    generated: int = 0  # handed off by this delivery
    skipped: int = 0  # settled by an earlier delivery
    dead_lettered: int = 0
    reason: str = ""  # why it was returned, failed or dropped
    error: Exception | None = None  # what failed it
