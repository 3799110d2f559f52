"""Records found more than once among shards (a shard restored from a backup, a job
folder copied beside itself), with memory flat in the number of records.

A record is the same record when its job and id are (the job as the record names it, so
a copied folder's records are copies whatever the folder is called; two jobs over one
dataset share prompt ids, and each job's answer is its own record). `regen shards
export` writes the first copy read and skips the others; `regen shards verify` reports
them (docs/design/tokenize.md, Tokenize).

A set of 10M keys would take ~1 GB of Python objects, so keys are spilled instead:
`add` writes each record's key and place (shard number, row) to one of B bucket files
by a hash of the key. `finish` sorts one bucket at a time by key (a stable sort: copies
stay in reading order, so the first read is the one kept) and writes the place of every
later copy to one of K place files by shard range. `rows_in(shard)`, asked shard by
shard in order, loads one place file at a time. Memory: one bucket (its share of the
keys) and the copies of one shard range.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import orjson

from regen.consumers.tokenize.operator_view import ShardRef, iter_job_ids

# Spilled key bytes per bucket while it is sorted: ~40K keys of ~100 bytes as Python
# objects, ~15 MB. Past MAX_BUCKETS buckets, buckets grow instead.
BUCKET_BYTES = 4 << 20
MAX_BUCKETS = 256
# Place files (by shard range) at most: each holds the copies of its shards.
MAX_RANGES = 256
# Write buffer per spill file: up to MAX_BUCKETS of them are open at once.
_BUFFER = 1 << 14


def record_key(job: str, rid: str) -> str:
    return f"{job}\0{rid}"


@dataclass(frozen=True)
class CopyPair:
    """Records of shard `copy` that shard `first` (read earlier) already holds."""

    first: int
    copy: int
    count: int
    example: str  # one of the ids


class Copies:
    """The outcome of a CopyFinder: copies per pair of shards, and the rows to skip."""

    def __init__(self, pairs: list[CopyPair], places: list[Path], shards: int) -> None:
        self.pairs = pairs
        self.total = sum(pair.count for pair in pairs)
        self._places = places
        self._shards = shards
        self._loaded: int | None = None
        self._rows: dict[int, set[int]] = {}

    def rows_in(self, shard: int) -> set[int]:
        """The rows of `shard` that repeat a record read before; ask in shard order."""
        if not self.total:
            return set()
        index = _range_of(shard, self._shards, len(self._places))
        if index != self._loaded:
            self._loaded, self._rows = index, {}
            with open(self._places[index], "rb") as fh:
                for line in fh:
                    at, row = map(int, line.split())
                    self._rows.setdefault(at, set()).add(row)
        return self._rows.get(shard, set())


def _range_of(shard: int, shards: int, ranges: int) -> int:
    return shard * ranges // max(shards, 1)


class CopyFinder:
    """Collects (shard, row, key) in reading order, into files under `scratch`."""

    def __init__(self, scratch: Path, shards: int, data_bytes: int) -> None:
        """`shards`: how many shards will be read (numbered 0 on); `data_bytes`: their
        size on disk, which bounds how many records they hold and so sizes the buckets."""
        self._scratch = scratch
        self._shards = shards
        buckets = max(1, min(MAX_BUCKETS, math.ceil(data_bytes / BUCKET_BYTES)))
        self._paths = [scratch / f"keys-{b:04d}" for b in range(buckets)]
        self._stack = ExitStack()
        self._files = [
            self._stack.enter_context(open(path, "wb", buffering=_BUFFER))  # noqa: SIM115 (closed in finish)
            for path in self._paths
        ]

    def add(self, shard: int, row: int, key: str) -> None:
        # As a JSON string: no raw newline in it, and one text per key.
        data = orjson.dumps(key)
        digest = hashlib.blake2b(data, digest_size=8).digest()
        bucket = int.from_bytes(digest, "big") % len(self._files)
        self._files[bucket].write(b"%s\t%d\t%d\n" % (data, shard, row))

    def finish(self) -> Copies:
        self._stack.close()
        ranges = max(1, min(MAX_RANGES, self._shards))
        places = [self._scratch / f"places-{k:04d}" for k in range(ranges)]
        found: dict[tuple[int, int], list[int | str]] = {}
        with ExitStack() as stack:
            outs = [stack.enter_context(open(p, "wb", buffering=_BUFFER)) for p in places]
            for path in self._paths:
                for first, shard, row, key in _copies_in_bucket(path):
                    outs[_range_of(shard, self._shards, ranges)].write(b"%d %d\n" % (shard, row))
                    pair = found.setdefault(
                        (first, shard), [0, orjson.loads(key).split("\0", 1)[-1]]
                    )
                    pair[0] = int(pair[0]) + 1
                path.unlink()
        pairs = [
            CopyPair(first, copy, int(count), str(example))
            for (first, copy), (count, example) in sorted(found.items(), key=lambda kv: kv[0][::-1])
        ]
        return Copies(pairs, places, self._shards)


def _copies_in_bucket(path: Path) -> Iterator[tuple[int, int, int, str]]:
    """(shard of the first copy, shard, row, key) of every later copy in one bucket."""
    entries: list[tuple[bytes, int, int]] = []
    with open(path, "rb") as fh:
        for line in fh:
            text, at, line_row = line.rstrip(b"\n").rsplit(b"\t", 2)
            entries.append((text, int(at), int(line_row)))
    entries.sort(key=lambda entry: entry[0])
    first: tuple[bytes, int] | None = None
    for key, shard, row in entries:
        if first is not None and first[0] == key:
            yield first[1], shard, row, key.decode()
        else:
            first = (key, shard)


def find_copies(shards: list[ShardRef], scratch: Path) -> Copies:
    """The copies among `shards` (in the order they will be read), from their ids alone."""
    finder = CopyFinder(scratch, len(shards), sum(shard.size() for shard in shards))
    for number, path in enumerate(shards):
        for row, found in enumerate(iter_job_ids(path)):
            if found is not None:
                finder.add(number, row, record_key(*found))
    return finder.finish()
