"""Committing a delivery's work under its chunk's lease: the one path by which the
single-turn work (chunk_runner.py) and the turn driver (turns.py) hand results off,
dead-letter prompts and turns, and so decide what a delivery may still write.

Every write goes through the delivery's `ChunkLease` (lease.py), whose check runs in
the same transaction or script as the write: a delivery that lost its chunk (frozen
past its lease, or its writes lost to a Redis rollback) writes nothing, and a Redis
outage is waited out for up to one lease. The acknowledgement is the lease's too
(`ChunkLease.finish`), so nothing a chunk writes bypasses the check (docs/design/delivery.md,
Delivery protocol).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import redis

from regen.common import keys
from regen.common.chunk import Chunk
from regen.common.results import GeneratedResult
from regen.consumers.generate.chunk_life.hooks import DeliveryEvent
from regen.consumers.generate.chunk_life.lease import Checkpoint, ChunkLease, HandOff

if TYPE_CHECKING:  # chunk_context.py holds a LeaseBook: imported at run time, a cycle
    from regen.consumers.generate.chunk_context import ChunkContext


def hand_off(
    ctx: ChunkContext,
    lease: ChunkLease,
    chunk: Chunk,
    results: Sequence[GeneratedResult],
    checkpoints: Sequence[Checkpoint | None] | None = None,
) -> list[bool]:
    """Hand results to the tokenize stage, each with its prompt's mark (and, for a turn,
    its conversation's checkpoint), in one lease-checked script; per result, whether it
    was handed off now (False: settled already, by a retry of this same write whose
    reply was lost). Raises LeaseLost."""
    marks = checkpoints or [None] * len(results)
    batch = [
        HandOff(result.id, result.encode(), checkpoint)
        for result, checkpoint in zip(results, marks, strict=True)
    ]
    fresh = lease.hand_off(ctx.redis, keys.results_stream(chunk.job), batch)
    ctx.hooks.emit(DeliveryEvent.AFTER_HAND_OFF, chunk=chunk, results=results)
    for result, is_fresh in zip(results, fresh, strict=True):
        if is_fresh:
            # A resumed answer's first tokens were decoded elsewhere (resume.py); its
            # tail alone would skew the answer lengths the worker measures.
            ctx.tokens.add(result.completion_tokens - result.resumed_tokens)
            ctx.prompts.add()
            if not result.resumed_tokens:
                ctx.answers.add(result.completion_tokens, result.latency_s)
    return fresh


def write_dead_letters(
    ctx: ChunkContext,
    lease: ChunkLease,
    fill: Callable[[redis.client.Pipeline], int],
    prompt_id: str | None = None,
) -> int:
    """Run `fill` (dead letters and their `generated` marks) in one lease-checked MULTI;
    returns what `fill` counted, 0 when `prompt_id` was settled already (a retry).
    Raises LeaseLost."""
    counted = 0

    def run(pipe: redis.client.Pipeline) -> None:
        nonlocal counted
        counted = fill(pipe)

    return counted if lease.write(ctx.redis, run, prompt_id=prompt_id) else 0
