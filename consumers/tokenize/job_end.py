"""Whether a job has nothing left to come to the tokenize stage: every prompt of the job
generated (its result on the stream or in a shard), dead-lettered or purged. A consumer
then commits its open shard of the job at once instead of after `--idle-commit`
(docs/design/tokenize.md, Tokenize: the job's last shard).

Two readings, the cheap one first:
- a bound, O(1) in one script: ids in the job against ids committed, results on the
  stream, dead letters and purged ids. A dead-letter entry without a prompt (a bad
  row) and a result on the stream twice (a chunk that ran twice) count too, so the
  bound can say "maybe" early but never "no" wrongly: while it says no, some prompt is
  still waiting, generating or in no place, and nothing more is read;
- the count `regen status` takes (common/ledger/places.count_places, O(window)): no prompt
  waiting, none generating, none in no place (a chunk kombu is delivering). Taken at
  most every EXACT_EVERY_S, so a bound that says "maybe" for long (many bad rows)
  costs little.

A wrong "nothing left" only commits a shard early (a smaller shard, then another):
exactly-once does not rest on it, the commit ledger does (docs/design/exactly-once.md, Exactly-once
commits). It can happen while `regen enqueue` is between two chunks of a file with
every published prompt already done, or when a later requeue or follower pass adds
prompts to a job that was done.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import redis

from regen.common import keys
from regen.common.jobspec import JobSpec
from regen.common.ledger.commit_ledger import COUNT_LUA, CommitLedger
from regen.common.ledger.places import count_places

# The bound is read at most this often per job with an open shard: one O(1) script a
# second, whatever the job's size; the last shard is committed within about this long
# of the last result read.
CHECK_EVERY_S = 1.0
# The full count at most this often per job (it reads the job's window and DLQs).
EXACT_EVERY_S = 5.0

# KEYS: counters, pending shards (the ledger's count keys), results stream, purged ids,
# then the DLQs. Returns {ids in the job, an upper bound on the ids placed}.
_BOUND_LUA = (
    COUNT_LUA
    + f"""
local committed, claimed = ledger_count(KEYS[1], KEYS[2])
local ids = tonumber(redis.call('HGET', KEYS[1], '{keys.IDS}') or '0')
local placed = committed - claimed + redis.call('XLEN', KEYS[3]) + redis.call('SCARD', KEYS[4])
for i = 5, #KEYS do placed = placed + redis.call('HLEN', KEYS[i]) end
return {{ids, placed}}
"""
)


class JobEnd:
    """One job's end, as one tokenize consumer asks about it."""

    def __init__(
        self, r: redis.Redis, spec: JobSpec, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._r = r
        self._spec = spec
        self._clock = clock
        self._bound = r.register_script(_BOUND_LUA)
        job = spec.name
        self._keys = [
            *CommitLedger(r, job).count_keys(),
            keys.results_stream(job),
            keys.dlq_purged(job),
            *(keys.dlq(job, stage) for stage in keys.STAGES),
        ]
        self._next_check = 0.0
        self._next_exact = 0.0
        # Full counts taken, for tests and logs.
        self.exact_checks = 0

    def nothing_left(self) -> bool:
        """True when every prompt of the job is generated, dead-lettered or purged (see
        the module doc); False when not, or not looked at again yet."""
        now = self._clock()
        if now < self._next_check:
            return False
        self._next_check = now + CHECK_EVERY_S
        ids, placed = (int(x) for x in self._bound(keys=self._keys))
        if ids == 0 or placed < ids or now < self._next_exact:
            return False
        self._next_exact = now + EXACT_EVERY_S
        self.exact_checks += 1
        counts = count_places(self._r, self._spec)
        return counts.waiting == 0 and counts.generating == 0 and counts.unplaced <= 0
