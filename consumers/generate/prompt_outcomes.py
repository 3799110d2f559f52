"""What a settled prompt leaves behind: its result for the tokenize stage, or its dead
letter holding what a requeue needs. Shared by the chunk runner and the turn driver; both
are written under the chunk's lease (chunk_life), the dead letter with its prompt's
`generated` mark.
"""

from __future__ import annotations

from typing import Any

import redis

from regen.common import dlq
from regen.common.chunk import Chunk, ChunkPrompt
from regen.common.results import GeneratedResult
from regen.consumers.generate.chunk_life import mark_generated
from regen.consumers.generate.engine import GenerateResult
from regen.consumers.generate.reasons import Reason


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
        resumed_tokens=result.resumed_tokens,
        worker=worker,
        attempt=attempt,
        sampling=sampling,
    )
