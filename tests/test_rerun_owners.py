"""Every config key reruns exactly its owners and what follows them (snaketune.config.owners).

The test walks the config schema (workflow/schemas/config.schema.yaml), not a list: for every leaf key it changes the
tiny config's value by one valid step (the next allowed value, a flipped switch, one more), dry-runs the finished
tiny run (conftest.tiny_run) with the change, and compares the jobs Snakemake would run with those of a dry run that
forces the key's owner stages (`-R`): the owners and everything Snakemake reruns after them. A key added to the
schema without an owner fails here (owners() raises), and so does a key whose change reruns more or less than its
owners and what follows. The report shows the resolved config and the command that reproduces the run, so any change
(given here as one more --configfile) reruns the report too: a second's work.

Keys whose change adds or removes stages (UNOWNED's "structure") only have to leave every training stage alone.
docs/rerun.md publishes the resulting table; tests/test_config_sources.py keeps it current (fast tier).
"""

from __future__ import annotations

import copy
import json
import shutil
from functools import cache
from pathlib import Path

import jsonschema
import pytest
import yaml

from conftest import REPO, TINY_CONFIG, clone_run, dry_run, job_stats
from rerun_cases import TOKENIZER
from snaketune.config import owners
from snaketune.config.choices import ConfigError
from snaketune.config.load import load_config, to_dict
from snaketune.config.paths import check_input_paths

pytestmark = pytest.mark.slow

SCHEMA = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
TINY = yaml.safe_load(TINY_CONFIG.read_text())
DEFAULTS = yaml.safe_load((REPO / "config/config.yaml").read_text())
"""config/config.yaml, which Snakemake reads before any --configfile."""
ARGS = ("--cores", "2", "--resources", "gpu=2")
TRAINING = {"download", "conversations", "tokenize", "tokenize_pairs", "train", "reference", "dpo"}
SOURCE_FILE = "messages.parquet"
"""dataset.source's step: the tiny run's own messages as a local file (other data for the download stage)."""
PAIRS_FILE = "pairs.parquet"
"""preference.source's step: the tiny run's training pairs as a pairs file (prompt, chosen, rejected)."""


class Together(dict):
    """A step that sets sibling keys too (train.epochs needs max_steps unset)."""


STEPS = {
    "dataset.source": [SOURCE_FILE],
    "preference.source": [PAIRS_FILE],
    "dataset.revision": ["v2"],
    "dataset.languages": [["en"]],
    "dataset.tree_states": [[], ["ready_for_export", "growing"]],
    "model.base": ["arch:deepseek-llm-7b"],
    "model.tokenizer": [TOKENIZER],
    "model.revision": ["v2"],
    "model.tokenizer_revision": ["v2"],
    "deepspeed": ["config/deepspeed/zero3.json"],
    "epochs": [Together(epochs=1.0, max_steps=None)],
    "adam_betas": [[0.9, 0.99]],
    "eval.prompts": [["Say tree twice.", "What is 2 + 2?"]],
    "export.models": [["sft"]],
    "export.quants": [["q4_k_m"]],  # q4_k_m stays: the benchmark's scored file (dropping it is structure)
    "benchmark.tasks": [["builtin_choice", "builtin_answer"]],
    "benchmark.task_settings": [{"builtin_choice": {"limit": 3}}],
    "export.max_kl": [{"q8_0": 0.02}],
    "gpu_memory_gib": [24],
    "gpu_ids": [[0]],
}
"""How to step a key whose type gives no obvious next value (by its full name, or by its last part)."""
NO_STEP = {
    "model.num_layers": "only with an arch: model; the tiny config's is builtin-tiny",
    "train.lora.quantize": "nf4 needs LoRA on a pretrained model; the tiny config trains builtin-tiny in full",
    "preference.train.lora.quantize": "as train.lora.quantize",
    "train.epochs": "preference.train sets max_steps, which the preference stage would then have beside epochs "
    "(preference.train.epochs is stepped)",
    "experiments": "structure: adding an experiment adds its own jobs (tests/test_rerun_clean.py)",
    "train.offload_activations": "true needs train.gradient_checkpointing, false in the tiny config (whose own step "
    "reruns the reference stage too)",
    "preference.train.offload_activations": "as train.offload_activations",
}
"""Keys with no valid one-step change of the tiny config, and why (checked: each candidate step is refused)."""


def schema_leaves(node: dict, path: tuple[str, ...] = ()):
    """(dotted key, schema node) of every leaf of the config schema, $refs followed."""
    if "$ref" in node:
        node = SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[-1]]
    if "properties" in node:
        for name, child in node["properties"].items():
            yield from schema_leaves(child, (*path, name))
    else:
        yield ".".join(path), node


