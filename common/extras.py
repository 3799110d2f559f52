"""regen's optional extras (pyproject.toml, [project.optional-dependencies]) and the one
line a command says when it needs one that is not installed: what to install, before
it starts anything, never an import traceback halfway through (docs/design/limits.md, "Optional
extras").

Packages are looked up with `find_spec`, which finds a package without importing it:
checking costs nothing, where importing torch would take seconds.
"""

from __future__ import annotations

import importlib.util

# Each extra's packages, by import name, as pyproject.toml lists them.
EXTRAS: dict[str, tuple[str, ...]] = {
    # The local engine (transformers on CPU or GPU) and the GGUF files it loads, the
    # demo's SmolLM2 included.
    "local": ("torch", "accelerate", "gguf"),
    # The in-process SGLang engine (--engine sglang-engine), on GPU hosts.
    "sglang": ("sglang",),
    # `regen shards export --format hf`: the `datasets` folder, and the dataset card's
    # histogram (drawn with matplotlib; the card is written without it when it is missing).
    "export": ("datasets", "matplotlib"),
}


class MissingExtra(ValueError):
    """A command needs packages of an extra that is not installed; the message says
    which and what to install."""


def installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):  # a parent package missing, or a broken install
        return False


def extra_of(package: str) -> str | None:
    """The extra that installs `package` (an import name), if one does."""
    return next((extra for extra, names in EXTRAS.items() if package in names), None)


def install_hint(extra: str) -> str:
    return f"pip install 'regen[{extra}]'"


def require(extra: str, what: str, packages: tuple[str, ...] | None = None) -> None:
    """MissingExtra when any of `packages` (default: all the extra's) is not installed;
    `what` names what needs them (e.g. "--engine local")."""
    absent = [name for name in packages or EXTRAS[extra] if not installed(name)]
    if absent:
        raise MissingExtra(
            f"{what} needs the `{extra}` extra ({', '.join(absent)} not installed): "
            f"{install_hint(extra)}"
        )
