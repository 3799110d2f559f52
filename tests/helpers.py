"""Small helpers shared by tests: reading what the producer queued, writing datasets."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import orjson
import redis

from common.queues import queue_lists


def queued_chunks(r: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The chunk payloads waiting in a generate queue, oldest first (not consumed)."""
    chunks = []
    for name in queue_lists(queue):
        for raw in reversed(r.lrange(name, 0, -1)):  # LPUSH + RPOP: the tail is the oldest
            chunks.append(decode_message(raw))
    return chunks


def decode_message(raw: bytes) -> dict[str, Any]:
    """The chunk payload of a kombu/Celery message as kept in a Redis list."""
    message = orjson.loads(raw)
    body = message["body"]
    if message["properties"].get("body_encoding") == "base64":
        body = base64.b64decode(body)
    args, _kwargs, _embed = orjson.loads(body)
    payload: dict[str, Any] = args[0]
    return payload


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    with open(path, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(row if isinstance(row, str) else json.dumps(row, ensure_ascii=False))
            fh.write("\n")
    return path


def user_rows(n: int, prefix: str = "Question", pad: int = 0) -> list[dict[str, Any]]:
    filler = " lorem ipsum" * pad
    return [{"prompt": f"{prefix} number {i}: what is {i} plus {i}?{filler}"} for i in range(n)]
