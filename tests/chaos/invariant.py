"""What must hold at the end of every chaos run, whatever the faults were.

- Every id the job owns (each row's prompt; with `--turns all`, each turn of each row's
  conversation) is in exactly one place: one record in one shard, or one entry, with a
  reason, in one dead-letter queue. No other id is anywhere.
- No shard file seen during the run changed or vanished.
- Every record is token-exact: its prompt ids are its messages rendered by the chat
  template, followed by exactly the ids the server answered that prompt with.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from regen.consumers.tokenize.job_folder import JobFolder

Record = dict[str, Any]


@dataclass
class Found:
    """Where the ids ended up: records by shard file, dead letters by stage."""

    records: dict[str, list[Record]] = field(default_factory=dict)  # shard name -> records
    dead: dict[str, dict[str, str]] = field(default_factory=dict)  # stage -> {id: reason}

    def record_count(self) -> int:
        return sum(len(records) for records in self.records.values())

    def dead_count(self) -> int:
        return sum(len(entries) for entries in self.dead.values())


def placement_violations(expected: set[str], found: Found) -> list[str]:
    """Every expected id exactly once, in a shard or a DLQ; nothing else anywhere."""
    problems: list[str] = []
    places: dict[str, list[str]] = {}
    for shard, records in found.records.items():
        for record in records:
            places.setdefault(record["id"], []).append(f"shard {shard}")
    for stage, entries in found.dead.items():
        for pid, reason in entries.items():
            places.setdefault(pid, []).append(f"{stage} DLQ")
            if not reason:
                problems.append(f"{pid}: dead-lettered in {stage} without a reason")
    for pid in sorted(expected - set(places)):
        problems.append(f"{pid}: lost (in no shard and no DLQ)")
    for pid, where in sorted(places.items()):
        if len(where) > 1:
            problems.append(f"{pid}: {len(where)} places ({', '.join(where)})")
        if pid not in expected:
            problems.append(f"{pid}: not an id of the job, found in {', '.join(where)}")
    return problems


class ShardWatch:
    """The digest of every shard file the first time it is seen; a committed shard never
    changes, so any later difference (or a vanished file) is a violation."""

    def __init__(self, folder: JobFolder) -> None:
        self.folder = folder
        self.digests: dict[str, str] = {}
        self.problems: list[str] = []

    def look(self) -> None:
        if not self.folder.readable_here():
            return
        for path in self.folder.shards():
            try:
                digest = hashlib.sha256()
                with path.open() as fh:
                    while block := fh.read(1 << 20):
                        digest.update(block)
            except FileNotFoundError:
                continue  # looked at as it went; the next look sees whether it is gone
            seen = self.digests.setdefault(path.name, digest.hexdigest())
            if seen != digest.hexdigest() and not any(path.name in p for p in self.problems):
                self.problems.append(f"shard {path.name} changed after it was committed")

    def final(self) -> list[str]:
        self.look()
        present = set(self.folder.shard_names()) if self.folder.readable_here() else set()
        gone = [f"shard {name} vanished" for name in sorted(set(self.digests) - present)]
        return [*self.problems, *gone]


def token_violations(
    records: Iterable[Record],
    render: Callable[[list[dict[str, Any]], list[dict[str, Any]] | None], list[int]],
    answer: Callable[[list[int], Mapping[str, Any]], list[int]],
) -> list[str]:
    """Each record's ids: `render(messages before the answer, tools)` then
    `answer(prompt ids, sampling)`, with a loss mask over the answer only."""
    problems: list[str] = []
    for record in records:
        pid = record["id"]
        n = record["prompt_tokens"]
        prompt, output = record["input_ids"][:n], record["input_ids"][n:]
        if prompt != render(record["messages"][:-1], record.get("tools")):
            problems.append(f"{pid}: prompt ids are not its messages as rendered")
        elif output != answer(prompt, record["sampling"]):
            problems.append(f"{pid}: answer ids are not the server's answer to its prompt")
        if record["loss_mask"] != [0] * n + [1] * len(output):
            problems.append(f"{pid}: loss mask does not cover exactly the answer")
        if record["completion_tokens"] != len(output):
            problems.append(
                f"{pid}: completion_tokens {record['completion_tokens']} != {len(output)}"
            )
    return problems


def export_violations(name: str, ids: list[str], records: set[str]) -> list[str]:
    """An export holds each id once, and only ids of records."""
    problems = [f"{name}: {pid} {n} times" for pid, n in Counter(ids).items() if n > 1]
    problems += [f"{name}: {pid} is no record's" for pid in sorted(set(ids) - records)]
    return problems
