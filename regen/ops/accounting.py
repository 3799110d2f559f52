"""Where a job's prompts are: the counts `regen status` shows, and the reads it shares
with `regen verify` (ops/locate.py holds verify's id-level reads).

A prompt id is, at any moment, in one of these places (docs/design.md, Accounting):
- waiting: in a chunk on the job's generate queue (kombu's Redis lists);
- in flight: in a chunk a worker holds (kombu's `unacked` hash), as a result on the
  job's results stream, or claimed by a shard that is still being committed;
- done: committed to a shard in place (`committed`, less the claims of pending shards);
- dead-lettered: in one of the job's DLQs, with a reason;
- purged: its dead letter deleted for good by an operator (`keys.dlq_purged`).
A chunk's prompts already handed off (`chunk_generated`: result on the stream, or in the
DLQ) are not counted with their chunk: they are wherever the hand-off put them.

Everything here reads a window of the job, not the job: queued and unacked chunks (at
most the producer's high-water mark plus the fleet's concurrency), pending shards and
the DLQs; the rest are O(1) counts. Chunk messages can be large (every prompt's token
ids), so their ids are picked out inside Redis, a few messages per call, and only the
ids come back.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import redis

from regen.common import keys
from regen.common.jobspec import JobSpec
from regen.common.queues import queue_lists
from regen.consumers.tokenize.operator_view import COUNT_LUA, CommitLedger

# Messages per script call: each call copies this many (possibly MB-sized) messages
# inside Redis, so keep it small enough that Redis never stalls on one call.
MESSAGES_PER_CALL = 16
ENTRIES_PER_CALL = 500
# A count is retaken when a chunk was published while it was taken, or one was being
# delivered (see count_places); the wait before a retake grows with each attempt.
COUNT_ATTEMPTS = 4
IN_DELIVERY_WAIT_S = 0.1

# The Celery task id (regen sets it to the chunk id) from a kombu message as JSON: the
# message's "headers" come after its base64 body, which holds no quotes, and their
# first "id" key is the task id ("root_id" and "parent_id" do not match '"id"').
_TASK_ID_LUA = """
local function task_id(m)
  local h = string.find(m, '"headers": {', 1, true)
  return h and string.match(m, '"id": "([^"]*)"', h) or ''
end
"""
# KEYS[1]: a queue list; ARGV: first index, count. Returns the task ids, in list order.
_LIST_TASK_IDS_LUA = (
    _TASK_ID_LUA
    + """
