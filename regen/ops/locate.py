"""The prompt ids in a job's moving parts, for `regen verify` (the counts are in
ops/accounting.py): the chunks waiting and in flight, with the ids they still hold
open, and the results on the stream.

Chunk messages are decoded whole here (their ids are inside a base64 body), a few at a
time; results are read by id only, inside Redis.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import orjson
import redis

from regen.common import keys
from regen.common.chunk import ChunkPrompt
from regen.common.jobspec import JobSpec
from regen.common.queues import queue_lists
from regen.common.results import FIELD
from regen.ops.accounting import ENTRIES_PER_CALL, MESSAGES_PER_CALL, run_script, text

# KEYS[1]: a results stream; ARGV: start (inclusive, or exclusive with "("), count, field.
# Returns {last entry id or '', prompt id, ...}: a GeneratedResult's JSON starts with "id".
_STREAM_IDS_LUA = """
local out = {''}
for _, e in ipairs(redis.call('XRANGE', KEYS[1], ARGV[1], '+', 'COUNT', ARGV[2])) do
  out[1] = e[1]
  for i = 1, #e[2], 2 do
    if e[2][i] == ARGV[3] then
      out[#out + 1] = string.match(e[2][i + 1], '^{"id":"([^"]*)"') or ''
    end
  end
end
return out
"""


@dataclass(frozen=True)
class ChunkContents:
    chunk_id: str
    in_flight: bool
    prompt_ids: list[str]
    # Prompts already handed off, whose place is downstream of the chunk.
    generated: frozenset[str]

    @property
    def open_ids(self) -> list[str]:
        return [pid for pid in self.prompt_ids if pid not in self.generated]


def decode_chunk_message(message: dict[str, Any]) -> dict[str, Any] | None:
    """The chunk payload of a kombu message (JSON-decoded), None if it is not one."""
    try:
        body = message["body"]
        if message["properties"].get("body_encoding") == "base64":
            body = base64.b64decode(body)
        args, _kwargs, _embed = orjson.loads(body)
        payload = args[0]
        return payload if isinstance(payload, dict) and "prompts" in payload else None
    except (KeyError, TypeError, ValueError, IndexError):
        return None


def _accounted_ids(prompt: object) -> list[str]:
    """The ids a prompt of a chunk message stands for (each turn's, for a conversation)."""
    if not isinstance(prompt, dict):
        return []
    try:
        return ChunkPrompt.from_payload(prompt).accounted_ids
    except TypeError:  # not a prompt regen wrote: its id, if any, is all there is
        return [str(prompt.get("id"))]


def _queued_messages(r: redis.Redis, queue: str) -> Iterator[dict[str, Any]]:
    """From the head, in slices: see accounting._list_task_ids for why none is skipped."""
    first = 0
    while True:
        raws = r.lrange(queue, first, first + MESSAGES_PER_CALL - 1)
        for raw in raws:
            yield orjson.loads(raw)
        if len(raws) < MESSAGES_PER_CALL:
            return
        first += MESSAGES_PER_CALL


def _unacked_messages(r: redis.Redis) -> Iterator[dict[str, Any]]:
    for _, raw in r.hscan_iter(keys.KOMBU_UNACKED, count=MESSAGES_PER_CALL):
        message, _exchange, _routing_key = orjson.loads(raw)
        yield message


def window_contents(r: redis.Redis, spec: JobSpec) -> list[ChunkContents]:
    """The job's chunks waiting or in flight, with their prompt ids; read in the order
    of accounting.window_chunks (a chunk seen in both places counts in flight)."""
    found: dict[str, tuple[bool, list[str]]] = {}
    sources = [(False, _queued_messages(r, q)) for q in queue_lists(spec.queue)]
    for in_flight, messages in [*sources, (True, _unacked_messages(r))]:
        for message in messages:
            payload = decode_chunk_message(message)
            if payload is None or payload.get("job") != spec.name:
                continue
            ids = [pid for p in payload["prompts"] for pid in _accounted_ids(p)]
            found[str(payload.get("chunk"))] = (in_flight, ids)
    pipe = r.pipeline(transaction=False)
    for chunk_id in found:
        pipe.smembers(keys.chunk_generated(spec.name, chunk_id))
    generated = pipe.execute()
    return [
        ChunkContents(chunk_id, in_flight, ids, frozenset(text(g) for g in done))
        for (chunk_id, (in_flight, ids)), done in zip(found.items(), generated, strict=True)
    ]


def stream_result_ids(r: redis.Redis, job: str) -> Iterator[str]:
    """The prompt id of every result on the job's stream (one per entry, so a chunk
    that ran twice can give an id twice)."""
    start = "-"
    while True:
        last, *ids = run_script(
            r, _STREAM_IDS_LUA, keys.results_stream(job), start, ENTRIES_PER_CALL, FIELD
        )
        yield from ids
        if not last:
            return
        start = f"({last}"
