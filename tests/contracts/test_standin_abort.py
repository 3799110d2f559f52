"""The stand-in's POST /abort_request (tests/support/sglang_standin/aborts.py): SGLang's abort
that hands the client the output so far, as strictly as SGLang does (the step in flight
comes back too, even the answer's last one; rids match by prefix; a queued request gets
its version's reply; an admin key guards it), and the continuation store
(continuations.py) that lets a second stand-in continue that output exactly, as regen
does when it moves a running answer to a faster server."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import StandinHandle, run_standin, start_standin

pytestmark = pytest.mark.slow

PROMPT = [100, 200, 300, 400]
MAX_NEW = 4000
# A 2000-token answer at 200 tokens/s: 10 s on a slot, cut after about 1 s.
SLOW: dict[str, Any] = {"output_len_dist": "fixed:n=2000", "decode_tokens_per_s": 200.0, "seed": 7}
# SGLang's FINISH_ABORT().to_json(), and the tokenizer manager's waiting-queue reasons.
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
IN_QUEUE = {"type": "abort", "message": "Abort in waiting queue"}
BEFORE_PREFILL = {"type": "abort", "message": "Abort before prefill"}
# A 1000-token answer decoding for 4 s: an abort lands long before its end.
MEDIUM: dict[str, Any] = {
    "output_len_dist": "fixed:n=1000",
    "decode_tokens_per_s": 250.0,
    "seed": 7,
}


def _body(rid: str, input_ids: list[int] = PROMPT, max_new: int = MAX_NEW) -> dict[str, Any]:
    return {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new}, "rid": rid}


def _post(server: StandinHandle, path: str, body: Any, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(
        f"{server.url}{path}", json=body, headers=headers, timeout=60, trust_env=False
    )


@pytest.fixture
def pool() -> Iterator[ThreadPoolExecutor]:
    """Threads for the /generate calls that are pending while a test aborts them."""
    with ThreadPoolExecutor(4) as executor:
        yield executor


def _generate(
    pool: ThreadPoolExecutor, server: StandinHandle, body: dict[str, Any], key: str | None = None
) -> Future:
    return pool.submit(_post, server, "/generate", body, key)


def _abort(server: StandinHandle, body: dict[str, Any], key: str | None = None) -> None:
    response = _post(server, "/abort_request", body, key)
    assert response.status_code == 200 and response.content == b""


def _slot_entry(server: StandinHandle, rid: str) -> dict[str, Any] | None:
    return next((e for e in server.slot_log() if e["rid"] == rid), None)


def _wait_running(server: StandinHandle, rid: str) -> None:
    def running() -> bool:
        entry = _slot_entry(server, rid)
        return entry is not None and entry["outcome"] == "running"

    wait_for(running, timeout=30, what=f"{rid} on a slot")


def test_an_aborted_answer_returns_its_prefix_with_the_step_in_flight_and_it_continues(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """SGLang's abort sets `to_finish`, and the request runs one more decode step: the
    reply holds the tokens decoded when the abort came plus the one in flight."""
    shared: dict[str, Any] = {**SLOW, "continuations_dir": str(tmp_path)}
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
    assert k == entry["decoded_at_abort"] + 1  # one token more than were done
    assert stats["moved_total"] == 1 and stats["aborted_total"] == 0
    assert stats["moved_at_end_total"] == 0
    assert stats["aborted_busy_s"] == 0 and stats["completed"] == 0 and stats["running"] == 0


def _abort_beside_a_reference(
    pool: ThreadPoolExecutor, options: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any] | None, dict[str, Any]]:
    """On a stand-in with `options`: the same prompt answered whole ("reference") beside
    one aborted once it runs ("long"). (the aborted reply, the whole one, the aborted
    request's slot-log entry, the stats)."""
    with run_standin(**options) as server:
        reference = _generate(pool, server, _body("reference"))
        pending = _generate(pool, server, _body("long"))
        _wait_running(server, "long")
        _abort(server, {"rid": "long"})
        cut = pending.result(timeout=30).json()
        full = reference.result(timeout=30).json()
        return cut, full, _slot_entry(server, "long"), server.stats()


def test_an_abort_on_the_last_step_returns_the_whole_answer_with_finish_abort(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """The rare race made certain: the abort reaches the scheduler as the answer's last
    step (its end-of-turn token) runs, and to_finish beats the EOS check."""
    options: dict[str, Any] = {
        **MEDIUM,
        "abort_on_last_step": 1.0,
        "continuations_dir": str(tmp_path / "c"),
    }
    cut, full, entry, stats = _abort_beside_a_reference(pool, options)
    eos = full["output_ids"][-1]
    assert len(full["output_ids"]) == 1001
    assert full["meta_info"]["finish_reason"] == {"type": "stop", "matched": eos}
    assert cut["output_ids"] == full["output_ids"]  # the end-of-turn token last
    assert cut["meta_info"]["finish_reason"] == ABORTED
    assert cut["meta_info"]["completion_tokens"] == 1001
    assert entry is not None and entry["outcome"] == "moved_at_end"
    assert entry["tokens"] == 1001 and entry["decoded_at_abort"] < 1000
    assert stats["moved_at_end_total"] == 1 and stats["moved_total"] == 1
    assert stats["completed"] == 1 and stats["aborted_total"] == 0  # the reference
    assert not (tmp_path / "c").exists()  # no rest to continue


def test_with_speculative_steps_an_abort_on_the_last_step_returns_tokens_past_the_end(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """Three tokens a step: the answer's 1000 tokens (999 and the end-of-turn) end on
    the first token of the step that decodes tokens 1000 to 1002 (counted from 1), so
    the abort brings the 2 after its end too."""
    options: dict[str, Any] = {**MEDIUM, "output_len_dist": "fixed:n=999", "tokens_per_step": 3,
               "abort_on_last_step": 1.0, "continuations_dir": str(tmp_path / "c")}  # fmt: skip
    cut, full, _, stats = _abort_beside_a_reference(pool, options)
    ids = cut["output_ids"]
    assert len(full["output_ids"]) == 1000 and len(ids) == 1002
    assert ids[:1000] == full["output_ids"] and ids[999] == full["output_ids"][-1]
    assert cut["meta_info"]["finish_reason"] == ABORTED
    assert cut["meta_info"]["completion_tokens"] == 1002
    assert stats["moved_at_end_total"] == 1
    assert not (tmp_path / "c").exists()


def test_an_abort_ends_every_request_whose_rid_starts_with_it(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    with run_standin(**SLOW, continuations_dir=str(tmp_path)) as server:
        calls = {rid: _generate(pool, server, _body(rid)) for rid in ("abc", "abcd", "xabc")}
        for rid in calls:
            _wait_running(server, rid)
        _abort(server, {"rid": "abc"})
        ended = {rid: calls[rid].result(timeout=30).json() for rid in ("abc", "abcd")}
        still_running = server.stats()["running"]  # "xabc" does not start with "abc"
        _abort(server, {"rid": "xabc"})
        last = calls["xabc"].result(timeout=30).json()
        stats = server.stats()
    assert still_running == 1
    for rid, out in [*ended.items(), ("xabc", last)]:
        assert out["meta_info"]["id"] == rid and out["meta_info"]["finish_reason"] == ABORTED
    assert stats["moved_total"] == 3


# What /generate answers a request aborted in the waiting queue, by version (SGLang's
# TokenizerManager._handle_abort_req); 0.5.23's meta_info adds e2e_latency too.
QUEUED_REPLIES = {
    "0.5.6": {"text": "", "output_ids": [], "meta_info": {
        "id": "waiting", "finish_reason": IN_QUEUE, "completion_tokens": 0}},
    "0.5.23": {"text": "", "output_ids": [], "meta_info": {
        "id": "waiting", "finish_reason": IN_QUEUE, "weight_version": "default",
        "completion_tokens": 0}},
    "0.5.3": {"text": "", "meta_info": {
        "id": "waiting", "finish_reason": BEFORE_PREFILL, "prompt_tokens": 0,
        "completion_tokens": 0}},
}  # fmt: skip


@pytest.mark.parametrize("version", sorted(QUEUED_REPLIES))
def test_a_request_aborted_while_waiting_for_a_slot_gets_its_versions_reply_and_never_runs(
    tmp_path: Path, pool: ThreadPoolExecutor, version: str
) -> None:
    options: dict[str, Any] = {**SLOW, "max_running_requests": 1, "version": version}
    with run_standin(**options, continuations_dir=str(tmp_path)) as server:
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
    e2e = out["meta_info"].pop("e2e_latency", None)
    assert (e2e is not None and e2e >= 0) == (version == "0.5.23")
    assert out == QUEUED_REPLIES[version]
    assert [(e["rid"], e["outcome"]) for e in log] == [("running", "moved")]
    assert stats["moved_waiting_total"] == 1 and stats["moved_total"] == 1
    assert stats["aborted_total"] == 0 and stats["queued"] == 0


def test_on_0_4_6_a_request_aborted_while_waiting_never_answers(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """0.4.6's tokenizer manager drops the state of a request aborted in the queue: its
    /generate call hangs until the client gives up (here 2 s after the abort took it out
    of the queue). Its replies are 0.4's too: text, no output_ids."""
    options: dict[str, Any] = {**SLOW, "max_running_requests": 1, "version": "0.4.6"}
    with run_standin(**options, continuations_dir=str(tmp_path)) as server:
        running = _generate(pool, server, _body("running"))
        _wait_running(server, "running")
        # A raw socket, so that the client's patience starts after the abort, not before.
        body = json.dumps(_body("waiting", [7, 8, 9])).encode()
        head = (f"POST /generate HTTP/1.1\r\nHost: standin\r\nContent-Type: application/json"
                f"\r\nContent-Length: {len(body)}\r\n\r\n")  # fmt: skip
        with socket.create_connection((server.config.host, server.port), timeout=2) as waiting:
            waiting.sendall(head.encode() + body)
            wait_for(lambda: server.stats()["queued"] == 1, timeout=30, what="the queued one")
            _abort(server, {"rid": "waiting"})
            wait_for(lambda: server.stats()["moved_waiting_total"] == 1, timeout=30,
                     what="the abort to take it out of the queue")  # fmt: skip
            with pytest.raises(TimeoutError):
                waiting.recv(1)
        stats = server.stats()
        _abort(server, {"rid": "running"})
        cut = running.result(timeout=30).json()
    assert stats["queued"] == 0 and stats["running"] == 1
    assert "output_ids" not in cut and cut["text"]
    assert cut["meta_info"]["finish_reason"] == ABORTED


def test_with_an_admin_key_only_that_key_aborts(tmp_path: Path, pool: ThreadPoolExecutor) -> None:
    """SGLang 0.5.23's /abort_request is ADMIN_OPTIONAL: with --admin-api-key it takes
    that bearer alone, while /generate takes the api key; health and metrics are open."""
    keys: dict[str, Any] = {
        "version": "0.5.23",
        "api_key": "user-key",
        "admin_api_key": "admin-key",
    }
    with run_standin(**SLOW, **keys, continuations_dir=str(tmp_path)) as server:
        no_key = _post(server, "/generate", _body("no-key"))
        pending = _generate(pool, server, _body("long"), key="user-key")
        _wait_running(server, "long")
        refused = [_post(server, "/abort_request", {"rid": "long"}, key)
                   for key in (None, "user-key")]  # fmt: skip
        running = server.stats()["running"]  # a refused abort never reached the route
        _abort(server, {"rid": "long"}, key="admin-key")
        cut = pending.result(timeout=30)
        open_routes = [server.get(path).status_code for path in ("/health", "/metrics")]
        info = server.get("/server_info").status_code
    assert no_key.status_code == 401 and no_key.json() == {"error": "Unauthorized"}
    assert [r.status_code for r in refused] == [401, 401] and running == 1
    assert cut.status_code == 200 and cut.json()["meta_info"]["finish_reason"] == ABORTED
    assert open_routes == [200, 200] and info == 401


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


def test_batch_mode_an_abort_on_the_last_step_returns_the_whole_answer_and_more(
    tmp_path: Path, pool: ThreadPoolExecutor
) -> None:
    """The batch model runs the aborted sequence to its last pass, whose 3 tokens all
    come back: the 1000-token answer and 2 past its end."""
    options: dict[str, Any] = {"output_len_dist": "fixed:n=999", "seed": 7, "decode_step_s": 0.01,
               "tokens_per_step": 3, "abort_on_last_step": 1.0, "skip_tokenizer_init": True,
               "continuations_dir": str(tmp_path / "c")}  # fmt: skip
    with run_standin(**options) as server:
        reference = _generate(pool, server, _body("reference"))
        pending = _generate(pool, server, _body("long"))
        wait_for(lambda: server.stats()["running"] == 2, timeout=30, what="both running")
        _abort(server, {"rid": "long"})
        cut = pending.result(timeout=30).json()
        full = reference.result(timeout=30).json()
        stats = server.stats()
    ids = cut["output_ids"]
    assert len(full["output_ids"]) == 1000 and len(ids) == 1002
    assert ids[:1000] == full["output_ids"]
    assert cut["meta_info"]["finish_reason"] == ABORTED
    assert stats["moved_at_end_total"] == 1 and stats["moved_total"] == 1
    assert stats["decoded_total"] == 1002 + 1000 and stats["running"] == 0
