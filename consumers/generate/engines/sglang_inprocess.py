"""The Engine for an in-process `sglang.Engine` on this host's GPUs (`--engine sglang-engine`).

Same request shape as the HTTP engine (`input_ids`, `sampling_params`, `rid`) through
`Engine.async_generate`, which returns the same reply dict as `POST /generate`. sglang is
imported only here and only when this engine is built: importing it needs CUDA, and the
rest of regen must run without it (`pip install regen[sglang]` on GPU hosts).

How SGLang 0.5 reports trouble in-process (its tokenizer manager): where its HTTP server
would answer 400, it raises ValueError (too long, invalid, "Duplicate request ID
detected"); for a scheduler abort with another status (503 queue full, 500) it raises
fastapi's HTTPException (`status_code`, `detail`). Both go through the HTTP engine's
`classify_status`, so a status means the same here as from a server: a bad prompt is
rejected, a duplicate rid or a busy or failing engine is retried. An aborted reply and
any other exception are retried too: never a reason to dead-letter a prompt.

A crashed scheduler makes SGLang kill this whole process (its SIGQUIT handler), so the
worker's chunks are redelivered and the chunk-attempt cap catches a poison prompt.

Tests run this module against `tests/support/sglang_standin/offline_engine.py`, a stand-in for
`sglang.Engine` that keeps this contract, and `scripts/check_sglang_api.py` checks the
API it calls in SGLang's own source.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from http import HTTPStatus
from typing import Any

from regen.common import defaults
from regen.consumers.generate.engine import (
    EngineDown,
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    PromptRejected,
    server_rid,
)
from regen.consumers.generate.engines.cache_tally import CacheTally
from regen.consumers.generate.engines.sglang_replies import (
    Failure,
    classify_status,
    result_from_reply,
)


class SGLangInProcessEngine:
    name = "sglang-engine"

    def __init__(
        self,
        model: str,
        *,
        tp_size: int = defaults.TP_SIZE,
        trust_remote_code: bool = False,
        max_inflight: int = defaults.MAX_INFLIGHT_PER_SERVER,
        server_args: dict[str, Any] | None = None,
    ) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise ValueError(
                "--engine sglang-engine needs SGLang on a GPU host: pip install 'regen[sglang]'"
            ) from exc
        args: dict[str, Any] = {
            "model_path": model,
            "tp_size": tp_size,
            "trust_remote_code": trust_remote_code,
            "log_level": "error",
            **(server_args or {}),
        }
        # Built on the worker's main thread, before Celery starts: SGLang installs signal
        # handlers there, and loading a large model takes minutes with no chunk held.
        try:
            self._engine = sglang.Engine(**args)
        except TypeError as exc:  # a ServerArgs field that does not exist
            raise ValueError(f"sglang.Engine rejected its arguments: {exc}") from exc
        self._label = f"sglang-engine:{model}"
        self._device = f"tp_size={args['tp_size']}"
        self._max_inflight = max_inflight
        self._slots: asyncio.Semaphore | None = None
        self._inflight = 0
        self._completed = 0
        self._failures: Counter[str] = Counter()
        self._cache = CacheTally()
        self._closed = False

    async def generate(
        self, request: GenerateRequest, *, outage_s: float | None = None
    ) -> GenerateResult:
        """Waits for a free slot however long the engine stays busy (the engine in this
        process is up while it is open, so `outage_s` never runs out); generation that
        started is not cut short."""
        if self._closed:
            raise EngineDown("the in-process SGLang engine is closed")
        if self._slots is None:  # created on the runner's loop, where it is awaited
            self._slots = asyncio.Semaphore(self._max_inflight)
        await self._slots.acquire()
        self._inflight += 1
        started = time.monotonic()
        try:
            reply = await self._engine.async_generate(
                input_ids=request.prompt_ids,
                sampling_params=request.sampling,
                rid=server_rid(request.rid),
            )
        except asyncio.CancelledError:
            # The chunk was abandoned (shutdown): free the scheduler's slot for the next.
            self._abort(server_rid(request.rid))
            raise
        except Exception as exc:
            raise self._translate(exc) from exc
        finally:
            self._inflight -= 1
            self._slots.release()
        try:
            result = result_from_reply(reply, request, self._label, started)
        except Failure as exc:
            self._failures[exc.kind] += 1
            raise EngineUnavailable(exc.message) from exc
        self._completed += 1
        self._cache.count(result.prompt_tokens, result.cached_tokens)
        return result

    def _translate(self, exc: Exception) -> Exception:
        """SGLang's exception for one request, as PromptRejected or EngineUnavailable."""
        status = getattr(exc, "status_code", None)  # fastapi.HTTPException, without fastapi
        if not isinstance(status, int):
            if not isinstance(exc, ValueError):
                self._failures["error"] += 1
                return EngineUnavailable(f"{type(exc).__name__}: {exc}")
            status = HTTPStatus.BAD_REQUEST  # what SGLang's server answers a ValueError with
        message = str(getattr(exc, "detail", None) or exc)
        outcome = classify_status(status, message, self._label)
        if isinstance(outcome, PromptRejected):
            self._failures["rejected"] += 1
            return outcome
        self._failures[outcome.kind] += 1
        return EngineUnavailable(outcome.message)

    def _abort(self, rid: str) -> None:
        manager = getattr(self._engine, "tokenizer_manager", None)
        if manager is not None:
            manager.abort_request(rid=rid)

    async def health(self) -> bool:
        return not self._closed

    async def hand_over(self, rid: str) -> bool:
        """One engine in this process serves one worker: there is no faster server
        to hand an answer to."""
        return False

    def capacity(self) -> int:
        return self._max_inflight

    def stats(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "model": self._label,
            "device": self._device,
            "inflight": self._inflight,
            "completed": self._completed,
            "failures": dict(self._failures),
            "closed": self._closed,
            **self._cache.snapshot(),
        }

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()
