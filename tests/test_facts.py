"""The repository stands alone: the package and docs/ cite the facts they rely on from docs/ (with their sources),
never from a file outside the repository that a user's clone does not have; and no code, test, script or benchmark
reads or cites one (bench/RESULTS.md's dated log is the record of its day, kept as written)."""

from __future__ import annotations

import re

from snaketune import keys

REPO = keys.PACKAGE_DIR.parents[1]
OUTSIDE = re.compile(r"\.\./shared|FACTS\.md|[\"']shared[\"'] */|/work/|\.library/")
"""../shared and its FACTS.md, a path built to it (`parents[2] / "shared" / ...`), and this machine's own folders."""
CODE = ("*.py", "*.sh", "*.smk", "Snakefile", "Makefile", "*.yaml", "run")


def _texts():
    """The package and docs/: what cites docs/."""
    for path in sorted([*keys.PACKAGE_DIR.rglob("*.py"), *(REPO / "docs").rglob("*.md")]):
        yield path.relative_to(REPO).as_posix(), path.read_text()


def _everything():
    """What could read or cite a file outside: the package, docs/, the rules, tests, scripts and benchmarks."""
    paths = [*keys.PACKAGE_DIR.rglob("*.py"), *(REPO / "docs").rglob("*.md")]
    for top in ("tests", "scripts", "bench", "workflow", ".ci"):
        paths += [
            p
            for pattern in CODE
            for p in (REPO / top).rglob(pattern)
            if "log" not in p.relative_to(REPO).parts
        ]
    paths += [REPO / "Makefile", REPO / "Snakefile", REPO / "README.md", REPO / "bench/README.md"]
    for path in sorted(set(paths)):
        if path.is_file() and path.name != "test_facts.py":  # this file names the patterns
            yield path.relative_to(REPO).as_posix(), path.read_text()


def test_nothing_cites_a_file_outside_the_repository():
    found = [
        f"{rel}:{text[: m.start()].count(chr(10)) + 1}"
        for rel, text in _everything()
        for m in OUTSIDE.finditer(text)
    ]
    assert not found, f"citations of files outside the repository (cite docs/ instead): {found}"


def test_every_cited_doc_exists():
    cited = {(rel, m.group(0)) for rel, text in _texts() for m in re.finditer(r"\bdocs/[\w./-]+\.md", text)}
    assert cited, "the package cites no docs/ file: the check would see nothing"
    missing = sorted(f"{rel} -> {doc}" for rel, doc in cited if not (REPO / doc).is_file())
    assert not missing, f"cited but absent: {missing}"
