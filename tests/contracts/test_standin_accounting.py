"""The stand-in at real time scale: it aborts a request whose client went away (as
SGLang's tokenizer manager does) and accounts slot time a bench reads back: busy time,
time spent on answers aborted or redone, and each request's slot interval."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.support.helpers import wait_for
from tests.support.sglang_standin.process import StandinHandle, run_standin

pytestmark = pytest.mark.slow

BODY = {"input_ids": [100, 200, 300], "sampling_params": {"max_new_tokens": 64}, "rid": "a"}


def _give_up_after(server: StandinHandle, seconds: float, body: dict[str, object]) -> None:
    """Send a request and drop the connection after `seconds`, as a cancelled client does."""
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{server.url}/generate", json=body, timeout=seconds, trust_env=False)


def test_a_request_whose_client_went_away_is_aborted_and_its_slot_freed() -> None:
    with run_standin(output_len_dist="fixed:n=40", decode_tokens_per_s=4.0) as server:
        _give_up_after(server, 0.5, BODY)
        wait_for(lambda: server.stats()["aborted_total"] == 1, timeout=10, what="the abort")
        stats = server.stats()
        log = server.slot_log()
    assert stats["running"] == 0 and stats["completed"] == 0
    assert 0.3 < stats["aborted_busy_s"] < 5.0  # not the 10 s the answer would take
    assert [entry["outcome"] for entry in log] == ["aborted"]


def test_with_keep_abandoned_the_answer_runs_on_as_without_abort() -> None:
    with run_standin(
        output_len_dist="fixed:n=40", decode_tokens_per_s=4.0, keep_abandoned=True
    ) as server:
        _give_up_after(server, 0.5, BODY)
        time.sleep(1.0)  # the abort, had there been one, lands within milliseconds
        stats = server.stats()
    assert stats["running"] == 1 and stats["aborted_total"] == 0


def test_an_answer_to_a_prompt_already_answered_counts_as_redone() -> None:
    with run_standin(output_len_dist="fixed:n=4", decode_tokens_per_s=40.0) as server:
        for rid in ("first", "again"):
            assert server.generate({**BODY, "rid": rid}).status_code == 200
        other = {**BODY, "rid": "other", "input_ids": [7, 8, 9]}
        assert server.generate(other).status_code == 200
        stats = server.stats()
        log = server.slot_log()
    assert stats["repeated_total"] == 1 and stats["repeated_busy_s"] > 0.05
    assert [entry["rid"] for entry in log] == ["first", "again", "other"]
    assert all(e["outcome"] == "completed" and e["end"] > e["start"] for e in log)
