"""Where each of a job's prompt ids is: the counts `regen status` shows, the id-level
reads `regen verify` places every id with, and the ids in no place that the job's
follower and `regen recover` give back to the job's enqueue.

A prompt id is, at any moment, in one of these places (docs/design/exactly-once.md, Accounting), in
the order it moves through them:
- waiting: in a chunk on the job's generate queue (kombu's Redis lists);
- in flight: in a chunk a worker holds (kombu's `unacked` hash), as a result on the
  job's results stream, or claimed by a shard that is still being committed;
- done: committed to a shard in place (`committed`, less the claims of pending shards);
- dead-lettered: in one of the job's DLQs, with a reason (its most downstream stage
  counts);
- purged: its dead letter deleted for good by an operator (`keys.dlq_purged`).
A chunk's prompts already handed off (`chunk_generated`: result on the stream, or in the
DLQ) are not counted with their chunk: they are wherever the hand-off put them.

Everything here reads a window of the job, not the job: queued and unacked chunks (at
most the producer's high-water mark plus the fleet's concurrency), pending shards and
the DLQs; the rest are O(1) counts. Chunk messages can be large (every prompt's token
ids), so for the counts their ids are picked out inside Redis, a few messages per call,
and only the ids come back; placing every id decodes them whole, a few at a time.

The reads are not one transaction (a job can hold 1M ids), so on a running job an id can
move between them: they follow the direction prompts move (a prompt moving on meanwhile
is seen twice, not missed), and an id that looks wrong gets a second look with fresh
reads. This module only reads, but for `forget_missing`, which takes ids in no place out
of the job's ids (common/ledger/job_ids.py writes them).
"""

from __future__ import annotations

import base64
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson
import redis

from regen.common import jobspec, keys
from regen.common.chunk import ChunkPrompt
from regen.common.conversation import split_turn_id, turn_id
from regen.common.jobspec import JobSpec
from regen.common.ledger.commit_ledger import COUNT_LUA, CommitLedger
from regen.common.ledger.job_ids import JobIds
from regen.common.queues import queue_lists
from regen.common.results import FIELD

# Ids per call of a batched read (HMGET of the committed index, of the job's ids).
BATCH = 1000


