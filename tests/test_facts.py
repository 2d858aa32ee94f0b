"""The repository stands alone: the package and docs/ cite the facts they rely on from docs/ (with their sources),
never from a file outside the repository that a user's clone does not have."""

from __future__ import annotations

import re

from snaketune import keys

REPO = keys.PACKAGE_DIR.parents[1]
OUTSIDE = re.compile(r"\.\./shared|FACTS\.md")


def _texts():
    for path in sorted([*keys.PACKAGE_DIR.rglob("*.py"), *(REPO / "docs").rglob("*.md")]):
        yield path.relative_to(REPO).as_posix(), path.read_text()


def test_nothing_cites_a_file_outside_the_repository():
    found = [
        f"{rel}:{text[: m.start()].count(chr(10)) + 1}"
        for rel, text in _texts()
        for m in OUTSIDE.finditer(text)
    ]
    assert not found, f"citations of files outside the repository (cite docs/ instead): {found}"


def test_every_cited_doc_exists():
    cited = {(rel, m.group(0)) for rel, text in _texts() for m in re.finditer(r"\bdocs/[\w./-]+\.md", text)}
    assert cited, "the package cites no docs/ file: the check would see nothing"
    missing = sorted(f"{rel} -> {doc}" for rel, doc in cited if not (REPO / doc).is_file())
    assert not missing, f"cited but absent: {missing}"
