"""A chunk's state in Redis, and the only code that writes it.

Per chunk of a job (docs/design/exactly-once.md, Redis keys and Delivery protocol):

- its attempts list (`keys.chunk_attempts`): one entry per delivery that started, each
  "started" until the delivery ends it (outcome.AttemptStatus); a delivery holds the
  chunk only while its entry is the last;
- its write count (`keys.chunk_writes`): the writes the delivery holding it made, so a
  Redis restored from an older copy is caught (it cannot fake a count the worker holds);
- its `generated` set (`keys.chunk_generated`): the prompts settled (handed off,
  dead-lettered, or given back to the queue in a new chunk), so a redelivery skips them.
  Written by the hand-off and give-back scripts below and by `mark_generated`, always
  in a lease-checked write (lease.py), read by `read_generated`; deleted by the ack
  script once nothing can redeliver the chunk. Outside a delivery,
  only recovery writes it (common/conversation.py, `regen recover` and the producer
  resuming a conversation Redis lost), before any delivery of the chunk runs.

Every key lives CHUNK_STATE_TTL_S past its last write: a redelivery that races the
acknowledgement still finds which prompts are done, then it expires (flat memory).
kombu's own keys (`unacked`, `unacked_index`) are touched here only by the scripts.
"""

from __future__ import annotations

import time

import orjson
import redis

from regen.common import defaults, keys
from regen.common.chunk import Chunk
from regen.common.connection import bytes_set
from regen.consumers.generate.chunk_life.outcome import AttemptStatus

Attempt = dict[str, object]

CHUNK_STATE_TTL_S = defaults.CHUNK_STATE_TTL_S


def attempt_entry(worker: str, status: AttemptStatus, error: str | None = None) -> bytes:
    """One entry of the attempts list: who, when, and how the delivery stands."""
    return orjson.dumps({"worker": worker, "time": time.time(), "status": status, "error": error})


def mark_generated(pipe: redis.client.Pipeline, chunk: Chunk, *prompt_ids: str) -> None:
    """Record that prompts of the chunk are settled (handed off or dead-lettered), so a
    redelivery of the chunk skips them. Only inside a lease-checked write (lease.py)."""
    key = keys.chunk_generated(chunk.job, chunk.chunk_id)
    pipe.sadd(key, *prompt_ids)
    pipe.expire(key, CHUNK_STATE_TTL_S)


def read_generated(r: redis.Redis, chunk: Chunk) -> set[str]:
    """The chunk's prompts settled so far (by any delivery)."""
    marks = bytes_set(r.smembers(keys.chunk_generated(chunk.job, chunk.chunk_id)))
    return {m.decode() for m in marks}


# KEYS: unacked_index, then per lease its attempts list, write count and generated set.
# ARGV: now, state TTL, then per lease its delivery tag ('' = none) and attempt index.
# Renews the leases still held (and, when half gone, the TTL of their chunk's state);
# returns the 1-based positions of the leases lost.
RENEW_LUA = """
local lost = {}
local ttl = tonumber(ARGV[2])
for i = 1, (#KEYS - 1) / 3 do
  local attempts, writes, generated = KEYS[3 * i - 1], KEYS[3 * i], KEYS[3 * i + 1]
  local tag = ARGV[2 * i + 1]
  local held = redis.call('LLEN', attempts) == tonumber(ARGV[2 * i + 2]) + 1
  if held and tag ~= '' then held = redis.call('ZSCORE', KEYS[1], tag) ~= false end
  if held then
    if tag ~= '' then redis.call('ZADD', KEYS[1], 'XX', ARGV[1], tag) end
    for _, key in ipairs({attempts, writes, generated}) do
      if redis.call('TTL', key) < ttl / 2 then redis.call('EXPIRE', key, ttl) end
    end
  else
    table.insert(lost, i)
  end
end
return lost
"""


# KEYS: unacked_index, unacked, the chunk's generated set, its write count; ARGV: the
# delivery tag. kombu's ack, and the end of the chunk's `generated` set (one id per
# prompt) and write count once it is acked: nothing redelivers an acked chunk (kombu's
# restore is a transaction watching `unacked`, which this HDEL changes), so they would
# only wait out their TTL. If the
# sweep restored the delivery after the lease check (its tag is gone from the index),
# the chunk is queued again and the set stays for its next delivery. The attempts list
# (one entry per delivery) stays for its TTL: the chunk's history (docs/design/delivery.md,
# Delivery protocol).
ACK_LUA = """
local acked = redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if acked == 1 then redis.call('DEL', KEYS[3], KEYS[4]) end
return acked
"""

# KEYS: attempts list, write count; ARGV: the attempt's JSON, state TTL.
# A delivery starts: its attempt appended, the chunk's write count set to 0 for it.
# Returns every attempt so far (this one last).
START_LUA = """
redis.call('RPUSH', KEYS[1], ARGV[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('SET', KEYS[2], 0, 'EX', ARGV[2])
return redis.call('LRANGE', KEYS[1], 0, -1)
"""

