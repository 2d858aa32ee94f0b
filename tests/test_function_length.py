"""Functions a reader can hold in one screen: no function or method of the package runs over MAX_LINES lines
(docstring and signature included; about 60 is the aim, tests/test_layout.py holds modules to 500), and no line is
kept from the formatter with `# fmt: skip` (a statement folded by hand to pass a length test is as long as before)."""

from __future__ import annotations

import ast

from snaketune import keys

MAX_LINES = 80


def _files():
    return sorted(p for p in keys.PACKAGE_DIR.rglob("*.py"))


def _long_functions(path) -> dict[str, int]:
    tree = ast.parse(path.read_text())
    return {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.end_lineno - node.lineno + 1 > MAX_LINES
    }


def test_no_function_runs_over_a_screen():
    over = {}
    for path in _files():
        rel = path.relative_to(keys.PACKAGE_DIR).as_posix()
        over.update({f"{rel}:{name}": n for name, n in _long_functions(path).items()})
    assert not over, f"functions over {MAX_LINES} lines, to split along their seams: {over}"


def test_the_formatter_decides_every_line():
    found = {}
    for path in _files():
        rel = path.relative_to(keys.PACKAGE_DIR).as_posix()
        n = path.read_text().count("# fmt: skip")
        if n:
            found[rel] = n
    assert not found, f"'# fmt: skip' per file: {found}"


def test_the_length_check_sees_a_long_function(tmp_path):
    """The check counts what a reader sees: a function of MAX_LINES + 1 lines fails, one of MAX_LINES passes."""
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_LINES - 1))
    (tmp_path / "ok.py").write_text(f"def f():\n{body}\n")
    (tmp_path / "long.py").write_text(f"def g():\n{body}\n    return x0\n")
    assert _long_functions(tmp_path / "ok.py") == {}
    assert _long_functions(tmp_path / "long.py") == {"g": MAX_LINES + 1}
