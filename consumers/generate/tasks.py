"""The Celery task of the generate stage: it runs a chunk's delivery (chunk_runner.py,
chunk_life/delivery.py) and maps how the delivery ended to Celery's action on the
message."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery
from celery.exceptions import Reject

from regen.common.celery_app import GENERATE_TASK
from regen.common.chunk import Chunk
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import (
    REQUEUE_PAUSE_S,
    DeliveryEnd,
    make_request_class,
)
from regen.consumers.generate.chunk_runner import run_chunk

log = logging.getLogger("regen.generate")


def register(app: Celery, ctx: ChunkContext) -> None:
    """Bind the generate task to `app`, running chunks in `ctx` (this process's engine)."""

    @app.task(
        name=GENERATE_TASK,
        bind=True,
        acks_late=True,
        ignore_result=True,
        Request=make_request_class(ctx.leases),
    )
    def generate_chunk(self: Any, payload: dict[str, Any]) -> dict[str, int]:
        # Only chunks for this queue get here: the worker's transport dead-letters any
        # other message before delivering it (poison.py).
        chunk = Chunk.from_payload(payload)
        # kombu's delivery tag: the key of the delivery in its unacked keys (the lease).
        tag = (self.request.properties or {}).get("delivery_tag")
        delivery = run_chunk(ctx, chunk, tag)
        if delivery.end is DeliveryEnd.RETURNED:
            log.warning("chunk %s: giving it back: %s", chunk.chunk_id, delivery.reason)
            raise Reject(f"given back: {delivery.reason}", requeue=True)
        if delivery.end is DeliveryEnd.FAILED:
            # Give the chunk back rather than let Celery ack a failure (acks_late acks
            # failed tasks): the delivery has expired its lease for the next sweep, or
            # else Celery requeues it. The attempt cap turns a chunk that always fails
            # into dead letters; the pause keeps a persistent error from spinning.
            log.error("chunk %s failed; returning it to the queue", chunk.chunk_id,
                      exc_info=delivery.error)  # fmt: skip
            time.sleep(REQUEUE_PAUSE_S)
            raise Reject(delivery.reason, requeue=True)
        if delivery.end is DeliveryEnd.DROPPED:
            log.warning("chunk %s: dropped: %s", chunk.chunk_id, delivery.reason)
        else:
            log.info(
                "chunk %s of %s: %d generated, %d already done, %d dead-lettered",
                chunk.chunk_id,
                chunk.job,
                delivery.generated,
                delivery.skipped,
                delivery.dead_lettered,
            )
        return {
            "generated": delivery.generated,
            "skipped": delivery.skipped,
            "dead_lettered": delivery.dead_lettered,
        }
