"""The job's ids: every prompt id ever enqueued in a job, in bucketed hashes
(common/ledger/id_buckets.py) with their number kept in the job's counters.

The publish script (producer/publish.py) records the ids of each chunk it queues with
ADD_IDS_LUA; a prompt refused at enqueue, or one found settled though Redis lost it,
goes in through `add`; `regen recover` takes out ids in no place (`remove`). Everything
else reads: enqueue's dedupe, status and verify.
"""

from __future__ import annotations

from collections.abc import Iterator

import redis

from regen.common import jobspec, keys
from regen.common.ledger.id_buckets import BucketedIds

# add_ids(counters, first, n, at): records the ids whose fields are ARGV[at..at+n-1],
# each in its bucket KEYS[first..first+n-1], and counts the new ones.
ADD_IDS_LUA = f"""
local function add_ids(counters, first, n, at)
  local added = 0
  for i = 0, n - 1 do
    added = added + redis.call('HSETNX', KEYS[first + i], ARGV[at + i], 1)
  end
  if added > 0 then redis.call('HINCRBY', counters, '{keys.IDS}', added) end
end
"""
# KEYS: counters, then the bucket of each id; ARGV: the ids' fields.
_ADD_LUA = ADD_IDS_LUA + "add_ids(KEYS[1], 2, #ARGV, 1)"
# The same KEYS and ARGV: forget the ids, counting those that were there.
_REMOVE_LUA = f"""
local removed = 0
for i = 1, #ARGV do
  removed = removed + redis.call('HDEL', KEYS[i + 1], ARGV[i])
end
if removed > 0 then redis.call('HINCRBY', KEYS[1], '{keys.IDS}', -removed) end
return removed
"""


class JobIds:
    def __init__(self, r: redis.Redis, job: str) -> None:
        """The bucket count is the stored spec's (a spec given to enqueue more into a
        job may have been sized differently): a job whose spec Redis lacks, or one an
        older regen wrote, raises JobSpecError."""
        self._r = r
        self._job = job
        buckets = jobspec.load(r, job).id_buckets
        self.index = BucketedIds(r, buckets, lambda b: keys.job_ids(job, b))
        self._add = r.register_script(_ADD_LUA)
        self._remove = r.register_script(_REMOVE_LUA)

    def contains(self, ids: list[str]) -> list[bool]:
        return [value is not None for value in self.index.get(ids)]

    def add(self, ids: list[str], pipe: redis.client.Pipeline | None = None) -> None:
        """Record ids in the job (in `pipe`, to land with other writes)."""
        if not ids:
            return
        buckets, fields = self.index.keys_and_fields(ids)
        self._add(keys=[keys.job_counters(self._job), *buckets], args=fields, client=pipe)

    def remove(self, ids: list[str]) -> int:
        """Forget ids, so that the job's enqueue queues them again (`regen recover`, for
        ids in no place); returns how many were there."""
        if not ids:
            return 0
        buckets, fields = self.index.keys_and_fields(ids)
        return int(self._remove(keys=[keys.job_counters(self._job), *buckets], args=fields))

    def count(self) -> int:
        return int(self._r.hget(keys.job_counters(self._job), keys.IDS) or 0)

    def __iter__(self) -> Iterator[str]:
        """Every id of the job, each once (a bucket is read whole)."""
        return (pid for pid, _ in self.index.items())


def reread_from_start(r: redis.Redis, job: str) -> int:
    """Drop the job's resume cursors, so its next enqueue reads every file from the first
    row (after `regen recover`: cursors restored from an older copy, or moved on by a
    producer that kept running, can be past prompts Redis lost). Enqueued, committed and
    dead-lettered prompts are skipped on the way. Returns how many cursors there were."""
    pipe = r.pipeline()
    pipe.hlen(keys.job_cursors(job))
    pipe.delete(keys.job_cursors(job))
    dropped, _ = pipe.execute()
    return int(dropped)
