"""Run one chunk: generate every prompt, hand each result to the tokenize stage, and
dead-letter what a healthy engine refuses.

Each result is handed off (XADD on the job's results stream) in the same script that
marks the prompt generated for this chunk (the results finished by then go together,
one round trip), so a redelivered chunk (its worker died,
or was frozen past its lease) skips the prompts already handed off. Every such write
goes through chunk_life (its handoff.py) and checks, in its transaction, that this
delivery still holds the chunk's lease: a worker that lost it drops its results. The delivery is
acknowledged only after every prompt is in the results stream or the DLQ
(docs/design.md, Delivery protocol). A chunk of conversations (`--turns all`) runs each
one's turns in order (turns.py), each turn settled through the same commit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
from dataclasses import dataclass
from typing import Any, cast

import redis

from regen.common import crashpoints, defaults
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.connection import OUTAGE_ERRORS
from regen.consumers.generate.chunk_life import (
    BEFORE_ACK,
    Attempt,
    ChunkDeferred,
    ChunkLease,
    LeaseLost,
    attempts_spent,
    hand_off,
    read_generated,
    write_dead_letters,
)
from regen.consumers.generate.context import ChunkContext
from regen.consumers.generate.engine import GenerateResult, PromptRejected
from regen.consumers.generate.engine_loop import Outcome
from regen.consumers.generate.held_prompts import HeldPrompts
from regen.consumers.generate.prompt_outcomes import dead_letter, generated_result
from regen.consumers.generate.reasons import Reason
from regen.consumers.generate.turn_state import dead_letter_conversation
from regen.consumers.generate.turns import run_conversations

log = logging.getLogger("regen.generate")


@dataclass(frozen=True)
class ChunkOutcome:
    generated: int
    skipped: int
    dead_lettered: int


def _dead_letter_all(
    ctx: ChunkContext,
    lease: ChunkLease,
    chunk: Chunk,
    prompts: list[ChunkPrompt],
    settled: set[str],
    history: list[Attempt],
) -> int:
    """Dead-letter the chunk's open prompts (a conversation at its open turn); returns
    how many ids that settled."""
    letter: dict[str, Any] = {
        "worker": ctx.worker,
        "reason": Reason.POISON_CHUNK,
        "message": (
            f"chunk {chunk.chunk_id} was delivered {len(history)} times without finishing "
            "(its worker died, or it failed: see history)"
        ),
        "attempts": len(history),
        "history": history,
    }

    def fill(pipe: redis.client.Pipeline) -> int:
        count = 0
        for prompt in prompts:
            if prompt.conversation is None:
                dead_letter(pipe, chunk, prompt, **letter)
                count += 1
            else:
                count += dead_letter_conversation(ctx.redis, pipe, chunk, prompt, settled, **letter)
        return count

    return write_dead_letters(ctx, lease, fill)


def _hand_off(
    ctx: ChunkContext,
    lease: ChunkLease,
    chunk: Chunk,
    completed: list[tuple[ChunkPrompt, GenerateResult]],
    sampling: dict[str, Any],
) -> None:
    """Hand completed prompts to the tokenize stage, each result with its mark, in
    batches of one script each (chunk_life.hand_off)."""
    for start in range(0, len(completed), defaults.HAND_OFF_BATCH):
        batch = [
            generated_result(chunk, prompt, result, worker=ctx.worker,
                             attempt=lease.attempt, sampling=sampling)
            for prompt, result in completed[start : start + defaults.HAND_OFF_BATCH]
        ]  # fmt: skip
        hand_off(ctx, lease, chunk, batch)


def _reject(
    ctx: ChunkContext, lease: ChunkLease, chunk: Chunk, prompt: ChunkPrompt, exc: PromptRejected
) -> None:
    def fill(pipe: redis.client.Pipeline) -> int:
        dead_letter(
            pipe,
            chunk,
            prompt,
            worker=ctx.worker,
            reason=Reason.REJECTED_BY_SERVER,
            message=exc.message,
            attempts=lease.attempt + 1,
            server=exc.server,
        )
        return 1

    write_dead_letters(ctx, lease, fill, prompt_id=prompt.id)


def run_chunk(ctx: ChunkContext, chunk: Chunk, tag: str | None = None) -> ChunkOutcome:
    """Run one delivery of a chunk (`tag`: kombu's delivery tag) and settle it.

    Raises LeaseLost when another delivery took the chunk (nothing more was written),
    ChunkDeferred when it was given back, and any unexpected error after giving it back
    with its attempt marked failed (past max_attempts failed or dead deliveries, the
    next delivery dead-letters it).
    """
    ctx.count_chunks(1)
    try:
        lease, history = ctx.leases.start(chunk.job, chunk.chunk_id, tag, ctx.worker)
        try:
            return _run_chunk(ctx, lease, chunk, history)
        except LeaseLost:
            lease.record_lost(ctx.redis, ctx.worker)
            raise
        finally:
            ctx.leases.release(lease)
    finally:
        ctx.count_chunks(-1)


def _run_chunk(
    ctx: ChunkContext, lease: ChunkLease, chunk: Chunk, history: list[Attempt]
) -> ChunkOutcome:
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
        dead_lettered = _dead_letter_all(ctx, lease, chunk, todo, done, history)
        lease.finish(ctx.redis, ctx.worker, "dead_lettered")
        return ChunkOutcome(0, len(done), dead_lettered)
    try:
        if any(p.conversation is not None for p in todo):
            generated, dead_lettered = run_conversations(ctx, lease, chunk, todo, done)
        else:
            generated, dead_lettered = _generate_all(ctx, lease, chunk, todo)
    except LeaseLost:
        raise  # nothing to record: the chunk is another's
    except OUTAGE_ERRORS:
        raise  # nothing can be recorded: its lease runs out and it comes back
    except ChunkDeferred:
        lease.give_back(ctx.redis, ctx.worker, "returned")  # not a failure of the chunk
        raise
    except Exception as exc:
        lease.give_back(ctx.redis, ctx.worker, "failed", error=repr(exc))
        raise
    crashpoints.hit(BEFORE_ACK)  # every prompt settled, the chunk not acknowledged
    lease.finish(ctx.redis, ctx.worker)
    return ChunkOutcome(generated, len(done), dead_lettered)


def _generate_all(
    ctx: ChunkContext, lease: ChunkLease, chunk: Chunk, todo: list[ChunkPrompt]
) -> tuple[int, int]:
    """Generate the chunk's prompts: those its worker can start soon at once, the rest
    as its slots free, or given back to the queue as soon as another worker has idle
    slots (docs/design.md, "Only what can start soon"); (handed off, dead-lettered)."""
    # A requeued chunk may override some params (`regen dlq requeue --set`).
    sampling = {**ctx.spec(chunk.job).sampling, **chunk.sampling}
    held = HeldPrompts(ctx, lease, chunk, todo, sampling)
    batch = held.start_first()
    lease.on_lost(batch.cancel)  # a lease a heartbeat found lost stops them at once
    generated = rejected = 0
    try:
        while held.running or held.waiting:
            held.start_or_give_back(batch)
            if not held.running and not held.waiting:
                break  # every prompt given back to faster servers, none started
            # Every prompt finished by now is handed off together: one round trip.
            finished = _take_finished(batch.finished, held.wake_after_s())
            held.finished([outcome.index for outcome in finished])
            if lease.lost.is_set():
                raise LeaseLost("another delivery holds the chunk")
            completed: list[tuple[ChunkPrompt, GenerateResult]] = []
            handed: list[tuple[ChunkPrompt, GenerateResult]] = []
            stopped: list[ChunkPrompt] = []
            for outcome in finished:
                prompt = held.started[outcome.index]
                if isinstance(outcome.error, PromptRejected):
                    _reject(ctx, lease, chunk, prompt, outcome.error)
                    rejected += 1
                elif isinstance(outcome.error, asyncio.CancelledError) and held.stopped(
                    outcome.index
                ):
                    stopped.append(prompt)  # by the delivery itself, to start elsewhere
                elif isinstance(outcome.error, asyncio.CancelledError):
                    # Not by this delivery (a lost lease is caught above): the engine's
                    # loop is going away. Not the chunk's fault: it goes back.
                    raise ChunkDeferred("the engine loop cancelled a prompt")
                elif outcome.error is not None:
                    raise outcome.error
                else:
                    result = cast(GenerateResult, outcome.result)
                    (handed if result.handed_over else completed).append((prompt, result))
            _hand_off(ctx, lease, chunk, completed, sampling)
            held.send_on(handed)
            held.send_back_stopped(stopped)
            generated += len(completed)
    except BaseException:
        # Leaving early (shutdown, lost lease, Redis out of reach, a prompt given back):
        # stop the prompts still running so the engine's capacity goes to the next chunk.
        batch.cancel()
        held.release()
        raise
    return generated, rejected


def _take_finished(
    finishing: queue.SimpleQueue[Outcome[GenerateResult]], timeout: float | None
) -> list[Outcome[GenerateResult]]:
    """The next outcome, and every other one ready by then; none after `timeout`."""
    try:
        finished = [finishing.get(timeout=timeout)]
    except queue.Empty:
        return []
    with contextlib.suppress(queue.Empty):
        while True:
            finished.append(finishing.get_nowait())
    return finished
