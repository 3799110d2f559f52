"""The chunk: a fixed group of prompts, the unit of work on the generate queue.

Its id is derived from its prompt ids, so the same prompts always form the same chunk,
and it travels as plain JSON (Celery's json serializer; never pickle). A chunk built by
`regen dlq requeue` salts its id (so it never meets the bookkeeping of the chunk its
prompts first came in) and may carry sampling params that override the job's.

With `--turns all` a prompt carries a conversation (common/conversation.py) and stands
for each of its turns' ids: `accounted_ids` are what the job's bookkeeping counts.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, fields
from typing import Any

from regen.common.conversation import Conversation


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
    # The turns to run (`--turns all`); `id`, `prompt_ids` and `messages` are then its
    # first turn's, and `prompt_ids` may be empty: the worker renders them.
    conversation: Conversation | None = None
    # The answer so far, decoded on a slower server that handed the prompt over at a
    # job's end (docs/design/placement.md, "A slow server's last answers move"): the worker
    # continues it rather than starting anew. None for a prompt never started.
    resume_ids: list[int] | None = None

    @property
    def accounted_ids(self) -> list[str]:
        """The ids this prompt settles: its own, or each turn's of its conversation."""
        return [self.id] if self.conversation is None else self.conversation.turn_ids()

    def to_payload(self) -> dict[str, Any]:
        # A shallow copy, serialized at once: asdict's deep copy of the ids and messages
        # showed in the producer's profile.
        payload = {f.name: getattr(self, f.name) for f in fields(self)}
        if self.conversation is None:
            del payload["conversation"]  # plain prompts travel as they always have
        else:
            payload["conversation"] = self.conversation.to_dict()
        if self.resume_ids is None:
            del payload["resume_ids"]
        return payload

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> ChunkPrompt:
        conversation = payload.get("conversation")
        if conversation is not None:
            payload = {**payload, "conversation": Conversation(**conversation)}
        return cls(**payload)


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
            "prompts": [p.to_payload() for p in self.prompts],
            "sampling": self.sampling,
        }

    @classmethod
    def from_payload(cls, payload: dict[str, Any]) -> Chunk:
        try:
            chunk = cls(
                job=payload["job"],
                chunk_id=payload["chunk"],
                prompts=[ChunkPrompt.from_payload(p) for p in payload["prompts"]],
                sampling=dict(payload.get("sampling") or {}),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed chunk payload: {exc}") from exc
        # Anyone can push to a queue: check the types a worker would trip on later (the
        # ids' types are collected in C: a generator showed in the worker's profile).
        if not isinstance(chunk.job, str) or not isinstance(chunk.chunk_id, str):
            raise ValueError("malformed chunk payload: job and chunk are not strings")
        for p in chunk.prompts:
            if not (isinstance(p.id, str) and isinstance(p.messages, list)
                    and _token_ids(p.prompt_ids)
                    and (p.resume_ids is None or _token_ids(p.resume_ids))):  # fmt: skip
                raise ValueError(f"malformed chunk payload: prompt {p.id!r} is not a prompt")
        return chunk


def _token_ids(ids: object) -> bool:
    return isinstance(ids, list) and set(map(type, ids)) <= {int}
