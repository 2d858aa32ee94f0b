"""snaketune.keys: a stage's code hash covers every package module the stage runs, and nothing the
Snakefile imports to compute it is heavy."""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from snaketune import keys

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = REPO / "workflow" / "scripts"
RULES = REPO / "workflow" / "rules"
SCRIPT_STAGES = {
    "import_gguf.py": "import_gguf",
    "download.py": "download",
    "conversations.py": "conversations",
    "train_tokenizer.py": "tokenizer",
    "fetch_tokenizer.py": "tokenizer",
    "tokenize_data.py": "tokenize",
    "plan.py": "plan",
    "train.py": "train",
    "preferences.py": "preferences",
    "tokenize_pairs.py": "pairs",
    "reference.py": "reference",
    "dpo.py": "dpo",
    "evaluate.py": "evaluate",
    "export.py": "export",
    "benchmark.py": "benchmark",
    "report.py": "report",
    "benchmark_gate.py": "benchmark_gate",
    "manifest.py": "manifest",
    "verify.py": "verify",
}
"""The stage (keys.STAGE_MODULES) whose code hash each script's rule carries in its params."""
HEAVY = (
    "torch",
    "transformers",
    "deepspeed",
    "datasets",
    "tokenizers",
    "peft",
    "matplotlib",
    "pandas",
    "pyarrow",
    "numpy",
)


