"""What a delivery of a chunk does with its open prompts (chunk_life/delivery.py runs
the delivery itself): generate every prompt, hand each result to the tokenize stage,
and dead-letter what a healthy engine refuses.

Each result is handed off (XADD on the job's results stream) in the same script that
marks the prompt generated for this chunk (the results finished by then go together,
one round trip), so a redelivered chunk (its worker died,
or was frozen past its lease) skips the prompts already handed off. Every such write
goes through chunk_life (its handoff.py) and checks, in its transaction, that this
delivery still holds the chunk's lease: a worker that lost it drops its results. The delivery is
acknowledged only after every prompt is in the results stream or the DLQ
(docs/design/delivery.md, Delivery protocol). A chunk of conversations (`--turns all`) runs each
one's turns in order (turns.py), each turn settled through the same commit path.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
from dataclasses import dataclass
from typing import Any, cast

import redis

from regen.common import defaults
from regen.common.chunk import Chunk, ChunkPrompt
from regen.consumers.generate.chunk_context import ChunkContext
from regen.consumers.generate.chunk_life import (
    Attempt,
    ChunkDeferred,
    ChunkLease,
    Delivery,
    LeaseLost,
    deliver,
    hand_off,
    write_dead_letters,
)
from regen.consumers.generate.engine import GenerateResult, PromptRejected
from regen.consumers.generate.engine_loop import Outcome
from regen.consumers.generate.placement.held_prompts import HeldPrompts
from regen.consumers.generate.prompt_outcomes import dead_letter, generated_result
from regen.consumers.generate.reasons import Reason
from regen.consumers.generate.turn_state import dead_letter_conversation
from regen.consumers.generate.turns import run_conversations


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


def run_chunk(ctx: ChunkContext, chunk: Chunk, tag: str | None = None) -> Delivery:
    """Run one delivery of a chunk (`tag`: kombu's delivery tag) and settle it: how it
    ended (chunk_life.Delivery: acked, returned, failed or dropped) and its counts."""
    return deliver(ctx, chunk, tag, PromptWork(ctx, chunk))


@dataclass
class PromptWork:
    """The generate stage's work on a chunk's open prompts (chunk_life.ChunkWork)."""

    ctx: ChunkContext
    chunk: Chunk

    def run(self, lease: ChunkLease, todo: list[ChunkPrompt], done: set[str]) -> tuple[int, int]:
        # The job's spec, looked up once for the delivery; a requeued chunk may override
        # some sampling params (`regen dlq requeue --set`).
        spec = self.ctx.spec(self.chunk.job)
        sampling = {**spec.sampling, **self.chunk.sampling}
        if any(p.conversation is not None for p in todo):
            return run_conversations(self.ctx, lease, self.chunk, todo, done, spec, sampling)
        held = HeldPrompts(self.ctx, lease, self.chunk, todo, spec, sampling)
        return _generate_all(self.ctx, lease, self.chunk, held, sampling)

    def dead_letter_all(
        self, lease: ChunkLease, todo: list[ChunkPrompt], done: set[str], history: list[Attempt]
    ) -> int:
        return _dead_letter_all(self.ctx, lease, self.chunk, todo, done, history)


def _generate_all(
    ctx: ChunkContext, lease: ChunkLease, chunk: Chunk, held: HeldPrompts, sampling: dict[str, Any]
) -> tuple[int, int]:
    """Generate the chunk's prompts `held`: those its worker can start soon at once, the
    rest as its slots free, or given back to the queue as soon as another worker has idle
    slots (docs/design/placement.md, "Only what can start soon"); (handed off, dead-lettered)."""
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
