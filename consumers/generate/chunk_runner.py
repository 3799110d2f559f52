"""Run one chunk: generate every prompt, hand each result to the tokenize stage, and
dead-letter what a healthy engine refuses.

Each result is handed off (XADD on the job's results stream) in the same transaction
that marks the prompt generated for this chunk, so a redelivered chunk (its worker died,
or was frozen past its lease) skips the prompts already handed off. Every such write
checks, in its transaction, that this delivery still holds the chunk's lease (lease.py):
a worker that lost it drops its results. The delivery is acknowledged only after every
prompt is in the results stream or the DLQ (DESIGN.md invariant 3).
"""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
import threading
import time
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field
from typing import Any, cast

import redis
from redis.typing import EncodableT, FieldT

from regen.common import defaults, dlq, jobspec, keys
from regen.common.celery_app import visibility_timeout
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.connection import OUTAGE_ERRORS, bytes_set
from regen.common.heartbeat import RateMeter
from regen.common.results import GeneratedResult
from regen.consumers.generate.engine import (
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    PromptRejected,
)
from regen.consumers.generate.lease import Attempt, ChunkLease, LeaseBook, LeaseLost
from regen.consumers.generate.runner import EngineRunner

log = logging.getLogger("regen.generate")

# A chunk still waiting for an unavailable engine this long is given back to the queue
# (results already handed off stay done): a chunk stuck behind a dead server is back for
# a healthy worker within about the bound a dead worker's chunk is.
GIVE_BACK_AFTER_S = 0.75 * visibility_timeout()


class ChunkDeferred(Exception):
    """The engine stayed unavailable until the chunk's deadline: give the chunk back."""


@dataclass
class ChunkContext:
    redis: redis.Redis
    runner: EngineRunner
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    max_attempts: int = defaults.MAX_CHUNK_ATTEMPTS
    # Output tokens and prompts handed off, for heartbeats and metrics.
    tokens: RateMeter = field(default_factory=RateMeter)
    prompts: RateMeter = field(default_factory=RateMeter)
    # Prompts submitted to the engine and not finished; chunks being worked on; the
    # limit on chunks held that flow control sets (see flow.py).
    inflight: int = 0
    chunks_held: int = 0
    chunk_limit: int = 0
    _specs: dict[str, jobspec.JobSpec] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    # The leases of the chunks held, renewed by the worker's heartbeat.
    leases: LeaseBook = field(init=False)

    def __post_init__(self) -> None:
        self.leases = LeaseBook(self.redis)

    def count_inflight(self, delta: int) -> None:
        with self._lock:
            self.inflight += delta

    def count_chunks(self, delta: int) -> None:
        with self._lock:
            self.chunks_held += delta

    def spec(self, job: str) -> jobspec.JobSpec:
        # A job's spec never changes once stored, so caching it for the process is safe.
        if job not in self._specs:
            self._specs[job] = jobspec.load(self.redis, job)
        return self._specs[job]


@dataclass(frozen=True)
class ChunkOutcome:
    generated: int
    skipped: int
    dead_lettered: int


def _mark_generated(pipe: redis.client.Pipeline, chunk: Chunk, prompt_id: str) -> None:
    """Record that a prompt of the chunk is settled (handed off or dead-lettered), so a
    redelivery of the chunk skips it."""
    key = keys.chunk_generated(chunk.job, chunk.chunk_id)
    pipe.sadd(key, prompt_id)
    pipe.expire(key, defaults.CHUNK_STATE_TTL_S)


def _dead_letter(
    ctx: ChunkContext,
    pipe: redis.client.Pipeline,
    chunk: Chunk,
    prompt: ChunkPrompt,
    *,
    reason: str,
    message: str,
    attempts: int,
    history: list[Attempt] | None = None,
    **payload: Any,
) -> None:
    """A generate-stage dead letter holding what a requeue needs, settled in `pipe`."""
    letter = dlq.DeadLetter(
        entry_id=prompt.id,
        job=chunk.job,
        stage="generate",
        reason=reason,
        message=message,
        prompt_id=prompt.id,
        source=prompt.source,
        attempts=attempts,
        payload={
            "chunk": chunk.chunk_id,
            "prompt_ids": prompt.prompt_ids,
            "messages": prompt.messages,
            "sampling": chunk.sampling,
            **payload,
        },
        history=history or [],
        worker=ctx.worker,
    )
    dlq.put(pipe, letter)
    _mark_generated(pipe, chunk, prompt.id)


def _dead_letter_all(
    ctx: ChunkContext,
    lease: ChunkLease,
    chunk: Chunk,
    prompts: list[ChunkPrompt],
    history: list[Attempt],
) -> None:
    message = (
        f"chunk {chunk.chunk_id} was delivered {len(history)} times without finishing "
        "(its worker died, or it failed: see history)"
    )

    def fill(pipe: redis.client.Pipeline) -> None:
        for prompt in prompts:
            _dead_letter(
                ctx,
                pipe,
                chunk,
                prompt,
                reason="poison_chunk",
                message=message,
                attempts=len(history),
                history=history,
            )

    lease.write(ctx.redis, fill)


