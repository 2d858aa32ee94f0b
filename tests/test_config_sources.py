"""The config is defined once, by the dataclasses of snaketune.config (each field: type, default, allowed values,
docstring), and every other place that writes it agrees with them:

- workflow/schemas/config.schema.yaml is generated from them, and whatever it refuses, loading refuses too, in one
  short line naming the key (Snakemake's validate used to print the whole schema for what loading let through);
- config/config.yaml spells out every key with its default and a comment, config/README.md's tables every key
  with its default;
- the test configs are overlays of config/config.yaml: they hold only what they change.
"""

from __future__ import annotations

import copy
import re
import shutil
import subprocess
import sys
from pathlib import Path

import jsonschema
import pytest
import yaml

from snaketune.config.choices import ConfigError
from snaketune.config.load import load_config

REPO = Path(__file__).resolve().parent.parent
SCHEMA = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
DEFAULT_YAML = REPO / "config/config.yaml"
OVERLAYS = [REPO / ".test/config.yaml", *sorted((REPO / "tests/configs").glob("*.yaml"))]
"""The test configs, each given after config/config.yaml (Snakemake reads that first, then each --configfile)."""


DEFAULTS = yaml.safe_load(DEFAULT_YAML.read_text())


def default_config() -> dict:
    return copy.deepcopy(DEFAULTS)


def merged(base: dict, change: dict) -> dict:
    """`change` over `base`, key by key (as Snakemake merges config files)."""
    out = copy.deepcopy(base)
    for key, value in change.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


def nested(path: tuple[str, ...], value) -> dict:
    for part in reversed(path):
        value = {part: value}
    return value


# ---- the schema against loading ---------------------------------------------------------------------------------


def schema_nodes(node: dict, path: tuple[str, ...] = ()):
    """(path, node) of every key the schema describes, sections included ($refs followed)."""
    if "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    if path:
        yield path, node
    for name, child in node.get("properties", {}).items():
        yield from schema_nodes(child, (*path, name))


NODES = dict(schema_nodes(SCHEMA))
SECTIONS = {path: node for path, node in NODES.items() if "properties" in node}
LEAVES = {path: node for path, node in NODES.items() if "properties" not in node}

ODD_VALUES = (
    "x!",
    7,
    0.5,
    -1,
    0,
    True,
    None,
    [],
    ["x!"],
    [7],
    [0.5],
    [-1],
    [True],
    {"x!": 1},
    {"x!": {"y": 1}},
)
"""Values of every JSON type, as a config value or a list's item: each key takes few of them."""


def probes(node: dict) -> list:
    """Values to try on a key: of every type, and at and beyond each bound the schema states."""
    out = list(ODD_VALUES)
    for branch in [node, node.get("items", {}), *node.get("anyOf", [])]:
        for bound in ("minimum", "exclusiveMinimum"):
            if bound in branch:
                out += [branch[bound], branch[bound] - 1, branch[bound] - 0.5]
        for bound in ("maximum", "exclusiveMaximum"):
            if bound in branch:
                out += [branch[bound], branch[bound] + 1, branch[bound] + 0.5]
        if "items" in node and branch is node.get("items"):
            out += [[x] for x in out if not isinstance(x, list | dict)]
    return out


VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)


def refused_by_schema(raw: dict) -> bool:
    return not VALIDATOR.is_valid(raw)


def assert_refused_in_one_line(raw: dict, key: str, why: str) -> None:
    """Loading refuses `raw`, in one short line that names the key (or the section it sits in)."""
    try:
        load_config(raw)
    except ConfigError as e:
        message = str(e)
        assert "\n" not in message and len(message) < 600, f"{why}: a long message ({len(message)} chars)"
        named = [key.rsplit(".", n)[0] for n in range(key.count(".") + 1)]
        assert any(f"'{k}" in message for k in named), f"{why}: {message} does not name {key}"
        return
    pytest.fail(f"{why}: the schema refuses it, loading takes it")


@pytest.mark.parametrize("path", list(LEAVES), ids=".".join)
def test_what_the_schema_refuses_loading_refuses_in_one_line(path):
    """Every value of every key that the schema refuses (of the wrong type, outside a bound, not a choice, not
    matching a pattern): loading refuses it too, naming the key. On 37abf77: train.warmup_steps -1, log_every 0,
    lora.alpha 0, adam_betas [1.5, 0.9], ... passed loading (and then Snakemake's validate printed the schema)."""
    for value in probes(LEAVES[path]):
        raw = merged(default_config(), nested(path, value))
        if refused_by_schema(raw):
            assert_refused_in_one_line(raw, ".".join(path), f"{'.'.join(path)}: {value!r}")


