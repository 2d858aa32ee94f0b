"""The front door holds: README.md is a page a newcomer reads, every link of it and of docs/ resolves (files and
anchors), every config key the docs name exists in the schema, and the pages stay short."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
PAGES = [REPO / "README.md", REPO / "config/README.md", *sorted((REPO / "docs").glob("*.md"))]
SCHEMA = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
SECTIONS = ("dataset", "model", "tokenize", "train", "preference", "eval", "export")
KEY = re.compile(rf"`((?:{'|'.join(SECTIONS)})(?:\.[a-z_0-9]+)+)")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    return re.sub(r"\s", "-", re.sub(r"[^\w\s-]", "", text))


def anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


def schema_keys(node: dict, path: tuple[str, ...] = ()) -> set[str]:
    """Every key of the schema, leaves and sections, dotted ($refs followed; preference.train's are train's)."""
    if "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    out = {".".join(path)} if path else set()
    for name, child in node.get("properties", {}).items():
        out |= schema_keys(child, (*path, name))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_links_resolve(page):
    broken = []
    for target in LINK.findall(re.sub(r"```.*?```", "", page.read_text(), flags=re.S)):
        if target.startswith(("http://", "https://", "mailto:")):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            broken.append(f"{target}: no heading with that anchor")
    assert not broken, f"{page.relative_to(REPO)}: {broken}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_config_keys_the_docs_name_exist(page):
    known = schema_keys(SCHEMA)
    files = ("parquet", "json", "jsonl", "csv", "py", "yaml", "md", "gguf", "log")
    named = {m.group(1) for m in KEY.finditer(page.read_text()) if m.group(1).rsplit(".", 1)[-1] not in files}
    unknown = sorted(k for k in named if k not in known)
    assert not unknown, f"{page.relative_to(REPO)} names config keys the schema does not have: {unknown}"


def test_pages_stay_short():
    assert len((REPO / "README.md").read_text().splitlines()) < 250
    long = {p.name: n for p in (REPO / "docs").glob("*.md") if (n := len(p.read_text().splitlines())) >= 400}
    assert not long, f"docs pages of 400 lines or more, split them by topic: {long}"


def test_the_readme_starts_with_the_two_commands_and_the_report():
    """The quick start is the first section: the two commands and where the result is."""
    readme = (REPO / "README.md").read_text()
    first = readme.split("\n## ")[1]
    assert first.startswith("Quick start") and "make run" in first and "make test" in first
    assert "results/report/index.html" in first
