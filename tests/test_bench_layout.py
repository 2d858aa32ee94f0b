"""bench/ as a product: every figure the README (and docs/*.md, config/README.md, config/examples/*.yaml) quotes
stands in bench/RESULTS.md's current table, with a command that `python -m bench --list` knows, or in its list of
figures that are stated, not measured; every file of bench/ lives in a folder by topic. Cheap: no GPU, no run.

A figure is a number token near a unit, as the README writes it: `15,784 against 15,362 tokens/s`, `0.8 instead of
4.7 GiB`, `PaLM MFU 0.49 against 0.41`, `3.2x-6.6x`, `+0.2 / +0.3 / +0.7%`, `91.7 against 96.4 ms`, `2 min 32 s`, or a
number in a markdown table column whose header names the unit (`| tokens/s |`)."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "bench/RESULTS.md"

NUM = r"[-+−]?\d[\d,]*(?:\.\d+)?"
LEAD = r"(?<![\w.^/\-−+])"  # not inside a word, a version, a power, a path or a range
CONN = r"\s*(?:/|-|–|against|and|or|to|instead of|vs\.?)\s*"
UNITS = ("tokens/s", "tok/s", "GiB", "ms", "s", "min", "minutes")
SUFFIX = re.compile(
    LEAD + rf"({NUM}(?:{CONN}{NUM})*)\s+(?:generated\s+)?({'|'.join(map(re.escape, UNITS))})(?![\w/])"
)
ATTACHED = re.compile(LEAD + rf"((?:{NUM}\s*/\s*)*{NUM}(?:x?-{NUM})?)(x|%)(?![\w])")
MFU = re.compile(rf"MFU:?\s+({NUM}(?:{CONN}{NUM})*)")


def figure_sources(repo: Path) -> list[Path]:
    """Where the project quotes figures: the README and the pages it links in docs/, config/README.md and the
    comments of the example configs."""
    docs = sorted((repo / "docs").rglob("*.md")) if (repo / "docs").is_dir() else []
    examples = sorted((repo / "config/examples").glob("*.yaml"))
    return [p for p in (repo / "README.md", *docs, repo / "config/README.md", *examples) if p.is_file()]


def prose(path: Path) -> str:
    """The text a reader sees: a YAML file's comments, markdown without emphasis and code marks; one line."""
    text = path.read_text()
    if path.suffix == ".yaml":
        text = "\n".join(line.split("#", 1)[1] for line in text.splitlines() if "#" in line)
    return normalize(text)


def normalize(text: str) -> str:
    return re.sub(r"\s+", " ", text.replace("**", "").replace("`", ""))


def numbers(chain: str) -> list[str]:
    return [n.lstrip("+-−") for n in re.findall(NUM, chain)]


SAME_UNIT = {"tok/s": "tokens/s", "minutes": "min"}


def figures(text: str) -> set[tuple[str, str]]:
    """(number, unit) of every figure in running text."""
    found = set()
    for m in SUFFIX.finditer(text):
        found |= {(n, SAME_UNIT.get(m.group(2), m.group(2))) for n in numbers(m.group(1))}
    for m in ATTACHED.finditer(text):
        found |= {(n, m.group(2)) for n in numbers(m.group(1))}
    for m in MFU.finditer(text):
        found |= {(n, "MFU") for n in numbers(m.group(1))}
    return found


def table_figures(markdown: str) -> set[tuple[str, str]]:
    """(number, unit) of every number in a markdown table column whose header names a unit (a number that the cell
    itself gives another unit, `8,941 (PaLM MFU 0.36)`, keeps that one)."""
    found, header = set(), None
    for line in markdown.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            for name, cell in zip(header, cells, strict=False):
                unit = next((u for u in ("tokens/s", "tok/s", "GiB", "MFU", "ms") if u in name), None)
                if unit:
                    own = figures(normalize(cell))
                    found |= own | {
                        (n, SAME_UNIT.get(unit, unit)) for n in numbers(cell) if n not in {f[0] for f in own}
                    }
    return found


def quoted(path: Path) -> set[tuple[str, str]]:
    found = figures(prose(path))
    if path.suffix == ".md":
        found |= table_figures(path.read_text())
    return found


def covers(cell: str, number: str, unit: str) -> bool:
    """The cell quotes this figure: read as running text, it has this number with this unit."""
    return (number, unit) in figures(normalize(cell))


