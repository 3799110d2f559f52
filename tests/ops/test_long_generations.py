"""bench/long_generations.py at a tenth of real answer lengths, end to end: real workers
and stand-ins; no request aborted, no chunk given back, no slot time wasted."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "long_generations.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("long_generations", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _args(**changes: object) -> argparse.Namespace:
    args = dict(
        scale=10.0, prompts=64, slots=16, ms_per_token=20.0, slow_ms_per_token=80.0,
        mean_tokens=1000.0, sigma=0.8, chunk_size=4, max_inflight="auto", log_dir=None,
    )  # fmt: skip
    return argparse.Namespace(**{**args, **changes})


@pytest.mark.slow
@pytest.mark.parametrize("run", ["last", "all"])
def test_a_quick_long_generation_run_aborts_and_gives_back_nothing(run: str) -> None:
    figures = _bench().run(run, _args())
    assert figures.aborted == 0 and figures.given_back == 0, figures
    assert figures.waste == 0.0 and figures.redone == 0, figures
    # Busy while work waited: loose bounds, as the machine running tests is shared.
    assert min(figures.busy) > 0.8, figures


def _entry(rid: str, start: float, end: float) -> dict[str, object]:
    return {"rid": rid, "prompt": hash(rid), "start": start, "end": end, "outcome": "completed"}


def test_an_idle_slot_counts_only_while_a_request_could_have_started() -> None:
    """One slot. Conversation c's turn 1 runs 0-10 s, its turn 2 10-20 s: nothing else
    could start meanwhile, so the slot counts fully busy. Prompt p could start from 0
    but waits until 25 s, while the slot idles 20-25 s: that idle time counts."""
    log = [
        _entry("k-c-0-0", 0.0, 10.0),
        _entry("k-c-1-0", 10.0, 20.0),
        _entry("k-p-0", 25.0, 30.0),
    ]
    (busy,) = _bench().busy_while_work_waits([log], slots=1)
    assert busy == pytest.approx(20.0 / 25.0)
    # Without p, turn 2 waited on turn 1 alone: never an idle slot with work waiting.
    (busy,) = _bench().busy_while_work_waits([log[:2]], slots=1)
    assert busy == pytest.approx(1.0)


def test_a_server_whose_worker_left_the_jobs_end_is_not_counted_while_away() -> None:
    """Two servers of one slot. The fast one runs p1-p4 back to back (0-40 s); the slow
    one runs s1 (0-15 s), then its worker leaves the job's end (15 s on): its idle slot
    while p3 and p4 wait counts as away, not as idle."""
    bench = _bench()
    fast = [_entry(f"k-p{i}-0", 10.0 * (i - 1), 10.0 * i) for i in range(1, 5)]
    slow = [_entry("k-s1-0", 0.0, 15.0)]
    log = (
        "2026-12-05 19:00:15,000 regen.generate leaving the last prompts of q to faster "
        "servers (under 96 queued)\n"
    )
    away = bench.stand_downs(log)
    assert len(away) == 1 and away[0][1] == float("inf")
    start = away[0][0]
    shifted = [{**e, "start": e["start"] + start - 15.0, "end": e["end"] + start - 15.0}
               for e in fast + slow]  # fmt: skip
    busy, gone = bench.busy_and_away([shifted[:4], shifted[4:]], 1, [[], away])
    assert busy == pytest.approx([1.0, 1.0]) and gone == pytest.approx([0.0, 15.0])
    # Without the stand-down, the slow server's idle slot 15-30 s counts against it.
    (_, slow_busy) = bench.busy_while_work_waits([shifted[:4], shifted[4:]], slots=1)
    assert slow_busy == pytest.approx(0.5)
    back = log + "2026-12-05 19:00:20,000 regen.generate taking q again\n"
    assert bench.stand_downs(back) == [(start, start + 5.0)]
