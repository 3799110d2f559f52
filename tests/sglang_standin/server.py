"""The stand-in's HTTP surface: SGLang's /generate contract plus test-only control routes.

Error bodies copy SGLang 0.5's shapes: a ValueError from request validation becomes
HTTP 400 `{"error": {"message": ...}}`; a scheduler abort with a status (the full
waiting queue) becomes `{"object": "error", "message": ..., "code": 503}`.
"""

from __future__ import annotations

import asyncio
import socket
import time
import weakref
from collections import Counter, deque
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
from aiohttp import web

from tests.sglang_standin.completer import Completer
from tests.sglang_standin.config import StandinConfig, parse_fault
from tests.sglang_standin.slots import QueueFull, Slots
from tests.sglang_standin.validate import Item, RequestError, parse_generate

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# A window for sglang:gen_throughput, which SGLang reports over its last log interval.
THROUGHPUT_WINDOW_S = 10.0
ALWAYS_COUNTED = (
    "requests_total",
    "completed",
    "generation_tokens_total",
    "prompt_tokens_total",
    "connections_total",
)


def _json(body: Any, status: int = 200) -> web.Response:
    return web.Response(body=orjson.dumps(body), status=status, content_type="application/json")


class Standin:
    def __init__(self, config: StandinConfig, completer: Completer, model_path: str) -> None:
        self.config = config
        self.completer = completer
        self.model_path = model_path
        self.slots = Slots(config.max_running_requests, config.max_queued_requests)
        self.started_at = time.time()
        self._started_mono = time.monotonic()
        self.unhealthy = config.unhealthy
        self.faults: deque[list[Any]] = deque(list(parse_fault(f)) for f in config.fault)
        # Per-status and per-fault counters appear on first use; these are always there.
        self.counters: Counter[str] = Counter(dict.fromkeys(ALWAYS_COUNTED, 0))
        self.inflight = 0
        self.peak_inflight = 0
        self._active_rids: set[str] = set()
        self._recent_tokens: deque[tuple[float, int]] = deque()
        self._connections: weakref.WeakSet[Any] = weakref.WeakSet()

    def app(self) -> web.Application:
        app = web.Application(
            client_max_size=256 * 1024 * 1024, middlewares=[self._count_connections]
        )
        for method in ("POST", "PUT"):  # as SGLang's route
            app.router.add_route(method, "/generate", self.generate)
        for path in ("/health", "/health_generate"):
            app.router.add_get(path, self.health)
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_get("/metrics", self.metrics)
        app.router.add_post("/_fault", self.set_fault)
        app.router.add_get("/_stats", self.stats)
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

    # --- SGLang routes -------------------------------------------------------------
    async def generate(self, request: web.Request) -> web.StreamResponse:
        self.counters["requests_total"] += 1
        self.inflight += 1
        self.peak_inflight = max(self.peak_inflight, self.inflight)
        try:
            response = await self._generate(request)
        finally:
            self.inflight -= 1
        if response is None:  # dropped: the client got no status at all
            return web.Response(status=499)
        self.counters[f"status_{response.status}"] += 1
        return response

    async def _generate(self, request: web.Request) -> web.Response | None:
        body = await request.read()
        delay_s = 0.0
        if self.faults:
            kind, _, delay_s = self._take_fault()
            self.counters[f"fault_{kind}"] += 1
            if kind == "drop":
                # Close the socket with no response, as a crashed or OOM-killed server does.
                assert request.transport is not None
                request.transport.abort()
                return None
            if kind == "500":
                return web.Response(status=500, text="Internal Server Error")
            if kind == "503":
                return self._overloaded("Injected fault: service unavailable.")
            if kind == "malformed":  # a 200 a client cannot use (no output_ids)
                return _json({"text": "", "meta_info": {"id": "malformed"}})
        try:
            batch, items = parse_generate(body, self.completer.vocab_size)
            self._check_lengths(items)
            self._claim_rids(items)
        except RequestError as exc:
            return _json({"error": {"message": str(exc)}}, status=400)
        started = time.monotonic()
        try:
            outs = await asyncio.gather(
                *(self._run(item, delay_s, started) for item in items), return_exceptions=True
            )
        finally:
            self._active_rids.difference_update(item.rid for item in items)
        for out in outs:
            if isinstance(out, QueueFull):
                return self._overloaded(str(out))
            if isinstance(out, BaseException):
                raise out
        return _json(outs if batch else outs[0])

    def _take_fault(self) -> tuple[str, int, float]:
        fault = self.faults[0]
        fault[1] -= 1
        if fault[1] <= 0:
            self.faults.popleft()
        return fault[0], fault[1], fault[2]

    def _overloaded(self, message: str) -> web.Response:
        body = {"object": "error", "message": message, "type": "503", "param": None, "code": 503}
        return _json(body, status=503)

    def _check_lengths(self, items: list[Item]) -> None:
        """SGLang's TokenizerManager._validate_one_request, with auto-truncate off."""
        ctx = self.config.context_length
        for item in items:
            n = len(item.input_ids)
            if n >= ctx:
                raise RequestError(
                    f"The input ({n} tokens) is longer than the model's context length "
                    f"({ctx} tokens)."
                )
            # Like SGLang, only an explicit max_new_tokens counts toward the total.
            max_new = item.sampling.get("max_new_tokens")
            if max_new is not None and n + max_new > ctx:
                raise RequestError(
                    "Requested token count exceeds the model's maximum context length of "
                    f"{ctx} tokens. You requested a total of {n + max_new} tokens: {n} tokens "
                    f"from the input messages and {max_new} tokens for the completion. Please "
                    "reduce the number of tokens in the input messages or the completion to "
                    "fit within the limit."
                )

    def _claim_rids(self, items: list[Item]) -> None:
        rids = [item.rid for item in items]
        for i, rid in enumerate(rids):
            if rid in self._active_rids or rid in rids[:i]:
                raise RequestError(f"Duplicate request ID detected: {rid}")
        self._active_rids.update(rids)

    async def _run(self, item: Item, delay_s: float, started: float) -> dict[str, Any]:
        await self.slots.acquire()
        try:
            done = self.completer.complete(item.input_ids, item.sampling)
            seconds = delay_s
            if self.config.decode_tokens_per_s > 0:
                seconds += len(done.output_ids) / self.config.decode_tokens_per_s
            if seconds > 0:
                await asyncio.sleep(seconds)
        finally:
            self.slots.release()
        n_out = len(done.output_ids)
        self.counters["completed"] += 1
        self.counters["generation_tokens_total"] += n_out
        self.counters["prompt_tokens_total"] += len(item.input_ids)
        self._recent_tokens.append((time.monotonic(), n_out))
        meta = {
            "id": item.rid,
            "finish_reason": done.finish_reason,
            "prompt_tokens": len(item.input_ids),
            "completion_tokens": n_out,
            "cached_tokens": 0,
            "e2e_latency": time.monotonic() - started,
        }
        return {"text": done.text, "output_ids": done.output_ids, "meta_info": meta}

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
                "version": "0.5.x-standin",
                "frontend": "standin",
            }
        )

    async def metrics(self, request: web.Request) -> web.Response:
        label = f'{{model_name="{self.model_path}"}}'
        values = {
            "num_running_reqs": self.slots.running,
            "num_queue_reqs": self.slots.queued,
            "generation_tokens_total": self.counters["generation_tokens_total"],
            "prompt_tokens_total": self.counters["prompt_tokens_total"],
            "gen_throughput": self._throughput(),
        }
        text = "".join(f"sglang:{name}{label} {float(v)}\n" for name, v in values.items())
        return web.Response(text=text, content_type="text/plain")

    def _throughput(self) -> float:
        horizon = time.monotonic() - THROUGHPUT_WINDOW_S
        while self._recent_tokens and self._recent_tokens[0][0] < horizon:
            self._recent_tokens.popleft()
        return sum(n for _, n in self._recent_tokens) / THROUGHPUT_WINDOW_S

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

    async def stats(self, request: web.Request) -> web.Response:
        now = time.time()
        return _json(
            {
                **self.counters,
                "capacity": self.slots.capacity,
                "running": self.slots.running,
                "queued": self.slots.queued,
                "peak_running": self.slots.peak_running,
                "inflight": self.inflight,
                "peak_inflight": self.peak_inflight,
                "open_connections": sum(not t.is_closing() for t in self._connections),
                "busy_slot_s": self.slots.busy_slot_s(),
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
    runner = web.AppRunner(standin.app(), access_log=None, keepalive_timeout=config.keep_alive_s)
    await runner.setup()
    await web.SockSite(runner, sock, backlog=2048).start()
    host, port = sock.getsockname()[:2]
    print(f"standin listening on http://{host}:{port}", flush=True)
    try:
        await stop.wait()
    finally:
        await runner.cleanup()
