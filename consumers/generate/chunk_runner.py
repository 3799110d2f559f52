"""Run one chunk: generate every prompt, hand each result to the tokenize stage, and
dead-letter what a healthy engine refuses.

Each result is handed off (XADD on the job's results stream) in the same transaction
that marks the prompt generated for this chunk, so a redelivered chunk (its worker died,
or its visibility timeout passed) skips the prompts already handed off. The Celery task
acknowledges the chunk only when this returns (acks_late), i.e. after every prompt is in
the results stream or the DLQ (docs/design.md, Delivery protocol). A chunk of conversations
(`--turns all`) runs each one's turns in order (turns.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from concurrent.futures import Future, as_completed
from dataclasses import dataclass, field
from typing import Any, cast

import orjson
import redis
from redis.typing import EncodableT, FieldT

from regen.common import defaults, jobspec, keys
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.connection import bytes_set
from regen.common.heartbeat import RateMeter
from regen.consumers.generate.engine import GenerateRequest, GenerateResult, PromptRejected
from regen.consumers.generate.job_chat import JobChat, load_job_chat
from regen.consumers.generate.reasons import Reason
from regen.consumers.generate.runner import EngineRunner
from regen.consumers.generate.settle import (
    CHUNK_STATE_TTL_S,
    GIVE_BACK_AFTER_S,
    ChunkDeferred,
    dead_letter,
    generate_with_retry,
    generated_result,
    mark_generated,
)
from regen.consumers.generate.turns import dead_letter_conversation, run_conversations

log = logging.getLogger("regen.generate")


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
    _chats: dict[str, JobChat] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _chat_lock: threading.Lock = field(default_factory=threading.Lock)

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

    def chat(self, job: str) -> JobChat:
        """The job's tokenizer and template, loaded on first use (`--turns all` jobs)."""
        with self._chat_lock:
            if job not in self._chats:
                self._chats[job] = load_job_chat(self.spec(job))
            return self._chats[job]


@dataclass(frozen=True)
class ChunkOutcome:
    generated: int
    skipped: int
    dead_lettered: int


def _attempts_key(chunk: Chunk) -> str:
    return keys.chunk_attempts(chunk.job) + ":" + chunk.chunk_id


def start_attempt(ctx: ChunkContext, chunk: Chunk) -> tuple[int, list[dict[str, object]]]:
    """Record this delivery; returns (its index, every delivery so far).

    An attempt stays "started" unless it ends cleanly, so started attempts other than
    this one are deliveries whose worker died (or that still run elsewhere).
    """
    entry = {"worker": ctx.worker, "time": time.time(), "status": "started"}
    key = _attempts_key(chunk)
    pipe = ctx.redis.pipeline()
    pipe.rpush(key, orjson.dumps(entry))
    pipe.expire(key, CHUNK_STATE_TTL_S)
    pipe.lrange(key, 0, -1)
    length, _, history = pipe.execute()
    return length - 1, [orjson.loads(h) for h in history]


def end_attempt(
    ctx: ChunkContext, chunk: Chunk, index: int, status: str, error: str | None = None
) -> None:
    entry = {"worker": ctx.worker, "time": time.time(), "status": status, "error": error}
    # redis-py's stub types LSET's value as str only; bytes are sent as they are.
    ctx.redis.lset(_attempts_key(chunk), index, orjson.dumps(entry))  # type: ignore[arg-type]


