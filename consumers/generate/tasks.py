"""The Celery task of the generate stage: a thin shell around chunk_runner."""

from __future__ import annotations

import logging
import time
from typing import Any

from celery import Celery
from celery.exceptions import Reject

from regen.common.celery_app import GENERATE_TASK
from regen.common.chunk import Chunk
from regen.consumers.generate.chunk_life import (
    REQUEUE_PAUSE_S,
    ChunkDeferred,
    LeaseLost,
    make_request_class,
)
from regen.consumers.generate.chunk_runner import run_chunk
from regen.consumers.generate.context import ChunkContext

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
        try:
            outcome = run_chunk(ctx, chunk, tag)
        except LeaseLost as exc:
            # Another delivery holds the chunk (this worker was frozen or cut off past its
            # lease), or Redis lost writes of this one (restored from an older copy: the
            # chunk comes back): this run's results from then on were not written.
            log.warning("chunk %s: dropped: %s", chunk.chunk_id, exc)
            return {"generated": 0, "skipped": 0, "dead_lettered": 0, "dropped": 1}
        except ChunkDeferred as exc:
            log.warning("chunk %s: giving it back: %s", chunk.chunk_id, exc)
            # `from None`: Celery logs every Reject with its traceback, and the chained
            # one says nothing the line above does not (an outage gives back each chunk).
            raise Reject(f"given back: {exc}", requeue=True) from None
        except Exception as exc:
            # Give the chunk back rather than let Celery ack a failure (acks_late acks
            # failed tasks): run_chunk has expired its lease for the next sweep, or else
            # Celery requeues it. The attempt cap turns a chunk that always fails into
            # dead letters; the pause keeps a persistent error from spinning.
            log.exception("chunk %s failed; returning it to the queue", chunk.chunk_id)
            time.sleep(REQUEUE_PAUSE_S)
            raise Reject(repr(exc), requeue=True) from None  # the traceback is logged above
        log.info(
            "chunk %s of %s: %d generated, %d already done, %d dead-lettered",
            chunk.chunk_id,
            chunk.job,
            outcome.generated,
            outcome.skipped,
            outcome.dead_lettered,
        )
        return {
            "generated": outcome.generated,
            "skipped": outcome.skipped,
            "dead_lettered": outcome.dead_lettered,
        }
