"""bench/specforge_side_by_side.py's quick `one` run (answer lengths / 10), end to end:
real `regen enqueue`, workers and stand-in; SpecForge's side too when
$SPECFORGE_SCRIPT names its scripts/regenerate_train_data.py (its script is not in
the specforge wheel, so by default only regen's side runs)."""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "specforge_side_by_side.py"


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("specforge_side_by_side", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def quick_args(**overrides: object) -> argparse.Namespace:
    script = os.environ.get("SPECFORGE_SCRIPT")
    values: dict[str, object] = dict(
        scale=10.0, prompts=264, slots=32, ms_per_token=20.0, slow_ms_per_token=80.0,
        mean_tokens=2000.0, sigma=0.8, first="both", specforge_script=script,
        specforge_python=os.environ.get("SPECFORGE_PYTHON", sys.executable),
    )  # fmt: skip
    values.update(overrides)
    return argparse.Namespace(**values)


def both_tools() -> list[str]:
    script = os.environ.get("SPECFORGE_SCRIPT")
    return ["regen", "specforge"] if script and Path(script).is_file() else ["regen"]


@pytest.mark.slow
def test_the_quick_one_run_keeps_the_server_busy_and_answers_every_prompt_once() -> None:
    sides = _bench().compare("one", both_tools(), quick_args())
    for side in sides:
        assert side.records == side.prompts == 264, side
        assert side.answered_once and side.aborted == 0, side
        # Loose bounds, as the machine running tests is shared.
        assert side.util > 0.5, side
        assert 0 < side.span_s <= side.wall_s, side
    if len(sides) == 2:
        assert sides[0].work == sides[1].work  # the same prompts, the same answer lengths


@pytest.mark.slow
def test_the_quick_two_speed_run_starts_the_slow_servers_worker_first() -> None:
    """regen's side only (SpecForge's takes 4x longer on this fleet): the slow server's
    worker starts first, the fast one's once the slow one holds a chunk; both serve."""
    (side,) = _bench().compare("two-speed", ["regen"], quick_args(first="slow"))
    assert side.first == "slow" and side.records == side.prompts == 264, side
    assert side.answered_once and side.aborted == 0, side
    fast, slow = side.first_request_s
    assert slow < fast, side
    assert all(n > 0 for n in side.answers_per_server), side
    assert sum(side.answers_per_server) == 264, side
