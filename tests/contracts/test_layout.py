"""The layout shows the flow (docs/design/README.md, Layout): the producer and what the stages
share never reach into a consumer."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import os
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
# pyproject.toml's package-dir: the top-level folders installed as one namespace.
FOLDERS = {"regen": "regen", "regen.common": "common", "regen.producer": "producer",
           "regen.consumers": "consumers"}  # fmt: skip


def test_the_package_tree_has_no_links() -> None:
    """The folders are real and each file is in one place: pyproject.toml maps common/,
    producer/ and consumers/ into the `regen` namespace (docs/design/README.md, Layout), so import
    graphs, linters and mypy see every file where it lives."""
    links = [
        str(path.relative_to(REPO))
        for folder in FOLDERS.values()
        for path in (REPO / folder).rglob("*")
        if path.is_symlink()
    ]
    assert links == []


@pytest.mark.parametrize(
    ("module", "path"),
    [*((name, f"{folder}/__init__.py") for name, folder in FOLDERS.items()),
     ("regen.consumers.generate.chunk_life.state", "consumers/generate/chunk_life/state.py"),
     ("regen.common.keys", "common/keys.py")],
)  # fmt: skip
def test_the_namespace_is_the_top_level_folders(module: str, path: str) -> None:
    assert Path(str(importlib.import_module(module).__file__)).resolve() == REPO / path


def test_pyproject_lists_every_package_folder() -> None:
    """setuptools is given the packages by name (a package-dir mapping finds none by
    itself): a folder left off would be missing from the wheel, yet import from a
    checkout. Every folder is one, regen/data too (setuptools warns of a folder that
    Python could import but `packages` leaves out)."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert setuptools["package-dir"] == FOLDERS
    folders = {
        ".".join([package, *path.relative_to(REPO / folder).parts])
        for package, folder in FOLDERS.items()
        for path in [REPO / folder, *(REPO / folder).rglob("*")]
        if path.is_dir() and "__pycache__" not in path.parts
    }
    assert sorted(setuptools["packages"]) == sorted(folders)


# What each folder may import of regen (docs/design/README.md, Layout): arrows run from the
# operator commands to the stages, from the stages to common/, and never back.
MAY_IMPORT = {
    "common": ("regen.common",),
    "producer": ("regen.common", "regen.producer"),
    "consumers": ("regen.common", "regen.consumers"),
}


def regen_imports(path: Path) -> set[str]:
    """The regen modules a file imports (absolute imports: the tree uses no other)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {name for name in names if name == "regen" or name.startswith("regen.")}


def test_arrows_run_one_way() -> None:
    """common/ (exactly-once state in common/ledger/ included) imports no stage; the
    producer and the consumers import common/ and themselves, never each other, the CLI
    or its operator code (regen/ops): a change to an operator command cannot reach a
    stage, and a stage's state is read through common/ledger/."""
    reaching = {}
    for folder, allowed in MAY_IMPORT.items():
        for path in python_files(folder):
            wrong = sorted(
                name
                for name in regen_imports(path)
                if not any(name == a or name.startswith(a + ".") for a in allowed)
            )
            if wrong:
                reaching[str(path.relative_to(REPO))] = wrong
    assert reaching == {}


def test_exactly_once_state_has_one_home() -> None:
    """The modules that write what proves where an id is live in common/ledger/ (its
    `__init__` names each key's writer), and no module elsewhere defines a Lua script
    that writes the committed index or the job's ids."""
    ledger = REPO / "common" / "ledger"
    assert {p.name for p in ledger.glob("*.py")} >= {
        "commit_ledger.py", "committed_index.py", "job_ids.py", "places.py", "id_buckets.py",
    }  # fmt: skip
    doc = (ledger / "__init__.py").read_text()
    for module in ("job_ids.py", "commit_ledger.py", "places.py"):
        assert f"`{module}`" in doc
    outside = [
        str(path.relative_to(REPO))
        for path in python_files("common", "producer", "consumers", "regen")
        if not path.is_relative_to(ledger)
        and ("def committed_index(" in path.read_text() or "ADD_IDS_LUA = " in path.read_text())
    ]
    assert outside == []


CHUNK_LIFE = "regen.consumers.generate.chunk_life"


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (REPO / folder).rglob("*.py"))


