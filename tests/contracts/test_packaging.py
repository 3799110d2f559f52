"""The built wheel installs one namespace, `regen`, and its command runs from a clean venv.

The repository keeps `producer/`, `consumers/` and `common/` at the top level (the layout
shows the flow); pyproject.toml's package-dir installs them as `regen.producer`,
`regen.consumers` and `regen.common`, so `import common` in a training environment never
meets regen's."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def run(*argv: str | Path, cwd: Path, env: dict[str, str] | None = None) -> str:
    done = subprocess.run(
        [str(a) for a in argv], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"{argv}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_the_wheel_installs_only_the_regen_namespace(tmp_path: Path) -> None:
    # Built from a copy: an in-tree build/ would keep stale modules and put them in the wheel.
    source = tmp_path / "src"
    shutil.copytree(REPO, source, symlinks=True, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "*.egg-info", ".*cache", ".regen", "__pycache__"))  # fmt: skip
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
        "-w", tmp_path / "dist", source, cwd=tmp_path)  # fmt: skip
    (wheel,) = (tmp_path / "dist").glob("regen-*.whl")

    clean = tmp_path / "venv"
    venv.create(clean, with_pip=False)
    python = clean / "bin" / "python"
    site = Path(run(python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))",
                    cwd=tmp_path).strip())  # fmt: skip
    # The dependencies come from this interpreter's site-packages (and those a venv layered
    # on another's puts on its path), by path entries that are there before the snapshot:
    # the install itself adds nothing but regen.
    deps = [sysconfig.get_path("purelib"), *(p for p in sys.path if p.endswith("site-packages"))]
    (site / "deps.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(deps)))
    before = {p.name for p in site.iterdir()}
    # Without PYTHONPATH: a checkout on it holds regen.egg-info (its editable install), and
    # pip would take regen for installed and install nothing.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    run(sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", "--no-index",
        "-q", wheel, cwd=tmp_path, env=env)  # fmt: skip
    added = {p.name for p in site.iterdir()} - before
    assert {n for n in added if not n.endswith(".dist-info")} == {"regen"}, added
    assert len(added) == 2, added
    assert (site / "regen" / "common" / "keys.py").is_file()  # real files, not links
    assert not (site / "regen" / "common").is_symlink()
    # Every module of the four folders, in its place in the namespace: pyproject.toml names
    # the packages one by one, and one left off would import from a checkout, not the wheel.
    folders = {"": "regen", "common/": "common", "producer/": "producer",
               "consumers/": "consumers"}  # fmt: skip
    expected = {
        inside + path.relative_to(source / folder).as_posix()
        for inside, folder in folders.items()
        for path in (source / folder).rglob("*.py")
    }
    installed = {path.relative_to(site / "regen").as_posix()
                 for path in (site / "regen").rglob("*.py")}  # fmt: skip
    assert installed == expected
    assert (site / "regen" / "data" / "demo_prompts.jsonl").is_file()

    # From a folder that is not the repository, so only the installed copy can answer.
    assert "Usage: regen demo" in run(clean / "bin" / "regen", "demo", "--help", cwd=tmp_path,
                                      env=env)  # fmt: skip
    for name in ("common", "producer", "consumers"):
        found = subprocess.run([python, "-c", f"import {name}"], cwd=tmp_path, env=env,
                               capture_output=True, text=True)  # fmt: skip
        assert found.returncode == 1 and "ModuleNotFoundError" in found.stderr, name
    imported = run(python, "-c", "import regen.consumers.tokenize.consumer as m; print(m.__file__)",
                   cwd=tmp_path, env=env)  # fmt: skip
    assert imported.strip().startswith(str(site)), imported
