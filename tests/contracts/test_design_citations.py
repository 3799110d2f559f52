"""Every section of the design (docs/design/) a comment or docstring cites exists in
the file it names: the code's reasons point at text a reader can find
(`docs/design/FILE.md, "Section"`, `docs/design/FILE.md "Section"` or
`docs/design/FILE.md, Section`, a citation running
on over its comment's next lines). The design's front page stays short."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DESIGN = REPO / "docs" / "design"
SOURCES = ("common", "consumers", "producer", "regen", "deploy", "scripts", "bench", "tests")
# A citation: the file's path, then ", " or ": ", then the section, quoted or not.
CITATION = re.compile(
    r"docs/design/(?P<file>[\w.-]+\.md)"
    r'(?:[,:] ?(?:"(?P<quoted>[^"]+)"|(?P<bare>[^)"]+))| "(?P<spaced>[^"]+)")'
)
# Comment markers and indentation between the lines a citation runs over.
LINE_BREAK = re.compile(r"\s*\n\s*(?:#\s*)?")
# A paragraph's bold lead-in names a section too: **Behind SGLang's router.**
LEAD_IN = re.compile(r"^\*\*([^*]+?)\.\*\*", re.M)
# The front page is read in one sitting (docs/design/README.md).
FRONT_PAGE_LINES = 150


def headings(name: str) -> list[str]:
    """One design file's headings and its paragraphs' bold lead-ins."""
    text = (DESIGN / name).read_text()
    titled = [line.lstrip("#").strip() for line in text.splitlines() if line.startswith("#")]
    return titled + LEAD_IN.findall(text)


def citations() -> list[tuple[str, str, str]]:
    """(file, design file, cited section) for every citation in the tree's Python, YAML
    and shell files."""
    found = []
    for folder in SOURCES:
        for path in sorted((REPO / folder).rglob("*")):
            if path.suffix not in (".py", ".yml", ".yaml", ".sh") or ".venv" in path.parts:
                continue
            if path == Path(__file__):
                continue  # its own docstring shows the forms
            text = LINE_BREAK.sub(" ", path.read_text(errors="replace"))
            for match in CITATION.finditer(text):
                cited = (
                    match["quoted"] or match["spaced"] or match["bare"].split(".")[0].split(";")[0]
                )
                found.append((str(path.relative_to(REPO)), match["file"], cited.strip()))
    return found


def test_every_cited_section_of_the_design_exists_in_the_file_cited() -> None:
    cites = citations()
    assert len(cites) > 50, "the citation pattern finds the code's citations"
    files = {p.name for p in DESIGN.glob("*.md")}
    missing = [
        (where, name, cited)
        for where, name, cited in cites
        if name not in files or not any(cited == h or cited.startswith(h) for h in headings(name))
    ]
    assert missing == [], f"cited, not a section of that design file: {missing}"


def test_no_citation_names_the_old_single_file() -> None:
    old = "docs/" + "design.md"
    naming = [
        str(path.relative_to(REPO))
        for folder in (*SOURCES, "docs")
        for path in (REPO / folder).rglob("*")
        if path.is_file()
        and path.suffix in (".py", ".md", ".yml", ".yaml", ".sh")
        and ".venv" not in path.parts
        and old in path.read_text(errors="replace")
    ]
    assert naming == []


def test_the_front_page_is_short_and_lists_every_design_file() -> None:
    front = (DESIGN / "README.md").read_text()
    assert len(front.splitlines()) <= FRONT_PAGE_LINES
    listed = set(re.findall(r"^\| ([\w-]+\.md) \|", front, re.M))
    assert listed == {p.name for p in DESIGN.glob("*.md")} - {"README.md"}


LAYOUT_ROW = re.compile(r"^\| `([a-z_/]+/)` \| (.*) \|$", re.MULTILINE)


def test_the_layout_table_names_every_module_and_only_modules_that_exist() -> None:
    """The design's Layout table (docs/design/README.md) has a row per top-level folder;
    each names every module under its folder (as `name.py`), and every `name.py` it names
    is there."""
    rows = dict(LAYOUT_ROW.findall((DESIGN / "README.md").read_text()))
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


DECISION_LINES = 10


def test_each_decision_is_short() -> None:
    """A design file's decisions (its `## Decisions`) say what was chosen and why in at
    most ten lines each; the runs behind them are in bench/README.md."""
    long = {}
    for path in sorted(DESIGN.glob("*.md")):
        _, _, decisions = path.read_text().partition("\n## Decisions\n")
        for section in re.split(r"(?m)^### ", decisions)[1:]:
            title, _, body = section.partition("\n")
            lines = [line for line in body.splitlines() if line.strip()]
            if len(lines) > DECISION_LINES:
                long[f"{path.name}: {title}"] = len(lines)
    assert long == {}