LEAVES = dict(schema_leaves(SCHEMA))


def nested(key: str, value) -> dict:
    """{'a': {'b': value}} for 'a.b' (a Together step sets its siblings)."""
    *parents, last = key.split(".")
    out = dict(value) if isinstance(value, Together) else {last: value}
    for part in reversed(parents):
        out = {part: out}
    return out


def merge(base: dict, change: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in change.items():
        out[k] = merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def current(cfg, key: str):
    """The tiny config's value of `key`, defaults filled in (preference.train's: the DPO stage's merged value)."""
    exp = cfg.experiments["default"]
    section, *rest = key.split(".")
    if section == "preference" and rest[0] == "train":
        value, rest = to_dict(exp.dpo_train), rest[1:]
    elif section in ("model", "tokenize", "train", "preference"):
        value = to_dict(getattr(exp, section))
    elif section in ("dataset", "eval", "export", "benchmark"):
        value = to_dict(getattr(cfg, section))
    else:
        return getattr(cfg, section)
    for part in rest:
        value = value[part]
    return value


def candidates(key: str, node: dict, value):
    """Values one step away from `value`, in order of preference."""
    special = STEPS.get(key) or STEPS.get(key.rsplit(".", 1)[-1])
    if special:
        yield from special
        return
    if "enum" in node:
        allowed = node["enum"]
        i = allowed.index(value)
        yield from allowed[i + 1 :] + allowed[:i]
        return
    kind = node.get("type")
    kind = kind[0] if isinstance(kind, list) else kind
    if kind == "boolean":
        yield not value
    elif kind == "integer" or (kind == "number" and isinstance(value, int) and value > 1):
        yield (value or 0) + 1
        yield (value or 0) + 2  # global_batch_size: the next multiple of the micro-batch
    elif kind == "number":
        yield round(value * 2, 6) if value else 0.1
        yield round(value / 2, 6)
    elif kind == "array" and value:
        yield value[:-1]


@cache
def steps(workdir: Path) -> dict[str, tuple[dict, str | None]]:
    """key -> (the change, as a config override; None where NO_STEP) and the reason when there is no step."""
    base = load_config(merge(DEFAULTS, TINY))
    out = {}
    for key, node in LEAVES.items():
        tried = []
        for value in candidates(key, node, current(base, key) if key != "experiments" else None):
            change = nested(key, value)
            raw = merge(merge(DEFAULTS, TINY), change)
            try:
                jsonschema.validate(raw, SCHEMA)  # as the Snakefile validates it
                check_input_paths(load_config(raw), workdir)
            except jsonschema.ValidationError as e:
                tried.append(f"{value!r}: {e.message}")
                continue
            except ConfigError as e:
                tried.append(f"{value!r}: {e}")
                continue
            out[key] = (change, None)
            break
        else:
            out[key] = (None, "; ".join(tried) or "no candidate")
    return out


@pytest.fixture(scope="module")
def finished(tiny_run, tmp_path_factory, deepseek_tokenizer) -> Path:
    workdir = clone_run(tiny_run, tmp_path_factory.mktemp("owners") / "wf")
    shutil.copytree(deepseek_tokenizer, workdir / TOKENIZER)  # model.tokenizer's step
    (workdir / SOURCE_FILE).write_bytes((workdir / "results/data/raw/messages.parquet").read_bytes())
    (workdir / PAIRS_FILE).write_bytes(
        (workdir / "results/data/preferences/best_vs_rest/train.parquet").read_bytes()
    )
    return workdir


def stats(workdir: Path, *extra: str, configs: tuple[str, ...] = ("tiny.yaml",)) -> dict[str, int]:
    code, output = dry_run(workdir, (*extra, *ARGS, "--configfile", *configs))
    assert code == 0, output[-3000:]
    return job_stats(output)


def owner_rules(key: str, change: dict, workdir: Path) -> list[str]:
    """The rules of a key's owners for the tiny config before and after the change (a source may stop or start
    reading a key), and the report where the key is in a section it shows."""
    rules = {"report"}
    overridden = merge(DEFAULTS, TINY)["preference"]["train"]  # the tiny config's merged over config.yaml's
    before, after = (
        load_config(merge(DEFAULTS, raw)).experiments["default"] for raw in (TINY, merge(TINY, change))
    )
    for exp in (before, after):
        for stage in owners.owners(key, exp, overridden=overridden):
            if stage == "tokenizer":  # the job of the config that runs: the changed one
                stage = "train_tokenizer" if after.model.uses_builtin_tokenizer else "fetch_tokenizer"
            rules.add(stage)
    return sorted(rules)


@cache
def stats_all(workdir: Path) -> dict[str, int]:
    return stats(workdir, "--forceall")


@cache
def forced(
    workdir: Path, rules: tuple[str, ...], configs: tuple[str, ...] = ("tiny.yaml",)
) -> dict[str, int]:
    return stats(workdir, "-R", *rules, configs=configs) if rules else {}


def expected(workdir: Path, rules: tuple[str, ...]) -> dict[str, int]:
    """What forcing `rules` reruns: under the tiny config where they all have jobs there (one dry run per set of
    rules, shared by the keys that own them), else under the changed config (a rule the change brings in)."""
    if set(rules) <= set(stats_all(workdir)):
        return forced(workdir, rules)
    return forced.__wrapped__(workdir, rules, ("tiny.yaml", "change.yaml"))


def test_a_finished_run_reruns_nothing(finished):
    assert stats(finished) == {}


@pytest.mark.parametrize("key", list(LEAVES))
def test_a_key_reruns_its_owners_and_what_follows(finished, key):
    change, why = steps(finished)[key]
    if change is None:
        assert key in NO_STEP, (
            f"{key}: no valid one-step change ({why}); step it in STEPS or explain in NO_STEP"
        )
        return
    assert key not in NO_STEP, f"{key} has a valid step {change}: remove it from NO_STEP"
    (finished / "change.yaml").write_text(json.dumps(change))
    got = stats(finished, configs=("tiny.yaml", "change.yaml"))
    structure = owners.UNOWNED.get(key, "").startswith("structure")
    if structure:
        assert not TRAINING & set(got), f"{key} {change}: reruns {sorted(TRAINING & set(got))}"
        return
    rules = tuple(owner_rules(key, change, finished))
    assert got == expected(finished, rules), f"{key} {change}: owners {rules}"


def test_every_key_has_an_owner_entry():
    """Every leaf of the schema is declared: owned (OWNERS, TRAIN_FIELDS) or unowned with a reason."""
    for key in LEAVES:
        name = key.removeprefix("experiments.")
        if name.startswith(("train.", "preference.train.")):
            assert name.split("train.", 1)[1] in owners.TRAIN_FIELDS, name
        else:
            assert name in owners.OWNERS or name in owners.UNOWNED, f"{name}: declare its owners"
    assert sorted(owners.TRAIN_FIELDS) == sorted(owners.train_keys())


# ---- inputs that do not exist or no longer match ---------------------------------------------------------------


@pytest.mark.parametrize(
    "change, expected",
    [
        (
            {"dataset": {"source": "exports/oasst.jsonl"}},
            "'dataset.source': 'exports/oasst.jsonl' does not exist",
        ),
        ({"model": {"base": "./models/deepseek"}}, "'model.base': './models/deepseek' does not exist"),
        (
            {"preference": {"source": "exports/pairs.jsonl"}},
            "'preference.source': 'exports/pairs.jsonl' does not exist",
        ),
        (
            {"model": {"tokenizer": "/no/such/tokenizer"}},
            "'model.tokenizer': '/no/such/tokenizer' does not exist",
        ),
        (
            {"train": {"deepspeed": "config/deepspeed/zero9.json"}},
            "'train.deepspeed': 'config/deepspeed/zero9.json'",
        ),
    ],
)
def test_an_input_that_does_not_exist_stops_the_dry_run(finished, change, expected):
    """Before any job, with the key, the path and what is allowed; the finished run's outputs are not touched (a
    missing source once tokenized the old data under a new key: Snakemake skips a job whose input is missing when
    its outputs exist)."""
    (finished / "change.yaml").write_text(json.dumps(change))
    code, output = dry_run(finished, (*ARGS, "--configfile", "tiny.yaml", "change.yaml"))
    assert code != 0 and expected in output and "allowed:" in output, output[-2000:]


def test_a_cached_output_that_changed_is_named_before_use(finished):
    """A truncated Arrow file of the tokenized cache: the dry run names it, its job and how to rebuild it (it once
    passed the dry run and failed inside a rank, the cache staying broken)."""
    (arrow,) = finished.glob("results/tokenized/*/train/*.arrow")
    data = arrow.read_bytes()
    arrow.write_bytes(data[: len(data) // 2])
    try:
        code, output = dry_run(finished, (*ARGS, "--configfile", "tiny.yaml"))
    finally:
        arrow.write_bytes(data)
    cache = arrow.parent.parent.relative_to(finished).as_posix()
    assert code != 0, output[-2000:]
    assert (
        f"{cache} (written by tokenize" in output
        and f"{len(data) // 2} bytes, recorded {len(data)}" in output
    )
    assert f"rm -r {cache}" in output
