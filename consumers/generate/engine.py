"""The small interface every generation engine implements.

An engine turns one prompt (token ids, exactly as rendered by the producer) into one
completion. The SGLang HTTP client, the in-process SGLang engine and the local
transformers engine are three implementations; the Celery task that drives them only
sees this module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True)
class GenerateRequest:
    """One prompt to complete. `rid` is unique per prompt and attempt (SGLang's request id)."""

    rid: str
    prompt_ids: list[int]
    # SGLang sampling_params, already merged from the job spec; always has max_new_tokens.
    sampling: dict[str, Any]
    # Requests with the same key prefer the server that served the last of them (the
    # conversation id of a `--turns all` turn), whose radix cache still holds their
    # prefix; None routes by load alone (docs/design.md, "Turns").
    affinity: str | None = None


@dataclass(frozen=True)
class GenerateResult:
    output_ids: list[int]
    # None from a server that detokenizes nothing (SGLang's `--skip-tokenizer-init`):
    # whoever needs the text decodes output_ids (common/detokenize.py).
    text: str | None
    # SGLang's shape: {"type": "stop", "matched": id|str} | {"type": "length", "length": n}
    # | {"type": "abort", "message": ..., "status_code": ...}
    finish_reason: dict[str, Any]
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens the server found in its prefix cache (SGLang's meta_info.cached_tokens);
    # None when the engine does not report it, which is unknown, not a miss.
    cached_tokens: int | None = None
    latency_s: float = 0.0
    # Which server (URL) or device produced it; for provenance and load accounting.
    server: str = ""
    meta: dict[str, Any] = field(default_factory=dict)


class EngineError(Exception):
    """Base class of the errors an engine raises."""


class EngineUnavailable(EngineError):
    """The engine cannot serve right now (down, overloaded, timed out): retry later.

    Never a reason to dead-letter a prompt (docs/design.md, "A dead server is not a bad prompt").
    """


class PromptRejected(EngineError):
    """A healthy engine refused this prompt (HTTP 400: too long, invalid request).

    Retrying will not help: the prompt goes to the `generate` dead-letter queue with
    `message`.
    """

    def __init__(self, message: str, *, server: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.server = server


class Engine(Protocol):
    """What the generate stage needs from an inference backend."""

    name: str

    async def generate(
        self, request: GenerateRequest, *, deadline: float | None = None
    ) -> GenerateResult:
        """Complete one prompt. Raises EngineUnavailable or PromptRejected.

        `deadline` (a time.monotonic() value) bounds how long the engine may wait for a
        server to become available; generation already running is not cut short.
        """
        ...

    async def health(self) -> bool:
        """True when the engine can take work now."""
        ...

    def capacity(self) -> int:
        """How many requests this engine wants in flight to stay fully busy."""
        ...

    def stats(self) -> dict[str, Any]:
        """Per-server health and in-flight counts, for heartbeats and status."""
        ...

    async def close(self) -> None: ...
