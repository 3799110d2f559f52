"""The stand-in's POST /abort_request (tests/sglang_standin/aborts.py): SGLang's abort
that hands the client the output so far, and the continuation store
(continuations.py) that lets a second stand-in continue that output exactly, as regen
does when it moves a running answer to a faster server."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.helpers import wait_for
from tests.sglang_standin.process import StandinHandle, run_standin, start_standin

pytestmark = pytest.mark.slow

PROMPT = [100, 200, 300, 400]
MAX_NEW = 4000
# A 2000-token answer at 200 tokens/s: 10 s on a slot, cut after about 1 s.
SLOW = {"output_len_dist": "fixed:n=2000", "decode_tokens_per_s": 200.0, "seed": 7}
ABORTED = {"type": "abort", "message": "Abort by request", "status_code": 200}
IN_QUEUE = {"type": "abort", "message": "Abort in waiting queue", "status_code": 200}


def _body(rid: str, input_ids: list[int] = PROMPT, max_new: int = MAX_NEW) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new}, "rid": rid}


def _post(server: StandinHandle, path: str, body: Any) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=60, trust_env=False)


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for the /generate calls that are pending while a test aborts them."""
    with ThreadPoolExecutor(4) as executor:
        yield executor


def _generate(pool: ThreadPoolExecutor, server: StandinHandle, body: dict[str, Any]) -> Future:
    return pool.submit(_post, server, "/generate", body)


def _abort(server: StandinHandle, body: dict[str, Any]) -> None:
    response = _post(server, "/abort_request", body)
    assert response.status_code == 200 and response.content == b""


def _slot_entry(server: StandinHandle, rid: str) -> dict[str, Any] | None:
    return next((e for e in server.slot_log() if e["rid"] == rid), None)


def _wait_running(server: StandinHandle, rid: str) -> None:
    def running() -> bool:
        entry = _slot_entry(server, rid)
        return entry is not None and entry["outcome"] == "running"

    wait_for(running, timeout=30, what=f"{rid} on a slot")


