"""The package's layout holds: layers in the order the data flows, each importing only the layers before it, no
import circle, empty __init__.py files, absolute imports only, no module over 500 lines, and no torch in the
stages that run in the Snakefile and on login nodes (config, data, plan, report). And the tests': no test module
imports another."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys

import pytest

from snaketune import keys

LAYERS = (
    (
        "snaketune.io",
        "snaketune.backups",
        "snaketune.verify",
        "snaketune.cuda_driver",
        "snaketune.gpus",
        "snaketune.device_memory",
        "snaketune.host_heap",
    ),  # infrastructure every stage uses
    ("snaketune.config",),  # allowed values, dataclasses, loading, DeepSpeed files
    ("snaketune.keys", "snaketune.provenance", "snaketune.hub"),  # cache names, job records, pinned revisions
    ("snaketune.data",),  # download -> tokenized pairs
    ("snaketune.model",),  # building blocks of training, reference and evaluation
    ("snaketune.plan",),  # the memory plan
    ("snaketune.train",),  # launcher and ranks
    ("snaketune.preference",),  # reference log-probs and DPO
    ("snaketune.evaluation",),
    ("snaketune.export",),  # GGUF files (llama.cpp), measured
    ("snaketune.benchmark",),  # lm-evaluation-harness on the models and the GGUF files
    ("snaketune.report",),
)
"""Each layer may import itself and the layers above it in this list, never one below."""
NO_TORCH = (
    "snaketune.io",
    "snaketune.backups",
    "snaketune.verify",
    "snaketune.cuda_driver",
    "snaketune.gpus",
    "snaketune.device_memory",
    "snaketune.host_heap",
    "snaketune.config",
    "snaketune.keys",
    "snaketune.hub",
    "snaketune.data",
    "snaketune.plan",
    "snaketune.report",
)
"""What the Snakefile imports and what runs on a login node or in the data job: torch takes seconds to import and
a GPU build's libraries there."""
MAX_LINES = 500


def modules() -> list[str]:
    return sorted(
        ".".join(p.relative_to(keys.PACKAGE_DIR.parent).with_suffix("").parts)
        for p in keys.PACKAGE_DIR.rglob("*.py")
        if p.name != "__init__.py"
    )


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} belongs to no layer of LAYERS: place it there")


@pytest.mark.parametrize("module", modules())
def test_imports_follow_the_layers(module):
    mine = layer(module)
    upward = [m for m in keys.imported_modules(module) if layer(m) > mine]
    assert not upward, f"{module} (layer {mine}: {LAYERS[mine]}) imports {upward}, from a later layer"


