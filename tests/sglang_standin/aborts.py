"""SGLang's `POST /abort_request`: end a request and hand back the output so far.

Real SGLang (0.5.x) answers the abort itself with HTTP 200 and an empty body, whether
or not the rid exists; the aborted request's own pending /generate call then returns
HTTP 200 with the ids decoded so far and `finish_reason {"type": "abort", ...}`. RL
frameworks continue such partial rollouts on another server, and regen does the same
to move a running answer to a faster server: the stand-in models this so that move can
be tested and benchmarked (continuations.py makes the continuation exact).

A running request is cut where its decode has got to; one still waiting for a slot
comes back with no output ("Abort in waiting queue") and never takes one. An answer
that would already have finished is not cut: it completes as usual.
"""

from __future__ import annotations

import asyncio
from typing import Any

import orjson

ABORT_BY_REQUEST = "Abort by request"
ABORT_IN_WAITING_QUEUE = "Abort in waiting queue"


def parse_abort(body: bytes) -> tuple[str | None, bool] | None:
    """(rid, abort_all) of an /abort_request body, or None when it is not a JSON object
    (FastAPI's HTTP 422 in SGLang)."""
    try:
        spec = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(spec, dict):
        return None
    rid = spec.get("rid")
    return (rid if isinstance(rid, str) else None), bool(spec.get("abort_all"))


def abort_reason(message: str) -> dict[str, Any]:
    """The `meta_info.finish_reason` of a request ended by POST /abort_request."""
    return {"type": "abort", "message": message, "status_code": 200}


def tokens_done(elapsed_s: float, tokens_per_s: float, planned: int) -> int:
    """Tokens a slot-mode request has decoded after `elapsed_s` (`planned` when decode is
    instant or over: a finished answer is not cut)."""
    if tokens_per_s <= 0:
        return planned
    return min(planned, max(0, int(elapsed_s * tokens_per_s)))


class Aborts:
    """One asyncio.Event per rid in flight, set by POST /abort_request.

    An event (not task cancellation) keeps the abort apart from a client that went
    away: that one is cancelled and its work counted as waste, while an abort by
    request returns what was done, which the client keeps."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}

    def watch(self, rid: str) -> None:
        self._events[rid] = asyncio.Event()

    def forget(self, rid: str) -> None:
        self._events.pop(rid, None)

    def event(self, rid: str) -> asyncio.Event | None:
        return self._events.get(rid)

    def abort(self, rid: str | None, *, abort_all: bool = False) -> None:
        """Abort `rid`, or every request in flight; an unknown rid is no error."""
        if abort_all:
            for event in self._events.values():
                event.set()
        elif rid is not None and rid in self._events:
            self._events[rid].set()


async def sleep_unless(abort: asyncio.Event | None, seconds: float) -> bool:
    """Sleep `seconds`, or less if `abort` is set first; True when it was aborted."""
    if abort is None:
        await asyncio.sleep(seconds)
        return False
    try:
        await asyncio.wait_for(abort.wait(), seconds)
    except asyncio.TimeoutError:  # TimeoutError itself from Python 3.11 on
        return False
    return True


async def wait_unless(abort: asyncio.Event | None, future: asyncio.Future[None]) -> bool:
    """Wait for `future`, or until `abort` is set first; True when aborted (then `future`
    may be done too: the caller decides which won). `future` is never cancelled here."""
    if abort is None:
        await future
        return False
    aborted = asyncio.ensure_future(abort.wait())
    try:
        await asyncio.wait((future, aborted), return_when=asyncio.FIRST_COMPLETED)
    finally:
        aborted.cancel()
    return abort.is_set()
