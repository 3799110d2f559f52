"""bench/long_generations.py at a tenth of real answer lengths, end to end: real workers
and stand-ins; no request aborted, no chunk given back, no slot time wasted."""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest

pytestmark = pytest.mark.slow

BENCH = Path(__file__).resolve().parents[1] / "bench" / "long_generations.py"


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
        mean_tokens=1000.0, sigma=0.8, chunk_size=4, max_inflight="auto",
    )  # fmt: skip
    return argparse.Namespace(**{**args, **changes})


@pytest.mark.parametrize("run", ["last", "all"])
def test_a_quick_long_generation_run_aborts_and_gives_back_nothing(run: str) -> None:
    figures = _bench().run(run, _args())
    assert figures.aborted == 0 and figures.given_back == 0, figures
    assert figures.waste == 0.0 and figures.redone == 0, figures
    # Busy while work waited: loose bounds, as the machine running tests is shared.
    assert min(figures.busy) > 0.8, figures
