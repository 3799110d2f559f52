"""A job's per-prompt ids in Redis: binary fields spread over many small hashes.

Redis keeps a hash of at most 128 fields, each field and value at most 64 bytes, as one
compact listpack (a ziplist before Redis 7.0): an id costs its bytes and ~4 more, where
a big hash or set costs ~50 bytes of pointers and headers per member on top of the
string. So the job's id index and its committed index are split into `count` hashes
(buckets) each, sized from the job's expected number of ids so a bucket holds ~32-64
(docs/design/exactly-once.md, Redis keys and Reasons behind the choices).

Python keeps the ids as strings; only their stored form changes. A field is one tag byte
then the id: `h` + the 8 bytes of a 16-hex prompt id, `t` + those of a conversation id
and the turn in decimal (`<16 hex>-<turn>`, common/conversation.py), or `s` + the UTF-8
of any other id. The bucket comes from the id's leading bytes (they are a hash already:
producer/rows.py), so the turns of a conversation share one.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Callable, Iterator

import redis

# Ids per bucket the count is sized for: half the listpack limit (128), so a bucket
# stays compact until the job is ~2-4x its expected size (counts vary by bucket).
IDS_PER_BUCKET = 64
# 2**22 buckets keep ~400M ids compact; more would only cost empty-bucket overhead.
MAX_BUCKETS = 2**22
# Buckets read per round trip when a whole index is scanned.
BUCKETS_PER_CALL = 256

_PLAIN, _TURN, _OTHER = b"h", b"t", b"s"
_HEX16 = re.compile(r"[0-9a-f]{16}")
_TURN_ID = re.compile(r"([0-9a-f]{16})-(0|[1-9][0-9]{0,8})")

# KEYS: the bucket of each id; ARGV: the ids' fields. Returns each field's value, or ''
# where there is none (no index stores an empty value).
LOOKUP_LUA = """
local out = {}
for i = 1, #ARGV do out[i] = redis.call('HGET', KEYS[i], ARGV[i]) or '' end
return out
"""


def bucket_count(expected_ids: int) -> int:
    """The power of two that puts at most IDS_PER_BUCKET of `expected_ids` in a bucket."""
    count = 1
    while count * IDS_PER_BUCKET < expected_ids and count < MAX_BUCKETS:
        count *= 2
    return count


def encode(pid: str) -> bytes:
    """The stored form of an id (the module doc)."""
    if len(pid) == 16 and _HEX16.fullmatch(pid):
        return _PLAIN + bytes.fromhex(pid)
    turn = _TURN_ID.fullmatch(pid)
    if turn:
        return _TURN + bytes.fromhex(turn[1]) + turn[2].encode()
    return _OTHER + pid.encode()


def decode(field: bytes) -> str:
    tag, body = field[:1], field[1:]
    if tag == _PLAIN:
        return body.hex()
    if tag == _TURN:
        return f"{body[:8].hex()}-{body[8:].decode()}"
    if tag == _OTHER:
        return body.decode()
    raise ValueError(f"not a stored id: {field!r}")


def bucket_of(field: bytes, count: int) -> int:
    """The bucket of an encoded id: its hash bytes, or a hash of any other id."""
    if field[:1] in (_PLAIN, _TURN):
        return int.from_bytes(field[1:5], "big") % count
    return int.from_bytes(hashlib.blake2b(field, digest_size=4).digest(), "big") % count


class BucketedIds:
    """One index of a job's ids (field -> value) spread over `count` hash keys, named
    by `key_of(bucket)` (common/keys.py). Writes are the owners' scripts: this gives
    them the keys and fields, and reads."""

    def __init__(self, r: redis.Redis, count: int, key_of: Callable[[int], str]) -> None:
        self._r = r
        self.count = count
        self._key_of = key_of
        self._lookup = r.register_script(LOOKUP_LUA)

    def keys_and_fields(self, ids: list[str]) -> tuple[list[str], list[bytes]]:
        """The bucket key of each id and its field, in order (a script's KEYS, ARGV)."""
        fields = [encode(pid) for pid in ids]
        return [self._key_of(bucket_of(f, self.count)) for f in fields], fields

    def get(self, ids: list[str]) -> list[bytes | None]:
        """Each id's value, None where it is not in the index; one atomic read."""
        if not ids:
            return []
        lua_keys, fields = self.keys_and_fields(ids)
        values = self._lookup(keys=lua_keys, args=fields)
        return [v if v else None for v in values]

    def items(self) -> Iterator[tuple[str, bytes]]:
        """(id, value) of every id, a few buckets per round trip; on a running job an id
        written meanwhile may be missed or seen, as with HSCAN."""
        for first in range(0, self.count, BUCKETS_PER_CALL):
            pipe = self._r.pipeline(transaction=False)
            for bucket in range(first, min(first + BUCKETS_PER_CALL, self.count)):
                pipe.hgetall(self._key_of(bucket))
            for bucket in pipe.execute():
                for field, value in bucket.items():
                    yield decode(field), value