async def _generate_with_retry(
    runner: EngineRunner, request: GenerateRequest, deadline: float
) -> GenerateResult:
    """Retry while the engine is unavailable: a dead server is not a bad prompt."""
    delay = 1.0
    while True:
        try:
            return await runner.engine.generate(request, deadline=deadline)
        except EngineUnavailable as exc:
            if time.monotonic() >= deadline:
                raise ChunkDeferred(str(exc)) from exc
            log.warning(
                "engine unavailable for %s (%s); retrying in ~%.0f s", request.rid, exc, delay
            )
            await asyncio.sleep(random.uniform(0, delay))
            delay = min(delay * 2, 60.0)


def _hand_off(
    ctx: ChunkContext,
    lease: ChunkLease,
    chunk: Chunk,
    prompt: ChunkPrompt,
    result: GenerateResult,
    sampling: dict[str, Any],
) -> None:
    generated = GeneratedResult(
        id=prompt.id,
        job=chunk.job,
        chunk=chunk.chunk_id,
        prompt_ids=prompt.prompt_ids,
        messages=prompt.messages,
        source=prompt.source,
        output_ids=list(result.output_ids),
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens,
        latency_s=result.latency_s,
        server=result.server,
        worker=ctx.worker,
        attempt=lease.attempt,
        sampling=sampling,
    )
    # A dict[bytes, bytes] is a valid fields mapping; the stub's dict type is invariant.
    fields = cast("dict[FieldT, EncodableT]", generated.to_fields())

    def fill(pipe: redis.client.Pipeline) -> None:  # the result and its mark land together
        pipe.xadd(keys.results_stream(chunk.job), fields)
        _mark_generated(pipe, chunk, prompt.id)

    if lease.write(ctx.redis, fill, prompt_id=prompt.id):
        ctx.tokens.add(result.completion_tokens)
        ctx.prompts.add()


def _reject(
    ctx: ChunkContext, lease: ChunkLease, chunk: Chunk, prompt: ChunkPrompt, exc: PromptRejected
) -> None:
    def fill(pipe: redis.client.Pipeline) -> None:
        _dead_letter(
            ctx,
            pipe,
            chunk,
            prompt,
            reason="rejected_by_server",
            message=exc.message,
            attempts=lease.attempt + 1,
            server=exc.server,
        )

    lease.write(ctx.redis, fill, prompt_id=prompt.id)


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
    settled = bytes_set(ctx.redis.smembers(keys.chunk_generated(chunk.job, chunk.chunk_id)))
    done = {m.decode() for m in settled}
    todo = [p for p in chunk.prompts if p.id not in done]
    # "started" entries other than this one are deliveries whose worker died.
    failed = [
        h
        for i, h in enumerate(history)
        if i != lease.attempt and h["status"] in ("started", "failed")
    ]
    if len(failed) >= ctx.max_attempts:
        log.error(
            "chunk %s: %d deliveries died or failed; dead-lettering its %d open prompts",
            chunk.chunk_id,
            len(failed),
            len(todo),
        )
        _dead_letter_all(ctx, lease, chunk, todo, history)
        lease.finish(ctx.redis, ctx.worker, "dead_lettered")
        return ChunkOutcome(0, len(done), len(todo))
    try:
        outcome = _generate_all(ctx, lease, chunk, todo, skipped=len(done))
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
    lease.finish(ctx.redis, ctx.worker)
    return outcome


def _generate_all(
    ctx: ChunkContext, lease: ChunkLease, chunk: Chunk, todo: list[ChunkPrompt], skipped: int
) -> ChunkOutcome:
    spec = ctx.spec(chunk.job)
    # A requeued chunk may override some params (`regen dlq requeue --set`).
    sampling = {**spec.sampling, **chunk.sampling}
    deadline = time.monotonic() + GIVE_BACK_AFTER_S
    futures: dict[Future[GenerateResult], ChunkPrompt] = {}
    for prompt in todo:
        request = GenerateRequest(
            rid=f"{chunk.chunk_id}-{prompt.id}-{lease.attempt}",
            prompt_ids=prompt.prompt_ids,
            sampling=dict(sampling),
        )
        futures[ctx.runner.submit(_generate_with_retry(ctx.runner, request, deadline))] = prompt
    ctx.count_inflight(len(futures))

    def stop_prompts() -> None:  # a lease a heartbeat found lost stops them at once
        for future in futures:
            future.cancel()

    lease.on_lost(stop_prompts)
    generated = rejected = 0
    try:
        for future in as_completed(futures):
            if lease.lost.is_set():
                raise LeaseLost("another delivery holds the chunk")
            prompt = futures[future]
            ctx.count_inflight(-1)
            try:
                result = future.result()
            except PromptRejected as exc:
                _reject(ctx, lease, chunk, prompt, exc)
                rejected += 1
                continue
            _hand_off(ctx, lease, chunk, prompt, result, sampling)
            generated += 1
    except BaseException:
        # Leaving early (shutdown, lost lease, Redis out of reach): stop the prompts still
        # running so the engine's capacity goes to the next chunk.
        for future in futures:
            if future.cancel():
                ctx.count_inflight(-1)
        raise
    return ChunkOutcome(generated, skipped, rejected)
