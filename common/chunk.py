"""The chunk: a fixed group of prompts, the unit of work on the generate queue.

Its id is derived from its prompt ids, so the same prompts always form the same chunk,
and it travels as plain JSON (Celery's json serializer; never pickle). A chunk built by
`regen dlq requeue` salts its id (so it never meets the bookkeeping of the chunk its
prompts first came in) and may carry sampling params that override the job's.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class ChunkPrompt:
    id: str
    # Token ids exactly as the server gets them (the chat template already applied).
    prompt_ids: list[int]
    messages: list[dict[str, Any]]
    # Provenance: {"file": ..., "row": ..., "id": source row id or None}.
    source: dict[str, Any]
    # The OpenAI tools the prompt was rendered with; None without (and in older chunks).
    tools: list[dict[str, Any]] | None = None


@dataclass(frozen=True)
class Chunk:
    job: str
    chunk_id: str
    prompts: list[ChunkPrompt]
    # SGLang sampling params merged over the job spec's for this chunk only (a requeue
    # with `--set`); empty for chunks the producer publishes.
    sampling: dict[str, Any] = field(default_factory=dict)

    @staticmethod
    def make_id(job: str, prompt_ids: list[str], salt: str = "") -> str:
        digest = hashlib.blake2b(digest_size=8)
        digest.update(job.encode())
        digest.update(salt.encode())
        for pid in sorted(prompt_ids):
            digest.update(pid.encode())
        return f"c{digest.hexdigest()}"

    def to_payload(self) -> dict[str, Any]:
        return {
            "job": self.job,
            "chunk": self.chunk_id,
            "prompts": [asdict(p) for p in self.prompts],
            "sampling": self.sampling,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Chunk:
        try:
            return cls(
                job=payload["job"],
                chunk_id=payload["chunk"],
                prompts=[ChunkPrompt(**p) for p in payload["prompts"]],
                sampling=dict(payload.get("sampling") or {}),
            )
        except (KeyError, TypeError) as exc:
            raise ValueError(f"malformed chunk payload: {exc}") from exc
