"""Publish a chunk as a Celery task and record its prompt ids in one atomic step.

A producer killed at any instant must neither lose a prompt (ids recorded, chunk never
queued) nor queue a chunk twice (queued, ids not recorded, so a rerun queues it again).
Celery publishes outside any transaction, so regen builds the exact message Celery and
kombu would send without sending it (common/chunk_message.py); a Lua script then
checks the ids, pushes the message, records the ids and advances the resume cursors,
all or nothing. The script first
checks that each cursor is not behind where this producer last moved it: a cursor
behind means Redis was restored from an older copy, which lost the chunks published
since, and the producer reads the file again from the cursor Redis has (CursorBehind;
docs/design/delivery.md, Delivery protocol). A requeued chunk
(`regen dlq requeue`) goes out the same way, with its dead letters removed in that same
script instead of its ids recorded (they are in the job already).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis
from celery import Celery

from regen.common import keys
from regen.common.chunk_message import ChunkMessages
from regen.common.jobspec import JobSpec
from regen.common.ledger.job_ids import ADD_IDS_LUA, JobIds

# KEYS: chunks hash, cursors hash, counters hash, then the bucket of each id
# (keys.job_ids), then one key per LPUSH.
# ARGV: chunk id, number of ids, number of cursors, ids' fields..., per cursor its name,
# its new value and the value it must not be behind (-1: not checked), messages..., and
# last the chunk this producer published before from the same rows ('' for none).
# That chunk missing from the chunks hash (append-only) is a rollback too: the chunks of
# a window of rows go out before the cursor moves past them (producer/longest_first.py),
# so the cursor alone cannot tell that one of them was lost; it is reported as the first
# cursor being behind, at its value in Redis.
# Returns {} when published, {'chunk'} when the chunk was already published (its ids
# all in the job: a chunk whose ids `regen recover` took out, its message lost, goes
# out again),
# {'behind', name, value} when a cursor is behind (nothing written), or the 1-based
# positions of the ids that another producer enqueued meanwhile (the caller rebuilds
# the chunk without them).
_PUBLISH_LUA = (
    ADD_IDS_LUA
    + """
local n_ids = tonumber(ARGV[2])
local n_cur = tonumber(ARGV[3])
for c = 4 + n_ids, 3 + n_ids + 3 * n_cur, 3 do
  local stored = tonumber(redis.call('HGET', KEYS[2], ARGV[c]) or '0')
  if stored < tonumber(ARGV[c + 2]) then return {'behind', ARGV[c], stored} end