# The lease check of `ChunkLease.write` (lease.py), at the head of every script that
# writes under a chunk's lease. KEYS 1-3: attempts list, unacked_index, write count;
# ARGV 1-4: attempt index, delivery tag ('' = none), writes made, state TTL. Returns
# {status} (LOST_WHY) when this delivery does not hold the chunk (nothing written),
# else counts this write and goes on.
LEASE_CHECK_LUA = """
if redis.call('LLEN', KEYS[1]) ~= tonumber(ARGV[1]) + 1 then return {1} end
if ARGV[2] ~= '' and redis.call('ZSCORE', KEYS[2], ARGV[2]) == false then return {2} end
local writes = tonumber(redis.call('GET', KEYS[3]))
local made = tonumber(ARGV[3])
if writes ~= made and writes ~= made + 1 then return {3} end
redis.call('SET', KEYS[3], made + 1, 'EX', ARGV[4])
"""

# KEYS: attempts list, unacked_index, write count, generated set, results stream, then
# the conversations' checkpoint keys (`--turns all`).
# ARGV: attempt index, delivery tag ('' = none), writes made, state TTL, the stream's
# field name, then per result: its prompt id, its encoded result, the position in KEYS
# of its checkpoint (0 = none), the checkpoint's field and the answer ('' deletes it).
# The lease check of `ChunkLease.write` (lease.py) and a batch of hand-offs in one
# atomic step: each result is added to the stream with its prompt's mark (and a turn's
# answer with it), unless the prompt was settled already (a retry whose first try landed). Returns
# {0, flag per result: 1 handed off, 0 already settled}, or {status} (LOST_WHY) when
# this delivery does not hold the chunk (nothing written).
HAND_OFF_LUA = (
    LEASE_CHECK_LUA
    + """
local flags = {0}
for i = 6, #ARGV, 5 do
  local fresh = redis.call('SADD', KEYS[4], ARGV[i])
  if fresh == 1 then
    redis.call('XADD', KEYS[5], '*', ARGV[5], ARGV[i + 1])
    local at = tonumber(ARGV[i + 2])
    if at > 0 and ARGV[i + 4] == '' then
      redis.call('DEL', KEYS[at])
    elseif at > 0 then
      redis.call('HSET', KEYS[at], ARGV[i + 3], ARGV[i + 4])
      redis.call('EXPIRE', KEYS[at], ARGV[4])
    end
  end
  table.insert(flags, fresh)
end
redis.call('EXPIRE', KEYS[4], ARGV[4])
return flags
"""
)

# KEYS: attempts list, unacked_index, write count, generated set, the job's chunks hash,
# then the queue list of each new chunk.
# ARGV: attempt index, delivery tag ('' = none), writes made, state TTL, number of ids,
# the ids, then per new chunk: its id, its prompt count, its message.
# The lease check of `ChunkLease.write` (lease.py) and the give-back of prompts this
# delivery has not started, in one atomic step: the ids are marked settled for this
# chunk (a redelivery skips them; they are open in the new chunks alone), each new
# chunk is recorded as the job's and pushed at the consuming end of its list (RPUSH:
# BRPOP takes it next, before chunks published later). A retry whose first try landed
# (its ids already marked) writes nothing more. Returns {0} or {status} (LOST_WHY).
GIVE_BACK_UNSTARTED_LUA = (
    LEASE_CHECK_LUA
    + """
local n_ids = tonumber(ARGV[5])
if redis.call('SISMEMBER', KEYS[4], ARGV[6]) == 1 then return {0} end
for i = 6, 5 + n_ids do redis.call('SADD', KEYS[4], ARGV[i]) end
redis.call('EXPIRE', KEYS[4], ARGV[4])
local k = 6
for a = 6 + n_ids, #ARGV, 3 do
  redis.call('HSET', KEYS[5], ARGV[a], ARGV[a + 1])
  redis.call('RPUSH', KEYS[k], ARGV[a + 2])
  k = k + 1
end
return {0}
"""
)
LOST_WHY = {
    1: "a later delivery of the chunk started",
    2: "its delivery went back to the queue",
    3: "Redis lost writes of this delivery (restored from an older copy)",
}

# KEYS: unacked, the chunk's attempts list, the job's chunks hash, the list the message
# was popped from. ARGV: delivery tag, this delivery's attempt index, chunk id, the
# message as popped. A delivery whose lease was lost puts its message back (RPUSH: the
# tail BRPOP took it from) only when Redis holds it nowhere: not in `unacked` (held, or
# waiting for the sweep), the attempts list without this delivery's start (so Redis is
# behind it: it was neither acked nor restored since), the chunk published (a copy
# taken before its publish lost its ids too: the producer publishes it again), and the
# message not on its list (found by its bytes, else by its tag, a UUID: a copy kombu
# restored carries the redelivered flag; the scan runs only when all else says
# forgotten). Returns 1 when put back.
HAND_BACK_LUA = """
if redis.call('HEXISTS', KEYS[1], ARGV[1]) == 1 then return 0 end
if redis.call('LLEN', KEYS[2]) > tonumber(ARGV[2]) then return 0 end
if redis.call('HEXISTS', KEYS[3], ARGV[3]) == 0 then return 0 end
if redis.call('LPOS', KEYS[4], ARGV[4]) then return 0 end
for _, queued in ipairs(redis.call('LRANGE', KEYS[4], 0, -1)) do
  if string.find(queued, ARGV[1], 1, true) then return 0 end
end
redis.call('RPUSH', KEYS[4], ARGV[4])
return 1
"""
