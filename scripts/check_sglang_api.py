"""Check SGLang's source (an unpacked wheel or an installed package) for the in-process
API that `--engine sglang-engine` and the offline stand-in rely on, without importing it
(importing sglang needs CUDA).

    python scripts/check_sglang_api.py PATH/TO/sglang      # the package folder
    python scripts/check_sglang_api.py sglang-0.5.23-*.whl  # or a wheel
    python scripts/check_sglang_api.py SOURCE --server-args mem_fraction_static,...

Exit 0 when every check passes; otherwise each broken expectation is printed.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
import tempfile
import zipfile
from pathlib import Path

# The keywords regen passes to Engine.async_generate, and what it reads back.
ASYNC_GENERATE_KEYWORDS = ("input_ids", "sampling_params", "rid")
# ServerArgs fields the worker itself sets (`--sglang-args` may name more).
REGEN_SERVER_ARGS = ("model_path", "tp_size", "trust_remote_code", "log_level")
# Texts of the errors the engine's mapping and the stand-ins copy.
TOKENIZER_MANAGER_TEXTS = ("is longer than the", "model's context length")


def method_params(tree: ast.Module, class_name: str, method: str) -> list[str] | None:
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if (
                    isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                    and item.name == method
                ):
                    args = item.args
                    return [a.arg for a in [*args.posonlyargs, *args.args, *args.kwonlyargs]]
    return None


def declared_fields(package: Path) -> set[str]:
    """Field names declared in ServerArgs: server_args.py (older releases) or the
    arg_groups/fields namespaces (0.5.2x)."""
    sources = [package / "srt" / "server_args.py"]
    sources += sorted((package / "srt" / "arg_groups" / "fields").glob("*.py"))
    names: set[str] = set()
    for source in sources:
        if source.exists():
            names.update(re.findall(r"^    ([a-z_][a-z0-9_]*)\s*:", source.read_text(), re.M))
    return names


def check(package: Path, server_args: tuple[str, ...] = REGEN_SERVER_ARGS) -> list[str]:
    problems: list[str] = []
    engine_py = package / "srt" / "entrypoints" / "engine.py"
    manager_py = package / "srt" / "managers" / "tokenizer_manager.py"
    for path in (engine_py, manager_py):
        if not path.exists():
            return [f"{path.relative_to(package.parent)} is missing: not an SGLang 0.5 package"]
    engine = ast.parse(engine_py.read_text())
    params = method_params(engine, "Engine", "async_generate")
    if params is None:
        problems.append("Engine.async_generate is missing")
    else:
        problems += [
            f"Engine.async_generate has no {name!r} keyword"
            for name in ASYNC_GENERATE_KEYWORDS
            if name not in params
        ]
    if method_params(engine, "Engine", "shutdown") is None:
        problems.append("Engine.shutdown is missing")
    manager_source = manager_py.read_text()
    abort = method_params(ast.parse(manager_source), "TokenizerManager", "abort_request")
    if abort is None or "rid" not in abort:
        problems.append("TokenizerManager.abort_request(rid=...) is missing")
    problems += [
        f"tokenizer_manager.py no longer says {text!r}"
        for text in TOKENIZER_MANAGER_TEXTS
        if text not in manager_source
    ]
    fields = declared_fields(package)
    problems += [f"ServerArgs has no field {name!r}" for name in server_args if name not in fields]
    return problems


def package_folder(path: Path, scratch: Path) -> Path:
    if path.suffix != ".whl":
        return path
    with zipfile.ZipFile(path) as wheel:
        wanted = [n for n in wheel.namelist() if n.startswith("sglang/srt/")]
        wheel.extractall(scratch, members=wanted)
    return scratch / "sglang"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path, help="the sglang package folder, or a wheel")
    parser.add_argument(
        "--server-args",
        default=",".join(REGEN_SERVER_ARGS),
        help="comma-separated ServerArgs fields that must exist (default: regen's own)",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as scratch:
        fields = tuple(filter(None, args.server_args.split(",")))
        problems = check(package_folder(args.source, Path(scratch)), fields)
    for problem in problems:
        print(f"sglang API: {problem}")
    if not problems:
        print("sglang API: every expectation holds")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
