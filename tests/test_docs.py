"""The documentation: README.md stays short; every relative link in README.md and docs/*.md
points at a file that exists and, with ``#anchor``, at a heading in it; every path a
docstring or comment of gpuwatchd/, bench/ and examples/ cites exists; and no file of the
repository refers to a path outside it (a plain clone carries everything it uses)."""

from __future__ import annotations

import re
from pathlib import Path
from urllib.parse import unquote

import pytest

REPO = Path(__file__).resolve().parent.parent
README = REPO / "README.md"
DOCUMENTS = [README, *sorted((REPO / "docs").glob("*.md"))]

# [text](target) outside code; images too. Autolinks and reference links are not used here.
_LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
_FENCE = re.compile(r"^(```|~~~)")
_CODE_SPAN = re.compile(r"`[^`\n]*`")


def _prose(text: str) -> list[str]:
    """The lines of ``text`` outside fenced code blocks, with code spans blanked."""
    lines, fenced = [], False
    for line in text.splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        if not fenced:
            lines.append(_CODE_SPAN.sub(lambda m: "`" + "x" * (len(m.group()) - 2) + "`", line))
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lowercase, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())  # links keep their text
    text = text.lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every heading anchor of a Markdown file, with GitHub's -1, -2 suffixes for repeats."""
    seen: dict[str, int] = {}
    result = set()
    fenced = False
    for line in path.read_text(encoding="utf-8").splitlines():
        if _FENCE.match(line.lstrip()):
            fenced = not fenced
            continue
        match = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if fenced or not match:
            continue
        base = slug(match.group(1))
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


def links(path: Path) -> list[str]:
    """The relative link targets of a Markdown file (no scheme, no mailto)."""
    found = []
    for line in _prose(path.read_text(encoding="utf-8")):
        for target in _LINK.findall(line):
            if not re.match(r"[a-z][a-z0-9+.-]*:", target):
                found.append(target)
    return found


def test_readme_is_under_20_kib() -> None:
    assert README.stat().st_size < 20 * 1024


def test_the_docs_exist_and_the_readme_links_to_each() -> None:
    names = {p.name for p in DOCUMENTS[1:]}
    assert {
        "policies.md",
        "policy-reference.md",
        "protocol.md",
        "managed-jobs.md",
        "journal.md",
        "configuration.md",
        "cli.md",
        "hook.md",
        "logging.md",
    } <= names
    linked = {Path(t.split("#")[0]).name for t in links(README)}
    missing = {n for n in names if n not in linked and not n.endswith("-internals.md")}
    assert not missing, f"README.md does not link to {sorted(missing)}"


@pytest.mark.parametrize("document", DOCUMENTS, ids=lambda p: p.relative_to(REPO).as_posix())
def test_every_relative_link_and_anchor_resolves(document: Path) -> None:
    broken = []
    for target in links(document):
        file_part, _, anchor = target.partition("#")
        dest = (document.parent / unquote(file_part)).resolve() if file_part else document
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif REPO not in dest.parents and dest != REPO:
            broken.append(f"{target}: outside the repository")
        elif anchor and (dest.suffix != ".md" or unquote(anchor) not in anchors(dest)):
            broken.append(f"{target}: no heading #{anchor} in {dest.relative_to(REPO)}")
    assert not broken, f"{document.relative_to(REPO)}: " + "; ".join(broken)


def test_the_checker_finds_broken_links_and_anchors(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "# Title: the `one`\n\n## Two words\n\n## Two words\n\n"
        "[a](page.md#title-the-one) [b](#two-words-1) [c](missing.md) `[d](nowhere.md)`\n"
        "```\n[e](also-nowhere.md)\n```\n[f](https://example.org/x) [g](#nope)\n",
        encoding="utf-8",
    )
    assert anchors(page) == {"title-the-one", "two-words", "two-words-1"}
    assert links(page) == ["page.md#title-the-one", "#two-words-1", "missing.md", "#nope"]


# -- paths cited in the code ----------------------------------------------------------------

_CITED = re.compile(
    r"(?<![\w/.~$-])((?:docs|tests|gpuwatchd|bench|examples|policies|systemd|contrib|man)"
    r"/[\w./-]*[\w/])(?![\w<*{$-])"
)
"""A repository path such as ``docs/protocol.md`` or ``tests/test_docs.py`` (not one under
``/etc/gpuwatchd/``, not a pattern such as ``tests/test_daemon_ops_<op>.py``)."""
_BARE_DOC = re.compile(r"(?<![\w/.-])([\w-]+\.md)\b")
"""A Markdown file named without a folder (``design.md``): it must be in docs/ or the root."""
INSTALLED_PATHS = {"gpuwatchd/unitfiles": "systemd", "gpuwatchd/policies": "policies"}
"""Where the wheel installs a repository folder (setup.py's ``package_dir``): cited as the
installed path, checked as the folder it comes from."""
CODE_SUFFIXES = (".py", ".yaml", ".yml", ".sh", ".toml", ".cfg")


