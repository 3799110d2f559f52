"""Handing a running answer over: SGLang's `POST /abort_request` for one request.

SGLang answers an aborted request's own `/generate` call with what it has decoded so far
(`finish_reason.type == "abort"`, the partial `output_ids`), as it does for the requests
it retracts under memory pressure and later prefills anew with their output; RL
frameworks continue partial rollouts the same way. So a worker can stop an answer on a
slow server and continue it on a faster one, throwing nothing away (docs/design.md, "A
slow server's last answers move").

The requests this worker runs are known by the prompt's rid (GenerateRequest.rid); each
attempt's own rid (a retry's carries a suffix) and server are what the abort names. A
reply aborted for any other reason (shutdown, an operator) stays a failure: only the
requests asked for here come back as answers so far. SGLang's router (0.3) has no such
route but passes the rid on to the server it picks, so behind it the abort goes to every
server it routes to; a server that has no such route and is no router is asked no more.
"""

from __future__ import annotations

import asyncio
import logging
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


@dataclass(frozen=True)
class Attempt:
    server: ServerState
    rid: str  # this attempt's rid, as the server knows it


class HandOvers:
    """The attempts running now, by prompt rid, and those asked to hand over."""

    def __init__(self) -> None:
        self._running: dict[str, Attempt] = {}
        self._asked: set[str] = set()
        self._no_route: set[str] = set()  # server URLs without /abort_request

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
        self._asked.add(rid)
        try:
            ok = await self._abort(http, attempt, dict(headers[attempt.server]))
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not hand over %s on %s: %s", rid, attempt.server.label, exc)
            ok = False
        if not ok:
            # Its reply, should an abort from elsewhere come, is a failure as before.
            self._asked.discard(rid)
        return ok

    async def _abort(
        self, http: aiohttp.ClientSession, attempt: Attempt, headers: dict[str, str]
    ) -> bool:
        """POST the abort to the attempt's server; behind SGLang's router (which has no
        such route, but passes the rid on) to each server it routes to: a server that
        does not run the rid ignores it."""
        server = attempt.server
        status = await _post_abort(http, server.url, attempt.rid, headers)
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
