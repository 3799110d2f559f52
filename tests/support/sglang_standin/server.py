"""The stand-in's HTTP surface: SGLang's /generate contract, its OpenAI chat route
(chat.py), /abort_request (aborts.py), plus test-only control routes; the routes and
shapes of the SGLang version it imitates (versions.py), and its API keys (auth.py).

Error bodies copy SGLang 0.5's shapes: a ValueError from request validation becomes
HTTP 400 `{"error": {"message": ...}}`; a scheduler abort with a status (the full
waiting queue) becomes `{"object": "error", "message": ..., "code": 503}`.
"""

from __future__ import annotations

import asyncio
import os
import socket
import time
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from tests.support.sglang_standin.aborts import parse_abort
from tests.support.sglang_standin.auth import UNAUTHORIZED, allowed
from tests.support.sglang_standin.chat import chat_error, chat_response, parse_chat
from tests.support.sglang_standin.completer import Completer
from tests.support.sglang_standin.config import StandinConfig, parse_fault
from tests.support.sglang_standin.metrics import metrics_registry, render
from tests.support.sglang_standin.scheduler import Scheduler
from tests.support.sglang_standin.slots import QueueFull
from tests.support.sglang_standin.validate import Item, RequestError, parse_generate

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


class Standin(Scheduler):
    def __init__(self, config: StandinConfig, completer: Completer, model_path: str) -> None:
        super().__init__(config, completer)
        self.model_path = model_path
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self.unhealthy = config.unhealthy
        self.inflight = 0
        self.peak_inflight = 0
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()
        self._metrics = metrics_registry(self, model_path)

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=256 * 1024 * 1024,
            middlewares=[self._count_connections, self._authorize],
        )
        for method in ("POST", "PUT"):  # as SGLang's route
            app.router.add_route(method, "/generate", self.generate)
        app.router.add_post("/v1/chat/completions", self.chat_completions)
        app.router.add_post("/abort_request", self.abort_request)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.health)
        app.router.add_get("/get_model_info", self.model_info)
        app.router.add_get("/get_server_info", self.server_info)
        if self.release.short_info_routes:
            app.router.add_get("/model_info", self.model_info)
            app.router.add_get("/server_info", self.server_info)
        if not self.config.no_metrics:
            app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/_fault", self.set_fault)
        app.router.add_get("/_stats", self.stats)
        app.router.add_get("/_served", self.served_requests)
        app.router.add_get("/_slot_log", self.slot_log_route)
        return app

    @web.middleware
    async def _count_connections(
        self, request: web.Request, handler: Handler
    ) -> web.StreamResponse:
        """Count client connections (keep-alive reuse shows as a transport already seen);
        the test-only routes are left out so that reading stats does not change them."""
        transport = request.transport
        if not request.path.startswith("/_") and transport and transport not in self._connections:
            self._connections.add(transport)
            self.counters["connections_total"] += 1
        return await handler(request)

    @web.middleware
    async def _authorize(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        """SGLang's API keys (auth.py): HTTP 401 before the route runs."""
        c = self.config
        if allowed(request.path, request.headers.get("Authorization"), c.api_key, c.admin_api_key):
            return await handler(request)
        return _json(UNAUTHORIZED, status=401)

    # --- SGLang routes -------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, self._generate)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._counted(request, self._chat)

    async def _counted(
        self, request: web.Request, handle: Callable[[web.Request], Awaitable[web.Response | None]]
    ) -> web.StreamResponse:
        self.counters["requests_total"] += 1
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            response = await handle(request)
        finally:
            self.inflight -= 1
        if response is None:  # dropped: the client got no status at all
            return web.Response(status=499)
        self.counters[f"status_{response.status}"] += 1
        return response

    def _injected(self, request: web.Request) -> tuple[bool, web.Response | None, float]:
        """The next armed fault on this request: (answered, its response or None when the
        connection was dropped, extra seconds on the slot)."""
        fault = self.take_fault()
        if fault is None:
            return False, None, 0.0
        kind, _, delay_s = fault
        if kind == "drop":
            # Close the socket with no response, as a crashed or OOM-killed server does.
            assert request.transport is not None
            request.transport.abort()
            return True, None, 0.0
        if kind == "500":
            return True, web.Response(status=500, text="Internal Server Error"), 0.0
        if kind == "503":
            return True, self._overloaded("Injected fault: service unavailable."), 0.0
        if kind == "malformed":  # a 200 a client cannot use (no output_ids)
            return True, _json({"text": "", "meta_info": {"id": "malformed"}}), 0.0
        return False, None, delay_s

    async def _generate(self, request: web.Request) -> web.Response | None:
        body = await request.read()
        answered, response, delay_s = self._injected(request)
        if answered:
            return response
        try:
            batch, items = parse_generate(body, self.completer.vocab_size)
            self.admit(items)
        except RequestError as exc:
            return _json({"error": {"message": str(exc)}}, status=400)
        outs = await self._run_all(items, delay_s)
        for out in outs:
            if isinstance(out, QueueFull):
                return self._overloaded(str(out))
        return _json(outs if batch else outs[0])

    async def _chat(self, request: web.Request) -> web.Response | None:
        """POST /v1/chat/completions (chat.py): one rendered prompt on the same slots."""
        body = await request.read()
        answered, response, delay_s = self._injected(request)
        if answered:
            return response
        try:
            item = parse_chat(
                body, self.completer.tokenizer, self.completer.vocab_size,
                self.config.context_length,
            )  # fmt: skip
            self.admit([item])
        except RequestError as exc:
            return _json(chat_error(str(exc), 400), status=400)
        (out,) = await self._run_all([item], delay_s)
        if isinstance(out, QueueFull):
            return self._overloaded(str(out))
        model = orjson.loads(body).get("model") or self.model_path
        return _json(chat_response(out, model))

    async def _run_all(self, items: list[Item], delay_s: float) -> list[Any]:
        """Each item's reply dict, or QueueFull; the rids are free again after."""
        started = time.monotonic()
        try:
            outs = await asyncio.gather(
                *(self.run(item, delay_s, started) for item in items), return_exceptions=True
            )
        finally:
            self.finish(items)
        for out in outs:
            if isinstance(out, BaseException) and not isinstance(out, QueueFull):
                raise out
        return outs

    def _overloaded(self, message: str) -> web.Response:
        body = {"object": "error", "message": message, "type": "503", "param": None, "code": 503}
        return _json(body, status=503)

    async def abort_request(self, request: web.Request) -> web.Response:
        """`{"rid": ...}` or `{"abort_all": true}`: HTTP 200 with an empty body, rid in
        flight or not; the request's own call returns its output so far (aborts.py)."""
        parsed = parse_abort(await request.read(), self.release)
        if parsed is None:
            return _json({"detail": "The body must be an AbortReq object."}, status=422)
        if self.config.abort_reply_delay_s:
            await asyncio.sleep(self.config.abort_reply_delay_s)
        self.abort(parsed[0], abort_all=parsed[1])
        return web.Response(status=200)

    async def health(self, request: web.Request) -> web.Response:
        starting = time.monotonic() - self._started_mono < self.config.startup_delay
        status = 503 if starting or self.unhealthy else 200
        self.counters[f"{request.path[1:]}_{status}"] += 1  # e.g. health_generate_503
        return web.Response(status=status)

    async def model_info(self, request: web.Request) -> web.Response:
        return _json(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "is_generation": True,
                "preferred_sampling_params": None,
                "weight_version": "default",
            }
        )

    async def server_info(self, request: web.Request) -> web.Response:
        c = self.config
        return _json(
            {
                "model_path": self.model_path,
                "tokenizer_path": self.model_path,
                "host": c.host,
                "port": c.port,
                "context_length": c.context_length,
                "max_running_requests": c.max_running_requests,
                "max_queued_requests": c.max_queued_requests,
                "trust_remote_code": c.trust_remote_code,
                "version": c.version,
                "frontend": "standin",
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        return web.Response(body=render(self._metrics), content_type="text/plain")

    # --- test-only routes ----------------------------------------------------------
    async def set_fault(self, request: web.Request) -> web.Response:
        """`{"kind": "500"|"503"|"drop"|"delay"|"malformed", "count": K, "delay_s": S}`,
        `{"healthy": false}` or `{"clear": true}` (clears both). The next K /generate
        requests each take one fault; `delay` holds its slot S seconds longer."""
        spec = orjson.loads(await request.read() or b"{}")
        if spec.get("clear"):
            self.faults.clear()
            self.unhealthy = False
        if "healthy" in spec:
            self.unhealthy = not spec["healthy"]
        if "kind" in spec:
            fault = f"{spec['kind']}:{int(spec.get('count', 1))}:{float(spec.get('delay_s', 0))}"
            try:
                self.faults.append(list(parse_fault(fault)))
            except ValueError as exc:
                return _json({"error": {"message": str(exc)}}, status=400)
        return _json({"faults": list(self.faults), "unhealthy": self.unhealthy})

    async def served_requests(self, request: web.Request) -> web.Response:
        """The last requests completed, oldest first: rid, prompt and cached tokens."""
        return _json(list(self.served))

    async def slot_log_route(self, request: web.Request) -> web.Response:
        """Each request's time on a slot, oldest first: {rid, prompt, start, end, outcome,
        tokens} with wall-clock times (end None while it runs; Scheduler.slot_log says
        which outcomes and extra fields there are); the rest of an answer begun
        elsewhere is logged under that answer's prompt, with `resumed` tokens."""
        return _json(list(self.slot_log))

    async def stats(self, request: web.Request) -> web.Response:
        now = time.time()
        batch = self.batch.stats if self.batch else None
        return _json(
            {
                **self.counters,
                "pid": os.getpid(),  # whose stats: tells a test's handle its process answers
                "capacity": self.slots.capacity,
                "running": self.running,
                "queued": self.queued,
                "peak_running": batch.peak_running if batch else self.slots.peak_running,
                "retracted_total": batch.retracted_total if batch else 0,
                "aborted_total": batch.aborted_total if batch else self.counters["aborted_total"],
                "aborted_busy_s": self.aborted_busy_s,
                "repeated_busy_s": self.repeated_busy_s,
                "decoded_total": batch.decoded_total if batch else 0,
                "inflight": self.inflight,
                "peak_inflight": self.peak_inflight,
                "open_connections": sum(not t.is_closing() for t in self._connections),
                "busy_slot_s": batch.busy_seq_s if batch else self.slots.busy_slot_s(),
                "started_at": self.started_at,
                "now": now,
                "wall_s": now - self.started_at,
                "pending_faults": list(self.faults),
                "unhealthy": self.unhealthy,
            }
        )


def listening_socket(host: str, port: int) -> socket.socket:
    """A listening socket with SO_REUSEADDR, so a restart can rebind a just-killed port."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve(standin: Standin, stop: asyncio.Event) -> None:
    config = standin.config
    sock = listening_socket(config.host, config.port)
    # SGLang aborts a request whose client disconnected (its tokenizer manager watches the
    # connection): aiohttp's handler cancellation does the same here.
    runner = web.AppRunner(
        standin.app(),
        access_log=None,
        keepalive_timeout=config.keep_alive_s,
        handler_cancellation=not config.keep_abandoned,
    )
    await runner.setup()
    await web.SockSite(runner, sock, backlog=2048).start()
    host, port = sock.getsockname()[:2]
    print(f"standin listening on http://{host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
