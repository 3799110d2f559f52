"""SGLang's `POST /abort_request`: end requests and hand back their output so far.

Real SGLang answers the abort itself with HTTP 200 and an empty body, whether or not the
rid exists; the aborted request's own pending /generate call then returns HTTP 200 with
the ids decoded so far and `finish_reason {"type": "abort", ...}`. RL frameworks
continue such partial rollouts on another server, and regen does the same to move a
running answer to a faster server: the stand-in models this so that move can be tested
and benchmarked (continuations.py makes the continuation exact).

How strict, as read in SGLang's source (0.5.3, 0.5.6, 0.5.23):

- Which requests: the tokenizer manager forwards an abort only for a rid it holds, and
  the scheduler then ends every request whose rid *starts with* it (`abort_request`).
- A running request gets `to_finish = FINISH_ABORT()` and still runs one more decode
  step; `check_finished` reads `to_finish` before the EOS and length checks. So the
  reply has every token decoded so far *and* the token(s) of the step in flight; on the
  answer's last step that is the whole answer, its end-of-turn token included, with
  finish "abort" (and with speculative decoding, `tokens_per_step` > 1, tokens past
  the end). The `abort_on_last_step` option makes that rare race happen on purpose.
- A request still waiting for a slot answers as its version does (versions.py).
"""

from __future__ import annotations

import asyncio
import hashlib
import math
from typing import Any

import orjson

from tests.support.sglang_standin.versions import Release

ABORT_IN_WAITING_QUEUE = "Abort in waiting queue"
ABORT_BEFORE_PREFILL = "Abort before prefill"
# FINISH_ABORT().to_json(): the finish reason of a running request aborted by rid.
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}


def abort_reason(message: str) -> dict[str, Any]:
    """The finish reason SGLang's tokenizer manager gives a request aborted in the
    waiting queue (it has no status_code, unlike FINISH_ABORT's)."""
    return {"type": "abort", "message": message}


def parse_abort(body: bytes, release: Release) -> tuple[str | None, bool] | None:
    """(rid, abort_all) of an /abort_request body, or None where SGLang's FastAPI
    answers HTTP 422: not a JSON object, or (0.4.6, whose AbortReq is a rid alone) no
    rid string."""
    try:
        spec = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(spec, dict):
        return None
    rid = spec.get("rid")
    rid = rid if isinstance(rid, str) else None
    if not release.abort_all:
        return None if rid is None else (rid, False)
    return rid, bool(spec.get("abort_all"))


def tokens_at_abort(elapsed_s: float, tokens_per_s: float, step: int, planned: int) -> int | None:
    """The tokens a slot-model request aborted after `elapsed_s` of decode returns, or
    None when its decode was over first (it finished: nothing is cut). Decode goes in
    steps of `step` tokens, and the step in flight is returned whole, so this can reach
    `planned` or pass it."""
    decoded = elapsed_s * tokens_per_s if tokens_per_s > 0 else math.inf
    if decoded >= planned:
        return None
    return (int(decoded // step) + 1) * step


def last_step_end(planned: int, step: int) -> int:
    """The tokens an abort on an answer's last step returns: through the end of the step
    that decodes the answer's last token (past the end when a step is several tokens)."""
    return math.ceil(planned / step) * step


def lands_on_last_step(share: float, seed: int, rid: str) -> bool:
    """Whether an abort of `rid` hits its answer's last step: a `share` of rids, the
    same ones on every run with this seed."""
    if share <= 0:
        return False
    digest = hashlib.blake2b(f"{seed}:{rid}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < share


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
        """Abort every request in flight, or, when `rid` itself is in flight (SGLang's
        tokenizer manager drops the abort of a rid it does not hold), every one whose
        rid starts with it. An unknown rid is no error."""
        if abort_all:
            for event in self._events.values():
                event.set()
        elif rid and rid in self._events:
            for other, event in self._events.items():
                if other.startswith(rid):
                    event.set()


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