def parsed_imports(path: Path) -> set[str]:
    """The snaketune modules a file imports, by Python's own parser."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.startswith("snaketune."))
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "snaketune":
            assert node.level == 0, f"{path}: relative import (keys' scan reads absolute ones only)"
            if node.module == "snaketune" or keys.is_package(node.module):
                found.update(
                    f"{node.module}.{a.name}"
                    for a in node.names
                    if keys.module_path(f"{node.module}.{a.name}")
                )
            else:
                found.add(node.module)
    return found


def package_modules() -> list[str]:
    """Every module of the package and its subpackages (their __init__.py files are empty: test_layout)."""
    return sorted(
        ".".join(p.relative_to(keys.PACKAGE_DIR.parent).with_suffix("").parts)
        for p in keys.PACKAGE_DIR.rglob("*.py")
        if p.name != "__init__.py"
    )


@pytest.mark.parametrize("module", package_modules())
def test_import_scan_agrees_with_the_parser(module):
    assert keys.imported_modules(module) == parsed_imports(keys.module_path(module)) - {module}


def test_stage_modules_are_the_import_closure():
    for stage, entries in keys.STAGE_MODULES.items():
        closure, todo = set(), list(entries)
        while todo:
            module = todo.pop()
            if module not in closure:
                closure.add(module)
                todo += parsed_imports(keys.module_path(module))
        assert set(keys.stage_modules(stage)) == closure, stage


def test_every_script_runs_inside_its_stage():
    scripts = sorted(p.name for p in SCRIPTS.glob("*.py") if p.name != "_stage.py")
    assert sorted(SCRIPT_STAGES) == scripts, (
        "a new script: add it to SCRIPT_STAGES, give its rule a keys.code_hash(<stage>) param and, for a "
        "new stage, an entry in keys.STAGE_MODULES"
    )
    for script, stage in SCRIPT_STAGES.items():
        outside = parsed_imports(SCRIPTS / script) - set(keys.stage_modules(stage))
        assert not outside, f"{script} imports {sorted(outside)}, outside stage {stage!r}"


def test_every_scripted_rule_hashes_its_code():
    """Each rule that runs a script has a code hash in its params, directly or through a helper of
    common*.smk (the workflow tests check that it reaches every job's provenance record)."""
    helpers = "".join(p.read_text() for p in RULES.glob("common*.smk"))
    hashing = {
        name
        for name, body in re.findall(r"^def (\w+)\(.*?\n((?:[ \t]+.*\n|\n)*)", helpers, re.M)
        if "code_hash(" in body
    }
    for rule_file in RULES.glob("*.smk"):
        for name, body in re.findall(r"^rule (\w+):\n((?:[ \t]+.*\n|\n)*)", rule_file.read_text(), re.M):
            if "script:" in body:
                params = body.split("params:", 1)[-1] if "params:" in body else ""
                assert "code_hash(" in params or hashing & set(re.findall(r"\w+", params)), (
                    f"rule {name} ({rule_file.name}) has no code hash in its params"
                )


def test_code_hash_follows_imports(tmp_path, monkeypatch):
    """Through modules and subpackages, in every spelling of an absolute import; an __init__.py is no module."""
    pkg = tmp_path / "snaketune"
    (pkg / "sub" / "deeper").mkdir(parents=True)
    (pkg / "a.py").write_text("from snaketune import b\nfrom snaketune.sub import e, h as h2\n")
    (pkg / "b.py").write_text("def f():\n    from snaketune.c import g\n")
    (pkg / "c.py").write_text("X = 1\n")
    (pkg / "d.py").write_text("Y = 1\n")
    for init in (pkg / "sub" / "__init__.py", pkg / "sub" / "deeper" / "__init__.py"):
        init.write_text("")
    (pkg / "sub" / "e.py").write_text("from snaketune.sub.deeper.f import (\n    x,\n)\n")
    (pkg / "sub" / "h.py").write_text("import snaketune.sub.deeper.i\n")
    (pkg / "sub" / "deeper" / "f.py").write_text("x = 1\n")
    (pkg / "sub" / "deeper" / "i.py").write_text("y = 1\n")
    (pkg / "sub" / "deeper" / "j.py").write_text("z = 1\n")
    monkeypatch.setattr(keys, "PACKAGE_DIR", pkg)
    monkeypatch.setattr(keys, "STAGE_MODULES", {"s": ("snaketune.a",)})
    caches = (keys._source, keys.module_source_hash, keys.imported_modules, keys.stage_modules)

    def fresh_hash():
        for fn in caches:
            fn.cache_clear()
        return keys.code_hash("s")

    try:
        before = fresh_hash()
        assert keys.stage_modules("s") == (
            "snaketune.a",
            "snaketune.b",
            "snaketune.c",
            "snaketune.sub.deeper.f",
            "snaketune.sub.deeper.i",
            "snaketune.sub.e",
            "snaketune.sub.h",
        )
        for unused in ("d.py", "sub/deeper/j.py"):  # not imported
            (pkg / unused).write_text("Y = 2\n")
            assert fresh_hash() == before
        for module in ("c.py", "sub/deeper/f.py", "sub/deeper/i.py"):
            path = pkg / module
            # What cannot change an output keeps the hash: a comment, a docstring, formatting.
            code = path.read_text()
            path.write_text(f'"""A module docstring."""\n# a comment\n\n{code.replace(" = ", "=")}\n')
            assert fresh_hash() == before, module
            path.write_text(code + "W = 3\n")  # code counts
            assert fresh_hash() != before, module
            before = fresh_hash()
    finally:
        for fn in caches:
            fn.cache_clear()


def test_code_hash_ignores_docstrings_not_strings():
    """A docstring of a module, class or function (and a dataclass field's attribute docstring) is dropped; a string
    the code uses is not. No module of the package reads `__doc__`, which would make a docstring behaviour."""
    src = 'import x\n\nclass A:\n    """doc"""\n    f: int = 1\n    """field doc"""\n\n    def g(self):\n        """g"""\n        return "text"\n'
    strip = keys._DropDocstrings()
    dump = lambda code: ast.dump(strip.visit(ast.parse(code)))  # noqa: E731
    assert dump(src) == dump(src.replace('"""doc"""', '"""other"""').replace('"""g"""', "# g"))
    assert dump(src) != dump(src.replace('"text"', '"other text"'))
    # config/fields.py reads the config classes' docstrings as the generated schema's descriptions: the schema is for
    # editors, no stage reads it (snaketune.config.generate), so a docstring there changes no output.
    allowed = {keys.PACKAGE_DIR / "config/fields.py"}
    users = {
        p
        for p in keys.PACKAGE_DIR.rglob("*.py")
        for node in ast.walk(ast.parse(p.read_text()))
        if "__doc__" in (getattr(node, "attr", None), getattr(node, "id", None), getattr(node, "value", None))
    }
    assert users <= allowed, users - allowed


def test_dag_time_imports_are_light():
    """What the rule files import runs whenever Snakemake builds the DAG (every dry run and no-op rerun):
    no torch or transformers there (seconds each), nor pyarrow or pandas (tenths)."""
    modules = sorted(
        {m for p in RULES.glob("*.smk") for m in parsed_imports_smk(p)}
        | {"snaketune.keys", "snaketune.config.schema"}
    )
    code = (
        f"import sys; sys.path.insert(0, {str(REPO / 'workflow')!r}); import json\n"
        f"for m in {modules!r}: __import__(m)\n"
        f"print(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == [], f"importing {modules} pulls in heavy packages"


def parsed_imports_smk(path: Path) -> set[str]:
    """`from snaketune import a, b` / `from snaketune.x import y` lines of a rule file."""
    found = set()
    for sub, names in re.findall(r"^from snaketune((?:\.\w+)*) import ([\w, ]+)", path.read_text(), re.M):
        parent = f"snaketune{sub}"
        if parent == "snaketune" or keys.is_package(parent):
            found |= {f"{parent}.{n.split()[0]}" for n in names.split(",")}
        else:
            found.add(parent)
    return found


def test_checkpoint_run_key_covers_the_content_of_every_input(tmp_path):
    """A job's checkpoint directory is named by its settings and every input it starts from, by content: another
    SFT model, reference or dataset never resumes a run; a rewrite of the same bytes still does."""
    import os

    from snaketune.train.checkpoint import run_key

    data, model, reference = tmp_path / "data", tmp_path / "model", tmp_path / "reference.parquet"
    (data / "train").mkdir(parents=True)
    (data / "stats.json").write_text('{"conversation_files_sha256": 1}')
    (data / "train" / "rows.arrow").write_bytes(b"rows")
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    reference.write_bytes(b"logprobs")
    inputs = {"data": str(data), "policy": str(model), "reference": str(reference), "extra": [str(reference)]}
    key = run_key("k", inputs)
    assert key.startswith("k-") and key == run_key("k", inputs) and run_key("j", inputs) != key
    os.utime(model / "model.safetensors", (1, 1))  # timestamps alone: the same run
    (data / "stats.json").write_text('{"conversation_files_sha256": 1}')
    assert run_key("k", inputs) == key
    for path, content in (
        (model / "model.safetensors", b"other weights"),
        (reference, b"other logprobs"),
        (data / "train" / "rows.arrow", b"other rows"),
    ):
        before = path.read_bytes()
        path.write_bytes(content)
        assert run_key("k", inputs) != key, path
        path.write_bytes(before)
    (model / "adapter").mkdir()
    (model / "adapter" / "a.safetensors").write_bytes(b"adapter")  # a file more
    assert run_key("k", inputs) != key
