"""Settling a chunk's prompts: each one ends handed off (its result on the job's results
stream) or dead-lettered, in one Redis transaction with the chunk's `generated` mark, so
a redelivered chunk skips it. Shared by the chunk runner and the turn driver.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis

from regen.common import defaults, dlq, keys, settings
from regen.common.backoff import Backoff
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.results import GeneratedResult
from regen.consumers.generate.engine import (
    EngineDown,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
)
from regen.consumers.generate.reasons import Reason
from regen.consumers.generate.runner import EngineRunner

log = logging.getLogger("regen.generate")

# Per-chunk bookkeeping outlives the chunk by this much, so a redelivery that races the
# acknowledgement still finds which prompts are done; then it expires (flat memory).
CHUNK_STATE_TTL_S = defaults.CHUNK_STATE_TTL_S
# A chunk whose engine has had no healthy server for this long in a row is given back
# to the queue (results already handed off stay done), so a worker with a live server
# takes it. Busy servers never count: a prompt waits for a slot however long answers
# run, and the heartbeat renews the chunk's lease meanwhile (docs/design.md, "Timers at
# real lengths").
GIVE_BACK_AFTER_S = 0.75 * settings.current().visibility_timeout_s
# Waits between tries of an engine that failed a request while a server is healthy
# (bad answers): from ~1 s up to a minute.
ENGINE_RETRY = Backoff(base_s=1.0, max_s=60.0)


class ChunkDeferred(Exception):
    """No server the chunk may use stayed healthy (or the engine closed): give it back."""


async def generate_with_retry(runner: EngineRunner, request: GenerateRequest) -> GenerateResult:
    """Generate one prompt, waiting however long healthy servers stay busy; ChunkDeferred
    once none has been healthy for GIVE_BACK_AFTER_S (a dead server is not a bad prompt,
    and a busy one is not a dead one)."""
    failures = 0
    while True:
        try:
            return await runner.engine.generate(request, outage_s=GIVE_BACK_AFTER_S)
        except EngineDown as exc:
            raise ChunkDeferred(str(exc)) from exc
        except EngineUnavailable as exc:
            log.warning(
                "engine unavailable for %s (%s); retrying in ~%.0f s",
                request.rid,
                exc,
                ENGINE_RETRY.ceiling(failures),
            )
            await asyncio.sleep(ENGINE_RETRY.delay(failures))
            failures += 1


def mark_generated(pipe: redis.client.Pipeline, chunk: Chunk, *prompt_ids: str) -> None:
    """Record that prompts of the chunk are settled (handed off or dead-lettered), so a
    redelivery of the chunk skips them."""
    key = keys.chunk_generated(chunk.job, chunk.chunk_id)
    pipe.sadd(key, *prompt_ids)
    pipe.expire(key, CHUNK_STATE_TTL_S)


def dead_letter(
    pipe: redis.client.Pipeline,
    chunk: Chunk,
    prompt: ChunkPrompt,
    *,
    worker: str,
    reason: Reason,
    message: str,
    attempts: int,
    history: list[dict[str, object]] | None = None,
    **payload: Any,
) -> dlq.DeadLetter:
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
            "tools": prompt.tools,
            "sampling": chunk.sampling,
            **payload,
        },
        history=history or [],
        worker=worker,
    )
    dlq.put(pipe, letter)
    mark_generated(pipe, chunk, prompt.id)
    return letter


def generated_result(
    chunk: Chunk,
    prompt: ChunkPrompt,
    result: GenerateResult,
    *,
    worker: str,
    attempt: int,
    sampling: dict[str, Any],
) -> GeneratedResult:
    """What the tokenize stage gets for a prompt the engine completed."""
    return GeneratedResult(
        id=prompt.id,
        job=chunk.job,
        chunk=chunk.chunk_id,
        prompt_ids=prompt.prompt_ids,
        messages=prompt.messages,
        tools=prompt.tools,
        source=prompt.source,
        output_ids=list(result.output_ids),
        text=result.text,
        finish_reason=result.finish_reason,
        prompt_tokens=result.prompt_tokens,
        completion_tokens=result.completion_tokens,
        cached_tokens=result.cached_tokens,
        latency_s=result.latency_s,
        server=result.server,
        server_version=result.server_version,
        worker=worker,
        attempt=attempt,
        sampling=sampling,
    )