def markdown_table(text: str, heading: str) -> list[dict[str, str]]:
    """The rows of the first table under `## heading`, as {column: cell}."""
    section = text.split(f"\n## {heading}\n", 1)[1].split("\n## ", 1)[0]
    lines = [line for line in section.splitlines() if line.startswith("|")]
    header = [c.strip() for c in lines[0].strip().strip("|").split("|")]
    return [
        dict(zip(header, [c.strip() for c in line.strip().strip("|").split("|")], strict=True))
        for line in lines[2:]
    ]


def results_tables() -> tuple[list[dict[str, str]], list[dict[str, str]]]:
    text = RESULTS.read_text()
    return markdown_table(text, "Current figures"), markdown_table(text, "Stated, not measured")


def status(row: dict[str, str]) -> str:
    """A current-table row's status word: current, superseded or no (record)."""
    return row["status"].split()[0].rstrip(";:,(")


def quotable_cells(current: list[dict[str, str]], stated: list[dict[str, str]]) -> list[str]:
    """The cells a quoted figure may come from: the value of each current row, and each stated figure but those
    measured without a record. A superseded row stays in the table as the log's pointer to what replaced it, but
    its figures are no longer the project's."""
    return [r["value"] for r in current if status(r) == "current"] + [
        r["value"] for r in stated if "no record" not in r["source"]
    ]


def missing_figures(sources: list[Path], cells: list[str]) -> list[str]:
    """`file: number unit` of each quoted figure that no cell covers."""
    missing = []
    for path in sources:
        where = path.relative_to(REPO) if path.is_relative_to(REPO) else path.name
        missing += [
            f"{where}: {n} {u}" for n, u in sorted(quoted(path)) if not any(covers(c, n, u) for c in cells)
        ]
    return missing


def listed_cases() -> set[str]:
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--list"], cwd=REPO, capture_output=True, text=True, check=True
    )
    return {line.split()[0] for line in out.stdout.splitlines() if line.strip()}


def bench_main():
    sys.path.insert(0, str(REPO))
    return importlib.import_module("bench.__main__")


