"""Exactly-once commits of shards, with Redis as the authority on which shard holds an id.

Commit protocol for a shard (the file is already durably written under its temp name):
1. claim: one Lua script maps every id of the shard to it in the job's `committed` index
   (bucketed hashes, common/ledger/id_buckets.py; a regular shard name stored as its number)
   and records the shard as pending with its claim's expiry, or, if any id already belongs to
   another shard, claims nothing and names those ids (the caller drops them, rewrites the
   temp file, and claims again);
2. the owner renames the file into place (only while its claim has a safety margin left,
   and Redis still holds its claim: a Redis restored from an older copy may have lost it);
3. finalize: one Lua script moves the shard from pending to the job's shard list, acks
   and deletes its stream entries, drops its ids' generate and tokenize dead letters (a
   requeued id that succeeds leaves the DLQ), and adds the shard to the job's committed counters and
   progress samples (what `regen status` reads its rates from).
A crash between 1 and 3 leaves a pending shard; once its claim expires any consumer of
the job resolves it from the filesystem alone: a shard in place is finalized, a missing
one has its claims released so its results, still unacked on the stream, are written
again. Either way no id is ever in two shards, and none is lost.

The ledger is the one reader and writer of these keys (`committed`, the pending and
placed shard hashes, the shard counter, the epoch, the progress samples): `regen status` and
`regen verify` read them through its read methods and COUNT_LUA, so the pending-claim
JSON, the stored form of a shard and the key names are known here alone. The index's
size is a counter (`committed_index` in the job's counters) that each script writing
the index keeps in step, so counts stay O(1).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass

import orjson
import redis

from regen.common import keys, settings
from regen.common.connection import bytes_hash
from regen.common.ledger.committed_index import committed_index
from regen.common.ledger.shard_names import shard_name, shard_number
from regen.common.quality_flags import FLAGS

# A claim is good for CLAIM_S; the owner renames only with CLAIM_MARGIN_S to spare, so
# a recovery (after expiry) never races a rename. A claim, not a lease: a chunk's lease
# is the generate stage's (consumers/generate/chunk_life).
CLAIM_S = settings.current().shard_lease_s
CLAIM_MARGIN_S = CLAIM_S / 2

# map_ids(counters, first, n, at, shard): maps the ids whose fields are ARGV[at..],
# each in its bucket KEYS[first..], to the stored shard, counting the ids new to the index.
_MAP_IDS_LUA = f"""
local function map_ids(counters, first, n, at, shard)
  local added = 0
  for i = 0, n - 1 do added = added + redis.call('HSET', KEYS[first + i], ARGV[at + i], shard) end
  if added > 0 then redis.call('HINCRBY', counters, '{keys.COMMITTED_INDEX}', added) end
end
"""

# KEYS: pending, counters, then the bucket of each id. ARGV: shard, pending record,
# stored shard, ids' fields... Returns the 1-based positions of the ids another shard
# holds (nothing claimed), or {}.
_CLAIM_LUA = (
    _MAP_IDS_LUA
    + """
local taken = {}
local n = #ARGV - 3
for i = 1, n do
  local owner = redis.call('HGET', KEYS[2 + i], ARGV[3 + i])
  if owner and owner ~= ARGV[3] then table.insert(taken, i) end
