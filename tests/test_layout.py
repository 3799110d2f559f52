"""The layout shows the flow (docs/design.md, Layout): the producer and what the stages
share never reach into a consumer."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def imported_modules(folder: Path) -> dict[str, set[str]]:
    found = {}
    for path in sorted(folder.glob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[path.name] = names
    return found


def test_neither_the_producer_nor_common_imports_a_consumer() -> None:
    for folder in ("producer", "common"):
        modules = imported_modules(REPO / folder)
        assert modules, folder
        reaching = {
            name: sorted(m for m in imported if m.startswith("regen.consumers"))
            for name, imported in modules.items()
        }
        assert {name: m for name, m in reaching.items() if m} == {}, folder
