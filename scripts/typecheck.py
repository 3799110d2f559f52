"""Type-check regen as it is installed: mypy over every module of the `regen` namespace.

The code lives in four top-level folders that pyproject.toml maps into one namespace
(setuptools' package-dir: regen/, and common/, producer/, consumers/ as regen.common,
regen.producer, regen.consumers; docs/design/README.md, Layout). mypy finds modules by folder
and knows no such mapping: a plain `mypy` in the repository sees `regen/` alone and
cannot follow `regen.common`. So this lays out the installed tree under build/typecheck/
(links to the real folders, made from pyproject.toml's mapping on every run) and runs
mypy there with the settings of pyproject.toml [tool.mypy]; mypy's paths are written
back as the repository's own (regen/common/keys.py is common/keys.py).

Usage: python scripts/typecheck.py [mypy options]. The exit status is mypy's.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:  # mypy itself depends on tomli before Python 3.11
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
# In build/ (ignored by git, ruff and the image): the same place on every run, so mypy's
# cache stays valid between runs. The cache is its own: a plain `mypy` in the repository
# caches regen/cli.py under the same relative path, seen without regen.common.
TREE = REPO / "build" / "typecheck"
CACHE = REPO / ".mypy_cache" / "installed-tree"


def package_dirs() -> dict[str, str]:
    """pyproject.toml's package-dir: a package name to its folder in the repository."""
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    mapping: dict[str, str] = config["tool"]["setuptools"]["package-dir"]
    return mapping


def lay_out(tree: Path, mapping: dict[str, str]) -> None:
    """The installed tree under `tree`: a top-level package is a real folder linking each
    of its entries; a mapped subpackage is a link to its whole folder."""
    if tree.exists():
        shutil.rmtree(tree)
    for package in sorted(mapping, key=lambda name: name.count(".")):
        source = REPO / mapping[package]
        target = tree.joinpath(*package.split("."))
        if "." not in package:
            target.mkdir(parents=True)
            for entry in source.iterdir():
                if entry.name != "__pycache__":
                    (target / entry.name).symlink_to(entry)
        else:
            target.symlink_to(source, target_is_directory=True)


def as_in_repository(line: str, mapping: dict[str, str]) -> str:
    """mypy's path at the start of `line` (a path in the laid-out tree) as the file's
    path in the repository; the deepest package first, so regen/common/ is not regen/."""
    for package in sorted(mapping, key=lambda name: -name.count(".")):
        prefix = package.replace(".", "/") + "/"
        if line.startswith(prefix):
            return mapping[package].rstrip("/") + "/" + line[len(prefix) :]
    return line


def main(argv: list[str]) -> int:
    mapping = package_dirs()
    lay_out(TREE, mapping)
    # Without PYTHONPATH: a checkout's regen/ on it would be found before the laid-out one.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [sys.executable, "-m", "mypy", "--config-file", str(REPO / "pyproject.toml"),
         "--cache-dir", str(CACHE), *argv],
        cwd=TREE, env=env, capture_output=True, text=True,
    )  # fmt: skip
    for line in done.stdout.splitlines():
        print(as_in_repository(line, mapping))
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
