"""Relative links in README.md, SECURITY.md and docs/ point at files of this repository that
exist, and at headings they have: a clone has nothing beside it (a link to ``../shared/``
resolved on the machine it was written on and nowhere else).

Anchors are GitHub's: the heading lowercased, punctuation other than ``-`` and ``_`` dropped,
spaces turned into ``-``. Links inside fenced code blocks and to other sites are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+)$", re.MULTILINE)


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {
        re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in HEADING.findall(text)
    }


def _links(page: Path) -> list[str]:
    text = FENCE.sub("", page.read_text())
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]


@pytest.mark.parametrize(
    "page", [*PAGES, ROOT / "SECURITY.md"], ids=lambda p: p.relative_to(ROOT).as_posix()
)
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for target in _links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.is_relative_to(ROOT):
            broken.append(f"{target}: outside the repository")
        elif not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no such heading")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme() -> None:
    linked = {t.partition("#")[0] for t in _links(ROOT / "README.md")}
    pages = {f"docs/{p.name}" for p in PAGES[1:]}
    assert pages <= linked, sorted(pages - linked)


def test_the_anchors_product_messages_name_exist() -> None:
    """``CheckpointDirFull`` and ``--keep-steps``'s help send a user to a heading: it must
    stay (a renamed heading would leave them pointing at nothing)."""
    from mtc_replicator.client.torch_io import RAM_DISK_SIZING, CheckpointDirFull
    from mtc_replicator.node.options import make_parser

    page, _, anchor = RAM_DISK_SIZING.partition("#")
    assert anchor in _anchors(ROOT / page)
    full = str(CheckpointDirFull(Path("/ram/checkpoint"), 10, 20))
    assert RAM_DISK_SIZING in full
    assert "--keep-steps" in full
    assert RAM_DISK_SIZING in "".join(make_parser({}).format_help().split())  # wrapped anywhere
