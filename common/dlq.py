"""Dead-letter queues: one Redis hash per job and stage, entry id -> JSON entry.

Redis has no dead-lettering of its own (`Reject(requeue=False)` just deletes), so every
stage writes here, in the same transaction that takes the item out of its queue. An entry
holds what is needed to requeue it without re-reading the dataset.

Entry ids: the prompt id, `row:<hash of file and row>` for a dataset row that gave no
prompt, `task:<task id or hash>` for a message on a generate queue that was no chunk for
it (consumers/generate/poison.py), `result:raw-<hash>` for a results-stream entry that
names no prompt of its job (consumers/tokenize/entries.py).

Reason codes: one `ReasonCode` enum per stage, each with its stage's checks:
producer.rows.Reason (input), consumers.generate.reasons.Reason (generate),
consumers.tokenize.record.Reason (tokenize).
"""

from __future__ import annotations

import os
import socket
import time
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field
from enum import Enum
from typing import Any

import orjson
import redis

from regen.common import keys


class ReasonCode(str, Enum):
    """A stage's reasons to dead-letter an item. A member is its string (the code stored
    in Redis, matched by `regen dlq --reason`) in comparisons, JSON values and f-strings;
    only a JSON object key must be the plain `str(code)` (orjson refuses a subclass)."""

    def __str__(self) -> str:
        return str(self.value)


class Refused(Exception):
    """An item a stage refuses: `reason`, its code as stored (a plain str), and a message."""

    def __init__(self, reason: ReasonCode, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = str(reason)
        self.message = message


@dataclass(frozen=True)
class DeadLetter:
    # Stable per item, so writing the same failure twice (a redelivery, a rerun of the
    # producer) overwrites instead of duplicating.
    entry_id: str
    job: str
    stage: str
    reason: str
    message: str
    prompt_id: str | None = None
    source: dict[str, Any] | None = None
    attempts: int = 1
    # What a requeue needs: messages and prompt_ids for a prompt, the result for a record.
    payload: dict[str, Any] = field(default_factory=dict)
    history: list[dict[str, Any]] = field(default_factory=list)
    worker: str = field(default_factory=lambda: f"{socket.gethostname()}:{os.getpid()}")
    time: float = field(default_factory=time.time)

    def to_json(self) -> bytes:
        return orjson.dumps(asdict(self))

    @classmethod
    def from_json(cls, raw: bytes) -> DeadLetter:
        return cls(**orjson.loads(raw))

    def summary(self) -> dict[str, Any]:
        """The entry without its payload and history (which can be large)."""
        out = asdict(self)
        del out["payload"], out["history"]
        return out


@dataclass(frozen=True)
class Selection:
    """Which entries a command acts on: jobs x stages, optionally only some reasons."""

    jobs: tuple[str, ...]
    stages: tuple[str, ...] = keys.STAGES
    reasons: frozenset[str] = frozenset()  # empty: every reason

    def __post_init__(self) -> None:
        for stage in self.stages:
            keys.dlq("-", stage)  # refuses an unknown stage

    def matches(self, letter: DeadLetter) -> bool:
        return not self.reasons or letter.reason in self.reasons


def put(r: redis.Redis | redis.client.Pipeline, letter: DeadLetter) -> None:
    """Add (or overwrite) an entry; usable inside a MULTI pipeline."""
    r.hset(keys.dlq(letter.job, letter.stage), letter.entry_id, letter.to_json())


def entries(r: redis.Redis, job: str, stage: str) -> Iterator[DeadLetter]:
    for _, raw in r.hscan_iter(keys.dlq(job, stage), count=500):
        yield DeadLetter.from_json(raw)


def reasons(r: redis.Redis, jobs: Iterable[str]) -> dict[str, Counter[str]]:
    """The jobs' dead letters counted by stage, then reason."""
    names = list(jobs)
    return {
        stage: Counter(letter.reason for job in names for letter in entries(r, job, stage))
        for stage in keys.STAGES
    }


def count(r: redis.Redis, job: str, stage: str) -> int:
    return int(r.hlen(keys.dlq(job, stage)))


def dead_lettered(r: redis.Redis, job: str, prompt_ids: list[str]) -> list[bool]:
    """Whether each prompt id has a dead letter in a stage of the job, or was purged
    (a purged prompt's last place)."""
    if not prompt_ids:
        return []
    pipe = r.pipeline(transaction=False)
    for stage in keys.STAGES:
        pipe.hmget(keys.dlq(job, stage), prompt_ids)
    pipe.smismember(keys.dlq_purged(job), prompt_ids)
    *stages, purged = pipe.execute()
    return [
        bool(gone) or any(letters[i] is not None for letters in stages)
        for i, gone in enumerate(purged)
    ]


def select(r: redis.Redis, selection: Selection) -> Iterator[DeadLetter]:
    """Every selected entry, job by job and stage by stage (each in no set order)."""
    for job in selection.jobs:
        for stage in selection.stages:
            for letter in entries(r, job, stage):
                if selection.matches(letter):
                    yield letter


def find(r: redis.Redis, entry_id: str, selection: Selection) -> list[DeadLetter]:
    """The entries with this id in the selected jobs and stages (usually one)."""
    places = [(job, stage) for job in selection.jobs for stage in selection.stages]
    pipe = r.pipeline(transaction=False)
    for job, stage in places:
        pipe.hget(keys.dlq(job, stage), entry_id)
    found = [DeadLetter.from_json(raw) for raw in pipe.execute() if raw is not None]
    return [letter for letter in found if selection.matches(letter)]


# KEYS: dlq hash, counters hash, purged-ids set; ARGV: entry ids. Counts what it removed,
# so a purged id stays accounted for (the job's `dlq_purged` counter) even though it is gone.
# Purged prompt ids are remembered (ids only), so `regen verify` can tell a purged
# prompt from a lost one; bad input rows (`row:`) and malformed tasks have no prompt id.
_PURGE_LUA = """
local n = 0
for i = 1, #ARGV do
  if redis.call('HDEL', KEYS[1], ARGV[i]) == 1 then
    n = n + 1
    if not string.find(ARGV[i], ':', 1, true) then redis.call('SADD', KEYS[3], ARGV[i]) end
  end
end
redis.call('HINCRBY', KEYS[2], 'dlq_purged', n)
return n
"""
# Entries per script call: keeps each call short.
_PURGE_BATCH = 500


def purge(r: redis.Redis, letters: Iterable[DeadLetter]) -> int:
    """Remove entries for good; returns how many were still there to remove."""
    by_hash: dict[tuple[str, str], list[str]] = {}
    for letter in letters:
        by_hash.setdefault((letter.job, letter.stage), []).append(letter.entry_id)
    script = r.register_script(_PURGE_LUA)
    removed = 0
    for (job, stage), ids in by_hash.items():
        for start in range(0, len(ids), _PURGE_BATCH):
            batch = ids[start : start + _PURGE_BATCH]
            lua_keys = [keys.dlq(job, stage), keys.job_counters(job), keys.dlq_purged(job)]
            removed += int(script(keys=lua_keys, args=batch))
    return removed
