"""The documentation hangs together: every relative link points at a file that exists and, with
an anchor, at a heading of that file (GitHub's anchor rules); the README stays a first page."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = sorted([ROOT / "README.md", ROOT / "CONTRIBUTING.md", ROOT / "CHANGELOG.md",
                ROOT / "benchmarks" / "NOTEBOOK.md", *(ROOT / "docs").glob("*.md")])

_LINK_RE = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_FENCE_RE = re.compile(r"^```.*?^```", re.M | re.S)


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lowercased, punctuation dropped, spaces to hyphens."""
    text = _FENCE_RE.sub("", path.read_text("utf-8"))
    found = set()
    for heading in re.findall(r"^#{1,6} +(.+?) *$", text, re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(slug)
    return found


def links(path: Path) -> list[str]:
    text = _FENCE_RE.sub("", path.read_text("utf-8"))
    return [target for target in _LINK_RE.findall(text)
            if not re.match(r"^[a-z]+:", target)]  # http(s)://, mailto: are not checked here


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    assert links(page), "a page without links"
    for target in links(page):
        file_part, _, anchor = target.partition("#")
        linked = (page.parent / file_part).resolve() if file_part else page
        assert linked.exists(), f"{page.name}: {target} does not exist"
        if anchor:
            assert linked.suffix == ".md", target
            assert anchor in anchors(linked), f"{page.name}: no heading for #{anchor} in {linked.name}"


def test_readme_is_a_first_page() -> None:
    lines = (ROOT / "README.md").read_text("utf-8").splitlines()
    # What it is, the two commands, producing, consuming, how it works, the headline figures
    # and where to read on: a page a user reads through, everything else in docs/.
    assert len(lines) <= 220
    headings = [line[3:] for line in lines if line.startswith("## ")]
    for needed in ("Requirements", "Quick start", "Producing events", "Consuming events",
                   "How it works", "Performance"):
        assert needed in headings, needed
    for page in ("configuration", "operations", "protocol", "reliability", "performance"):
        assert f"(docs/{page}.md" in "\n".join(lines), page
