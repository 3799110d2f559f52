"""What an SGLang /generate reply means: a result, a rejected prompt, or a failure.

Failures are sorted by what they say about the *server*:

| what happened                                    | kind          | server   | request   |
|--------------------------------------------------|---------------|----------|-----------|
| 400 / 413 / 422 (too long, invalid)              | -             | -        | rejected  |
| 400 "Duplicate request ID" (an earlier attempt   | duplicate_rid | -        | new rid,  |
|   of this prompt still runs there)               |               |          | bounded   |
| 503 / 429 (queue full)                           | overloaded    | back off | retry     |
| refused, connect timeout                         | connect       | down     | retry     |
| 502 / 504 from a proxy in front                  | gateway       | down     | retry     |
| SGLang's router reached no worker (500/503/504   | gateway       | down     | retry     |
|   with an upstream error code)                   |               |          |           |
| reset, closed before a full response             | disconnect    | down (*) | retry     |
| read timeout (request_timeout_s)                 | timeout       | down     | retry     |
| 500 and other 5xx                                | server_error  | down     | bounded   |
| 200 without output_ids, aborted, or other 4xx    | bad_response  | down     | bounded   |
| 200 aborted at the worker's asking (hand-over),  | -             | -        | answer so |
|   with or without output_ids (none: nothing yet) |               |          | far       |

(*) The first disconnect of a request is retried at once without blaming the server: it
is most likely an idle keep-alive connection the server closed as we reused it.

A down server gets no requests until its health probe passes again (see sglang_pool).
"Bounded" failures are answers from a server that looks healthy; after
`max_bad_answers` of them one request gives up with EngineUnavailable (never
PromptRejected: only the worker's chunk-attempt cap may dead-letter it), so a server bug
that hits one prompt cannot pin a slot forever.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from http import HTTPStatus
from typing import Any

import aiohttp
import orjson

from regen.consumers.generate.engine import GenerateRequest, GenerateResult, PromptRejected

REJECT_STATUSES = frozenset({400, 413, 422})
OVERLOAD_STATUSES = frozenset({429, 503})
GATEWAY_STATUSES = frozenset({502, 504})
# SGLang's router (sglang-router) names its own failures in `{"error": {"code"}}`. These
# say it got no answer from any worker (a dead one, or none registered or healthy): the
# router is a gateway with nothing behind it, not a server that answered badly. Its
# "call_upstream_status_error" carries a worker's own status and is classified by it
# (docs/design/sglang.md, "Behind SGLang's router").
ROUTER_UPSTREAM_CODE_PREFIX = "call_upstream_"
ROUTER_WORKER_STATUS_CODE = "call_upstream_status_error"
ROUTER_NO_WORKER_CODE = "no_available_workers"


class Failure(Exception):
    """One failed attempt: `kind` names it in stats; `down` says the server is suspect."""

    def __init__(self, kind: str, message: str, *, down: bool = False, bad: bool = False):
        super().__init__(message)
        self.kind, self.message, self.down, self.bad = kind, message, down, bad


def transport_failure(exc: aiohttp.ClientError | asyncio.TimeoutError) -> Failure:
    """No reply at all: refused, timed out, or the connection closed under us."""
    message = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    # ConnectionTimeoutError is also a TimeoutError: test for it before the read timeout.
    if isinstance(exc, (aiohttp.ClientConnectorError, aiohttp.ConnectionTimeoutError)):
        return Failure("connect", message, down=True)
    if isinstance(exc, asyncio.TimeoutError):  # sock_read: request_timeout_s passed
        return Failure("timeout", message, down=True)
    # ServerDisconnectedError, reset (ClientOSError), truncated body (ClientPayloadError),
    # or a reply that is not HTTP.
    return Failure("disconnect", message, down=True)


def classify_error(status: int, body: bytes, server: str) -> Failure | PromptRejected:
    """The exception for a non-200 reply (returned, for the caller to raise)."""
    message = error_message(status, body)
    code = router_error_code(body)
    if code is not None and reached_no_worker(code):
        return Failure("gateway", f"HTTP {status}: {code}: {message}", down=True)
    return classify_status(status, message, server)


def reached_no_worker(router_code: str) -> bool:
    """Whether a router error code says that no worker answered at all."""
    if router_code == ROUTER_NO_WORKER_CODE:
        return True
    return router_code.startswith(ROUTER_UPSTREAM_CODE_PREFIX) and (
        router_code != ROUTER_WORKER_STATUS_CODE
    )


def router_error_code(body: bytes) -> str | None:
    """The `error.code` string of an sglang-router error body; None for other bodies
    (SGLang's own error codes are integers)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    error = data.get("error") if isinstance(data, dict) else None
    code = error.get("code") if isinstance(error, dict) else None
    return code if isinstance(code, str) else None


def classify_status(status: int, message: str, server: str) -> Failure | PromptRejected:
    """The exception for an error status and its message, however SGLang reported them
    (an HTTP reply, or an exception raised by the in-process engine)."""
    if status in REJECT_STATUSES:
        if "Duplicate request ID" in message:
            return Failure("duplicate_rid", message, bad=True)
        return PromptRejected(message, server=server)
    if status in OVERLOAD_STATUSES:
        return Failure("overloaded", f"HTTP {status}: {message}")
    if status in GATEWAY_STATUSES:
        return Failure("gateway", f"HTTP {status}: {message}", down=True)
    kind = "server_error" if status >= 500 else "bad_response"
    return Failure(kind, f"HTTP {status}: {message}", down=True, bad=True)


def parse_result(
    payload: bytes,
    request: GenerateRequest,
    server: str,
    started: float,
    *,
    handed_over: bool = False,
) -> GenerateResult:
    """Map SGLang's HTTP response; anything that is not a finished completion is a Failure,
    but for a request the worker asked to hand over (sglang_handover.py), whose abort
    carries the answer so far."""
    try:
        data = orjson.loads(payload)
    except orjson.JSONDecodeError as exc:
        raise Failure("bad_response", f"malformed response: {exc!r}", down=True, bad=True) from None
    return result_from_reply(data, request, server, started, handed_over=handed_over)


def result_from_reply(
    data: Any,
    request: GenerateRequest,
    server: str,
    started: float,
    *,
    handed_over: bool = False,
) -> GenerateResult:
    """Map one /generate reply dict (HTTP or `Engine.async_generate`, the same shape)."""
    if handed_over and isinstance(data, dict) and "output_ids" not in data and _aborted(data):
        # SGLang 0.5.1 and 0.5.3 answer the abort of a request still in their queue with
        # no output_ids ("Abort before prefill"): nothing was decoded, and the server is
        # fine. Never asked of them (sglang_handover.py), but a router may mix versions.
        data = {**data, "output_ids": []}
    try:
        # No `text` at all is SGLang started with --skip-tokenizer-init: the ids are
        # the answer either way, and the stages decode them where they need text.
        output_ids, meta, text = data["output_ids"], data["meta_info"], data.get("text")
        finish = meta["finish_reason"]
        if text is not None and not isinstance(text, str):
            raise TypeError("text must be a string")
        if not isinstance(output_ids, list) or not all(type(t) is int for t in output_ids):
            raise TypeError("output_ids must be a list of integers")
        result = GenerateResult(
            output_ids=output_ids,
            text=text,
            finish_reason=finish,
            prompt_tokens=int(meta.get("prompt_tokens", len(request.prompt_ids))),
            completion_tokens=int(meta.get("completion_tokens", len(output_ids))),
            cached_tokens=cached_tokens(meta),
            latency_s=float(meta.get("e2e_latency") or time.monotonic() - started),
            server=server,
            meta=meta,
        )
        aborted = finish["type"] == "abort"
    except (KeyError, TypeError, ValueError) as exc:
        raise Failure("bad_response", f"malformed response: {exc!r}", down=True, bad=True) from None
    if aborted and handed_over:  # at the worker's asking: the answer so far
        return dataclasses.replace(result, handed_over=True)
    if aborted:  # aborted by the server (shutdown, operator): not a completion
        message = f"request aborted: {finish.get('message')}"
        raise Failure("bad_response", message, down=True, bad=True)
    return result


def _aborted(data: dict[str, Any]) -> bool:
    meta = data.get("meta_info")
    finish = meta.get("finish_reason") if isinstance(meta, dict) else None
    return isinstance(finish, dict) and finish.get("type") == "abort"


def cached_tokens(meta: dict[str, Any]) -> int | None:
    """The prompt tokens SGLang took from its prefix cache rather than computing them
    (`meta_info.cached_tokens`, the radix-tree match at prefill, counted once even if
    the request is retracted); None when a server leaves it out: unknown, not a miss."""
    value = meta.get("cached_tokens")
    return None if value is None else int(value)


def error_message(status: int, body: bytes) -> str:
    """SGLang's error bodies: {"error": {"message"}}, {"error": str}, {"message"} or text."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return body.decode("utf-8", "replace")[:500] or reason_phrase(status)
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        for value in (error, data.get("message"), data.get("detail")):
            if value:
                return str(value)
    return str(data)[:500]


def reason_phrase(status: int) -> str:
    """The standard phrase for a status (an empty body's message), "" for unknown ones."""
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