end
local after = ARGV[#ARGV]
if after ~= '' and redis.call('HEXISTS', KEYS[1], after) == 0 then
  local name = ARGV[4 + n_ids]
  return {'behind', name, tonumber(redis.call('HGET', KEYS[2], name) or '0')}
end
local present = {}
for i = 1, n_ids do
  if redis.call('HEXISTS', KEYS[3 + i], ARGV[3 + i]) == 1 then table.insert(present, i) end
end
if #present == n_ids and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then
  return {'chunk'}
end
if #present > 0 then return present end
add_ids(KEYS[3], 4, n_ids, 4)
local c = 4 + n_ids
for i = 1, n_cur do
  redis.call('HSET', KEYS[2], ARGV[c], ARGV[c + 1])
  c = c + 3
end
for k = 4 + n_ids, #KEYS do
  redis.call('LPUSH', KEYS[k], ARGV[c])
  c = c + 1
end
redis.call('HSET', KEYS[1], ARGV[1], n_ids)
redis.call('HINCRBY', KEYS[3], 'enqueued', n_ids)
return {}
"""
)


# KEYS: cursors hash; ARGV: the cursor's name, its new value, the value it must not be
# behind. Moves the cursor and returns -1, or returns the cursor when it is behind.
_MOVE_CURSOR_LUA = """
local stored = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if stored < tonumber(ARGV[3]) then return stored end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return -1
"""


# KEYS: dlq hash, chunks hash, counters hash, then one key per LPUSH.
# ARGV: chunk id, number of ids, ids..., messages...
# Returns {} when published, else the ids no longer in the DLQ (requeued or purged by
# someone else meanwhile: the caller rebuilds the chunk without them).
_REQUEUE_LUA = """
local n_ids = tonumber(ARGV[2])
local gone = {}
for i = 3, 2 + n_ids do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 then table.insert(gone, ARGV[i]) end
end
if #gone > 0 then return gone end
for i = 3, 2 + n_ids do redis.call('HDEL', KEYS[1], ARGV[i]) end
local c = 3 + n_ids
for k = 4, #KEYS do
  redis.call('LPUSH', KEYS[k], ARGV[c])
  c = c + 1
end
redis.call('HSET', KEYS[2], ARGV[1], n_ids)
redis.call('HINCRBY', KEYS[3], 'requeued', n_ids)
return {}
"""


class CursorBehind(Exception):
    """A resume cursor is behind where this producer moved it: Redis was restored from
    an older copy. `value` is the cursor Redis has, where reading resumes."""

    def __init__(self, name: str, value: int) -> None:
        super().__init__(f"cursor {name} is back at row {value}")
        self.name = name
        self.value = value


@dataclass(frozen=True)
class PublishOutcome:
    published: bool
    # Ids someone else enqueued first; non-empty only when published is False.
    already_enqueued: list[str]


class ChunkPublisher:
    """Publishes chunks of one job onto its generate queue."""

    def __init__(self, app: Celery, r: redis.Redis, spec: JobSpec) -> None:
        self._r = r
        self._job = spec.name
        self._queue = spec.queue
        self._ids = JobIds(r, spec.name).index
        self._script = r.register_script(_PUBLISH_LUA)
        self._move_cursor = r.register_script(_MOVE_CURSOR_LUA)
        self._requeue_script = r.register_script(_REQUEUE_LUA)
        self._messages = ChunkMessages(app)

    def publish(
        self,
        chunk_id: str,
        payload: dict[str, Any],
        prompt_ids: list[str],
        cursors: dict[str, int],
        behind: dict[str, int] | None = None,
        after_chunk: str | None = None,
    ) -> PublishOutcome:
        """Publish the chunk with its ids and move `cursors`; raises CursorBehind when
        one of them is behind its value in `behind`, or when `after_chunk` (this
        producer's previous chunk from the same rows; needs a cursor) is not in the job:
        nothing written."""
        rendered = self._messages.render(chunk_id, payload, self._queue)
        pushes, after = rendered.pushes, rendered.after
        job = self._job
        buckets, fields = self._ids.keys_and_fields(prompt_ids)
        lua_keys = [keys.job_chunks(job), keys.job_cursors(job), keys.job_counters(job)]
        lua_keys += [*buckets, *(key for key, _ in pushes)]
        cursor_args: list[Any] = []
        for name, value in cursors.items():
            cursor_args += [name, value, (behind or {}).get(name, -1)]
        argv = [chunk_id, len(prompt_ids), len(cursors), *fields, *cursor_args]
        argv += [message for _, message in pushes]
        argv.append(after_chunk or "")
        result = self._script(keys=lua_keys, args=argv)
        if result and result[0] == b"behind":
            raise CursorBehind(result[1].decode(), int(result[2]))
        if not result:
            for name, args in after:
                self._r.execute_command(name, *args)
            return PublishOutcome(True, [])
        if result == [b"chunk"]:
            return PublishOutcome(False, [])
        return PublishOutcome(False, [prompt_ids[int(i) - 1] for i in result])

    def move_cursor(self, name: str, value: int, behind: int) -> None:
        """Move a cursor past rows that needed no chunk; raises CursorBehind when it is
        behind `behind` (nothing written)."""
        stored = int(
            self._move_cursor(keys=[keys.job_cursors(self._job)], args=[name, value, behind])
        )
        if stored >= 0:
            raise CursorBehind(name, stored)

    def requeue(
        self, chunk_id: str, payload: dict[str, Any], prompt_ids: list[str], dlq_key: str
    ) -> list[str]:
        """Publish a chunk of dead-lettered prompts and remove their entries from
        `dlq_key`, together. Returns [] when done, else the ids no longer dead-lettered
        (nothing was published)."""
        rendered = self._messages.render(chunk_id, payload, self._queue)
        pushes, after = rendered.pushes, rendered.after
        job = self._job
        lua_keys = [dlq_key, keys.job_chunks(job), keys.job_counters(job)]
        lua_keys += [key for key, _ in pushes]
        argv: list[Any] = [chunk_id, len(prompt_ids), *prompt_ids]
        argv += [message for _, message in pushes]
        gone = [x.decode() for x in self._requeue_script(keys=lua_keys, args=argv)]
        if not gone:
            for name, args in after:
                self._r.execute_command(name, *args)
        return gone

    def close(self) -> None:
        self._messages.close()
