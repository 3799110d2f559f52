"""One delivery of a chunk, from its receipt to its end, read top to bottom.

The delivery takes the chunk's lease (lease_book.py), reads which prompts earlier deliveries
settled (state.py), and either dead-letters the open ones (past the attempt cap,
policy.py) or has its work run them: the generate stage's `ChunkWork` hands each
result off or dead-letters it under the lease (handoff.py). It ends in exactly one way
(outcome.py), recorded in the chunk's attempts list by the lease (lease.py):
- ACKED: every prompt settled; the lease's `finish` acknowledges it;
- RETURNED: the work gave the chunk back (ChunkDeferred), not the chunk's fault;
- FAILED: an unexpected error of the work (the attempt marked failed, which the cap
  counts), a Redis outage (nothing can be recorded: its lease runs out and it comes
  back), or any other error the delivery could not settle (the task gives it back);
- DROPPED: another delivery holds the chunk (LeaseLost); this one writes nothing more.
The end is announced to the worker's hooks (hooks.py), and the Celery task maps it to
an action on the message (tasks.py). docs/design/delivery.md, Delivery protocol.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Protocol

from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.connection import OUTAGE_ERRORS
from regen.consumers.generate.chunk_life.hooks import DeliveryEvent
from regen.consumers.generate.chunk_life.lease import ChunkLease, LeaseLost
from regen.consumers.generate.chunk_life.outcome import AttemptStatus, Delivery, DeliveryEnd
from regen.consumers.generate.chunk_life.policy import ChunkDeferred, attempts_spent
from regen.consumers.generate.chunk_life.state import Attempt, read_generated

if TYPE_CHECKING:  # chunk_context.py holds a LeaseBook: imported at run time, a cycle
    from regen.consumers.generate.chunk_context import ChunkContext

log = logging.getLogger("regen.generate")


class ChunkWork(Protocol):
    """What a delivery does with its open prompts (chunk_runner.py)."""

    def run(self, lease: ChunkLease, todo: list[ChunkPrompt], done: set[str]) -> tuple[int, int]:
        """Settle every prompt of `todo` under `lease`; (handed off, dead-lettered)."""
        ...

    def dead_letter_all(
        self, lease: ChunkLease, todo: list[ChunkPrompt], done: set[str], history: list[Attempt]
    ) -> int:
        """Dead-letter `todo` (the chunk is past its attempts); how many ids settled."""
        ...


def deliver(ctx: ChunkContext, chunk: Chunk, tag: str | None, work: ChunkWork) -> Delivery:
    """Run one delivery of `chunk` (`tag`: kombu's delivery tag) and settle it."""
    ctx.count_chunks(1)
    try:
        delivery = _under_lease(ctx, chunk, tag, work)
    except OUTAGE_ERRORS as exc:  # the lease could not be taken, or its end not written
        delivery = Delivery(DeliveryEnd.FAILED, reason=f"Redis out of reach: {exc!r}", error=exc)
    except Exception as exc:
        # Anything else the delivery could not settle (the dead letters of a chunk past
        # its attempts, the lease's own writes): a failure, so that the task gives the
        # chunk back rather than let Celery ack a failed task.
        delivery = Delivery(DeliveryEnd.FAILED, reason=repr(exc), error=exc)
    finally:
        ctx.count_chunks(-1)
    ctx.hooks.emit(DeliveryEvent.AFTER_END, chunk=chunk, delivery=delivery)
    return delivery


def _under_lease(ctx: ChunkContext, chunk: Chunk, tag: str | None, work: ChunkWork) -> Delivery:
    lease, history = ctx.leases.start(chunk.job, chunk.chunk_id, tag, ctx.worker)
    try:
        return _settle(ctx, lease, chunk, history, work)
    except LeaseLost as exc:
        # Another delivery holds the chunk (this worker was frozen or cut off past its
        # lease), or Redis lost writes of this one (restored from an older copy: the
        # chunk comes back): this run's results from then on were not written.
        lease.record_lost(ctx.redis, ctx.worker)
        return Delivery(DeliveryEnd.DROPPED, reason=str(exc))
    finally:
        ctx.leases.release(lease)


def _settle(
    ctx: ChunkContext, lease: ChunkLease, chunk: Chunk, history: list[Attempt], work: ChunkWork
) -> Delivery:
    done = read_generated(ctx.redis, chunk)
    todo = [p for p in chunk.prompts if not done.issuperset(p.accounted_ids)]
    spent = attempts_spent(history, lease.attempt, ctx.max_attempts)
    if spent is not None:
        log.error(
            "chunk %s: %d deliveries died or failed; dead-lettering its %d open prompts",
            chunk.chunk_id,
            spent,
            len(todo),
        )
        dead_lettered = work.dead_letter_all(lease, todo, done, history)
        lease.finish(ctx.redis, ctx.worker, AttemptStatus.DEAD_LETTERED)
        return Delivery(DeliveryEnd.ACKED, 0, len(done), dead_lettered)
    try:
        generated, dead_lettered = work.run(lease, todo, done)
    except LeaseLost:
        raise  # nothing to record: the chunk is another's
    except OUTAGE_ERRORS as exc:  # nothing can be recorded: its lease runs out, it comes back
        return Delivery(DeliveryEnd.FAILED, reason=f"Redis out of reach: {exc!r}", error=exc)
    except ChunkDeferred as exc:
        lease.give_back(ctx.redis, ctx.worker, AttemptStatus.RETURNED)
        return Delivery(DeliveryEnd.RETURNED, reason=str(exc))
    except Exception as exc:
        lease.give_back(ctx.redis, ctx.worker, AttemptStatus.FAILED, error=repr(exc))
        return Delivery(DeliveryEnd.FAILED, reason=repr(exc), error=exc)
    ctx.hooks.emit(DeliveryEvent.BEFORE_ACK, chunk=chunk)
    lease.finish(ctx.redis, ctx.worker)
    return Delivery(DeliveryEnd.ACKED, generated, len(done), dead_lettered)
