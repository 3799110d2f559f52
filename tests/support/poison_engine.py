"""A test engine (`--engine tests.support.poison_engine:make`) that dies on a poison prompt.

It stands for an engine that crashes its process on one input (a CUDA fault, an OOM):
any prompt whose text contains $REGEN_TEST_POISON kills the worker with SIGKILL; other
prompts get a short real answer.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from regen.common.tokenizer import load_tokenizer
from regen.consumers.generate.engine import GenerateRequest, GenerateResult
from regen.consumers.generate.engines import EngineOptions


class PoisonEngine:
    name = "poison"

    def __init__(self) -> None:
        self._tokenizer = load_tokenizer("smollm2")
        self._marker = os.environ["REGEN_TEST_POISON"]

    async def generate(
        self, request: GenerateRequest, *, outage_s: float | None = None
    ) -> GenerateResult:
        if self._marker in self._tokenizer.decode(request.prompt_ids):
            os.kill(os.getpid(), signal.SIGKILL)
        answer = "Fine."
        output_ids = [*self._tokenizer.encode(answer, add_special_tokens=False), 2]
        return GenerateResult(
            output_ids=output_ids,
            text=answer,
            finish_reason={"type": "stop", "matched": 2},
            prompt_tokens=len(request.prompt_ids),
            completion_tokens=len(output_ids),
            server="poison",
        )

    async def health(self) -> bool:
        return True

    def capacity(self) -> int:
        return 4

    def stats(self) -> dict[str, Any]:
        return {}

    async def close(self) -> None:
        return None


def make(options: EngineOptions) -> PoisonEngine:
    return PoisonEngine()
