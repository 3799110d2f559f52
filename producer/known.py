"""Which of a chunk's prompt ids a job already has, asked in one script: one Redis round
trip with the ids sent once, where a lookup per place (the job's ids, the commit index,
each stage's dead letters, the purged ids) sent them six times."""

from __future__ import annotations

from enum import IntEnum

import redis

from regen.common import keys

# KEYS: the job's ids, its purged ids, then the hashes that settle an id (the commit
# index, each stage's DLQ). ARGV: prompt ids. An id settled though not among the job's
# ids (Redis lost it; `regen recover` rebuilt the ledger) is put back among them.
_KNOWN_LUA = """
local out = {}
for i, id in ipairs(ARGV) do
  local known = redis.call('SISMEMBER', KEYS[1], id) == 1 and 1 or 0
  if known == 0 then
    local settled = redis.call('SISMEMBER', KEYS[2], id) == 1
    for k = 3, #KEYS do
      settled = settled or redis.call('HEXISTS', KEYS[k], id) == 1
    end
    if settled then
      redis.call('SADD', KEYS[1], id)
      known = 2
    end
  end
  out[i] = known
end
return out
"""


class Known(IntEnum):
    NEW = 0
    IN_JOB = 1  # among the job's ids: enqueued before
    SETTLED = 2  # committed or dead-lettered, though not among the job's ids (now it is)


class KnownIds:
    """Looks a job's prompt ids up where the job keeps them."""

    def __init__(self, r: redis.Redis, job: str) -> None:
        self._script = r.register_script(_KNOWN_LUA)
        self._keys = [keys.job_ids(job), keys.dlq_purged(job), keys.committed(job),
                      *(keys.dlq(job, stage) for stage in keys.STAGES)]  # fmt: skip

    def lookup(self, ids: list[str]) -> list[Known]:
        if not ids:
            return []
        return [Known(int(x)) for x in self._script(keys=self._keys, args=ids)]