def test_code_outside_chunk_life_uses_its_public_face() -> None:
    """A chunk's life is one package (docs/design/delivery.md, A chunk's states): the rest of the
    code imports its `__init__`, never one of its modules."""
    inside = REPO / "consumers" / "generate" / "chunk_life"
    reaching = {}
    for path in python_files("consumers", "producer", "common", "regen", "bench"):
        if path.is_relative_to(inside):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                CHUNK_LIFE + "."
            ):
                reaching[str(path.relative_to(REPO))] = node.module
    assert reaching == {}


def test_one_writer_of_a_chunks_generated_marks() -> None:
    """Within the generate worker only chunk_life/state.py writes a chunk's `generated`
    set (its scripts and `mark_generated`); lease.py only names the key for them."""
    writers = {
        str(path.relative_to(REPO))
        for path in python_files("consumers/generate")
        if "chunk_generated(" in path.read_text() or "SADD', KEYS" in path.read_text()
    }
    assert writers == {
        "consumers/generate/chunk_life/state.py",
        "consumers/generate/chunk_life/lease.py",
    }
    lease = (REPO / "consumers/generate/chunk_life/lease.py").read_text()
    assert ".sadd(" not in lease and "SADD" not in lease


def test_one_redis_retry() -> None:
    """Every process waits out a Redis outage with the same backoff, defined once."""
    defining = [
        str(path.relative_to(REPO))
        for path in python_files("consumers", "producer", "common", "regen")
        if "REDIS_RETRY = " in path.read_text()
    ]
    assert defining == ["common/backoff.py"]


def test_the_operator_tools_see_the_tokenize_stage_through_its_face() -> None:
    """regen/ops (and the CLI's shard commands, the demo's report) import the tokenize
    stage from consumers/tokenize/operator_view.py only, never its inner modules."""
    face = "regen.consumers.tokenize.operator_view"
    reaching = {}
    paths = [*sorted((REPO / "regen" / "ops").glob("*.py")), REPO / "regen" / "cli_shards.py",
             REPO / "regen" / "demo_report.py"]  # fmt: skip
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text())):
            module = node.module if isinstance(node, ast.ImportFrom) else None
            if module and module.startswith("regen.consumers.tokenize") and module != face:
                reaching[path.name] = module
    assert reaching == {}


def load_typecheck() -> Any:
    spec = importlib.util.spec_from_file_location("typecheck", REPO / "scripts" / "typecheck.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mypy_is_shown_the_installed_tree(tmp_path: Path) -> None:
    """scripts/typecheck.py lays out the namespace as the wheel has it (mypy knows no
    package-dir), so mypy reaches every module, and reports the files where they live."""
    typecheck = load_typecheck()
    mapping = typecheck.package_dirs()
    assert mapping == FOLDERS
    typecheck.lay_out(tmp_path / "tree", mapping)
    laid_out = {  # through the links, as mypy goes
        (Path(folder) / name).relative_to(tmp_path / "tree").as_posix()
        for folder, _, names in os.walk(tmp_path / "tree", followlinks=True)
        for name in names
        if name.endswith(".py")
    }
    assert "regen/common/keys.py" in laid_out
    assert len(laid_out) == len(python_files("regen", "common", "producer", "consumers"))
    keys = tmp_path / "tree" / "regen" / "common" / "keys.py"
    assert keys.resolve() == REPO / "common" / "keys.py"

    error = ": error: Incompatible types in assignment  [assignment]"
    assert typecheck.as_in_repository(f"regen/common/keys.py:3{error}", mapping) == (
        f"common/keys.py:3{error}"
    )
    assert typecheck.as_in_repository("regen/consumers/generate/tasks.py:9: note", mapping) == (
        "consumers/generate/tasks.py:9: note"
    )
    assert typecheck.as_in_repository("regen/cli.py:1: error", mapping) == "regen/cli.py:1: error"
    assert typecheck.as_in_repository("Found 1 error in 1 file", mapping) == (
        "Found 1 error in 1 file"
    )


TEST_FOLDERS = {"producer", "generate", "tokenize", "common", "ops", "contracts", "chaos"}


def test_every_test_lives_in_the_folder_of_what_it_tests() -> None:
    """Tests are grouped by what they test (docs/design/README.md, Layout), and what they share
    is in tests/support/: no test module at the top of tests/, none in support/."""
    tests = REPO / "tests"
    loose = sorted(
        p.name for p in tests.glob("*.py") if p.name not in ("__init__.py", "conftest.py")
    )
    assert loose == []
    folders = {p.parent.relative_to(tests).parts[0] for p in tests.rglob("test_*.py")}
    assert folders == TEST_FOLDERS
    assert not list((tests / "support").rglob("test_*.py"))
