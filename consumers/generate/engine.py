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
    # prefix; None routes by load alone (docs/design/delivery.md, "Turns").
    affinity: str | None = None
    # A later turn of a conversation this worker runs: it takes a freed slot before
    # waiting first turns, so started conversations finish and no slot idles while a
    # conversation's next turn waits (docs/design/delivery.md, "Turns").
    next_turn: bool = False


# Ends every rid sent to a server, and appears nowhere else in one (chunk and prompt ids
# are hex, attempts and retries digits), so that no rid sent is a prefix of another.
RID_END = "."


def server_rid(rid: str, retry: int = 0) -> str:
    """The rid a server is sent for a request's `retry`-th try (each try its own: a
    server may still run an earlier one, and SGLang refuses a duplicate rid).

    SGLang's `/abort_request` ends every request whose rid *starts with* the one named
    (`Scheduler.abort_request`), so a plain `C-P-1` would also end `C-P-10` and `C-P-1~1`.
    Ending each rid in a character none holds elsewhere makes the rids prefix-free."""
    if RID_END in rid:
        raise ValueError(f"a request rid may not hold {RID_END!r}: {rid!r}")
    return f"{rid}{RID_END}" if retry == 0 else f"{rid}~{retry}{RID_END}"


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
    # The server's SGLang version where it reports one (provenance).
    server_version: str | None = None
    meta: dict[str, Any] = field(default_factory=dict)
    # Stopped at the worker's asking (Engine.hand_over): output_ids are the answer so
    # far, to be continued on another server; not a completion.
    handed_over: bool = False
    # The first this many output_ids were decoded on another server, which handed the
    # answer over (resume.py); 0 for an answer decoded here alone.
    resumed_tokens: int = 0


class EngineError(Exception):
    """Base class of the errors an engine raises."""


class EngineUnavailable(EngineError):
    """The engine cannot serve right now (down, overloaded, timed out): retry later.

    Never a reason to dead-letter a prompt (docs/design/delivery.md, "A dead server is not
    a bad prompt").
    """


class EngineDown(EngineUnavailable):
    """No server the request may use has been healthy for the caller's whole `outage_s`:
    the worker gives the chunk back so that a worker with a live server takes it. Never
    raised because servers are busy (docs/design/limits.md, "Timers at real lengths")."""


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
        self, request: GenerateRequest, *, outage_s: float | None = None
    ) -> GenerateResult:
        """Complete one prompt. Raises EngineUnavailable or PromptRejected.

        `outage_s`: raise EngineDown once no server has been healthy for that many
        seconds in a row (None: wait for ever). A healthy server that is busy is waited
        out however long its slots stay full, and generation already running is never
        cut short: at real answer lengths a full server is the normal case.
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

    async def hand_over(self, rid: str) -> bool:
        """Stop the running request `rid` so that its generate() returns the answer so
        far, marked `handed_over` (docs/design/placement.md, "A slow server's last answers move");
        False where the engine cannot (then the request runs on untouched). A request
        that finishes meanwhile returns its completion as usual."""
        ...

    async def close(self) -> None: ...
