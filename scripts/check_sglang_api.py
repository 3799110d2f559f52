"""Check SGLang's source (an unpacked wheel or an installed package) for the in-process
API that `--engine sglang-engine` and the offline stand-in rely on, and for the
`POST /abort_request` contract that regen's hand-over and the HTTP stand-in rely on
(docs/design/sglang.md, "SGLang contract"), without importing it (importing sglang needs CUDA).

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
# Where the abort contract lives, under the package's srt/ (the tokenizer manager beside).
ABORT_SOURCES = {
    "http_server": "entrypoints/http_server.py",
    "scheduler": "managers/scheduler.py",
    "schedule_batch": "managers/schedule_batch.py",
}
ABORT_ROUTE = re.compile(r'@app\.(?:post|api_route)\(\s*"/abort_request"')
PREFIX_MATCH = re.compile(r"\.rid\.startswith\(\s*recv_req\.rid\s*\)")
# The flag an abort sets on a running request (0.5.3 and older: to_abort), and the
# method that ends a request after a step (0.5.23: update_finish_state).
ABORT_FLAGS = ("self.to_finish", "self.to_abort")
FINISH_CHECKS = ("check_finished", "update_finish_state")


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


def find_function(
    tree: ast.Module, names: tuple[str, ...]
) -> ast.FunctionDef | ast.AsyncFunctionDef | None:
    """The first function or method named one of `names` (a method's names across a
    rename)."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name in names:
            return node
    return None


def abort_problems(package: Path) -> list[str]:
    """What breaks the abort contract: the route, the scheduler's prefix match, the
    abort flag read before the other finish checks (so a running request aborted on its
    last step still returns that step's token, the end-of-turn one included), and
    output_ids in the reply to a request aborted in the waiting queue."""
    srt = package / "srt"
    sources = {name: srt / path for name, path in ABORT_SOURCES.items()}
    missing = [path for path in sources.values() if not path.exists()]
    if missing:
        return [f"{path.relative_to(package.parent)} is missing" for path in missing]
    problems: list[str] = []
    if not ABORT_ROUTE.search(sources["http_server"].read_text()):
        problems.append("http_server.py has no POST /abort_request route")
    scheduler = sources["scheduler"].read_text()
    abort = find_function(ast.parse(scheduler), ("abort_request",))
    if abort is None or not PREFIX_MATCH.search(ast.get_source_segment(scheduler, abort) or ""):
        problems.append(
            "Scheduler.abort_request does not end every rid starting with the one asked"
        )
    finish = find_function(ast.parse(sources["schedule_batch"].read_text()), FINISH_CHECKS)
    # Its finish checks in order, less the guard of a request already finished.
    body = finish.body if finish else []
    checks = [ast.unparse(node.test) for node in body if isinstance(node, ast.If)]
    checks = [test for test in checks if test != "self.finished()"]
    if not checks or not checks[0].startswith(ABORT_FLAGS):
        problems.append(
            "Req.check_finished does not read the abort flag (to_finish) before its length "
            "and EOS checks: an abort on the last step would not return that step's token"
        )
    manager = ast.parse((srt / "managers" / "tokenizer_manager.py").read_text())
    handler = find_function(manager, ("_handle_abort_req",))
    keys = [
        key.value
        for node in (ast.walk(handler) if handler else ())
        if isinstance(node, ast.Dict)
        for key in node.keys
        if isinstance(key, ast.Constant)
    ]
    if "output_ids" not in keys:
        problems.append(
            "the reply to a request aborted in the waiting queue "
            "(TokenizerManager._handle_abort_req) has no output_ids"
        )
    return problems


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
    return problems + abort_problems(package)


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
