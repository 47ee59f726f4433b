"""The documentation: README.md stays short, and every relative link in README.md and
docs/*.md points at a file that exists and, with ``#anchor``, at a heading in it."""

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
