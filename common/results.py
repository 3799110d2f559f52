"""A generated result: what the generate stage hands to the tokenize stage.

One entry per prompt on the job's results stream (a Redis Stream, consumed by the
tokenize stage with a consumer group so each entry is acknowledged only after its record
is in a shard).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

FIELD = b"r"


# Not frozen: a frozen dataclass sets each field through object.__setattr__, which made
# building one from its stream entry half again as slow; nothing changes one once built.
@dataclass
class GeneratedResult:
    id: str
    job: str
    chunk: str
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    source: dict[str, Any]
    # Exactly as the engine returned them; the record is built from these, never from text.
    output_ids: list[int]
    # None: the server sent no text (`--skip-tokenizer-init`); the decode of output_ids.
    text: str | None
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None  # None: the engine did not report it
    latency_s: float
    server: str
    worker: str
    attempt: int
    # The sampling params sent (the job's, with the chunk's override merged over them).
    # Empty in results written before this field existed: those used the job's.
    sampling: dict[str, Any] = field(default_factory=dict)
    # With `--turns all`: the conversation and the turn (0 first) this result answers.
    conversation_id: str | None = None
    turn: int | None = None
    # The OpenAI tools the prompt was rendered with; None without (and in older results).
    tools: list[dict[str, Any]] | None = None
    # The server's SGLang version where it reported one (provenance); None otherwise.
    server_version: str | None = None
    # The first this many output_ids were decoded on a slower server that handed the
    # answer over to `server` at the job's end (docs/design/placement.md, "A slow server's last
    # answers move"); 0: all on `server`.
    resumed_tokens: int = 0

    def encode(self) -> bytes:
        """The stream entry's one field value (FIELD). orjson serializes the dataclass
        itself, field by field as `asdict` would, without asdict's deep copy of every
        prompt's ids and messages (which showed in the generate worker's profile)."""
        return orjson.dumps(self)

    def to_fields(self) -> dict[bytes, bytes]:
        return {FIELD: self.encode()}

    @classmethod
    def from_fields(cls, fields: dict[bytes, bytes]) -> GeneratedResult:
        return cls(**orjson.loads(fields[FIELD]))
