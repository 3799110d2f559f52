"""The Engine for SGLang servers over HTTP: one `POST /generate` per prompt.

Prompts are never batched into one call, because SGLang fails a whole batch with HTTP 400
when one item is bad. What each failure says about the server, and what happens to the
request, is in sglang_replies; a down server gets no requests until its health probe
passes again (sglang_pool).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Any

import aiohttp
import orjson

from regen.common import defaults
from regen.common.backoff import Backoff
from regen.consumers.generate.engine import (
    EngineDown,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    server_rid,
)
from regen.consumers.generate.engines.admission_policy import (
    AdmissionPolicy,
    MetricsUnavailable,
    parse_metrics,
)
from regen.consumers.generate.engines.sglang_admission import AdmissionPoller
from regen.consumers.generate.engines.sglang_handover import HandOvers, server_version
from regen.consumers.generate.engines.sglang_pool import ServerPool, ServerState
from regen.consumers.generate.engines.sglang_replies import (
    Failure,
    classify_error,
    parse_result,
    transport_failure,
)
from regen.consumers.generate.engines.sglang_router import RouterError, router_worker_urls

log = logging.getLogger(__name__)

# SGLang (uvicorn) closes idle keep-alive connections after 5 s; dropping ours first
# avoids sending a request down a socket the server is closing.
KEEPALIVE_EXPIRY_S = 4.0
CONNECT_TIMEOUT_S = 10.0
# How often a healthy server is re-probed; down servers are re-probed sooner.
HEALTH_INTERVAL_S = 10.0
# /health_generate answers within SGLang's 20 s HEALTH_CHECK_TIMEOUT, even when wedged.
HEALTH_TIMEOUT_S = 30.0
BACKOFF_BASE_S = 0.1
BACKOFF_MAX_S = 10.0
MAX_BAD_ANSWERS = 5
# A request's read timeout covers this many times the time its max_new_tokens take at
# the server's measured per-request speed (queue wait included), and never less than
# request_timeout_s: a timeout marks the server down and aborts the answer, so it must
# only catch a wedged server (docs/design/limits.md, "Timers at real lengths").
READ_TIMEOUT_MARGIN = 4.0


def read_timeout_s(floor_s: float, max_new_tokens: int, decode_tps: float | None) -> float:
    """How long one attempt may go without a byte back (SGLang sends the whole reply at
    the end): `floor_s`, or longer when `max_new_tokens` at `decode_tps` need it."""
    if not decode_tps or max_new_tokens <= 0:
        return floor_s
    return max(floor_s, READ_TIMEOUT_MARGIN * max_new_tokens / decode_tps)


class SGLangHTTPEngine:
    name = "sglang"

    def __init__(
        self,
        servers: list[str],
        *,
        max_inflight_per_server: int = defaults.MAX_INFLIGHT_PER_SERVER,
        admission: AdmissionPolicy | None = None,
        admission_poll_s: float = defaults.ADMISSION_POLL_S,
        request_timeout_s: float = defaults.REQUEST_TIMEOUT_S,
        connect_timeout_s: float = CONNECT_TIMEOUT_S,
        keepalive_expiry_s: float = KEEPALIVE_EXPIRY_S,
        health_path: str = "/health_generate",
        health_interval_s: float = HEALTH_INTERVAL_S,
        health_timeout_s: float = HEALTH_TIMEOUT_S,
        backoff_base_s: float = BACKOFF_BASE_S,
        backoff_max_s: float = BACKOFF_MAX_S,
        max_bad_answers: int = MAX_BAD_ANSWERS,
        give_up_after_s: float | None = None,
        api_key: str | None = None,
        admin_api_key: str | None = None,
    ) -> None:
        """`health_path`: /health_generate, because since SGLang 0.5 /health answers 200
        without asking the scheduler, so a wedged server passes it; /health_generate runs
        (or, under load, piggybacks on) a real one-token generation.

        `give_up_after_s`: how long one generate() may go with no healthy server before
        raising EngineDown, when the caller passes no `outage_s`. None (the default)
        waits for ever: an outage is not the prompt's fault (docs/design/delivery.md, "A dead
        server is not a bad prompt"). Busy servers are waited out in either case.

        `request_timeout_s`: the least read timeout of one attempt; a request that asks
        for many tokens of a slow server gets longer (read_timeout_s).

        `admission`: `--max-inflight auto`, each server's limit steered by its /metrics
        (sglang_admission); None keeps `max_inflight_per_server` fixed.

        `api_key`, `admin_api_key`: SGLang's `--api-key` and `--admin-api-key`; the
        admin key, where a server has one, is what its `/abort_request` takes.
        """
        self._pool = ServerPool(
            servers,
            max_inflight_per_server,
            self._probe,
            health_interval_s=health_interval_s,
            # A busy server is waited out for at least half of each backoff.
            overload_backoff=Backoff(backoff_base_s, backoff_max_s, jitter=0.5),
        )
        self._health_path = health_path
        self._retry = Backoff(backoff_base_s, backoff_max_s)
        self._max_bad_answers = max_bad_answers
        self._give_up_after_s = give_up_after_s
        self._request_timeout_s = request_timeout_s
        # A read timeout, which bounds a whole attempt because SGLang sends nothing
        # until the completion is done; total=None replaces aiohttp's default 300 s cap.
        self._timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=connect_timeout_s, sock_read=request_timeout_s
        )
        self._health_timeout = aiohttp.ClientTimeout(
            total=None, sock_connect=health_timeout_s, sock_read=health_timeout_s
        )
        self._keepalive_expiry_s = keepalive_expiry_s
        # Credentials from a server's URL win over the API key. Both travel as headers
        # because aiohttp refuses an auth argument next to an Authorization header.
        bearer = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._auth_headers = {
            s: {"Authorization": s.auth.encode()} if s.auth else bearer for s in self._pool.servers
        }
        admin = {"Authorization": f"Bearer {admin_api_key}"} if admin_api_key else None
        self._abort_headers = {s: admin or self._auth_headers[s] for s in self._pool.servers}
        self._http: aiohttp.ClientSession | None = None
        self._hand_overs = HandOvers()
        self._admission = (
            None
            if admission is None
            else AdmissionPoller(
                self._pool, admission, self.read_metrics, interval_s=admission_poll_s
            )
        )
        if self._admission is not None:  # each server's /metrics will be read
            for server in self._pool.servers:
                server.slots.expect_readings()

    async def __aenter__(self) -> SGLangHTTPEngine:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- Engine protocol ---------------------------------------------------------------
    async def generate(
        self, request: GenerateRequest, *, outage_s: float | None = None
    ) -> GenerateResult:
        """Complete one prompt, retrying through outages; EngineDown once no server has
        been healthy for `outage_s` seconds in a row."""
        try:
            return await self._generate(request, outage_s)
        finally:
            self._hand_overs.forget(request.rid)

    async def _generate(self, request: GenerateRequest, outage_s: float | None) -> GenerateResult:
        self._start()
        if outage_s is None:
            outage_s = self._give_up_after_s
        failures = bad = disconnects = 0
        while True:
            try:
                server = await self._pool.acquire(
                    outage_s, request.affinity, urgent=request.next_turn
                )
            except TimeoutError:
                raise EngineDown(
                    f"no SGLang server healthy for {outage_s:.0f} s ({self._describe()})"
                ) from None
            rid = server_rid(request.rid, failures)
            self._hand_overs.started(request.rid, server, rid)
            try:
                result = await self._attempt(server, request, rid)
            except Failure as failure:
                self._pool.release(server, ok=False)
                failures += 1
                disconnects += failure.kind == "disconnect"
                if failure.kind == "disconnect" and disconnects == 1:
                    self._pool.record(server, failure.kind, failure.message)
                    continue
                self._note(server, failure)
                bad += failure.bad
                if bad >= self._max_bad_answers:
                    raise EngineUnavailable(
                        f"{bad} bad answers for rid {request.rid}; last from "
                        f"{server.label}: {failure.kind}: {failure.message}"
                    ) from None
                await asyncio.sleep(self._retry.delay(failures))
                continue
            except BaseException:  # PromptRejected, or cancellation of the caller
                self._pool.release(server, ok=False)
                raise
            finally:
                self._hand_overs.ended(request.rid)
            self._pool.release(server, ok=True)
            server.cache.count(result.prompt_tokens, result.cached_tokens)
            server.note_speed(result.completion_tokens, result.latency_s)
            return result

    async def health(self) -> bool:
        """True when at least one server passed its last health probe.

        Answers from the watchers' latest probes, so calling it often (heartbeats) costs
        nothing; only a server never probed yet is probed first (SGLang's
        /health_generate takes a second or more).
        """
        self._start()
        await self._pool.probe_unprobed()
        return bool(self._pool.healthy())

    def capacity(self) -> int:
        """Requests the healthy servers start soon: each one's limit, or its running
        slots where its /metrics show fewer (flow control holds no more than this)."""
        return sum(s.startable() for s in self._pool.healthy())

    async def hand_over(self, rid: str) -> bool:
        """Abort `rid` where it runs, its generate() returning the answer so far
        (sglang_handover.py)."""
        return await self._hand_overs.ask(self._session(), rid, self._abort_headers)

    def servers(self) -> list[ServerState]:
        return list(self._pool.servers)

    def stats(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "servers": [s.snapshot() for s in self._pool.servers],
            "affinity": self._pool.affinity_stats(),
        }

    async def close(self) -> None:
        if self._admission is not None:
            await self._admission.close()
        await self._pool.close()
        if self._http is not None:
            await self._http.close()
            self._http = None

    def _start(self) -> None:
        self._pool.start()
        if self._admission is not None:
            self._admission.start()

    # --- helpers for the worker ----------------------------------------------------------
    def healthy_servers(self) -> list[str]:
        """Redacted URLs of the servers that passed their last health probe."""
        return [s.label for s in self._pool.healthy()]

    async def wait_until_healthy(self, timeout: float | None = None) -> bool:
        """Wait until a server is healthy; False if `timeout` seconds pass first."""
        self._start()
        return await self._pool.wait_until_healthy(timeout)

    # --- one attempt ---------------------------------------------------------------------
    async def _attempt(
        self, server: ServerState, request: GenerateRequest, rid: str
    ) -> GenerateResult:
        body = {"input_ids": request.prompt_ids, "sampling_params": request.sampling, "rid": rid}
        headers = {**self._auth_headers[server], "Content-Type": "application/json"}
        started = time.monotonic()
        max_new = int(request.sampling.get("max_new_tokens") or 0)
        timeout = aiohttp.ClientTimeout(
            total=None,
            sock_connect=self._timeout.sock_connect,
            sock_read=read_timeout_s(self._request_timeout_s, max_new, server.decode_tps),
        )
        try:
            async with self._session().post(
                server.url + "/generate", data=orjson.dumps(body), headers=headers, timeout=timeout
            ) as response:
                status, payload = response.status, await response.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            raise transport_failure(exc) from None
        # Requests are logged here, by label, so credentials never reach a log line.
        log.debug("HTTP Request: POST %s/generate %d", server.label, status)
        if status == 200:
            handed_over = self._hand_overs.asked(request.rid)
            result = parse_result(payload, request, server.label, started, handed_over=handed_over)
            return dataclasses.replace(result, server_version=server.version or None)
        raise classify_error(status, payload, server.label)

    def _session(self) -> aiohttp.ClientSession:
        """The HTTP session, made on first use: aiohttp binds it to the running loop, and
        the engine is built before its loop runs (consumers/generate/engine_loop.py)."""
        if self._http is None:
            connector = aiohttp.TCPConnector(
                # No connection cap: the pool already bounds requests per server, and a
                # cap would only make health probes queue behind generations.
                limit=0,
                limit_per_host=0,
                keepalive_timeout=self._keepalive_expiry_s,
            )
            self._http = aiohttp.ClientSession(
                connector=connector,
                timeout=self._timeout,
                # Inference servers sit on private networks; an HTTP(S)_PROXY meant for
                # the internet must not silently capture every request.
                trust_env=False,
            )
        return self._http

    def _note(self, server: ServerState, failure: Failure) -> None:
        if failure.kind == "overloaded":
            self._pool.mark_overloaded(server, failure.message)
        elif failure.down:
            self._pool.mark_down(server, failure.kind, failure.message)
        else:
            self._pool.record(server, failure.kind, failure.message)
        if failure.bad:
            log.warning("bad answer from %s: %s: %s", server.label, failure.kind, failure.message)
        else:
            log.debug("retrying after %s from %s: %s", failure.kind, server.label, failure.message)

    async def _probe(self, server: ServerState) -> bool:
        try:
            async with self._session().get(
                server.url + self._health_path,
                headers=self._auth_headers[server],
                timeout=self._health_timeout,
            ) as response:
                await response.read()  # so the connection goes back to the pool
                healthy = response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            healthy = False
        if not healthy:
            server.version = None  # it may come back as another version
        elif server.version is None:
            server.version = await self._server_version(server) or ""
        return healthy

    async def _server_version(self, server: ServerState) -> str | None:
        return await server_version(self._session(), server.url, self._auth_headers[server])

    async def read_metrics(self, server: ServerState) -> tuple[int, bytes]:
        """The server's /metrics; for SGLang's router, its servers' together.

        The router serves no `sglang:*` metrics of its own (docs/design/sglang.md, "Behind
        SGLang's router"), so on a 404 its worker list is asked for, and each listed
        server's /metrics is read: their text put together sums running and queued
        requests and throughput over the servers, and keeps the highest token usage
        (admission.parse_metrics), so the router's one limit follows all of them. A
        server that does not answer is left out of that reading.

        Each reading also tells what the server runs at once (server_slots.py), which
        bounds what flow control counts on (capacity()).
        """
        status, body = await self._read_metrics(server)
        try:
            if status != 200:
                raise MetricsUnavailable(f"HTTP {status}")
            load = parse_metrics(body.decode("utf-8", errors="replace"))
        except MetricsUnavailable:
            server.slots.no_readings()
        else:
            server.slots.observe(load.running, load.queued, time.monotonic())
        return status, body

    async def _read_metrics(self, server: ServerState) -> tuple[int, bytes]:
        headers = self._auth_headers[server]
        status, body = await self._get_metrics(server.url, headers)
        if status != 404:
            return status, body
        try:
            workers = await router_worker_urls(server.url, session=self._session(), headers=headers)
        except RouterError:
            return status, body  # no router either: the controller keeps the fixed limit
        readings = await asyncio.gather(
            *(self._get_metrics(url, headers) for url in workers), return_exceptions=True
        )
        texts = [r[1] for r in readings if not isinstance(r, BaseException) and r[0] == 200]
        return (200, b"\n".join(texts)) if texts else (status, body)

    async def _get_metrics(self, base_url: str, headers: dict[str, str]) -> tuple[int, bytes]:
        async with self._session().get(
            base_url + "/metrics", headers=headers, timeout=self._health_timeout
        ) as response:
            return response.status, await response.read()

    def _describe(self) -> str:
        return "; ".join(f"{s.label}: {s.last_error or 'no error'}" for s in self._pool.servers)
