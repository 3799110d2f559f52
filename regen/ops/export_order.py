"""Deterministic, memory-flat ordering for exports: the held-out split and the shuffle.

The split is decided by a hash of the record id alone, so a record lands on the same side
whatever the seed, the shard layout or the jobs merged with it.

The shuffle sorts rows by a hash of their key (job and id) keyed with the seed: a permutation that
depends only on the seed and the ids. Millions of rows are sorted without holding them
by an external bucket sort: rows are spilled to bucket files by key range (bucket b holds
the keys in [b, b+1) * 2**64 / B), then each bucket is read back, sorted in memory and
emitted in bucket order, which is the global sort. Memory is one bucket, whose size the
caller bounds through the bucket count; the output does not depend on that count.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import orjson

KEY_BYTES = 8
# The data one bucket holds while it is sorted (as spilled JSON lines).
BUCKET_BYTES = 256 << 20
# Files open at once while spilling; past MAX_BUCKETS * BUCKET_BYTES, buckets grow instead.
MAX_BUCKETS = 512
_SPACE = 1 << (8 * KEY_BYTES)
_SPLIT_SALT = b"regen-split"


def held_out(record_id: str, fraction: float) -> bool:
    """Whether a record belongs to the held-out set of size `fraction` (0 to 1)."""
    digest = hashlib.blake2b(record_id.encode(), digest_size=KEY_BYTES, person=_SPLIT_SALT)
    return int.from_bytes(digest.digest(), "big") < fraction * _SPACE


def shuffle_key(seed: int, key: str) -> bytes:
    """A row's place in the shuffled order: sorting by it is the shuffle."""
    return hashlib.blake2b(key.encode(), digest_size=KEY_BYTES, key=str(seed).encode()).digest()


def bucket_count(data_bytes: int) -> int:
    """Enough buckets for each to hold about BUCKET_BYTES of `data_bytes`."""
    return max(1, min(MAX_BUCKETS, math.ceil(data_bytes / BUCKET_BYTES)))


def sort_by_key(items: Iterable[tuple[bytes, Any]], buckets: int, scratch: Path) -> Iterator[Any]:
    """The payloads (JSON-serializable) of `items` in key order; ties keep input order.

    Spills to `buckets` files in `scratch` and removes each once it has been emitted.
    """
    paths = [scratch / f"bucket-{b:04d}" for b in range(buckets)]
    with ExitStack() as stack:
        files = [stack.enter_context(open(path, "wb", buffering=1 << 16)) for path in paths]
        for key, payload in items:
            bucket = int.from_bytes(key, "big") * buckets // _SPACE
            files[bucket].write(key + orjson.dumps(payload) + b"\n")
    for path in paths:
        entries: list[tuple[bytes, bytes]] = []
        with open(path, "rb") as fh:
            # The key is fixed-width binary (it may hold a newline byte); the JSON after
            # it never does, as orjson escapes newlines in strings.
            while key := fh.read(KEY_BYTES):
                entries.append((key, fh.readline()))
        path.unlink()
        entries.sort(key=lambda entry: entry[0])
        for _, line in entries:
            yield orjson.loads(line)
