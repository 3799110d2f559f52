"""What the other generate workers can take: whether one consuming a queue has idle
slots, read from their heartbeats (`regen:workers`).

A worker holding prompts it has not started gives them back only when another worker
could start them sooner (docs/design/placement.md, "Only what can start soon"): with no such
peer, a give-back would only put the prompts back for the same worker to take again,
a Redis script and a message rewrite per prompt for nothing (the one-server case).
A worker beats at once (at most once a second) when its slots fall idle with nothing
waiting in it, so its idle slots are seen within a couple of seconds, not at its next
regular beat (up to 10 s): at 40 s answers, 10 s is a quarter of a slot's work.

Besides its idle slots, a worker's beat says how many prompts it is `short`: its idle
slots plus the slack its flow control would hold waiting (flow_control.slack). A
worker whose slots are full but has no slack waiting would idle each slot that frees
for the give-back's round trip (a beat, a read, a chunk fetched: 2-3 s, 6% of a fast
server's slot time at 40 s answers); prompts given for its slack start there at once.
A giver gives prompts for a peer's slack only beyond its own slack (held_prompts.py),
so slack never moves from one worker to another and back.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import orjson
import redis

from regen.common import defaults, keys
from regen.common.connection import bytes_hash

# A heartbeat older than this is a worker gone or stuck: not a peer to hand work to.
FRESH_S = 30.0
# The fleet view is read at most this often per process (every delivery with waiting
# prompts asks, several times a second).
CACHE_S = 1.0
# Slots this worker gave prompts back for count as taken until every peer that had room
# on the queue has beaten TAKE_S after the give-back (its flow control takes a chunk within half a
# second of its arrival: the beat shows the prompts taken), and at most for CLAIM_S
# (heartbeats are at most HEARTBEAT_INTERVAL_MAX_S apart). Without it each look at the
# same stale beat gives back more; kept longer, it hid the slots that free after the
# beat (at 0.8 prompts/s a fast server showed ~9 idle slots before it got any).
CLAIM_S = defaults.HEARTBEAT_INTERVAL_MAX_S + CACHE_S
TAKE_S = 1.5


@dataclass(frozen=True)
class PeerRoom:
    """What one peer's last beat says: idle slots, prompts short, when it beat; and its
    engine's slots and one request's decode speed (tokens/s, None until measured)."""

    idle: int
    short: int
    seen: float
    slots: int = 0
    decode_tps: float | None = None


@dataclass(frozen=True)
class Claim:
    """Room this worker gave prompts for: `idle` slots and `slack` beyond them, on
    `queue`, at `when`; `takers`: the peers that had room then (one of them takes the
    prompts; a peer without room does not, its flow control being full)."""

    when: float
    queue: str
    idle: int
    slack: int
    takers: frozenset[str]


class PeerView:
    """The idle slots of the other live generate workers, and the prompts they are
    short (idle slots and slack), by queue."""

    def __init__(self, r: redis.Redis, me: str, clock: Callable[[], float] = time.time) -> None:
        self._r = r
        self._me = me
        self._clock = clock
        self._lock = threading.Lock()
        self._read_at = float("-inf")
        self._rooms: dict[str, dict[str, PeerRoom]] = {}  # queue -> peer -> its room
        self._claims: list[Claim] = []

    def idle_slots(self, queue: str) -> int:
        """Idle slots of the other live, healthy generate workers consuming `queue`,
        less those this worker recently gave prompts back for."""
        with self._lock:
            self._refresh()
            return max(0, self._total(queue).idle - self._claimed(queue)[0])

    def claim(
        self, queue: str, wanted: int, beyond_slack: int = 0, faster_than: float = 0.0
    ) -> int:
        """Claim peers' room on `queue` for prompts about to be given back; how many:
        up to `wanted` of their idle slots, or up to `beyond_slack` (the giver's waiting
        prompts beyond its own slack) of what they are short; only the room of peers whose
        requests decode at `faster_than` tokens/s or more, when given. Read and claimed
        under one lock, so two deliveries of this worker do not both give prompts for the
        same slots."""
        with self._lock:
            self._refresh()
            total = self._total(queue, faster_than)
            idle_claimed, slack_claimed = self._claimed(queue)
            idle = max(0, total.idle - idle_claimed)
            short = max(0, total.short - idle_claimed - slack_claimed)
            for_idle = min(wanted, idle)
            for_slack = max(0, min(beyond_slack, short) - for_idle)
            if for_idle or for_slack:
                rooms = self._rooms.get(queue, {})
                takers = frozenset(name for name, room in rooms.items() if room.short > 0)
                self._claims.append(Claim(self._clock(), queue, for_idle, for_slack, takers))
            return for_idle + for_slack

    def faster(self, queue: str, than_tps: float) -> list[PeerRoom]:
        """The live peers consuming `queue` whose requests decode at least `than_tps`."""
        with self._lock:
            self._refresh()
            return self._faster(queue, than_tps)

    def _faster(self, queue: str, than_tps: float) -> list[PeerRoom]:
        rooms = self._rooms.get(queue, {}).values()
        return [r for r in rooms if r.decode_tps is not None and r.decode_tps >= than_tps]

    def _total(self, queue: str, faster_than: float = 0.0) -> PeerRoom:
        """Peers' room on `queue`: all of them, or those decoding at `faster_than` or more."""
        rooms = (
            self._faster(queue, faster_than)
            if faster_than > 0
            else self._rooms.get(queue, {}).values()
        )
        return PeerRoom(sum(r.idle for r in rooms), sum(r.short for r in rooms), 0.0)

    def _refresh(self) -> None:
        now = self._clock()
        if now - self._read_at >= CACHE_S:
            self._rooms = self._read(now)
            self._read_at = now
        self._claims = [c for c in self._claims if now - c.when < CLAIM_S and not self._taken(c)]

    def _taken(self, claim: Claim) -> bool:
        """Every peer that could take the claim's prompts beat TAKE_S after it (or is
        gone): its beat counts them, so the claim must not count them again."""
        rooms = self._rooms.get(claim.queue, {})
        return all(
            name not in rooms or rooms[name].seen >= claim.when + TAKE_S for name in claim.takers
        )

    def _claimed(self, queue: str) -> tuple[int, int]:
        """Slots claimed on `queue`: idle ones, and slack room beyond them."""
        claims = [c for c in self._claims if c.queue == queue]
        return sum(c.idle for c in claims), sum(c.slack for c in claims)

    def _read(self, now: float) -> dict[str, dict[str, PeerRoom]]:
        rooms: dict[str, dict[str, PeerRoom]] = {}
        for raw_name, raw in bytes_hash(self._r.hgetall(keys.WORKERS)).items():
            name = raw_name.decode()
            if name == self._me:
                continue
            beat = orjson.loads(raw)
            fresh = now - float(beat.get("last_seen", 0)) < FRESH_S
            if beat.get("kind") != "generate" or not beat.get("healthy") or not fresh:
                continue
            idle = int(beat.get("idle_slots", 0))
            speed = beat.get("decode_tps")
            room = PeerRoom(
                idle, max(idle, int(beat.get("short", 0))), float(beat["last_seen"]),
                int(beat.get("slots", 0)), None if speed is None else float(speed),
            )  # fmt: skip
            for queue in beat.get("queues", []):
                rooms.setdefault(queue, {})[name] = room
        return rooms
