"""The SGLang servers one engine spreads its requests over, and what it knows about each.

A server is routable when its last health probe passed, it is not backing off after an
overload (HTTP 503), and it has a free in-flight slot under its limit (fixed, or moved
by `--max-inflight auto`: sglang_admission.py); among those the least loaded wins.
A request failure marks a server down at once, and its watcher re-probes it right away,
then with growing delays: routing never waits for a timer to find out a server died,
and a restarted server is back within one probe.

Waiting is not failing: while any server is healthy a request waits for a slot however
long they all stay full (at real answer lengths a full server is the normal case); only
when none has been healthy for the caller's `outage_s` in a row does `acquire` give up
(docs/design/limits.md, "Timers at real lengths"). A later turn of a conversation waits at the
front, so conversations already started finish first.

A request with an affinity key (a conversation's turns) goes to the server that served
that key last, when that server is routable, because its radix cache still holds the
prefix; when it is not (down, backing off, full) the request goes to the least loaded
one instead and the key follows it. Affinity never makes a request wait for a server
(docs/design/delivery.md, "Turns"). The pool remembers a bounded number of keys, the least
recently used forgotten first, so memory stays flat over a long job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from yarl import URL

from regen.common import defaults
from regen.common.backoff import Backoff
from regen.consumers.generate.engines.cache_tally import CacheTally
from regen.consumers.generate.engines.server_slots import SlotEstimate

log = logging.getLogger(__name__)

# Re-probe delay for a server that is down: starts here, doubles up to the interval.
DOWN_RECHECK_MIN_S = 0.1
# A server's per-request decode speed (tokens/s, queue wait included) is an average of
# its replies with at least this many tokens, each weighing this much.
SPEED_MIN_TOKENS = 16
SPEED_WEIGHT = 0.2


async def wait_event(event: asyncio.Event, timeout: float | None) -> None:
    """Wait until `event` is set or `timeout` passes.

    Not asyncio.wait_for: on Python < 3.12 it swallows a cancellation that arrives as the
    event fires, and a task that cannot be cancelled hangs close() and worker shutdown.
    """
    waiter = asyncio.ensure_future(event.wait())
    try:
        await asyncio.wait({waiter}, timeout=timeout)
    finally:
        waiter.cancel()


def _resolve(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


async def cancel_and_wait(tasks: list[asyncio.Task[None]]) -> None:
    """Cancel background tasks and wait until each has stopped."""
    for task in tasks:
        task.cancel()
    for task in tasks:
        with contextlib.suppress(asyncio.CancelledError):
            await task


def split_credentials(url: str) -> tuple[str, str, aiohttp.BasicAuth | None]:
    """(URL to request, label for logs and stats, auth) for a server URL.

    Credentials move out of the URL into an auth object, because HTTP clients put the
    request URL in exception messages; the label also drops the query, where API keys
    tend to hide.
    """
    parsed = URL(url.rstrip("/"))
    bare = parsed.with_user(None)  # drops the password too
    label = str(bare.with_query(None).with_fragment(None))
    if parsed.user is None and parsed.password is None:
        return str(bare), label, None
    # UTF-8, not aiohttp's Latin-1 default: what the credentials' percent-escapes mean.
    auth = aiohttp.BasicAuth(parsed.user or "", parsed.password or "", encoding="utf-8")
    scheme, _, rest = label.partition("://")
    return str(bare), f"{scheme}://***@{rest}", auth


@dataclass(eq=False)
class ServerState:
    url: str
    label: str
    cap: int  # the in-flight limit
    auth: aiohttp.BasicAuth | None = None
    limit_reason: str = "fixed: --max-inflight"
    healthy: bool = False
    probed: bool = False
    inflight: int = 0
    picks: int = 0
    completed: int = 0
    failures: Counter[str] = field(default_factory=Counter)
    last_error: str | None = None
    overload_until: float = 0.0
    overload_streak: int = 0
    # Bumped when a request marks the server down, so a probe that started before the
    # failure cannot flip it back to healthy with stale news.
    epoch: int = 0
    recheck: asyncio.Event = field(default_factory=asyncio.Event)
    # Prefix-cache hits reported by this server's replies.
    cache: CacheTally = field(default_factory=CacheTally)
    # Output tokens per second one request gets here, from its replies (None: no reply
    # yet); sizes each request's read timeout (sglang_http.read_timeout_s).
    decode_tps: float | None = None
    # What it runs at once, from its /metrics (with `--max-inflight auto`).
    slots: SlotEstimate = field(default_factory=SlotEstimate)
    # SGLang's version as its /server_info reports it: None until read ("" where it says
    # none), read again after each outage (a restart may be an upgrade); every result
    # carries it, so a job served by several versions shows.
    version: str | None = None

    def note_speed(self, tokens: int, seconds: float) -> None:
        """Fold one reply's tokens over its latency into `decode_tps`."""
        if tokens < SPEED_MIN_TOKENS or seconds <= 0:
            return  # a short answer's latency is mostly overhead, not decoding
        rate = tokens / seconds
        old = self.decode_tps
        self.decode_tps = rate if old is None else old + SPEED_WEIGHT * (rate - old)

    def startable(self) -> int:
        """Requests it starts soon: its limit, or fewer where /metrics show it runs
        fewer at once (server_slots.py); what flow control counts on (flow_control.py)."""
        slots = self.slots.estimate()
        return self.cap if slots is None else min(self.cap, slots)

    def routable(self, now: float) -> bool:
        return self.healthy and self.overload_until <= now and self.inflight < self.cap

    def snapshot(self) -> dict[str, Any]:
        return {
            "url": self.label,
            "healthy": self.healthy,
            "probed": self.probed,
            "inflight": self.inflight,
            "max_inflight": self.cap,
            "limit_reason": self.limit_reason,
            "completed": self.completed,
            "failures_by_kind": dict(self.failures),
            "last_error": self.last_error,
            "overloaded_for_s": max(0.0, self.overload_until - time.monotonic()),
            "decode_tokens_per_s": self.decode_tps,
            "startable": self.startable(),
            **self.cache.snapshot(),
        }


