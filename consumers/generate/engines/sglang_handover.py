"""Handing a running answer over: SGLang's `POST /abort_request` for one request.

SGLang answers an aborted request's own `/generate` call with what it has decoded so far
(`finish_reason.type == "abort"`, the partial `output_ids`), as it does for the requests
it retracts under memory pressure and later prefills anew with their output; RL
frameworks continue partial rollouts the same way. So a worker can stop an answer on a
slow server and continue it on a faster one, throwing nothing away (docs/design/placement.md, "A
slow server's last answers move").

The requests this worker runs are known by the prompt's rid (GenerateRequest.rid); each
attempt's own rid (a retry's carries a suffix) and server are what the abort names. A
reply aborted for any other reason (shutdown, an operator) stays a failure: only the
requests asked for here come back as answers so far. SGLang's router (0.3) has no such
route but passes the rid on to the server it picks, so behind it the abort goes to every
server it routes to; a server that has no such route and is no router is asked no more.

Only servers whose abort returns the answer so far are asked (SGLang 0.5.6 and later, by
the version their /server_info reports): 0.5.1 and 0.5.3 answer a queued request's
abort with no `output_ids`, 0.4.6 leaves its /generate call hanging, and a server that
says no version is not trusted with it. A server that refuses the route (401 or 403: an
`--admin-api-key` the worker was not given) is asked no more either. Each says so once;
its answers run to their end there, as before.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import aiohttp
import orjson

from regen.consumers.generate.engines.sglang_pool import ServerState
from regen.consumers.generate.engines.sglang_router import RouterError, router_worker_urls

log = logging.getLogger(__name__)

# /abort_request only queues a message to the scheduler: it answers at once.
ABORT_TIMEOUT_S = 10.0
# Replies that say the route is not there (not found, method not allowed, not built).
NO_ROUTE = frozenset({404, 405, 501})
# Replies that refuse it: SGLang 0.5.23 guards it with --admin-api-key when one is set.
REFUSED = frozenset({401, 403})
# The first SGLang whose abort answers a queued request with `output_ids` (0.5.3 has
# none: "Abort before prefill"); a running one's tokens so far come back from 0.5.x on.
FIRST_VERSION_TO_HAND_OVER = (0, 5, 6)
_VERSION = re.compile(r"(\d+)\.(\d+)\.(\d+)")


# A router's servers are looked up again this long after: a server that joins it later
# may be an older SGLang.
ROUTED_VERSIONS_TTL_S = 300.0
# Where a server tells its SGLang version: /server_info, or its older name (0.5.3 and
# before serve only that one; SGLang's router answers it for itself, with no version).
SERVER_INFO_PATHS = ("/server_info", "/get_server_info")
INFO_TIMEOUT_S = 10.0


def _version_key(version: str) -> tuple[int, ...]:
    found = _VERSION.match(version)
    return tuple(map(int, found.groups())) if found else (-1,)


def abort_returns_answer(version: str | None) -> bool:
    """Whether a server reporting `version` answers an aborted request with its tokens
    so far, queued or running (unknown: no)."""
    return _version_key(version or "") >= FIRST_VERSION_TO_HAND_OVER


async def server_version(
    http: aiohttp.ClientSession, base_url: str, headers: Mapping[str, str]
) -> str | None:
    """SGLang's version from a server's info (SERVER_INFO_PATHS); None where it says
    none or cannot be asked."""
    timeout = aiohttp.ClientTimeout(total=INFO_TIMEOUT_S)
    for path in SERVER_INFO_PATHS:
        try:
            async with http.get(base_url + path, headers=headers, timeout=timeout) as response:
                body = await response.read()
                if response.status != 200:
                    continue
            info = orjson.loads(body)
        except (aiohttp.ClientError, asyncio.TimeoutError, orjson.JSONDecodeError):
            continue
        version = info.get("version") if isinstance(info, dict) else None
        if isinstance(version, str):
            return version
    return None


@dataclass(frozen=True)
class Attempt:
    server: ServerState
    rid: str  # this attempt's rid, as the server knows it


class HandOvers:
    """The attempts running now, by prompt rid, and those asked to hand over."""

    def __init__(self) -> None:
        self._running: dict[str, Attempt] = {}
        self._asked: set[str] = set()
        # Server URLs asked no more (no /abort_request, or refused), and the (URL,
        # version) pairs already said to be too old: each is logged once.
        self._no_route: set[str] = set()
        self._too_old: set[tuple[str, str | None]] = set()
        # A router's URL -> (when read, the oldest version of the servers behind it).
        self._routed: dict[str, tuple[float, str]] = {}

    def started(self, rid: str, server: ServerState, attempt_rid: str) -> None:
        self._running[rid] = Attempt(server, attempt_rid)

    def ended(self, rid: str) -> None:
        self._running.pop(rid, None)

    def forget(self, rid: str) -> None:
        """The prompt's generate() returned: it is no longer asked for."""
        self._running.pop(rid, None)
        self._asked.discard(rid)

    def asked(self, rid: str) -> bool:
        return rid in self._asked

    async def ask(
        self,
        http: aiohttp.ClientSession,
        rid: str,
        headers: Mapping[ServerState, Mapping[str, str]],
    ) -> bool:
        """Abort the running attempt of `rid` on its server; False when none runs (between
        retries, or finished) or the server did not take the abort."""
        attempt = self._running.get(rid)
        if attempt is None or attempt.server.url in self._no_route:
            return False
        sent = dict(headers[attempt.server])
        try:
            if not await self._can_ask(http, attempt, sent):
                return False
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not hand over %s on %s: %s", rid, attempt.server.label, exc)
            return False
        self._asked.add(rid)
        try:
            ok = await self._abort(http, attempt, sent)
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not hand over %s on %s: %s", rid, attempt.server.label, exc)
            ok = False
        if not ok:
            # Its reply, should an abort from elsewhere come, is a failure as before.
            self._asked.discard(rid)
        return ok

    async def _can_ask(
        self, http: aiohttp.ClientSession, attempt: Attempt, headers: dict[str, str]
    ) -> bool:
        """Whether the attempt's server answers an abort with the answer so far: by the
        version it reports, or behind SGLang's router (which reports none of its own) by
        its servers' versions, all of them (the abort goes to each)."""
        server = attempt.server
        version = server.version
        if version == "":  # says no version: a router, or no SGLang regen can trust
            version = await self._routed_versions(http, server, headers)
        if abort_returns_answer(version):
            return True
        if server.version is not None and (server.url, version) not in self._too_old:
            self._too_old.add((server.url, version))
            log.warning("%s reports SGLang %s: only 0.5.6 and later answer an abort with the "
                        "answer so far, so its running answers are not handed over",
                        server.label, version or "no version")  # fmt: skip
        return False

    async def _routed_versions(
        self, http: aiohttp.ClientSession, server: ServerState, headers: dict[str, str]
    ) -> str:
        """The oldest version of the servers behind the router at `server` ("" when it
        is no router, or one of them says none), looked up once per router and again
        after ROUTED_VERSIONS_TTL_S: servers join and leave it."""
        known = self._routed.get(server.url)
        if known is not None and time.monotonic() - known[0] < ROUTED_VERSIONS_TTL_S:
            return known[1]
        try:
            workers = await router_worker_urls(server.url, session=http, headers=headers)
        except RouterError:
            workers = []
        versions = await asyncio.gather(*(server_version(http, url, headers) for url in workers))
        said = [v for v in versions if v is not None]
        oldest = min(said, key=_version_key) if said and len(said) == len(versions) else ""
        self._routed[server.url] = (time.monotonic(), oldest)
        return oldest

    async def _abort(
        self, http: aiohttp.ClientSession, attempt: Attempt, headers: dict[str, str]
    ) -> bool:
        """POST the abort to the attempt's server; behind SGLang's router (which has no
        such route, but passes the rid on) to each server it routes to: a server that
        does not run the rid ignores it."""
        server = attempt.server
        status = await _post_abort(http, server.url, attempt.rid, headers)
        if status in REFUSED:
            self._no_route.add(server.url)
            log.warning("%s refuses /abort_request (HTTP %d; an --admin-api-key guards it: "
                        "give the worker the same key): its running answers are not handed "
                        "over", server.label, status)  # fmt: skip
            return False
        if status not in NO_ROUTE:
            return status == 200
        try:
            workers = await router_worker_urls(server.url, session=http, headers=headers)
        except RouterError:
            self._no_route.add(server.url)
            log.warning("%s has no /abort_request (HTTP %d) and is no router: its running "
                        "answers are not handed over", server.label, status)  # fmt: skip
            return False
        statuses = await asyncio.gather(
            *(_post_abort(http, url, attempt.rid, headers) for url in workers),
            return_exceptions=True,
        )
        return any(status == 200 for status in statuses)


async def _post_abort(
    http: aiohttp.ClientSession, base_url: str, rid: str, headers: dict[str, str]
) -> int:
    async with http.post(
        base_url + "/abort_request",
        data=orjson.dumps({"rid": rid}),
        headers={**headers, "Content-Type": "application/json"},
        timeout=aiohttp.ClientTimeout(total=ABORT_TIMEOUT_S),
    ) as response:
        await response.read()
        return response.status
