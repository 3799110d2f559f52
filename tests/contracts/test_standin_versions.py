"""The stand-in's SGLang versions (tests/support/sglang_standin/versions.py), API keys (auth.py)
and abort rules (aborts.py), as SGLang's source has them: the rules in-process, then
the routes each version serves from a real stand-in."""

from __future__ import annotations

import pytest

from tests.support.sglang_standin import run_standin
from tests.support.sglang_standin.aborts import (
    Aborts,
    lands_on_last_step,
    last_step_end,
    parse_abort,
    tokens_at_abort,
)
from tests.support.sglang_standin.auth import allowed
from tests.support.sglang_standin.config import StandinConfig
from tests.support.sglang_standin.versions import QueuedAbort, Release


def test_each_version_answers_a_queued_abort_as_its_release_does() -> None:
    shapes = {v: Release.parse(v).queued_abort for v in ("0.4.6.post5", "0.4.10.post2",
              "0.5.1", "0.5.3", "0.5.4", "0.5.5", "0.5.6", "0.5.23")}  # fmt: skip
    assert shapes == {
        "0.4.6.post5": QueuedAbort.HANG,
        "0.4.10.post2": QueuedAbort.BEFORE_PREFILL,
        "0.5.1": QueuedAbort.BEFORE_PREFILL,
        "0.5.3": QueuedAbort.BEFORE_PREFILL,
        "0.5.4": QueuedAbort.BEFORE_PREFILL,
        "0.5.5": QueuedAbort.SO_FAR,
        "0.5.6": QueuedAbort.SO_FAR,
        "0.5.23": QueuedAbort.SO_FAR,
    }
    old, new = Release.parse("0.4.6"), Release.parse("0.5.6")
    assert not old.output_ids and new.output_ids
    assert not old.abort_all and new.abort_all
    assert not Release.parse("0.5.3").short_info_routes and new.short_info_routes
    assert not new.admin_api_key and Release.parse("0.5.23").admin_api_key


def test_a_version_the_standin_cannot_imitate_is_refused_before_it_starts() -> None:
    assert StandinConfig().version == "0.5.6"
    for bad in ("0.5.x-standin", "0.4.5", "latest"):
        with pytest.raises(ValueError, match="version"):
            StandinConfig(version=bad)
    with pytest.raises(ValueError, match="admin-api-key"):
        StandinConfig(version="0.5.6", admin_api_key="k")
    for bad_knob in ({"tokens_per_step": 0}, {"abort_on_last_step": 1.5}, {"api_key": ""}):
        with pytest.raises(ValueError):
            StandinConfig(**bad_knob)  # type: ignore[arg-type]


def test_only_the_right_bearer_gets_through() -> None:
    def ok(path: str, header: str | None, api: str | None, admin: str | None) -> bool:
        return allowed(path, header, api, admin)

    # No keys: everything is open.
    assert ok("/generate", None, None, None) and ok("/abort_request", None, None, None)
    # An api key guards every route but health, metrics and the stand-in's own.
    assert not ok("/generate", None, "u", None) and ok("/generate", "Bearer u", "u", None)
    assert not ok("/generate", "bearer u", "u", None)  # as 0.5.6 compares it
    assert not ok("/abort_request", "Bearer x", "u", None)
    assert ok("/abort_request", "Bearer u", "u", None)
    for path in ("/health", "/health_generate", "/metrics", "/_stats"):
        assert ok(path, None, "u", "a")
    # An admin key: /abort_request takes it alone; other routes the api key, or nothing.
    assert ok("/abort_request", "Bearer a", "u", "a")
    assert not ok("/abort_request", "Bearer u", "u", "a")
    assert not ok("/abort_request", None, None, "a")
    assert ok("/generate", None, None, "a") and not ok("/generate", "Bearer a", "u", "a")
    assert not ok("/generate", "Bearer ü", "u", None)  # not ASCII: refused, not an error


def test_an_abort_returns_the_step_in_flight_and_may_pass_the_end() -> None:
    # 10 tokens/s, 1 token a step: 0.35 s in, 3 tokens were done and the 4th in flight.
    assert tokens_at_abort(0.35, 10.0, 1, 100) == 4
    assert tokens_at_abort(0.0, 10.0, 1, 100) == 1  # the first step (prefill) runs too
    # 3 tokens a step: the step in flight is tokens 4 to 6.
    assert tokens_at_abort(0.35, 10.0, 3, 100) == 6
    # On the last step: the whole answer, and with 3-token steps 2 tokens past its end.
    assert tokens_at_abort(9.95, 10.0, 1, 100) == 100
    assert tokens_at_abort(9.95, 10.0, 3, 100) == 102
    # The decode was over: the answer finished, nothing is cut.
    assert tokens_at_abort(10.0, 10.0, 1, 100) is None
    assert tokens_at_abort(0.0, 0.0, 1, 100) is None  # instant decode
    assert last_step_end(100, 1) == 100 and last_step_end(100, 3) == 102
    assert last_step_end(99, 3) == 99


def test_the_aborts_that_land_on_the_last_step_are_a_share_that_repeats() -> None:
    rids = [f"r{i}" for i in range(2000)]
    hits = [rid for rid in rids if lands_on_last_step(0.25, 7, rid)]
    assert 400 < len(hits) < 600
    assert hits == [rid for rid in rids if lands_on_last_step(0.25, 7, rid)]
    assert hits != [rid for rid in rids if lands_on_last_step(0.25, 8, rid)]
    assert all(lands_on_last_step(1.0, 7, rid) for rid in rids)
    assert not any(lands_on_last_step(0.0, 7, rid) for rid in rids)


def test_an_abort_ends_every_rid_that_starts_with_a_rid_in_flight() -> None:
    aborts = Aborts()
    rids = ("abc", "abcd", "xabc", "ab-other")
    for rid in rids:
        aborts.watch(rid)

    def ended() -> list[str]:
        return [rid for rid in rids if (event := aborts.event(rid)) and event.is_set()]

    aborts.abort("ab")  # not in flight itself: SGLang's tokenizer manager drops it
    assert ended() == []
    aborts.abort("abc")
    assert ended() == ["abc", "abcd"]
    aborts.abort(None, abort_all=True)
    assert ended() == list(rids)


def test_an_abort_body_is_read_as_its_version_reads_it() -> None:
    new, old = Release.parse("0.5.6"), Release.parse("0.4.6")
    assert parse_abort(b'{"rid": "r"}', new) == ("r", False)
    assert parse_abort(b'{"abort_all": true}', new) == (None, True)
    assert parse_abort(b"[1]", new) is None and parse_abort(b"{", new) is None
    # 0.4.6's AbortReq is a rid alone: abort_all is ignored, and a body without a rid is
    # FastAPI's 422.
    assert parse_abort(b'{"rid": "r", "abort_all": true}', old) == ("r", False)
    assert parse_abort(b'{"abort_all": true}', old) is None


@pytest.mark.slow
def test_each_version_serves_its_info_routes() -> None:
    with run_standin(version="0.5.3") as old, run_standin() as new:
        assert old.get("/server_info").status_code == 404
        assert old.get("/model_info").status_code == 404
        assert old.get("/get_server_info").json()["version"] == "0.5.3"
        assert old.get("/get_model_info").status_code == 200
        for path in ("/server_info", "/get_server_info"):
            assert new.get(path).json()["version"] == "0.5.6"