def rule_names() -> set[str]:
    text = "\n".join(p.read_text() for p in (REPO / "workflow/rules").glob("*.smk"))
    return set(re.findall(r"^rule (\w+):", text, re.M))


def names_to_try() -> set[str]:
    """Keys a user might put in the wrong place: every key name of the config, and the workflow's rules' names
    (`report:` as a section)."""
    return {path[-1] for path in NODES} | rule_names()


EXPERIMENT = ("experiments", "x")
"""An experiment's overrides: the sections it may override."""


@pytest.mark.parametrize("section", [(), *SECTIONS, EXPERIMENT], ids=lambda p: ".".join(p) or "top level")
def test_a_key_the_schema_does_not_have_is_refused_in_one_line(section):
    """Every key name of the config and every rule's name, where the schema has no such key: loading refuses it with
    one line naming it. On 37abf77 `report:` at the top level passed loading and failed Snakemake's validate with
    a 755-line dump of the schema."""
    if section == EXPERIMENT:
        known = set(SCHEMA["properties"]["experiments"]["additionalProperties"]["properties"])
    else:
        known = set(SECTIONS[section]["properties"]) if section else set(SCHEMA["properties"])
    for name in sorted(names_to_try() - known):
        raw = merged(default_config(), nested((*section, name), {}))
        assert refused_by_schema(raw), name
        assert_refused_in_one_line(raw, ".".join((*section, name)), f"{'.'.join((*section, name))}: unknown")


def test_an_unknown_key_names_the_nearest_one():
    for change, expected in [
        ({"report": {}}, "config key 'report': unknown key; did you mean 'export'?"),
        (
            {"train": {"learning_rat": 1e-3}},
            "config key 'train.learning_rat': unknown key; did you mean 'learning_rate'?",
        ),
        (
            {"experiments": {"x": {"train": {"lora": {"rnak": 8}}}}},
            "config key 'experiments.x.train.lora.rnak': unknown key; did you mean 'rank'?",
        ),
        (
            {"eval": {"zzz": 1}},
            "config key 'eval.zzz': unknown key; allowed: prompts, max_new_tokens, builtin_examples, "
            "batch_size",
        ),
    ]:
        with pytest.raises(ConfigError) as e:
            load_config(merged(default_config(), change))
        assert str(e.value) == expected


def test_the_schema_is_the_one_the_dataclasses_make():
    """python -m snaketune.config.generate writes it; a field added, changed or documented without running it fails
    here."""
    from snaketune.config.generate import SCHEMA_PATH, render

    assert SCHEMA_PATH == REPO / "workflow/schemas/config.schema.yaml"
    assert SCHEMA_PATH.read_text() == render(), "python -m snaketune.config.generate"