def test_no_import_circle():
    graph = {m: keys.imported_modules(m) for m in modules()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(module: str, path: list[str]) -> None:
        state[module] = 1
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                raise AssertionError("import circle: " + " -> ".join([*path[path.index(dep) :], dep]))
            if dep not in state:
                visit(dep, [*path, dep])
        state[module] = 2

    for module in graph:
        if module not in state:
            visit(module, [module])


def test_packages_are_empty_and_imports_absolute():
    for init in keys.PACKAGE_DIR.rglob("__init__.py"):
        assert init.read_text() == "", f"{init}: an __init__.py stays empty (imports name the module)"
    for module in modules():
        tree = ast.parse(keys.module_path(module).read_text())
        relative = [n.lineno for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level]
        assert not relative, f"{module}: relative import on line(s) {relative}"


def test_modules_stay_short():
    long = {m: n for m in modules() if (n := len(keys.module_path(m).read_text().splitlines())) > MAX_LINES}
    assert not long, f"modules over {MAX_LINES} lines, to split along a seam: {long}"


def test_layers_name_every_subpackage():
    packages = {p.parent for p in keys.PACKAGE_DIR.rglob("__init__.py")} - {keys.PACKAGE_DIR}
    named = {n for names in LAYERS for n in names}
    for p in packages:
        assert ".".join(p.relative_to(keys.PACKAGE_DIR.parent).parts) in named, p


def test_the_snakefile_and_login_node_stages_never_import_torch():
    """Importing every module of config, data, plan and report (what the Snakefile and the plan rule load) leaves
    torch unloaded; tests/test_reproducibility.py checks the same of their jobs as they ran (provenance records)."""
    light = [m for m in modules() if any(m == n or m.startswith(n + ".") for n in NO_TORCH)]
    code = (
        f"import sys, json; sys.path.insert(0, {str(keys.PACKAGE_DIR.parent)!r})\n"
        f"for m in {light!r}: __import__(m)\n"
        "print(json.dumps([m for m in ('torch', 'deepspeed', 'peft') if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [], f"importing {light} loads torch"


def test_the_layout_page_names_every_module():
    """docs/layout.md lists each subpackage's modules on its own entry ("  data/   messages, readers, ...",
    continued on the lines below it) and each top-level module as a file name ("io.py"): a new module appears
    there, or the page has drifted from the package (it had: seven modules were missing before this test)."""
    readme = (keys.PACKAGE_DIR.parents[1] / "docs/layout.md").read_text()
    block = readme.split("```")[1]
    entries: dict[str, str] = {}  # "data" -> its text; "" -> the top-level modules' lines
    current = None
    for line in block.splitlines():
        if match := re.match(r"^  (\w+)/\s", line):  # a subpackage's entry under workflow/snaketune/
            current = match.group(1)
        elif match := re.match(r"^  \w+\.py\s", line):  # top-level modules
            current = ""
        elif line[:1].strip():  # the next top-level path of the repository
            current = None
        if current is not None:
            entries[current] = entries.get(current, "") + " " + line
    missing = []
    for m in modules():
        parts = m.split(".")[1:]
        where, name = (parts[0], parts[1]) if len(parts) == 2 else ("", parts[0] + ".py")
        if not re.search(rf"(?<![\w.]){re.escape(name)}(?![\w])", entries.get(where, "")):
            missing.append(m)
    assert not missing, f"docs/layout.md does not name {missing} in its subpackage's entry"


def _private_uses(path) -> list[str]:
    """`from snaketune.x import _name` and `module._name` (module: a snaketune module imported by name) in a file."""
    tree = ast.parse(path.read_text())
    modules_by_alias: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("snaketune"):
            for alias in node.names:
                if alias.name.startswith("_") and not alias.name.startswith("__"):
                    found.append(f"{path.name}:{node.lineno} imports {node.module}.{alias.name}")
                elif keys.module_path(f"{node.module}.{alias.name}"):
                    modules_by_alias[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("snaketune.") and alias.asname:
                    modules_by_alias[alias.asname] = alias.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in modules_by_alias
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
        ):
            found.append(f"{path.name}:{node.lineno} uses {modules_by_alias[node.value.id]}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names():
    """What one module of the package (or a Snakemake script) uses of another is public and named for what it is: a
    leading underscore says "only this module relies on it", which a change to that module may then break unseen."""
    files = [keys.module_path(m) for m in modules()]
    files += sorted((keys.PACKAGE_DIR.parent / "scripts").glob("*.py"))
    found = [use for path in files for use in _private_uses(path)]
    assert not found, "private names used outside their module:\n" + "\n".join(found)


def test_no_test_module_imports_another():
    """A test module imports no other test module (`from test_workflow import snakemake` once ran that module's code,
    fixtures included, inside fifteen others): shared helpers live in tests/conftest.py, inputs in the modules
    that build them (chat_data, oasst_trees, ...), which import no test module either."""
    tests = keys.PACKAGE_DIR.parents[1] / "tests"
    found = []
    for path in sorted(tests.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [
                f"{path.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0].startswith("test_")
            ]
    assert not found, "test modules importing test modules:\n" + "\n".join(found)


def test_a_missing_prerequisite_fails_in_ci_and_skips_elsewhere(monkeypatch):
    """conftest.needs: in CI (the CI variable set) a test whose system prerequisite or SLURM cluster is missing
    fails with the reason; on a user's machine it skips with it; with nothing missing it does neither."""
    import conftest

    monkeypatch.setattr(conftest, "IN_CI", True)
    with pytest.raises(pytest.fail.Exception, match="the two-node cluster did not start"):
        conftest.needs("the two-node cluster did not start")
    monkeypatch.setattr(conftest, "IN_CI", False)
    with pytest.raises(pytest.skip.Exception, match="chromium is not installed"):
        conftest.needs("chromium is not installed")
    conftest.needs(None)
    conftest.needs(False)  # `condition and "why"` with the condition false


def test_an_unmarked_test_may_not_start_ranks_or_snakemake_jobs(monkeypatch):
    """conftest.heavy, which run_training, run_reference and conftest.start call: a test without the slow mark
    that starts DeepSpeed ranks or Snakemake jobs fails, naming itself and the mark, so make check's tier stays
    fast as tests are added; a slow one goes on."""
    import conftest

    monkeypatch.setattr(conftest, "_CURRENT", {"id": "tests/test_x.py::test_y", "slow": False})
    with pytest.raises(
        pytest.fail.Exception, match=r"test_x.py::test_y starts DeepSpeed ranks .* not marked slow"
    ):
        conftest.heavy("starts DeepSpeed ranks (run_training)")
    monkeypatch.setattr(conftest, "_CURRENT", {"id": "tests/test_x.py::test_y", "slow": True})
    conftest.heavy("starts DeepSpeed ranks (run_training)")