def batches(items: Iterable[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for item in items:
        batch.append(item)
        if len(batch) == BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


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
_PLACE_COUNTS_LUA = (
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
    script = r.register_script(_PLACE_COUNTS_LUA)
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


# --- every id, placed (regen verify) --------------------------------------------------

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
    """From the head, in slices: see _list_task_ids for why none is skipped."""
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
    of window_chunks (a chunk seen in both places counts in flight)."""
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


# Problems kept per kind, with their ids; beyond that they are only counted.
MAX_LISTED = 100


@dataclass
class Reconciliation:
    job: str
    enqueued: int = 0
    places: Counter[str] = field(default_factory=Counter)
    # Ids placed in a DLQ: stage -> reason -> count.
    dead_letters: dict[str, Counter[str]] = field(default_factory=dict)
    notes: Counter[str] = field(default_factory=Counter)
    problem_counts: Counter[str] = field(default_factory=Counter)
    problems: list[tuple[str, str, str]] = field(default_factory=list)  # kind, id, detail
    shards_read: int = 0
    shard_ids_read: int = 0
    shards_note: str = ""
    # What is not a problem of accounting but worth knowing (servers' versions mixed).
    warnings: list[str] = field(default_factory=list)
    max_listed: int = MAX_LISTED  # problems listed per kind

    def problem(self, kind: str, subject: str, detail: str) -> None:
        self.problem_counts[kind] += 1
        if self.problem_counts[kind] <= self.max_listed:
            self.problems.append((kind, subject, detail))

    @property
    def ok(self) -> bool:
        return not self.problem_counts

    def to_dict(self) -> dict[str, Any]:
        return {
            "job": self.job, "ok": self.ok, "enqueued": self.enqueued,
            "places": dict(self.places),
            "dead_letters": {
                s: dict(self.dead_letters[s]) for s in keys.STAGES if s in self.dead_letters
            },
            "notes": dict(self.notes), "problem_counts": dict(self.problem_counts),
            "problems": [{"kind": k, "id": i, "detail": d} for k, i, d in self.problems],
            "shards_read": self.shards_read, "shard_ids_read": self.shard_ids_read,
            "shards_note": self.shards_note, "warnings": self.warnings,
        }  # fmt: skip


@dataclass
class _Window:
    """The job's moving parts at one reading."""

    waiting: set[str] = field(default_factory=set)  # open in a queued chunk
    # Open in a chunk a worker holds, a result on the stream, or claimed by a shard
    # being committed.
    in_flight: set[str] = field(default_factory=set)
    chunk_of: dict[str, str] = field(default_factory=dict)  # open id -> its chunk
    stream: Counter[str] = field(default_factory=Counter)
    dead: dict[str, list[str]] = field(default_factory=dict)  # id -> stages
    reasons: dict[str, dict[str, str]] = field(default_factory=dict)  # stage -> id -> reason
    pending: dict[str, list[str]] = field(default_factory=dict)  # shard -> claimed ids
    purged: set[str] = field(default_factory=set)
    everywhere: set[str] = field(default_factory=set)  # every id seen, for "not enqueued"


def _read_window(
    r: redis.Redis, ledger: CommitLedger, spec: JobSpec, report: Reconciliation | None
) -> _Window:
    """Read in the direction prompts move (queues, workers, stream, shards being
    committed, DLQs), so a prompt moving on meanwhile is seen twice, not missed."""
    w = _Window()
    for chunk in window_contents(r, spec):
        w.everywhere.update(chunk.prompt_ids)
        for pid in chunk.open_ids:
            other = w.chunk_of.setdefault(pid, chunk.chunk_id)
            if other != chunk.chunk_id and report is not None:
                report.problem("in_two_chunks", pid, f"chunks {other} and {chunk.chunk_id}")
            (w.in_flight if chunk.in_flight else w.waiting).add(pid)
    w.stream.update(stream_result_ids(r, spec.name))
    w.pending = {shard: claim.ids for shard, claim in ledger.pending().items()}
    w.in_flight.update(w.stream, *w.pending.values())
    for stage in keys.STAGES:
        w.reasons[stage] = dead_letter_reasons(r, spec.name, stage)
        for entry_id in w.reasons[stage]:
            if is_prompt_entry(entry_id):
                w.dead.setdefault(entry_id, []).append(stage)
    w.purged = {text(m) for m in r.sscan_iter(keys.dlq_purged(spec.name), count=BATCH)}
    w.everywhere.update(w.in_flight, w.dead, w.purged)
    return w


def _classify(
    report: Reconciliation, w: _Window, ids: list[str], owners: list[str | None], final: bool
) -> list[str]:
    """Place each id (see the module doc). On a first pass (`final` False) an id that
    looks wrong is not placed but returned, for a second look with fresh reads."""
    second_look = []
    for pid, owner in zip(ids, owners, strict=True):
        stages = w.dead.get(pid, [])
        done = owner is not None and owner not in w.pending
        live = "in_flight" if pid in w.in_flight else "waiting" if pid in w.waiting else None
        placed = bool(done or live or stages or pid in w.purged)
        if not final and (len(stages) > 1 or bool(stages and (done or live)) or not placed):
            second_look.append(pid)
            continue
        if len(stages) > 1:
            report.problem("dead_lettered_twice", pid, f"in the {' and '.join(stages)} DLQs")
        if done:
            report.places["done"] += 1
            if stages:
                report.problem("done_and_dead_lettered", pid, f"in {owner}, {stages[0]} DLQ")
            if w.stream[pid]:  # a chunk ran twice: the tokenize stage drops the result
                report.notes["result_of_a_done_prompt"] += 1
            if pid in w.chunk_of:  # will be generated again, and dropped the same way
                report.notes["done_and_open_in_a_chunk"] += 1
        elif live is not None:
            report.places[live] += 1
            if stages:
                report.problem("live_and_dead_lettered", pid, f"{live}, {stages[0]} DLQ")
            if w.stream[pid] > 1:
                report.notes["duplicate_results"] += 1
        elif stages:
            stage = stages[-1]  # keys.STAGES order: the most downstream
            report.places["dead_lettered"] += 1
            report.dead_letters.setdefault(stage, Counter())[w.reasons[stage][pid]] += 1
        elif pid in w.purged:
            report.places["purged"] += 1
        else:
            report.places["missing"] += 1
            report.problem("missing", pid, "enqueued, in no queue, worker, stream, shard or DLQ")
    return second_look


def _enqueued(r: redis.Redis, job: str) -> set[str]:
    """The job's ids. ~100 bytes an id."""
    return set(JobIds(r, job))


def missing_ids(r: redis.Redis, spec: JobSpec) -> list[str]:
    """Every id of the job in no place, each seen so in two readings (the module doc)."""
    report = Reconciliation(spec.name, max_listed=1 << 62)
    place_enqueued(r, CommitLedger(r, spec.name), spec, report)
    return [pid for kind, pid, _ in report.problems if kind == "missing"]


def place_enqueued(
    r: redis.Redis, ledger: CommitLedger, spec: JobSpec, report: Reconciliation
) -> tuple[_Window, set[str]]:
    """Place every id of the job; (the first reading, the job's ids)."""
    w = _read_window(r, ledger, spec, report)
    enqueued = _enqueued(r, spec.name)
    report.enqueued = len(enqueued)
    second_look = []
    for batch in batches(enqueued):
        second_look += _classify(report, w, batch, ledger.owner_of(batch), False)
    if second_look:  # on a running job, an id may have moved between two reads
        fresh = _read_window(r, ledger, spec, None)
        _classify(report, fresh, second_look, ledger.owner_of(second_look), True)
    return w, enqueued


def forget_missing(r: redis.Redis, spec: JobSpec, missing: list[str]) -> int:
    """Take the ids in no place (`regen verify`'s `missing`, missing_ids) out
    of the job's ids, so that the job's enqueue, reading its files from the first row,
    queues them again.
    An id goes missing when its chunk does: popped off the queue by a worker but never
    recorded in `unacked` (kombu's BRPOP-then-HSET window), as when Redis dies between
    popping it and answering. With `--turns all` the first turn of each conversation
    with a turn missing goes too: that is how the enqueue finds a conversation to
    resume after its settled turns (producer/lost_turns.py), on the answers `regen
    recover` saves from the shards (consumers/tokenize/recover_turns.py). Returns how
    many ids were taken out."""
    if spec.turns == jobspec.TURNS_ALL:
        firsts = {turn_id(split_turn_id(tid)[0], 0) for tid in missing}
        missing = sorted(set(missing) | firsts)
    return JobIds(r, spec.name).remove(missing)