def test_the_extraction_finds_figures_in_the_readme_and_its_docs_pages(tmp_path):
    """A shorter README that links docs/ pages: the figures of both count, and a figure quoted nowhere in the table
    is reported (so the check below can fail)."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text(
        "Fast: 15,784 against 15,362 tokens/s ([docs/speed.md](docs/speed.md)).\n"
    )
    (tmp_path / "docs/speed.md").write_text(
        "PaLM **MFU 0.49** against 0.41; 3.2x-6.6x the seed recipe; by quarter +0.2 / +0.7%; 8 x 512 tokens; H200; "
        "0.8 instead of 4.7 GiB; 2 min 32 s.\n\n| recipe | tokens/s | peak GiB (plan) |\n|---|---:|---:|\n"
        "| LoRA | 11,425 | 18.68 (18.53) |\n"
    )
    sources = figure_sources(tmp_path)
    assert [p.name for p in sources] == ["README.md", "speed.md"]
    found = set().union(*(quoted(p) for p in sources))
    assert found == {
        ("15,784", "tokens/s"), ("15,362", "tokens/s"), ("0.49", "MFU"), ("0.41", "MFU"), ("3.2", "x"), ("6.6", "x"),
        ("0.2", "%"), ("0.7", "%"), ("0.8", "GiB"), ("4.7", "GiB"), ("2", "min"), ("32", "s"), ("11,425", "tokens/s"),
        ("18.68", "GiB"), ("18.53", "GiB"),
    }  # fmt: skip
    cells = ["15,784 against 15,362 tokens/s, PaLM MFU 0.49 against 0.41", "3.2x-6.6x; +0.2 / +0.7%", "0.8 instead of "
             "4.7 GiB; 2 min 32 s", "11,425 tokens/s, 18.68 GiB (plan 18.53 GiB)"]  # fmt: skip
    assert missing_figures(sources, cells) == []
    assert missing_figures(sources, cells[1:]) == [
        "README.md: 15,362 tokens/s",
        "README.md: 15,784 tokens/s",
        "speed.md: 0.41 MFU",
        "speed.md: 0.49 MFU",
    ]
    # A number without its unit beside it does not quote the figure.
    assert "speed.md: 18.53 GiB" in missing_figures(
        sources, [*cells[:3], "11,425 tokens/s, 18.68 GiB (plan 18.53)"]
    )


def test_a_figure_from_a_superseded_row_or_without_a_record_is_refused(tmp_path):
    """Only a current row's figures may be quoted: a superseded row stays in the table as the pointer to what
    replaced it, and a figure measured without a record (either table) is to be measured again first."""
    (tmp_path / "README.md").write_text(
        "Full fine-tuning at 15,444 tokens/s, 4.95x TRL; before, 4.59x TRL; about 10x slower with offload; "
        "3.5 min to install.\n"
    )
    current = [
        {"value": "15,444 tokens/s, 4.95x TRL (3,120)", "status": "current"},
        {"value": "4.59x TRL (3,435)", "status": "superseded by the row above"},
        {"value": "about 10x slower", "status": "no record: measure it again"},
    ]
    stated = [{"value": "about 3.5 min to install", "source": "a CI log, not kept; no record"}]
    sources = figure_sources(tmp_path)
    assert missing_figures(sources, quotable_cells(current, stated)) == [
        "README.md: 10 x",
        "README.md: 3.5 min",
        "README.md: 4.59 x",
    ]
    # Every cell, whatever its status: nothing missing (what the check accepted before).
    assert missing_figures(sources, [r["value"] for r in current + stated]) == []


def test_every_quoted_figure_stands_in_the_results_tables():
    current, stated = results_tables()
    cells = quotable_cells(current, stated)
    missing = missing_figures(figure_sources(REPO), cells)
    assert not missing, (
        "figures quoted without a current row in bench/RESULTS.md's tables (a superseded row names the figure that "
        "replaces it; a row without a record is to be measured again before it is quoted):\n"
        + "\n".join(missing)
    )


def test_every_row_has_its_record_and_a_command_that_names_a_known_case():
    current, _ = results_tables()
    cases = listed_cases()
    main = bench_main()
    for row in current:
        assert all(row[k] for k in ("figure", "value", "machine", "date", "command", "status")), row
        # One status per row: a row whose figures differ in worth ("current; the estimate is 7.07 since ...") is two
        # rows, or a figure the row no longer stands behind would pass as current.
        assert re.fullmatch(r"current(?: \([^()]*\))?|superseded\b.*|no record\b.*", row["status"]), (
            f"{row['figure']}: status {row['status']!r} is not one of `current` (with a remark in parentheses), "
            "`superseded ...` or `no record ...`: split a row whose figures differ in status"
        )
        commands = re.findall(r"python -m bench ([\w-]+)([^`]*)`", row["command"])
        assert commands, f"no `python -m bench CASE` in {row['command']!r}"
        for name, args in commands:
            assert name in cases, f"{row['figure']}: {name} is not a case of `python -m bench --list`"
            known = main.sub_case_names(main.BY_NAME[name])
            for sub in main.only_values(args.split()):
                assert sub in known, f"{row['figure']}: {name} has no sub-case {sub}"


def test_bench_has_one_entry_point_and_a_folder_per_topic():
    """No file in bench/ outside a topic folder but the entry point and the two documents; every topic folder
    holds what a case runs, and every case's script is there."""
    main = bench_main()
    topics = {c.folder for c in main.CASES if c.folder}
    tracked = subprocess.run(
        ["git", "ls-files", "bench"], cwd=REPO, capture_output=True, text=True, check=True
    )
    files = [Path(f) for f in tracked.stdout.split()] or [
        p.relative_to(REPO)
        for p in (REPO / "bench").rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    ]
    loose = [
        str(f)
        for f in files
        if len(f.parts) == 2 and f.name not in ("__main__.py", "README.md", "RESULTS.md")
    ]
    assert not loose, f"files in bench/ outside a topic folder: {loose}"
    folders = {f.parts[1] for f in files if len(f.parts) > 2}
    assert folders <= topics | {"transport", "log"}, (
        f"folders no case names: {folders - topics - {'transport', 'log'}}"
    )
    for case in main.CASES:
        scripts = [part for part in case.command if part.startswith("bench/")]
        assert all((REPO / s).is_file() for s in scripts), (case.name, scripts)
        assert all(Path(s).parts[1] == case.folder for s in scripts), (case.name, case.folder, scripts)
