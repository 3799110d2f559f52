"""Taking over results a tokenize consumer holds but will not commit.

Every consumer of the results stream has a pending list (read, not yet acknowledged).
A consumer that dies leaves its list behind, and a restarted one comes back under a new
name (`tokenize@HOST:PID`), so nobody reads it again unless it is taken over. A consumer
is dead when its heartbeat (keys.WORKERS) is stale, or, having none (stopped cleanly,
or not beating yet), when the stream has not seen it for as long: its entries are
claimed by a live consumer and the dead name is removed from the group. A consumer
also re-reads entries of its own that it left unacknowledged (their ids were held by
another shard, or Redis went away mid-commit). See docs/design/tokenize.md, Tokenize.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import redis
from redis.typing import StreamIdT

from regen.common import keys, settings

Entries = list[Any]  # [(entry id, fields or None), ...] as redis-py gives them

# An entry any consumer touched this recently is left alone: two live consumers that
# both found the same dead one claim each entry once.
MIN_IDLE_MS = 1000
_PAGE = 500

# KEYS: stream; ARGV: group, consumer. Removes the consumer only if nothing is pending
# for it: a consumer thought dead that read again keeps its name and its entries.
_DELETE_IF_EMPTY_LUA = """
if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 then return -1 end
return redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2])
"""


def _text(value: StreamIdT) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def dead_consumers(r: redis.Redis, stream: str, me: str, beats: dict[str, float]) -> list[str]:
    """Consumers of the group other than `me` that are dead, given every worker's last
    heartbeat (`beats`, heartbeat.last_seen)."""
    stale_s = settings.current().heartbeat_stale_s
    now = time.time()
    dead = []
    for consumer in r.xinfo_consumers(stream, keys.TOKENIZE_GROUP):
        name = _text(consumer["name"])
        beat = beats.get(name)
        # No heartbeat (stopped cleanly, or not beating yet): dead once silent as long.
        gone = int(consumer["idle"]) >= stale_s * 1000 if beat is None else now - beat >= stale_s
        if name != me and gone:
            dead.append(name)
    return dead


def _pending_ids(r: redis.Redis, stream: str, consumer: str, after: str = "-") -> list[StreamIdT]:
    rows = r.xpending_range(
        stream, keys.TOKENIZE_GROUP, min=after, max="+", count=_PAGE, consumername=consumer
    )
    return [row["message_id"] for row in rows]


def claim_from(r: redis.Redis, stream: str, dead: str, me: str) -> Iterator[Entries]:
    """Claim every entry pending for `dead` to `me`, a page at a time (entries deleted
    from the stream meanwhile just leave the pending list)."""
    ids = _pending_ids(r, stream, dead)
    while ids:
        entries = r.xclaim(stream, keys.TOKENIZE_GROUP, me, MIN_IDLE_MS, ids)
        if entries:
            yield entries
        claimed, ids = ids, _pending_ids(r, stream, dead)
        if ids == claimed:
            return  # nothing moved: another consumer touched them just now


def delete_if_empty(r: redis.Redis, stream: str, consumer: str) -> bool:
    """Remove a consumer from the group if nothing is pending for it."""
    return int(r.eval(_DELETE_IF_EMPTY_LUA, 1, stream, keys.TOKENIZE_GROUP, consumer)) >= 0


def own_left_over(r: redis.Redis, stream: str, me: str, keep: set[str]) -> Iterator[Entries]:
    """This consumer's pending entries other than `keep` (those in its open shard), with
    their fields, a page at a time."""
    after = "-"
    while ids := _pending_ids(r, stream, me, after):
        after = "(" + _text(ids[-1])
        wanted = [eid for eid in ids if _text(eid) not in keep]
        if wanted:
            # Claiming to itself returns the fields (and drops deleted entries).
            yield r.xclaim(stream, keys.TOKENIZE_GROUP, me, 0, wanted)
