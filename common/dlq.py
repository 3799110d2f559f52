"""Dead-letter queues: one Redis hash per job and stage, entry id -> JSON entry.

Redis has no dead-lettering of its own (`Reject(requeue=False)` just deletes), so every
stage writes here, in the same transaction that takes the item out of its queue. An entry
holds what is needed to requeue it without re-reading the dataset.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import orjson
import redis

from common import keys


@dataclass(frozen=True)
class DeadLetter:
    # Stable per item, so writing the same failure twice (a redelivery, a rerun of the
    # producer) overwrites instead of duplicating.
    entry_id: str
    job: str
    stage: str
    reason: str
    message: str
    prompt_id: str | None = None
    source: dict[str, Any] | None = None
    attempts: int = 1
    # What a requeue needs: messages and prompt_ids for a prompt, the result for a record.
    payload: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    time: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> DeadLetter:
        return cls(**orjson.loads(raw))


def put(r: redis.Redis | redis.client.Pipeline, letter: DeadLetter) -> None:
    """Add (or overwrite) an entry; usable inside a MULTI pipeline."""
    r.hset(keys.dlq(letter.job, letter.stage), letter.entry_id, letter.to_json())


def entries(r: redis.Redis, job: str, stage: str) -> Iterator[DeadLetter]:
    for _, raw in r.hscan_iter(keys.dlq(job, stage), count=500):
        yield DeadLetter.from_json(raw)


def count(r: redis.Redis, job: str, stage: str) -> int:
    return int(r.hlen(keys.dlq(job, stage)))