end
if #taken > 0 then return taken end
map_ids(KEYS[2], 3, n, 4, ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return {}
"""
)

# Progress samples kept per job (keys.job_progress): at one commit a minute or faster,
# more than `regen status` needs for its rate window.
PROGRESS_SAMPLES = 1000

# KEYS: pending, shards, stream, dlq generate, dlq tokenize, counters, progress (+ more
# for a script that needs them). record() moves a shard from pending to the shard list,
# acks and deletes its stream entries (ARGV[e_first..e_last]) and drops the dead letters
# of its ids (ARGV[i_first..i_last]). The counters and the progress sample move only when
# the shard is new to the shard list: a recovery may record a shard again, and must not
# count it twice. Returns 1 when the shard was new to the list.
_RECORD_LUA = f"""
local function record(shard, row, group, e_first, e_last, i_first, i_last)
  redis.call('HDEL', KEYS[1], shard)
  local new = redis.call('HSET', KEYS[2], shard, row)
  if new == 1 then
    local info = cjson.decode(row)
    local prompts = redis.call('HINCRBY', KEYS[6], '{keys.COMMITTED_PROMPTS}',
                               i_last - i_first + 1)
    local tokens = redis.call('HINCRBY', KEYS[6], '{keys.COMMITTED_OUTPUT_TOKENS}',
                              info['completion_tokens'])
    redis.call('HINCRBY', KEYS[6], '{keys.COMMITTED_SHARD_BYTES}', info['compressed_bytes'])
    if type(info['flags']) == 'table' then
      for flag, n in pairs(info['flags']) do
        redis.call('HINCRBY', KEYS[6], '{keys.COMMITTED_FLAG_PREFIX}' .. flag, n)
      end
    end
    if type(info['server_versions']) == 'table' then
      for version, n in pairs(info['server_versions']) do
        redis.call('HINCRBY', KEYS[6], '{keys.COMMITTED_SERVER_VERSION_PREFIX}' .. version, n)
      end
    end
    local t = redis.call('TIME')
    local sample = string.format('[%s.%06d,%d,%d]', t[1], tonumber(t[2]), prompts, tokens)
    redis.call('LPUSH', KEYS[7], sample)
    redis.call('LTRIM', KEYS[7], 0, {PROGRESS_SAMPLES - 1})
  end
  for i = e_first, e_last do
    redis.call('XACK', KEYS[3], group, ARGV[i])
    redis.call('XDEL', KEYS[3], ARGV[i])
  end
  for i = i_first, i_last do
    redis.call('HDEL', KEYS[4], ARGV[i])
    redis.call('HDEL', KEYS[5], ARGV[i])
  end
  return new
end
"""

# ARGV: shard, manifest row, group, n entries, entries..., ids...
_FINALIZE_LUA = (
    _RECORD_LUA
    + """
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 0 and redis.call('HEXISTS', KEYS[1], ARGV[1]) == 0
then return 0 end
local n = tonumber(ARGV[4])
record(ARGV[1], ARGV[2], ARGV[3], 5, 4 + n, 5 + n, #ARGV)
return 1
"""
)

# `regen recover`: a shard on disk that Redis lost (or never finalized) is recorded as
# its writer would have. KEYS[8..]: the bucket of each remapped id. ARGV: shard,
# manifest row, n remapped, stored shard, remapped ids' fields..., every id of the shard.
# Remapped ids (free, or on a shard not on disk) are mapped to it.
_RESTORE_LUA = (
    _RECORD_LUA
    + _MAP_IDS_LUA
    + """
local n = tonumber(ARGV[3])
map_ids(KEYS[6], 8, n, 5, ARGV[4])
return record(ARGV[1], ARGV[2], '', 1, 0, 5 + n, #ARGV)
"""
)

# KEYS: shards, pending; ARGV: shard names. The names in neither.
_UNKNOWN_LUA = """
local unknown = {}
for i = 1, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 0 and redis.call('HEXISTS', KEYS[2], ARGV[i]) == 0
  then table.insert(unknown, ARGV[i]) end
end
return unknown
"""

# KEYS: a counter; ARGV: a floor, and 1 to go one above it. Returns {before, after}.
_RAISE_LUA = """
local before = tonumber(redis.call('GET', KEYS[1]) or '0')
local after = math.max(before, tonumber(ARGV[1])) + tonumber(ARGV[2])
if after ~= before then redis.call('SET', KEYS[1], after) end
return {before, after}
"""
# Names per _UNKNOWN_LUA call: keeps each call short.
_NAMES_BATCH = 1000

# For a read script of an operator command that counts the ledger in the same atomic
# reading as other keys (common/ledger/places.count_places): prepend it to the script and call
# ledger_count with the keys of CommitLedger.count_keys(), in order. Returns the ids
# committed or claimed, and the ids claimed by shards still pending.
COUNT_LUA = f"""
local function ledger_count(counters, pending)
  local claimed = 0
  for _, raw in ipairs(redis.call('HVALS', pending)) do
    claimed = claimed + #cjson.decode(raw)['ids']
  end
  return tonumber(redis.call('HGET', counters, '{keys.COMMITTED_INDEX}') or '0'), claimed
end
"""
_COUNT_ONLY_LUA = COUNT_LUA + "return {ledger_count(KEYS[1], KEYS[2])}"

# KEYS: pending, counters, then the bucket of each id; ARGV: shard, owner-or-empty,
# stored shard, ids' fields...
_RELEASE_LUA = f"""
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return 0 end
if ARGV[2] ~= '' and cjson.decode(raw)['owner'] ~= ARGV[2] then return 0 end
local removed = 0
for i = 4, #ARGV do
  if redis.call('HGET', KEYS[i - 1], ARGV[i]) == ARGV[3] then
    removed = removed + redis.call('HDEL', KEYS[i - 1], ARGV[i])
  end
end
if removed > 0 then redis.call('HINCRBY', KEYS[2], '{keys.COMMITTED_INDEX}', -removed) end
redis.call('HDEL', KEYS[1], ARGV[1])
return 1
"""


def _stored_shard(shard: str) -> str:
    """A shard as the index stores it: a regular name as its number (a listpack keeps
    that as an integer of a few bytes), any other name after a '~'."""
    seq = shard_number(shard)
    return str(seq) if seq is not None and shard_name(seq) == shard else f"~{shard}"


def _shard_of(stored: bytes) -> str:
    text = stored.decode()
    return text[1:] if text.startswith("~") else shard_name(int(text))


@dataclass(frozen=True)
class PendingShard:
    shard: str
    owner: str
    # When the claim expires; the field's name in the pending records Redis holds.
    lease_until: float
    ids: list[str]

    def expired(self, now: float | None = None) -> bool:
        return (now or time.time()) > self.lease_until


@dataclass(frozen=True)
class Sample:
    """Committed totals of a job at one moment (Redis server time)."""

    time: float
    prompts: int
    tokens: int


@dataclass(frozen=True)
class CommitTotals:
    """A job's committed output, as `regen status` shows it."""

    shards: int  # shards in place
    shard_bytes: int
    samples: list[Sample]  # taken at each shard commit, oldest first
    now: Sample  # the committed totals now
    flags: dict[str, int]  # committed records with each quality flag
    server_versions: dict[str, int]  # committed records by their server's SGLang version


def _prefixed(counters: dict[str, int], prefix: str) -> dict[str, int]:
    """The counters whose field starts with `prefix`, by the rest of the field."""
    return {
        field.removeprefix(prefix): value
        for field, value in counters.items()
        if field.startswith(prefix)
    }


class CommitLedger:
    """The Redis side of one job's shards."""

    def __init__(self, r: redis.Redis, job: str) -> None:
        """The index's bucket count is the job spec's: a job whose spec Redis lacks, or
        one an older regen wrote, raises JobSpecError."""
        self._r = r
        self._job = job
        self._index = committed_index(r, job)
        self._claim = r.register_script(_CLAIM_LUA)
        self._finalize = r.register_script(_FINALIZE_LUA)
        self._restore = r.register_script(_RESTORE_LUA)
        self._unknown = r.register_script(_UNKNOWN_LUA)
        self._raise = r.register_script(_RAISE_LUA)
        self._release = r.register_script(_RELEASE_LUA)
        self._count = r.register_script(_COUNT_ONLY_LUA)

    def next_shard_seq(self) -> int:
        return int(self._r.incr(keys.shard_seq(self._job)))

    def owner_of(self, ids: list[str]) -> list[str | None]:
        """The shard each id is committed (or claimed) to, None when free."""
        return [None if v is None else _shard_of(v) for v in self._index.get(ids)]

    def pending(self) -> dict[str, PendingShard]:
        raw = bytes_hash(self._r.hgetall(keys.pending_shards(self._job)))
        return {k.decode(): PendingShard(**orjson.loads(v)) for k, v in raw.items()}

    def claim(self, shard: str, owner: str, ids: list[str]) -> tuple[list[str], PendingShard]:
        """Claim ids for shard; returns (ids owned by other shards, the pending record)."""
        record = PendingShard(shard, owner, time.time() + CLAIM_S, ids)
        buckets, fields = self._index.keys_and_fields(ids)
        taken = self._claim(
            keys=[keys.pending_shards(self._job), keys.job_counters(self._job), *buckets],
            args=[shard, orjson.dumps(asdict(record)), _stored_shard(shard), *fields],
        )
        return [ids[int(i) - 1] for i in taken], record

    def holds(self, pending: PendingShard) -> bool:
        """Whether Redis still records this claim: not released by a recovery, nor lost
        to a Redis restored from a copy taken before it."""
        raw = self._r.hget(keys.pending_shards(self._job), pending.shard)
        if raw is None:
            return False
        record = PendingShard(**orjson.loads(raw))
        return (record.owner, record.lease_until) == (pending.owner, pending.lease_until)

    def _record_keys(self) -> list[str]:
        """The KEYS of _RECORD_LUA, in order."""
        job = self._job
        return [
            keys.pending_shards(job),
            keys.shards(job),
            keys.results_stream(job),
            keys.dlq(job, "generate"),
            keys.dlq(job, "tokenize"),
            keys.job_counters(job),
            keys.job_progress(job),
        ]

    def finalize(self, shard: str, manifest_row: bytes, entries: list[str], ids: list[str]) -> bool:
        done = self._finalize(
            keys=self._record_keys(),
            args=[shard, manifest_row, keys.TOKENIZE_GROUP, len(entries), *entries, *ids],
        )
        return bool(done)

    def release(self, pending: PendingShard, *, owner: str | None = None) -> bool:
        """Undo a claim whose shard never reached its place (owner: only if still ours)."""
        buckets, fields = self._index.keys_and_fields(pending.ids)
        done = self._release(
            keys=[keys.pending_shards(self._job), keys.job_counters(self._job), *buckets],
            args=[pending.shard, owner or "", _stored_shard(pending.shard), *fields],
        )
        return bool(done)

    # --- the ledger against the disk (consumers/tokenize/ledger_vs_disk.py, `regen recover`) --

    def epoch(self) -> int:
        """The ledger's epoch (keys.job_epoch): 0 before the job's first shard, and in a
        Redis that lost it."""
        return int(self._r.get(keys.job_epoch(self._job)) or 0)

    def start_epoch(self) -> int:
        """Epoch 1 at the job's first shard, unless one is set; returns the epoch."""
        self._r.set(keys.job_epoch(self._job), 1, nx=True)
        return self.epoch()

    def raise_epoch(self, above: int) -> tuple[int, int]:
        """(before, after): a new epoch, one above both the ledger's and `above`."""
        before, after = self._raise(keys=[keys.job_epoch(self._job)], args=[above, 1])
        return int(before), int(after)

    def raise_shard_seq(self, at_least: int) -> tuple[int, int]:
        """(before, after): the shard counter moved up to `at_least` if it was below, so
        the next shard number is new on disk."""
        before, after = self._raise(keys=[keys.shard_seq(self._job)], args=[at_least, 0])
        return int(before), int(after)

    def unknown_shards(self, names: list[str]) -> list[str]:
        """The shard names neither in place nor pending here: on disk, `names` are shards
        this ledger has lost."""
        lua_keys = [keys.shards(self._job), keys.pending_shards(self._job)]
        unknown: list[str] = []
        for start in range(0, len(names), _NAMES_BATCH):
            found = self._unknown(keys=lua_keys, args=names[start : start + _NAMES_BATCH])
            unknown += [name.decode() for name in found]
        return unknown

    def restore(self, shard: str, manifest_row: bytes, remap: list[str], ids: list[str]) -> bool:
        """Record a shard found on disk as committed: `remap` (ids free, or committed to a
        shard that is not on disk) are mapped to it, and it is finalized with all its
        `ids` (those in `remap` included), as its writer would have. True when the shard
        was new to the shard list."""
        buckets, fields = self._index.keys_and_fields(remap)
        args: list[str | bytes | int] = [shard, manifest_row, len(remap), _stored_shard(shard)]
        args += [*fields, *ids]
        return bool(self._restore(keys=[*self._record_keys(), *buckets], args=args))

    # --- reads of the operator commands (`regen status`, `regen verify`) ---------------

    def shard_names(self) -> tuple[set[str], set[str]]:
        """(shards in place, shards being committed)."""
        pipe = self._r.pipeline(transaction=False)
        pipe.hkeys(keys.shards(self._job))
        pipe.hkeys(keys.pending_shards(self._job))
        final, pending = pipe.execute()
        return {k.decode() for k in final}, {k.decode() for k in pending}

    def iter_committed(self) -> Iterator[tuple[str, str]]:
        """(id, shard) of every id committed or claimed, a few buckets at a time: each
        id once (an id claimed meanwhile may be missed or seen)."""
        for pid, stored in self._index.items():
            yield pid, _shard_of(stored)

    def count_keys(self) -> list[str]:
        """The keys COUNT_LUA's ledger_count takes, in order."""
        return [keys.job_counters(self._job), keys.pending_shards(self._job)]

    def count(self) -> tuple[int, int]:
        """(ids committed or claimed, ids claimed by shards still pending), read at once."""
        committed, claimed = self._count(keys=self.count_keys())
        return int(committed), int(claimed)

    def totals(self) -> CommitTotals:
        """Shards in place, their bytes, and the progress samples with the totals now."""
        job = self._job
        pipe = self._r.pipeline(transaction=False)
        pipe.hlen(keys.shards(job))
        pipe.lrange(keys.job_progress(job), 0, -1)
        # The counters hash holds a few dozen fields at most (the versions' among them,
        # whose names are not known ahead): one read of all of it.
        pipe.hgetall(keys.job_counters(job))
        pipe.time()
        shards, raw_samples, raw_counters, (secs, micros) = pipe.execute()
        counters = {k.decode(): int(v) for k, v in bytes_hash(raw_counters).items()}
        flags = _prefixed(counters, keys.COMMITTED_FLAG_PREFIX)
        return CommitTotals(
            shards=shards,
            shard_bytes=counters.get(keys.COMMITTED_SHARD_BYTES, 0),
            samples=[Sample(*orjson.loads(raw)) for raw in reversed(raw_samples)],
            now=Sample(
                secs + micros / 1e6,
                counters.get(keys.COMMITTED_PROMPTS, 0),
                counters.get(keys.COMMITTED_OUTPUT_TOKENS, 0),
            ),
            flags={flag: flags.get(flag, 0) for flag in FLAGS},
            server_versions=_prefixed(counters, keys.COMMITTED_SERVER_VERSION_PREFIX),
        )
