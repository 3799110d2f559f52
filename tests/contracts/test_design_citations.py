"""Every section of docs/design.md a comment or docstring cites exists: the code's
reasons point at text a reader can find (`docs/design.md, "Section"` or
`docs/design.md, Section`, a citation running on over its comment's next lines)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design.md"
SOURCES = ("common", "consumers", "producer", "regen", "deploy", "scripts", "bench", "tests")
# A citation: the file's name, then ", " or ": ", then the section, quoted or not.
CITATION = re.compile(r'docs/design\.md[,:] ?(?:"(?P<quoted>[^"]+)"|(?P<bare>[^)"]+))')
# Comment markers and indentation between the lines a citation runs over.
LINE_BREAK = re.compile(r"\s*\n\s*(?:#\s*)?")


# A paragraph's bold lead-in names a section too: **Behind SGLang's router.**
LEAD_IN = re.compile(r"^\*\*([^*]+?)\.\*\*", re.M)


def headings() -> list[str]:
    """The design's headings and its paragraphs' bold lead-ins."""
    text = DESIGN.read_text()
    titled = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return titled + LEAD_IN.findall(text)


def citations() -> list[tuple[str, str]]:
    """(file, cited section) for every citation in the tree's Python and YAML files."""
    found = []
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".yml", ".yaml", ".sh") or ".venv" in path.parts:
                continue
            if path == Path(__file__):
                continue  # its own docstring shows the forms
            text = LINE_BREAK.sub(" ", path.read_text(errors="replace"))
            for match in CITATION.finditer(text):
                cited = match["quoted"] or match["bare"].split(".")[0].split(";")[0]
                found.append((str(path.relative_to(REPO)), cited.strip()))
    return found


def test_every_cited_section_of_the_design_exists() -> None:
    names = headings()
    cites = citations()
    assert len(cites) > 50, "the citation pattern finds the code's citations"
    missing = [
        (where, cited)
        for where, cited in cites
        if not any(cited == name or cited.startswith(name) for name in names)
    ]
    assert missing == [], f"cited, not a section of docs/design.md: {missing}"


LAYOUT_ROW = re.compile(r"^\| `([a-z_/]+/)` \| (.*) \|$", re.MULTILINE)


def test_the_layout_table_names_every_module_and_only_modules_that_exist() -> None:
    """docs/design.md's Layout table has a row per top-level folder; each names every
    module under its folder (as `name.py`), and every `name.py` it names is there."""
    rows = dict(LAYOUT_ROW.findall((REPO / "docs" / "design.md").read_text()))
    assert set(rows) == {
        "producer/",
        "consumers/generate/",
        "consumers/tokenize/",
        "common/",
        "regen/",
    }
    unnamed, unknown = {}, {}
    for folder, text in rows.items():
        # A module by its name; a path (tests/contracts/test_layout.py) names no module of the row.
        named = set(re.findall(r"(?<![\w/.])([A-Za-z_]+\.py)", text))
        modules = {p.name for p in (REPO / folder).rglob("*.py") if p.name != "__init__.py"}
        if modules - named:
            unnamed[folder] = sorted(modules - named)
        if named - modules:
            unknown[folder] = sorted(named - modules)
    assert unnamed == {}, "modules the Layout table leaves out"
    assert unknown == {}, "modules the Layout table names that are not in the tree"