def _dead_letter_all(
    ctx: ChunkContext,
    chunk: Chunk,
    prompts: list[ChunkPrompt],
    settled: set[str],
    history: list[dict[str, object]],
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
    pipe = ctx.redis.pipeline()
    count = 0
    for prompt in prompts:
        if prompt.conversation is None:
            dead_letter(pipe, chunk, prompt, **letter)
            count += 1
        else:
            count += dead_letter_conversation(ctx.redis, pipe, chunk, prompt, settled, **letter)
    pipe.execute()
    return count


def _hand_off(
    ctx: ChunkContext,
    chunk: Chunk,
    prompt: ChunkPrompt,
    result: GenerateResult,
    attempt: int,
    sampling: dict[str, Any],
) -> None:
    generated = generated_result(
        chunk, prompt, result, worker=ctx.worker, attempt=attempt, sampling=sampling
    )
    pipe = ctx.redis.pipeline()  # MULTI: the result and the "done" mark land together
    # A dict[bytes, bytes] is a valid fields mapping; the stub's dict type is invariant.
    fields = cast("dict[FieldT, EncodableT]", generated.to_fields())
    pipe.xadd(keys.results_stream(chunk.job), fields)
    mark_generated(pipe, chunk, prompt.id)
    pipe.execute()
    ctx.tokens.add(result.completion_tokens)
    ctx.prompts.add()


def _reject(
    ctx: ChunkContext, chunk: Chunk, prompt: ChunkPrompt, exc: PromptRejected, attempt: int
) -> None:
    pipe = ctx.redis.pipeline()
    dead_letter(
        pipe,
        chunk,
        prompt,
        worker=ctx.worker,
        reason=Reason.REJECTED_BY_SERVER,
        message=exc.message,
        attempts=attempt + 1,
        server=exc.server,
    )
    pipe.execute()


def run_chunk(ctx: ChunkContext, chunk: Chunk) -> ChunkOutcome:
    """Raises on an unexpected error, after marking the attempt failed (the task then
    gives the chunk back; past max_attempts failed or dead deliveries it is dead-lettered).
    """
    ctx.count_chunks(1)
    try:
        return _run_chunk(ctx, chunk)
    finally:
        ctx.count_chunks(-1)


def _run_chunk(ctx: ChunkContext, chunk: Chunk) -> ChunkOutcome:
    attempt, history = start_attempt(ctx, chunk)
    settled = bytes_set(ctx.redis.smembers(keys.chunk_generated(chunk.job, chunk.chunk_id)))
    done = {m.decode() for m in settled}
    todo = [p for p in chunk.prompts if not done.issuperset(p.accounted_ids)]
    # "started" entries other than this one are deliveries whose worker died.
    failed = [
        h for i, h in enumerate(history) if i != attempt and h["status"] in ("started", "failed")
    ]
    if len(failed) >= ctx.max_attempts:
        log.error(
            "chunk %s: %d deliveries died or failed; dead-lettering its %d open prompts",
            chunk.chunk_id,
            len(failed),
            len(todo),
        )
        dead_lettered = _dead_letter_all(ctx, chunk, todo, done, history)
        end_attempt(ctx, chunk, attempt, "dead_lettered")
        return ChunkOutcome(0, len(done), dead_lettered)
    try:
        if any(p.conversation is not None for p in todo):
            generated, dead_lettered = run_conversations(ctx, chunk, todo, attempt, done)
        else:
            generated, dead_lettered = _generate_all(ctx, chunk, todo, attempt)
    except ChunkDeferred:
        end_attempt(ctx, chunk, attempt, "returned")  # not a failure of the chunk
        raise
    except Exception as exc:
        end_attempt(ctx, chunk, attempt, "failed", error=repr(exc))
        raise
    end_attempt(ctx, chunk, attempt, "done")
    return ChunkOutcome(generated, len(done), dead_lettered)


def _generate_all(
    ctx: ChunkContext, chunk: Chunk, todo: list[ChunkPrompt], attempt: int
) -> tuple[int, int]:
    """Generate every prompt at once; (handed off, dead-lettered)."""
    spec = ctx.spec(chunk.job)
    # A requeued chunk may override some params (`regen dlq requeue --set`).
    sampling = {**spec.sampling, **chunk.sampling}
    deadline = time.monotonic() + GIVE_BACK_AFTER_S
    futures: dict[Future[GenerateResult], ChunkPrompt] = {}
    for prompt in todo:
        request = GenerateRequest(
            rid=f"{chunk.chunk_id}-{prompt.id}-{attempt}",
            prompt_ids=prompt.prompt_ids,
            sampling=dict(sampling),
        )
        futures[ctx.runner.submit(generate_with_retry(ctx.runner, request, deadline))] = prompt
    ctx.count_inflight(len(futures))
    generated = rejected = 0
    try:
        for future in as_completed(futures):
            prompt = futures[future]
            ctx.count_inflight(-1)
            try:
                result = future.result()
            except PromptRejected as exc:
                _reject(ctx, chunk, prompt, exc, attempt)
                rejected += 1
                continue
            _hand_off(ctx, chunk, prompt, result, attempt, sampling)
            generated += 1
    except BaseException:
        # Leaving early (shutdown, lost Redis): stop the prompts still running so the
        # engine's capacity goes to the next chunk; the chunk itself comes back unacked.
        for future in futures:
            if future.cancel():
                ctx.count_inflight(-1)
        raise
    return generated, rejected