def test_an_error_names_the_file_that_sets_the_key(tmp_path):
    """The dry run of a config with a typo stops before any job with one line: the key, the nearest key and the
    file (Snakemake's own validation of the schema is gone: it printed the whole schema)."""
    for part in ("Snakefile", "workflow", "config"):
        src = REPO / part
        (shutil.copytree if src.is_dir() else shutil.copy2)(src, tmp_path / part)
    (tmp_path / "mine.yaml").write_text("train:\n  learning_rat: 1.0e-3\n")
    run = subprocess.run(
        [sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--configfile", "mine.yaml"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode != 0
    lines = [line for line in (run.stdout + run.stderr).splitlines() if "Invalid configuration" in line]
    assert lines == [
        "Invalid configuration: config key 'train.learning_rat': unknown key; did you mean 'learning_rate'? "
        "(set in mine.yaml)"
    ], run.stdout + run.stderr
    assert "additionalProperties" not in run.stdout + run.stderr


def test_set_in_names_the_last_layer_that_sets_a_key():
    from snaketune.config.load import set_in

    layers = [
        ("config/config.yaml", {"train": {"gpus": 3}}),
        ("a.yaml", {"train": {"gpus": 0}, "experiments": {"v1.2": {"train": {"lr": 1}}}}),
        ("--config", {"eval": {"batch_size": 0}}),
    ]
    assert set_in("train.gpus", layers) == "a.yaml"
    assert set_in("eval.batch_size", layers) == "--config"
    assert set_in("experiments.v1.2.train.lr", layers) == "a.yaml"  # an experiment's name may hold dots
    assert set_in("train.seed", layers) is None and set_in(None, layers) is None


# ---- config/config.yaml and config/README.md ----------------------------------------------------------------------


def test_config_yaml_spells_out_every_default():
    """Every key, its value the dataclass default: reading config.yaml or nothing gives the same run, and a key
    added to a dataclass is added here."""
    from snaketune.config.load import defaults

    assert default_config() == defaults()
    from_file, from_nothing = load_config(default_config()), load_config({})
    assert (from_file.experiments, from_file.eval, from_file.export, from_file.benchmark) == (
        from_nothing.experiments,
        from_nothing.eval,
        from_nothing.export,
        from_nothing.benchmark,
    )


def test_every_setting_of_config_yaml_has_a_comment():
    """Each setting's line says what it does (`key: value  # ...`), as a user reading the file sees it."""
    lines = DEFAULT_YAML.read_text().splitlines()
    root = yaml.compose(DEFAULT_YAML.read_text())
    bare = []

    def walk(node, path):
        for key, value in node.value:
            if isinstance(value, yaml.MappingNode) and not value.flow_style:
                walk(value, (*path, key.value))  # a section: its settings have the comments
            elif "#" not in lines[key.start_mark.line]:
                bare.append(".".join((*path, key.value)))

    walk(root, ())
    assert not bare, f"config/config.yaml: settings without a comment: {bare}"


def readme_tables() -> dict[str, dict[str, str]]:
    """config/README.md's tables, by section heading's first word: key -> default cell."""
    text = (REPO / "config/README.md").read_text()
    out = {}
    for part in text.split("\n## ")[1:]:
        heading, body = part.split("\n", 1)
        rows = re.findall(r"^\| (`[^|]*`|[^|]*) \| ([^|]*) \|", body, re.M)
        keys = [(k.strip(), d.strip()) for k, d in rows if k.strip() not in ("key", "---")]
        if keys:
            out[heading.split()[0].lower()] = dict(keys) | {"_rows": [k for k, _ in keys]}
    return out


def cell_value(cell: str):
    """A default cell as YAML reads it (`[q8_0, q4_k_m]`, 3.0e-3, `null`)."""
    return yaml.safe_load(cell.replace("`", ""))


def test_the_readme_tables_hold_every_key_with_its_default():
    """One row per key of each section (train's LoRA keys as lora.<key>, the top-level GPU keys in the GPUs
    section), its default cell the default."""
    from snaketune.config.load import SECTIONS, defaults

    tables = readme_tables()
    values = defaults()
    expected = {name: dict(values[name]) for name in SECTIONS}
    expected["train"] = {k: v for k, v in expected["train"].items() if k != "lora"} | {
        f"lora.{k}": v for k, v in values["train"]["lora"].items()
    }
    expected["gpus"] = {k: values[k] for k in ("gpu_memory_gib", "gpu_ids")}
    wrong = []
    for section, keys in expected.items():
        table = tables.get(section, {"_rows": []})
        rows = [re.sub(r"^`|`$", "", k) for k in table["_rows"]]
        if sorted(rows) != sorted(keys):
            missing, extra = sorted(set(keys) - set(rows)), sorted(set(rows) - set(keys))
            twice = sorted({r for r in rows if rows.count(r) > 1})
            wrong.append(f"{section}: rows missing {missing}, not keys {extra}, twice {twice}")
            continue
        for key, default in keys.items():
            cell = cell_value(table[f"`{key}`"])
            if cell != default:
                wrong.append(f"{section}.{key}: README {cell!r}, default {default!r}")
    assert not wrong, "config/README.md:\n" + "\n".join(wrong)


# ---- the test configs ---------------------------------------------------------------------------------------------


def changes(overlay: dict, default: dict, path: tuple[str, ...] = ()):
    """(path, value, default) of every setting the overlay makes, down to the defaults' leaves."""
    for key, value in overlay.items():
        below = default.get(key) if isinstance(default, dict) else None
        if isinstance(value, dict) and isinstance(below, dict) and below:
            yield from changes(value, below, (*path, key))
        else:
            yield (*path, key), value, below


@pytest.mark.parametrize("path", OVERLAYS, ids=lambda p: str(p.relative_to(REPO)))
def test_a_test_config_holds_only_what_it_changes(path):
    """Each setting of a test config differs from config/config.yaml's: a copy of a default would stay behind when
    the default changes (two of them once said "every key is spelled out" and lacked 14-16 keys)."""
    overlay = yaml.safe_load(path.read_text())
    copies = [".".join(p) for p, value, default in changes(overlay, default_config()) if value == default]
    assert not copies, f"{path.name} repeats the defaults of {copies}"
    load_config(merged(default_config(), overlay))


def test_the_published_rerun_table_is_current():
    """docs/rerun.md holds the table snaketune.config.owners makes (python -m snaketune.config.owners prints it);
    tests/test_rerun_owners.py checks the table against Snakemake's dry runs."""
    from snaketune.config import owners

    assert owners.table() in (REPO / "docs/rerun.md").read_text()
