"""Finding records that are in two shards, with memory flat in the number of records."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

from regen.ops.shard_copies import BUCKET_BYTES, Copies, CopyFinder, CopyPair, record_key


def _find(scratch: Path, n: int) -> Copies:
    """Shard 0 holds keys [0, n/2), shard 1 [n/2, n); shard 2 repeats 1,000 keys of
    shard 0 and then one of its own; shard 3 holds one key twice."""
    finder = CopyFinder(scratch, shards=4, data_bytes=64 * BUCKET_BYTES)  # 64 buckets
    for i in range(n):
        finder.add(i * 2 // n, i % (n // 2), record_key("job", f"{i:016x}"))
    for row in range(1000):
        finder.add(2, row, record_key("job", f"{row * 7:016x}"))
    finder.add(2, 1000, record_key("other-job", f"{0:016x}"))  # another job's: no copy
    finder.add(3, 0, record_key("job", "x"))
    finder.add(3, 1, record_key("job", "x"))
    return finder.finish()


def test_copies_are_found_and_skipped_with_flat_memory(tmp_path: Path) -> None:
    n = 100_000
    tracemalloc.start()
    try:
        copies = _find(tmp_path, n)
        rows = [copies.rows_in(shard) for shard in range(4)]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert copies.total == 1001
    assert copies.pairs == [
        CopyPair(first=0, copy=2, count=1000, example=copies.pairs[0].example),
        CopyPair(first=3, copy=3, count=1, example="x"),
    ]
    assert int(copies.pairs[0].example, 16) % 7 == 0
    assert rows == [set(), set(), set(range(1000)), {1}]
    # The keys as a set would take ~10 MB; a bucket is 1/64 of them.
    assert peak < 2 << 20, peak
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"places-{k:04d}" for k in range(4)]


def test_no_copies_reads_no_place_file(tmp_path: Path) -> None:
    finder = CopyFinder(tmp_path, shards=2, data_bytes=0)
    finder.add(0, 0, record_key("job", "a"))
    finder.add(1, 0, record_key("job", "b"))
    copies = finder.finish()
    assert (copies.total, copies.pairs) == (0, [])
    assert copies.rows_in(0) == copies.rows_in(1) == set()
