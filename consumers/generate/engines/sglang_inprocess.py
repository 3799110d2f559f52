"""The Engine for an in-process `sglang.Engine` on this host's GPUs (`--engine sglang-engine`).

Same request shape as the HTTP engine (`input_ids`, `sampling_params`, `rid`) through
`Engine.async_generate`, which returns the same reply dict as `POST /generate`. sglang is
imported only here and only when this engine is built: importing it needs CUDA, and the
rest of regen must run without it (`pip install regen[sglang]` on GPU hosts).

Not exercised by the test suite (it needs a GPU); the reply mapping it shares with the
HTTP engine is.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from consumers.generate.engine import (
    EngineUnavailable,
    GenerateRequest,
    GenerateResult,
    PromptRejected,
)
from consumers.generate.engines.sglang_replies import Failure, result_from_reply

# In flight at once: the scheduler queues the rest, as a server would.
DEFAULT_MAX_INFLIGHT = 256


class SGLangInProcessEngine:
    name = "sglang-engine"

    def __init__(
        self,
        model: str,
        *,
        tp_size: int = 1,
        trust_remote_code: bool = False,
        max_inflight: int = DEFAULT_MAX_INFLIGHT,
        **engine_args: Any,
    ) -> None:
        try:
            import sglang
        except ImportError as exc:
            raise ValueError(
                "--engine sglang-engine needs SGLang on a GPU host: pip install 'regen[sglang]'"
            ) from exc
        self._engine = sglang.Engine(
            model_path=model,
            tp_size=tp_size,
            trust_remote_code=trust_remote_code,
            log_level="error",
            **engine_args,
        )
        self._label = f"sglang-engine:{model}"
        self._max_inflight = max_inflight
        self._slots: asyncio.Semaphore | None = None
        self._inflight = 0
        self._completed = 0
        self._closed = False

    async def generate(
        self, request: GenerateRequest, *, deadline: float | None = None
    ) -> GenerateResult:
        if self._closed:
            raise EngineUnavailable("the in-process SGLang engine is closed")
        if self._slots is None:  # created on the runner's loop, where it is awaited
            self._slots = asyncio.Semaphore(self._max_inflight)
        async with self._slots:
            self._inflight += 1
            started = time.monotonic()
            try:
                reply = await self._engine.async_generate(
                    input_ids=request.prompt_ids,
                    sampling_params=request.sampling,
                    rid=request.rid,
                )
            except ValueError as exc:  # SGLang's own input validation: too long, invalid
                raise PromptRejected(str(exc), server=self._label) from exc
            finally:
                self._inflight -= 1
        try:
            result = result_from_reply(reply, request, self._label, started)
        except Failure as exc:
            raise EngineUnavailable(exc.message) from exc
        self._completed += 1
        return result

    async def health(self) -> bool:
        return not self._closed

    def capacity(self) -> int:
        return self._max_inflight

    def stats(self) -> dict[str, Any]:
        return {
            "engine": self.name,
            "model": self._label,
            "inflight": self._inflight,
            "completed": self._completed,
            "closed": self._closed,
        }

    async def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._engine.shutdown()
