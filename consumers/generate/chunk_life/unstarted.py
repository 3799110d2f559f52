"""Giving back the prompts of a chunk its worker cannot start soon.

A worker holds a delivered chunk whole, but its engine starts only as many prompts as
it has free slots. A prompt it holds and cannot start waits in the worker, where no
other worker can take it: with a 64-prompt chunk on a 32-slot server, half the chunk
waits minutes at real answer lengths while a faster server idles. So a delivery starts
what its worker can start soon (chunk_context.py's `reserve`, flow_control.py's measure) and
gives the rest back to the queue as new chunks of at most GIVEN_BACK_CHUNK_SIZE
prompts, in one lease-checked script that also marks them settled for this chunk
(state.py): every prompt is then open in exactly one chunk, and a redelivery of this
one skips them (docs/design/placement.md, "Only what can start soon").

Only prompts that were never sent to an engine move, so no GPU time is thrown away.
A chunk of conversations (`--turns all`) keeps every prompt: a conversation's progress
is checkpointed under its chunk's id.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis

from regen.common import crashpoints, defaults
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.chunk_message import ChunkMessages
from regen.consumers.generate.chunk_life.lease import ChunkLease, QueuedChunk

# Crash point (common/crashpoints.py): prompts given back, the kept ones not started.
AFTER_GIVE_BACK = "generate.after_give_back"


def new_chunks(
    messages: ChunkMessages, queue: str, lease: ChunkLease, chunk: Chunk,
    prompts: Sequence[ChunkPrompt],
) -> list[QueuedChunk]:  # fmt: skip
    """The chunks `prompts` go back in, rendered for `queue`. Their ids are salted with
    this delivery (chunk and attempt), so a retried give-back renders the same chunks
    and they never meet the bookkeeping of another chunk of the same prompts."""
    size = defaults.GIVEN_BACK_CHUNK_SIZE
    queued = []
    for start in range(0, len(prompts), size):
        piece = list(prompts[start : start + size])
        salt = f"{chunk.chunk_id}/{lease.attempt}"
        chunk_id = Chunk.make_id(chunk.job, [p.id for p in piece], salt=salt)
        payload = Chunk(chunk.job, chunk_id, piece, chunk.sampling).to_payload()
        # Only the queue's push: Celery's task-sent event (off unless configured) is
        # not sent for a chunk regen splits.
        ((queue_list, message),) = messages.render(chunk_id, payload, queue).pushes
        queued.append(QueuedChunk(chunk_id, len(piece), queue_list, message))
    return queued


def give_back_unstarted(
    r: redis.Redis,
    messages: ChunkMessages,
    queue: str,
    lease: ChunkLease,
    chunk: Chunk,
    prompts: Sequence[ChunkPrompt],
) -> int:
    """Give `prompts` (not started, single-turn) back to `queue` in new chunks; returns
    how many chunks. Raises LeaseLost when this delivery lost the chunk (nothing
    written)."""
    if any(p.conversation is not None for p in prompts):
        raise ValueError("a conversation stays with its chunk: its turns are checkpointed there")
    queued = new_chunks(messages, queue, lease, chunk, prompts)
    lease.give_back_unstarted(r, [p.id for p in prompts], queued)
    crashpoints.hit(AFTER_GIVE_BACK)
    return len(queued)