local out = {}
local first = tonumber(ARGV[1])
for _, m in ipairs(redis.call('LRANGE', KEYS[1], first, first + tonumber(ARGV[2]) - 1)) do
  out[#out + 1] = task_id(m)
end
return out
"""
)
# KEYS[1]: kombu's unacked hash; ARGV: cursor, count. Returns {cursor, task ids...}.
_UNACKED_TASK_IDS_LUA = (
    _TASK_ID_LUA
    + """
local reply = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local out = {reply[1]}
for i = 2, #reply[2], 2 do out[#out + 1] = task_id(reply[2][i]) end
return out
"""
)
# KEYS[1]: a DLQ hash; ARGV: cursor, count. Returns {cursor, entry id, reason, ...}.
# DeadLetter JSON starts entry_id, job, stage, reason (none can hold a quote), so the
# first "reason" key is the entry's own; only a prefix is searched.
_DLQ_REASONS_LUA = """
local reply = redis.call('HSCAN', KEYS[1], ARGV[1], 'COUNT', ARGV[2])
local out = {reply[1]}
for i = 1, #reply[2], 2 do
  out[#out + 1] = reply[2][i]
  out[#out + 1] = string.match(string.sub(reply[2][i + 1], 1, 1024), '"reason":"([^"]*)"') or '?'
end
return out
"""
# One consistent reading of every count (a script runs atomically), the commit ledger's
# counted by its own fragment (commit.COUNT_LUA).
# KEYS: counters (the job's ids), results stream, chunks, purged ids, the ledger's count
# keys (2), the DLQs
# (keys.STAGES order), then the `chunk_generated` set of each chunk on the queues or in
# flight.
_COUNT_LUA = (
    COUNT_LUA
    + f"""
local committed, claimed = ledger_count(KEYS[5], KEYS[6])
local ids = tonumber(redis.call('HGET', KEYS[1], '{keys.IDS}') or '0')
local out = {{ids, redis.call('XLEN', KEYS[2]), committed, claimed,
              redis.call('HLEN', KEYS[3]), redis.call('SCARD', KEYS[4])}}
for i = 7, #KEYS do
  out[#out + 1] = redis.call(i < {7 + len(keys.STAGES)} and 'HLEN' or 'SCARD', KEYS[i])
end
return out
"""
)


def text(value: bytes | str) -> str:
    return value.decode() if isinstance(value, bytes) else value


def run_script(r: redis.Redis, lua: str, key: str, *args: str | int | bytes) -> list[str]:
    """Run a read-only script on one key (redis-py caches it and sends its hash)."""
    return [text(x) for x in r.register_script(lua)(keys=[key], args=list(args))]


def is_prompt_entry(entry_id: str) -> bool:
    """DLQ entries of a prompt are keyed by its id; a bad row (`row:...`), a malformed
    task (`task:...`) or an unreadable result naming no prompt (`result:...`) has no
    prompt id."""
    return not entry_id.startswith(("row:", "task:", "result:"))


def dead_letter_reasons(r: redis.Redis, job: str, stage: str) -> dict[str, str]:
    """Entry id -> reason of one DLQ, without moving the entries' payloads out of Redis."""
    out: dict[str, str] = {}
    cursor = "0"
    while True:
        cursor, *pairs = run_script(
            r, _DLQ_REASONS_LUA, keys.dlq(job, stage), cursor, ENTRIES_PER_CALL
        )
        out.update(zip(pairs[::2], pairs[1::2], strict=True))
        if cursor == "0":
            return out


# --- chunk ids on the queues and in flight ------------------------------------------------


def _list_task_ids(r: redis.Redis, queue: str) -> Iterator[str]:
    """Task ids in a kombu list, read from the head in slices. kombu pushes at the head
    and pops from the tail, so a push only makes a slice see a message twice (the caller
    dedupes), and a pop never makes it skip one."""
    first = 0
    while True:
        ids = run_script(r, _LIST_TASK_IDS_LUA, queue, first, MESSAGES_PER_CALL)
        yield from ids
        if len(ids) < MESSAGES_PER_CALL:
            return
        first += MESSAGES_PER_CALL


def _unacked_task_ids(r: redis.Redis) -> Iterator[str]:
    cursor = "0"
    while True:
        cursor, *ids = run_script(
            r, _UNACKED_TASK_IDS_LUA, keys.KOMBU_UNACKED, cursor, MESSAGES_PER_CALL
        )
        yield from ids
        if cursor == "0":
            return


def window_chunks(r: redis.Redis, spec: JobSpec) -> dict[str, tuple[bool, int]]:
    """The job's chunks now waiting or in flight: chunk id -> (in flight, size).

    Queues are read before `unacked`, in the direction chunks move, so a chunk delivered
    meanwhile is seen in both (and counted once, in flight) rather than in neither.
    """
    in_flight: dict[str, bool] = {}
    for name in queue_lists(spec.queue):
        in_flight.update(dict.fromkeys(_list_task_ids(r, name), False))
    in_flight.update(dict.fromkeys(_unacked_task_ids(r), True))
    # The unacked hash is shared by every queue, and a queue may be shared by jobs: a
    # chunk is the job's when the job published it.
    candidates = [c for c in in_flight if c]
    sizes = r.hmget(keys.job_chunks(spec.name), candidates) if candidates else []
    return {
        c: (in_flight[c], int(size))
        for c, size in zip(candidates, sizes, strict=True)
        if size is not None
    }


# --- the counts ---------------------------------------------------------------------------


@dataclass(frozen=True)
class PlaceCounts:
    total: int
    waiting: int
    generating: int  # open prompts of the chunks workers hold
    results_pending: int  # results on the stream, not yet in a shard in place
    committing: int  # of which claimed by a shard being committed
    done: int
    dead_lettered: int
    purged: int  # prompts whose dead letters were deleted for good (`regen dlq purge`)
    waiting_chunks: int
    in_flight_chunks: int
    # Prompts dead-lettered: stage -> reason -> count; entries without a prompt (bad
    # rows, malformed chunks): reason -> count.
    dead_letters: dict[str, dict[str, int]] = field(default_factory=dict)
    other_dead_letters: dict[str, int] = field(default_factory=dict)

    @property
    def in_flight(self) -> int:
        return self.generating + self.results_pending

    @property
    def unplaced(self) -> int:
        """Enqueued prompts in no place by these counts: 0 unless something is wrong."""
        placed = self.waiting + self.in_flight + self.done + self.dead_lettered + self.purged
        return self.total - placed


def count_places(r: redis.Redis, spec: JobSpec) -> PlaceCounts:
    """Counts of the job's prompts by place (see the module doc), at O(window) cost.

    The chunk ids are found first (sliced reads), then every count is read in one
    script: a prompt handed off or committed meanwhile is counted once, its chunk
    showing it generated. Two moves can still hide a chunk from one reading, so the
    count is retaken (a few times at most, the last reading kept) when either shows:
    a chunk published between the two reads (the job's chunk total moved), or prompts
    in no place. The latter is a chunk kombu is delivering: its BRPOP takes the message
    off the queue and a later round trip puts it in `unacked`, and in between (longer
    while the generate worker's screen checks it) the chunk is in neither.
    """
    job = spec.name
    dead: dict[str, dict[str, int]] = {}
    other: dict[str, int] = {}
    for stage in keys.STAGES:
        by_reason = dead.setdefault(stage, {})
        for entry_id, reason in dead_letter_reasons(r, job, stage).items():
            tally = by_reason if is_prompt_entry(entry_id) else other
            tally[reason] = tally.get(reason, 0) + 1
    script = r.register_script(_COUNT_LUA)
    ledger = CommitLedger(r, job)
    for attempt in range(1, COUNT_ATTEMPTS + 1):
        published = r.hlen(keys.job_chunks(job))
        chunks = window_chunks(r, spec)
        lua_keys = [
            keys.job_counters(job),
            keys.results_stream(job),
            keys.job_chunks(job),
            keys.dlq_purged(job),
            *ledger.count_keys(),
            *(keys.dlq(job, stage) for stage in keys.STAGES),
            *(keys.chunk_generated(job, c) for c in chunks),
        ]
        total, results, committed, claimed, now_published, purged, *rest = map(
            int, script(lua_keys)
        )
        n_stages = len(keys.STAGES)
        in_dlq, generated = rest[:n_stages], rest[n_stages:]
        open_by_place = {True: 0, False: 0}
        for (in_flight, size), done in zip(chunks.values(), generated, strict=True):
            open_by_place[in_flight] += max(size - done, 0)
        n_in_flight = sum(1 for in_flight, _ in chunks.values() if in_flight)
        counts = PlaceCounts(
            total=total,
            waiting=open_by_place[False],
            generating=open_by_place[True],
            results_pending=results,
            committing=claimed,
            done=committed - claimed,
            dead_lettered=sum(in_dlq) - sum(other.values()),
            purged=purged,
            waiting_chunks=len(chunks) - n_in_flight,
            in_flight_chunks=n_in_flight,
            dead_letters=dead,
            other_dead_letters=other,
        )
        if now_published == published and counts.unplaced == 0:
            break
        if counts.unplaced and attempt < COUNT_ATTEMPTS:
            time.sleep(IN_DELIVERY_WAIT_S * attempt)
    return counts