def _least_loaded(servers: list[ServerState]) -> ServerState:
    return min(servers, key=lambda s: (s.inflight, s.picks))


class ServerPool:
    def __init__(
        self,
        urls: list[str],
        cap: int,
        probe: Callable[[ServerState], Awaitable[bool]],
        *,
        health_interval_s: float,
        overload_backoff: Backoff,
        affinity_keys: int = defaults.AFFINITY_KEYS,
    ) -> None:
        if not urls:
            raise ValueError("SGLang engine needs at least one server URL")
        if cap < 1:
            raise ValueError("max_inflight_per_server must be >= 1")
        if affinity_keys < 1:
            raise ValueError("affinity_keys must be >= 1")
        self.servers: list[ServerState] = []
        for raw in urls:
            url, label, auth = split_credentials(raw)
            self.servers.append(ServerState(url, label, cap, auth))
        self._probe = probe
        self._health_interval_s = health_interval_s
        self._overload_backoff = overload_backoff
        # A down server is re-probed soon, then less often, up to the healthy interval.
        self._recheck_backoff = Backoff(DOWN_RECHECK_MIN_S, health_interval_s, jitter=0)
        self._watchers: list[asyncio.Task[None]] = []
        # Replaced on every change: a waiter grabs the current event before checking,
        # so a change between its check and its wait is never missed.
        self._changed = asyncio.Event()
        # Requests waiting for a slot, oldest first. A freed slot wakes one of them; a
        # change of health, overload or limit wakes them all. Waking all on each release
        # would cost O(waiting) per completion: hundreds or thousands while servers are
        # full, as flow control keeps them (flow_control.py).
        self._slot_waiters: deque[asyncio.Future[None]] = deque()
        # Affinity key -> the server that served it last, least recently used first.
        self._affinity: OrderedDict[str, ServerState] = OrderedDict()
        self._affinity_keys = affinity_keys
        # Since when no server has been healthy (None while one is): a request gives up
        # only once this outage has lasted its `outage_s` (outage_since()).
        self._down_since: float | None = None
        # Requests with a key that went to its last server, and that had to go elsewhere.
        self.affinity_kept = 0
        self.affinity_moved = 0

    def start(self) -> None:
        if not self._watchers:
            self._watchers = [asyncio.create_task(self._watch(s)) for s in self.servers]

    async def close(self) -> None:
        await cancel_and_wait(self._watchers)

    def healthy(self) -> list[ServerState]:
        return [s for s in self.servers if s.healthy]

    # --- routing -----------------------------------------------------------------------
    async def acquire(
        self, outage_s: float | None, affinity: str | None = None, *, urgent: bool = False
    ) -> ServerState:
        """A routable server with its slot taken. While some server is healthy this waits
        however long every slot stays taken; TimeoutError once no server has been healthy
        for `outage_s` seconds in a row (None: never).

        With an `affinity` key: the server that served the key last, if it is routable.
        `urgent` (a conversation's next turn) waits ahead of the others.
        """
        while True:
            now = time.monotonic()
            candidates = [s for s in self.servers if s.routable(now)]
            if candidates:
                server = self._choose(candidates, affinity)
                server.inflight += 1
                server.picks += 1
                return server
            wake = [s.overload_until for s in self.servers if s.healthy and s.overload_until > now]
            down_since = self.outage_since()
            if outage_s is not None and down_since is not None:
                give_up = down_since + outage_s
                if now >= give_up:
                    raise TimeoutError
                wake.append(give_up)
            await self._wait_for_slot(max(0.0, min(wake) - now) if wake else None, urgent)

    async def _wait_for_slot(self, timeout: float | None, urgent: bool = False) -> None:
        """Until a slot may have freed (or anything else changed), or `timeout` passes.

        A waiter that times out or is cancelled stays in the queue, done; the next wake
        skips it (removing it here would cost O(waiting) each, and a cancelled chunk
        cancels all of its waiters at once).
        """
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[None] = loop.create_future()
        if urgent:
            self._slot_waiters.appendleft(waiter)
        else:
            self._slot_waiters.append(waiter)
        timer = None if timeout is None else loop.call_later(timeout, _resolve, waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._wake_one()  # woken, then cancelled: the slot goes to the next one
            raise
        finally:
            if timer is not None:
                timer.cancel()

    def _wake_one(self) -> None:
        while self._slot_waiters:
            waiter = self._slot_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def set_limit(self, server: ServerState, limit: int, reason: str) -> None:
        """Move a server's in-flight limit; a lower one drains as requests finish."""
        server.cap, server.limit_reason = limit, reason
        self._notify()

    def _choose(self, candidates: list[ServerState], affinity: str | None) -> ServerState:
        """The key's last server among the routable `candidates`, else the least loaded;
        the key then points at the one chosen."""
        if affinity is None:
            return _least_loaded(candidates)
        last = self._affinity.get(affinity)
        if last is not None and last in candidates:
            self.affinity_kept += 1
            self._affinity.move_to_end(affinity)
            return last
        server = _least_loaded(candidates)
        self.affinity_moved += last is not None
        self._affinity[affinity] = server
        self._affinity.move_to_end(affinity)
        if len(self._affinity) > self._affinity_keys:
            self._affinity.popitem(last=False)
        return server

    def affinity_stats(self) -> dict[str, int]:
        return {
            "kept": self.affinity_kept,
            "moved": self.affinity_moved,
            "keys": len(self._affinity),
        }

    def release(self, server: ServerState, *, ok: bool) -> None:
        server.inflight -= 1
        if ok:
            server.completed += 1
            server.overload_streak = 0
        self._wake_one()  # one slot freed: one waiter can take it

    def mark_down(self, server: ServerState, kind: str, error: str) -> None:
        self.record(server, kind, error)
        server.epoch += 1
        server.recheck.set()
        if server.healthy:
            server.healthy = False
            log.warning("SGLang server %s is down (%s: %s)", server.label, kind, error)
            self._notify()

    def mark_overloaded(self, server: ServerState, error: str) -> None:
        """Back off a server that refused work (queue full): busy, not dead."""
        self.record(server, "overloaded", error)
        server.overload_streak += 1
        wait_s = self._overload_backoff.delay(server.overload_streak)
        server.overload_until = time.monotonic() + wait_s
        self._notify()

    def record(self, server: ServerState, kind: str, error: str) -> None:
        """Count a failure; alone, it says nothing about the server's health."""
        server.failures[kind] += 1
        server.last_error = f"{kind}: {error}"

    def outage_since(self) -> float | None:
        """When the outage began (time.monotonic()): since no server has been healthy;
        None while one is. Kept on every change of health, so it starts when the last
        server went down, not when a request first asked."""
        if any(s.healthy for s in self.servers):
            self._down_since = None
        elif self._down_since is None:
            self._down_since = time.monotonic()
        return self._down_since

    def _notify(self) -> None:
        self.outage_since()
        self._changed.set()
        self._changed = asyncio.Event()
        while self._slot_waiters:
            _resolve(self._slot_waiters.popleft())

    # --- health --------------------------------------------------------------------------
    async def wait_until_healthy(self, timeout: float | None) -> bool:
        self.start()
        deadline = None if timeout is None else time.monotonic() + timeout
        while not self.healthy():
            changed = self._changed
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                return False
            await wait_event(changed, remaining)
        return True

    async def probe_unprobed(self) -> None:
        """Probe now the servers no probe has answered for yet (the watchers do the rest)."""
        await asyncio.gather(*(self._probe_once(s) for s in self.servers if not s.probed))

    async def _probe_once(self, server: ServerState) -> bool:
        epoch = server.epoch
        ok = await self._probe(server)
        server.probed = True
        if server.epoch != epoch:  # a request failed meanwhile: trust that, probe again
            server.recheck.set()
            return False
        if ok != server.healthy:
            server.healthy = ok
            if ok:
                log.info("SGLang server %s is healthy", server.label)
            else:
                self.record(server, "health", "health probe failed")
                log.warning("SGLang server %s failed its health probe", server.label)
            self._notify()
        return ok

    async def _watch(self, server: ServerState) -> None:
        delay = 0.0
        failed_probes = 0
        while True:
            await wait_event(server.recheck, delay)
            server.recheck.clear()
            try:
                ok = await self._probe_once(server)
            except Exception:  # a watcher must outlive any one bad probe
                log.exception("health probe of %s crashed", server.label)
                ok = False
            if ok:
                delay, failed_probes = self._health_interval_s, 0
            else:
                delay = self._recheck_backoff.delay(failed_probes)
                failed_probes += 1