def test_an_aborted_answer_returns_its_prefix_and_another_standin_continues_it(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    shared = {**SLOW, "continuations_dir": str(tmp_path)}
    first = start_standin(**shared)
    # Same seed and answers, decoding at once: the faster server the answer moves to.
    second = start_standin(**{**shared, "decode_tokens_per_s": 0.0})
    try:
        first.wait_ready()
        second.wait_ready()
        full = second.generate(_body("reference")).json()
        assert len(full["output_ids"]) == 2001  # 2000 tokens and the end-of-turn token

        pending = _generate(pool, first, _body("long"))
        _wait_running(first, "long")
        time.sleep(1.0)  # ~200 tokens at 200 tokens/s; the answer needs 10 s
        _abort(first, {"rid": "long"})
        reply = pending.result(timeout=30)
        assert reply.status_code == 200
        cut = reply.json()
        partial = cut["output_ids"]
        k = len(partial)
        assert 0 < k < len(full["output_ids"])
        assert partial == full["output_ids"][:k]
        assert cut["meta_info"]["finish_reason"] == ABORTED
        assert cut["meta_info"]["completion_tokens"] == k and cut["meta_info"]["id"] == "long"
        assert cut["text"][:20] == full["text"][:20]  # the decoded partial ids

        rest = second.generate(_body("continue", PROMPT + partial, MAX_NEW - k)).json()
        assert partial + rest["output_ids"] == full["output_ids"]
        assert rest["meta_info"]["finish_reason"] == full["meta_info"]["finish_reason"]
        # The second server decoded the remaining tokens only.
        moved_on = _slot_entry(second, "continue")
        assert moved_on is not None and moved_on["tokens"] == len(full["output_ids"]) - k
        # Logged under the prompt the answer began on, with the tokens decoded before it:
        # a bench joins the pieces of one answer by them.
        assert moved_on["resumed"] == k
        assert moved_on["prompt"] == _slot_entry(first, "long")["prompt"]  # type: ignore[index]
        # A continuation with a smaller limit is cut there, as any answer is.
        short = second.generate(_body("continue-short", PROMPT + partial, 10)).json()
        assert short["output_ids"] == full["output_ids"][k : k + 10]
        assert short["meta_info"]["finish_reason"] == {"type": "length", "length": 10}

        entry = _slot_entry(first, "long")
        stats = first.stats()
    finally:
        first.close()
        second.close()
    assert entry is not None and entry["outcome"] == "moved" and entry["tokens"] == k
    assert stats["moved_total"] == 1 and stats["aborted_total"] == 0
    assert stats["aborted_busy_s"] == 0 and stats["completed"] == 0 and stats["running"] == 0


def test_a_request_aborted_while_waiting_for_a_slot_returns_nothing_and_never_runs(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    with run_standin(**SLOW, max_running_requests=1, continuations_dir=str(tmp_path)) as server:
        running = _generate(pool, server, _body("running"))
        _wait_running(server, "running")
        waiting = _generate(pool, server, _body("waiting", [7, 8, 9]))
        wait_for(lambda: server.stats()["queued"] == 1, timeout=30, what="the queued request")
        _abort(server, {"rid": "waiting"})
        reply = waiting.result(timeout=30)
        assert server.stats()["running"] == 1  # the first one still decodes
        _abort(server, {"abort_all": True})  # ends the running one too
        assert running.result(timeout=30).json()["meta_info"]["finish_reason"] == ABORTED
        stats = server.stats()
        log = server.slot_log()
    assert reply.status_code == 200
    out = reply.json()
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == IN_QUEUE
    assert out["meta_info"]["completion_tokens"] == 0
    assert [(e["rid"], e["outcome"]) for e in log] == [("running", "moved")]
    assert stats["moved_waiting_total"] == 1 and stats["moved_total"] == 1
    assert stats["aborted_total"] == 0 and stats["queued"] == 0


def test_aborting_an_unknown_rid_answers_200_and_changes_nothing(tmp_path: Path) -> None:
    with run_standin(output_len_dist="fixed:n=8", continuations_dir=str(tmp_path)) as server:
        _abort(server, {"rid": "never-sent"})
        _abort(server, {"abort_all": True})  # nothing in flight
        malformed = _post(server, "/abort_request", [1, 2])
        answered = server.generate(_body("after", max_new=64))
        stats = server.stats()
    assert malformed.status_code == 422
    assert answered.status_code == 200
    assert answered.json()["meta_info"]["finish_reason"]["type"] == "stop"
    assert stats["moved_total"] == stats["moved_waiting_total"] == stats["aborted_total"] == 0
    assert list(tmp_path.iterdir()) == []  # no continuation written


def test_batch_mode_abort_returns_the_partial_output_and_it_continues(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    # The batch model at ~500 tokens/s: a 1000-token answer takes 2 s.
    with run_standin(
        output_len_dist="fixed:n=1000",
        decode_step_s=0.002,
        seed=7,
        skip_tokenizer_init=True,
        continuations_dir=str(tmp_path),
    ) as server:
        pending = _generate(pool, server, _body("long"))
        wait_for(lambda: server.stats()["decoded_total"] >= 10, timeout=30, what="decoding")
        _abort(server, {"rid": "long"})
        cut = pending.result(timeout=30).json()
        partial = cut["output_ids"]
        k = len(partial)
        stats = server.stats()
        # The whole answer and the continuation, decoded side by side in one batch.
        full_call = _generate(pool, server, _body("reference"))
        rest_call = _generate(pool, server, _body("continue", PROMPT + partial, MAX_NEW - k))
        full, rest = full_call.result(timeout=60).json(), rest_call.result(timeout=60).json()
    assert cut["meta_info"]["finish_reason"] == ABORTED and "text" not in cut
    assert 0 < k < len(full["output_ids"]) == 1001
    assert partial == full["output_ids"][:k]
    assert partial + rest["output_ids"] == full["output_ids"]
    assert stats["moved_total"] == 1 and stats["aborted_total"] == 0 and stats["running"] == 0