def cited_paths(
    root: Path, folders: tuple[str, ...] = ("gpuwatchd", "bench", "examples")
) -> list[str]:
    """``file:line: path`` for every repository path cited in the code files of ``folders``
    (docstrings, comments, help texts) that does not exist under ``root``, or whose
    ``#anchor`` is no heading of that Markdown file."""
    missing = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*")):
            if path.suffix not in CODE_SUFFIXES or not path.is_file():
                continue
            where = path.relative_to(root).as_posix()
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
                for match in _CITED.finditer(line):
                    cited = match.group(1).rstrip("./")
                    for installed, source in INSTALLED_PATHS.items():
                        if cited == installed or cited.startswith(installed + "/"):
                            cited = source + cited[len(installed) :]
                    anchor = re.match(r"#([\w-]+)", line[match.end() :])
                    if not (root / cited).exists():
                        missing.append(f"{where}:{number}: {match.group(1)}")
                    elif (
                        anchor and cited.endswith(".md") and anchor[1] not in anchors(root / cited)
                    ):
                        missing.append(f"{where}:{number}: {match.group(1)}{anchor[0]}")
                for match in _BARE_DOC.finditer(line):
                    name = match.group(1)
                    if not any(
                        p.is_file() for p in (root / "docs" / name, root / name, path.parent / name)
                    ):
                        missing.append(f"{where}:{number}: {name}")
    return missing


def test_every_path_the_code_cites_exists() -> None:
    """``Specification: docs/x.md``, ``see tests/test_y.py``, ``(design.md)``: each is in
    this repository."""
    assert cited_paths(REPO) == []


def test_the_citation_check_finds_missing_paths(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "design.md").write_text("# Design\n")
    (tmp_path / "systemd").mkdir()
    (tmp_path / "gpuwatchd").mkdir()
    (tmp_path / "gpuwatchd" / "a.py").write_text(
        '"""Spec: docs/design.md#design and design.md; also docs/daemon.md, docs/design.md#no."""\n'
        "# see tests/test_a.py, gpuwatchd/unitfiles/ and /etc/gpuwatchd/policies.d\n"
        "# one per op: tests/test_daemon_ops_<op>.py; old notes in notes.md\n"
    )
    assert cited_paths(tmp_path, ("gpuwatchd",)) == [
        "gpuwatchd/a.py:1: docs/daemon.md",
        "gpuwatchd/a.py:1: docs/design.md#no",
        "gpuwatchd/a.py:2: tests/test_a.py",
        "gpuwatchd/a.py:3: notes.md",
    ]


# -- nothing outside the repository ----------------------------------------------------------

_OUTSIDE = (
    re.compile(r"(?:\.\./)+shared\b"),
    re.compile(r"\b(?:REPO|ROOT|REPO_ROOT|REPOSITORY)\.parent\b"),
    re.compile(r"(?<![\w.~-])/work/"),
)
"""The shared folder beside the checkout, a path built above the repository's root, this
workplace's root folder."""
_UP = re.compile(r"(?<![\w.])((?:\.\./)+)")
RECORDED = ("tests/data/",)
"""Recorded outputs (tracebacks captured on a GPU machine) quote that machine's paths: they
are data, not references, and are not scanned."""
SKIPPED_DIRS = {
    ".git",
    ".venv",
    "__pycache__",
    "build",
    "dist",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    ".whl",
}


def outside_references(root: Path) -> list[str]:
    """``file:line: text`` for every reference in a text file under ``root`` to a path
    outside it: one of :data:`_OUTSIDE`, or a ``../`` chain climbing above the root from
    the file's folder."""
    found = []
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if (
            not path.is_file()
            or SKIPPED_DIRS & set(rel.parts)
            or any(p.endswith(".egg-info") for p in rel.parts)
            or rel.as_posix().startswith(RECORDED)
            or path.name == "test_docs.py"  # the patterns themselves
        ):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # binary (images, wheels)
        depth = len(rel.parts) - 1
        for number, line in enumerate(text.splitlines(), 1):
            hits = [m.group() for pattern in _OUTSIDE for m in pattern.finditer(line)]
            hits += [m.group() for m in _UP.finditer(line) if m.group().count("../") > depth]
            found.extend(f"{rel.as_posix()}:{number}: {hit}" for hit in hits)
    return found


def test_no_file_refers_to_a_path_outside_the_repository() -> None:
    """A plain ``git clone`` with nothing beside it runs its tests, benches and docs (issue
    21: the traces were read from the shared folder beside the checkout)."""
    assert outside_references(REPO) == []


SHARED = "shared"
"""The outside folder's name, kept apart from ``../`` so this file names no outside path."""


def test_the_outside_check_finds_a_planted_reference(tmp_path: Path) -> None:
    (tmp_path / "tests" / "data").mkdir(parents=True)
    (tmp_path / "docs").mkdir()
    (tmp_path / "tests" / "conftest.py").write_text(
        f'TRACES = REPO.parent / "{SHARED}" / "traces"\nOK = "../x.csv"\n'
    )
    (tmp_path / "docs" / "a.md").write_text(f"see [t](../../{SHARED}/t.csv) and /work/main/x\n")
    (tmp_path / "tests" / "data" / "trace.txt").write_text("File /work/main/x.py\n")
    (tmp_path / "b.sh").write_text(f"cp ../{SHARED}/traces/*.csv .\n")
    assert outside_references(tmp_path) == [
        f"b.sh:1: ../{SHARED}",
        "b.sh:1: ../",
        f"docs/a.md:1: ../../{SHARED}",
        "docs/a.md:1: /work/",
        "docs/a.md:1: ../../",
        "tests/conftest.py:1: REPO.parent",
    ]
