"""The in-process SGLang API that `--engine sglang-engine` and the offline stand-in rely
on, and the `POST /abort_request` contract of regen's hand-over and the HTTP stand-in,
checked in the real SGLang source (wheels from PyPI, read without importing: sglang
needs CUDA), at both ends of the range the `sglang` extra allows."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.sglang_standin.offline_engine import SERVER_ARGS
from tests.support.sglang_standin.process import REPO_ROOT

pytestmark = pytest.mark.slow

WHEELS = REPO_ROOT / ".pytest_cache" / "sglang-wheels"
CHECK = REPO_ROOT / "scripts" / "check_sglang_api.py"
OLDEST_WITHOUT_RID = "0.5.5"  # async_generate gained `rid` in 0.5.6
# 0.5.1 to 0.5.4 answer a request aborted in their waiting queue with {"text": ""} alone.
QUEUED_ABORT_WITHOUT_IDS = "0.5.3"
NO_QUEUED_OUTPUT_IDS = (
    "the reply to a request aborted in the waiting queue "
    "(TokenizerManager._handle_abort_req) has no output_ids"
)


def oldest_allowed() -> str:
    """X of the `sglang` extra's 'sglang>=X,<Y' in pyproject.toml."""
    pyproject = (REPO_ROOT / "pyproject.toml").read_text()
    match = re.search(r'sglang = \["sglang>=([\d.]+),<[\d.]+"\]', pyproject)
    assert match, "the sglang extra is not 'sglang>=X,<Y'"
    return match.group(1)


def wheel(version: str) -> Path:
    """sglang's wheel at `version`, downloaded once (no dependencies, nothing imported)."""
    target = WHEELS / version
    found = sorted(target.glob(f"sglang-{version}-*.whl"))
    if not found:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
             f"sglang=={version}", "--dest", str(target)],
            check=True, timeout=600,
        )  # fmt: skip
        found = sorted(target.glob(f"sglang-{version}-*.whl"))
    assert found, f"pip downloaded no sglang {version} wheel"
    return found[0]


def problems(version: str, *server_args: str) -> list[str]:
    """What scripts/check_sglang_api.py finds wrong with that release (checking these
    ServerArgs fields, or by default the ones regen sets)."""
    flags = ["--server-args", ",".join(server_args)] if server_args else []
    run = subprocess.run(
        [sys.executable, str(CHECK), str(wheel(version)), *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    found = [line.removeprefix("sglang API: ") for line in run.stdout.splitlines()]
    found = [line for line in found if line != "every expectation holds"]
    assert run.returncode == (1 if found else 0), run
    return found


def test_the_oldest_allowed_release_has_what_regen_calls() -> None:
    assert problems(oldest_allowed()) == []


def test_the_release_the_stand_in_copies_has_every_argument_it_accepts() -> None:
    assert problems("0.5.23", *sorted(SERVER_ARGS)) == []


def test_the_check_fails_on_a_release_without_rid() -> None:
    assert problems(OLDEST_WITHOUT_RID) == ["Engine.async_generate has no 'rid' keyword"]


@pytest.mark.parametrize("version", ["0.5.6", "0.5.23"])
def test_the_abort_contract_holds_on_the_releases_regen_runs_on(version: str) -> None:
    """The route, the rid prefix match, the abort flag read before the length and EOS
    checks (an abort on the last step returns that step's token), and output_ids in the
    reply to a request aborted while queued: all there."""
    assert problems(version) == []


def test_the_check_fails_on_a_release_whose_queued_abort_has_no_output_ids() -> None:
    assert problems(QUEUED_ABORT_WITHOUT_IDS) == [
        "Engine.async_generate has no 'rid' keyword",
        NO_QUEUED_OUTPUT_IDS,
    ]
