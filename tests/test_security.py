"""Security: remote code only when the config asks for it (and the report says whether it did), weights only
as safetensors, no unpickling of untrusted files, hub tokens only from the environment and never written
anywhere, and no config value that makes a rule write outside results/, logs/ or benchmarks/.

The source checks read the package and the Snakemake scripts with Python's own parser. The token check greps
every file of the shared run of the tiny workflow (conftest.tiny_run), which had fake tokens in its environment. The path checks dry-run the workflow on
adversarial configs and read every output, log and benchmark path of the resulting jobs.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path, PurePosixPath

import pandas as pd
import pytest

from conftest import FAST_CONFIG, HUB_TOKENS, TINY_CONFIG, snakemake, workflow_copy
from snaketune.config.choices import ConfigError
from snaketune.config.load import load_config
from snaketune.config.paths import check_input_paths
from snaketune.report.reproducibility import remote_code_line

REPO = Path(__file__).resolve().parent.parent
SOURCES = sorted((REPO / "workflow/snaketune").rglob("*.py")) + sorted(
    (REPO / "workflow/scripts").glob("*.py")
)
WRITABLE_ROOTS = ("results", "logs", "benchmarks")


@pytest.fixture(scope="module")
def reference(tiny_run) -> Path:
    return tiny_run


# ---- reading the source ------------------------------------------------------------------------------


def calls(attribute: str) -> Iterator[tuple[str, ast.Call]]:
    """(file:line, call) of every call of `<anything>.attribute(...)` or `attribute(...)` in the sources."""
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Call):
                func = node.func
                name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                if name == attribute:
                    yield f"{path.relative_to(REPO)}:{node.lineno}", node


def keyword(call: ast.Call, name: str) -> ast.expr | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def receiver(call: ast.Call) -> str:
    """The source of what a method is called on: `AutoTokenizer`, `self.tokenizer`, `net`."""
    return ast.unparse(call.func.value) if isinstance(call.func, ast.Attribute) else ""


def is_true(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value is True


def is_tokenizer(call: ast.Call) -> bool:
    return "tokenizer" in receiver(call).lower()


# Loads of the workflow's own tokenizer directory (results/tokenizer/<id>/, written by the tokenizer stage),
# not of a name from the config: transformers' default refuses remote code there.
OWN_TOKENIZER_LOADS = {"workflow/snaketune/data/chat.py"}


# snaketune.data.tokenizer.load_fast_tokenizer(name, what, **kwargs) forwards its keywords to
# AutoTokenizer.from_pretrained: its callers are held to the rules of a from_pretrained call instead.
FORWARDING_LOADERS = {"workflow/snaketune/data/tokenizer.py": "load_fast_tokenizer"}


def forwards_kwargs(where: str, call: ast.Call) -> bool:
    return where.split(":")[0] in FORWARDING_LOADERS and any(k.arg is None for k in call.keywords)


def tokenizer_and_model_loads() -> list[tuple[str, ast.Call]]:
    loads = [(w, c) for w, c in calls("from_pretrained") if not forwards_kwargs(w, c)]
    return loads + [x for name in FORWARDING_LOADERS.values() for x in calls(name)]


def test_sources_are_found():
    assert len(SOURCES) > 20
    assert len(list(calls("from_pretrained"))) >= 3  # model.py, inference.py, tokenizer.py
    assert len(list(calls("load_fast_tokenizer"))) >= 2  # tokenizer.py (fetch), chat.py (own dir)


def test_remote_code_is_never_allowed_literally_and_comes_from_the_config():
    loads = tokenizer_and_model_loads()
    for where, call in loads:
        value = keyword(call, "trust_remote_code")
        assert not is_true(value), f"{where}: trust_remote_code=True"
        if where.split(":")[0] in OWN_TOKENIZER_LOADS:
            assert value is None or "trust_remote_code" in ast.unparse(value), where
            continue
        # model.trust_remote_code, spec["trust_remote_code"] or a parameter of that name, nothing else.
        assert value is not None and "trust_remote_code" in ast.unparse(value), (
            f"{where}: {ast.unparse(call)[:200]} does not pass trust_remote_code from the config"
        )
    for where, call in calls("load_dataset"):
        assert not is_true(keyword(call, "trust_remote_code")), where
    # Every default of a trust_remote_code parameter in the package is off.
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.arguments):
                args = node.posonlyargs + node.args + node.kwonlyargs
                defaults = [None] * (len(node.posonlyargs + node.args) - len(node.defaults)) + node.defaults
                defaults += node.kw_defaults
                for arg, default in zip(args, defaults, strict=True):
                    if arg.arg == "trust_remote_code":
                        assert not is_true(default), f"{path.relative_to(REPO)}:{arg.lineno}"


def test_remote_code_is_off_in_every_shipped_config(tmp_path):
    """Every config we ship, bench's included. A GGUF model.base that exists only where the config runs (the device
    machine's /tmp/smollm2/...) is given as an empty stand-in: model.base must name a file that exists."""
    import yaml

    for path in [
        REPO / "config/config.yaml",
        FAST_CONFIG,
        TINY_CONFIG,
        *sorted((REPO / "bench").glob("*/configs/*.yaml")),
    ]:
        raw = yaml.safe_load(path.read_text())
        base = (raw.get("model") or {}).get("base", "")
        if base.endswith(".gguf") and not Path(base).is_file():
            (tmp_path / Path(base).name).touch()
            raw["model"]["base"] = str(tmp_path / Path(base).name)
        cfg = load_config(raw)
        for name, exp in cfg.experiments.items():
            assert exp.model.trust_remote_code is False, f"{path.name}: experiment {name}"
    assert load_config({}).experiments["default"].model.trust_remote_code is False


@pytest.mark.slow  # a whole workflow run
def test_the_report_says_whether_remote_code_was_allowed(reference):
    summary = json.loads((reference / "results/report/summary.json").read_text())
    assert summary["experiments"]["default"]["trust_remote_code"] is False
    for name in ("report.md", "index.html"):
        text = (reference / "results/report" / name).read_text()
        assert "remote code" in text and "not allowed (off for every experiment)" in text, name

    class Exp:
        def __init__(self, name, allowed):
            self.name, self.config = name, {"model": {"trust_remote_code": allowed}}

    line = remote_code_line([Exp("base", False), Exp("custom", True)])
    assert line.startswith("**allowed** for `custom`") and "base" not in line


def test_weights_are_read_and_written_as_safetensors_only():
    for where, call in calls("from_pretrained"):
        # Tokenizers hold no weights; a GGUF file (rule import_gguf) holds tensors and metadata, no pickle.
        if not is_tokenizer(call) and keyword(call, "gguf_file") is None:
            assert is_true(keyword(call, "use_safetensors")), f"{where}: {ast.unparse(call)[:160]}"
    saves = [(w, c) for w, c in calls("save_pretrained") if not is_tokenizer(c)]
    assert len(saves) >= 3
    for where, call in saves:
        assert is_true(keyword(call, "safe_serialization")), f"{where}: {ast.unparse(call)[:160]}"


@pytest.mark.slow  # a whole workflow run
def test_the_run_wrote_no_pickled_weights(reference):
    # What the run wrote: safetensors for the model; pickled .pt files only in the resumable checkpoints
    # (DeepSpeed's format, and the RNG states, read back with weights_only=True).
    model = reference / "results/train/default/model"
    assert (model / "model.safetensors").is_file()
    pickled = [
        str(p.relative_to(reference))
        for p in (reference / "results").rglob("*")
        if p.suffix in (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
        and not p.is_relative_to(reference / "results/checkpoints")
    ]
    assert pickled == []


def test_nothing_is_unpickled():
    """torch.load only with weights_only=True; no pickle, dill, joblib, marshal, shelve, pandas pickles,
    numpy object arrays or unsafe YAML anywhere in the package or the scripts."""
    loads = list(calls("load"))
    torch_loads = [(w, c) for w, c in loads if receiver(c) == "torch"]
    assert torch_loads, "no torch.load found: the scan is broken"
    for where, call in torch_loads:
        assert is_true(keyword(call, "weights_only")), f"{where}: torch.load without weights_only=True"
    for where, call in loads + list(calls("loads")) + list(calls("Unpickler")):
        assert receiver(call) not in (
            "pickle",
            "cPickle",
            "dill",
            "joblib",
            "marshal",
            "shelve",
            "cloudpickle",
        ), f"{where}: {ast.unparse(call)[:120]}"
    for where, call in loads:
        if receiver(call) in ("np", "numpy"):
            assert not is_true(keyword(call, "allow_pickle")), where
        if receiver(call) == "yaml":
            loader = keyword(call, "Loader")
            assert loader is not None and "Safe" in ast.unparse(loader), (
                f"{where}: yaml.load without SafeLoader"
            )
    for name in ("read_pickle", "unsafe_load", "full_load"):
        assert list(calls(name)) == [], name
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
        assert not imported & {"pickle", "cPickle", "dill", "joblib", "marshal", "shelve"}, path


class _Planted:
    """Unpickling this runs a shell command: what a tampered checkpoint file would do."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


@pytest.fixture(scope="module")
def checkpointed_run(tiny_data, tmp_path_factory):
    """A 3-step ZeRO-0 training with a complete checkpoint at step 2."""
    from conftest import run_training

    run = run_training(
        tmp_path_factory.mktemp("checkpointed"), tiny_data, train_overrides=CHECKPOINTED, deepspeed="zero0"
    )
    assert (run.checkpoint_dir / "step00000002" / "COMPLETE.json").is_file()
    return tiny_data, run


CHECKPOINTED = dict(max_steps=3, checkpoint_every=2)


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["planted pickle", "truncated file"])
def test_resume_refuses_a_damaged_checkpoint(checkpointed_run, tmp_path, damage):
    """DeepSpeed loads its checkpoint files with torch.load(weights_only=False); the ranks force weights_only
    (snaketune.train.ranks.safe_checkpoint_loading), so a file that would run code is refused, and so is a
    truncated one, with a message naming the checkpoint and what to delete; the planted code never runs.
    An intact checkpoint resumes (tests/test_training.py, test_fast_path.py)."""
    import shutil

    import torch

    from conftest import run_training
    from snaketune.train.launch import LaunchError

    data, first = checkpointed_run
    ckpt_root = tmp_path / "checkpoints"
    shutil.copytree(first.checkpoint_dir, ckpt_root)
    shutil.rmtree(ckpt_root / "step00000003")  # the final step's: resume from step 2, the damaged one
    ckpt = ckpt_root / "step00000002"
    states = ckpt / "mp_rank_00_model_states.pt"
    marker = tmp_path / "code-ran"
    if damage == "planted pickle":
        torch.save({"module": _Planted(marker)}, states)
        cause = "UnpicklingError: Weights only load failed"
    else:
        states.write_bytes(states.read_bytes()[: states.stat().st_size // 2])
        cause = "could not be loaded ("
    with pytest.raises(LaunchError, match="training failed"):
        run_training(
            tmp_path, data, train_overrides=CHECKPOINTED, deepspeed="zero0", checkpoint_dir=ckpt_root
        )
    log = (tmp_path / "train.log").read_text()
    assert f"checkpoint {ckpt} could not be loaded (" in log and cause in log
    assert f"delete {ckpt} to resume from an older checkpoint, or {ckpt_root} to restart" in log
    assert not marker.exists()


# ---- hub tokens ---------------------------------------------------------------------------------------


def test_hub_tokens_come_from_the_environment_only():
    # No config key can hold one (the schema and the typed config know no token; a typo is refused)...
    import yaml

    def keys(node) -> Iterator[str]:
        if isinstance(node, dict):
            for k, v in node.items():
                yield str(k)
                yield from keys(v)
        elif isinstance(node, list):
            for v in node:
                yield from keys(v)

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    secret_words = {"token", "auth", "secret", "password", "credential", "apikey", "key"}
    assert "tokenizer" in set(keys(schema))  # the walk sees property names
    secretive = [k for k in keys(schema) if secret_words & set(k.lower().split("_"))]
    assert secretive == [], secretive
    for raw in ({"model": {"token": "hf_x"}}, {"hub_token": "hf_x"}, {"model": {"use_auth_token": "hf_x"}}):
        with pytest.raises(ConfigError, match="unknown key"):
            load_config(raw)
    # ...and no code passes one: the hub libraries read HF_TOKEN from the environment themselves.
    for attribute in ("from_pretrained", "load_dataset", "hf_hub_download", "snapshot_download"):
        for where, call in calls(attribute):
            for kw in ("token", "use_auth_token"):
                assert keyword(call, kw) is None, f"{where}: passes {kw}="


@pytest.mark.slow  # a whole workflow run
def test_hub_tokens_never_reach_an_output_log_or_record(reference):
    """Every file under results/, logs/, benchmarks/ and .snakemake/ of a whole run with the tokens in its
    environment, binary files too, as bytes."""
    roots = [reference / d for d in (*WRITABLE_ROOTS, ".snakemake")]
    files = [p for root in roots for p in root.rglob("*") if p.is_file()]
    names = {str(p.relative_to(reference)) for p in files}
    for expected in (
        "results/report/index.html",
        "results/provenance/manifest.json",
        "results/train/default/model/model.safetensors",
        "logs/train/default.log",
    ):
        assert expected in names, expected
    assert any(n.startswith(".snakemake/log/") for n in names)
    assert len(files) > 50
    leaks = [
        f"{p.relative_to(reference)}: {name}"
        for p in files
        for name, token in HUB_TOKENS.items()
        if token.encode() in p.read_bytes()
    ]
    assert leaks == []
    for record in (reference / "results/provenance").rglob("*.json"):
        assert not set(json.loads(record.read_text()).get("env", {})) & set(HUB_TOKENS), record


# ---- paths from the config ----------------------------------------------------------------------------


REJECTED = {
    "experiment ../x": ({"experiments": {"../x": {}}}, "experiments.../x"),
    "experiment /abs": ({"experiments": {"/tmp/abs": {}}}, "experiments./tmp/abs"),
    "experiment a/b": ({"experiments": {"a/b": {}}}, "experiments.a/b"),
    "experiment ..": ({"experiments": {"..": {}}}, "experiments..."),
    "revision with ..": ({"model": {"revision": "../../../tmp/evil"}}, "model.revision"),
    # Neither a hub id (owner/name) nor a directory that exists: refused before any job (issue #42).
    "hub id with ..": ({"model": {"base": "hub/../../x"}}, "model.base"),
}
ALLOWED_TEXT = {"model.revision": "is not a git revision", "model.base": "does not exist"}
"""What the message says is allowed, by key (experiment names otherwise)."""
"""Configs that validation refuses, with the key its message names (the hub's cache uses a revision as a path)."""


def accepted_configs(outside: Path) -> dict[str, dict]:
    """Adversarial configs that are valid: their names and paths must still lead only into results/."""
    return {
        "experiment x..y": {"experiments": {"x..y": {}, "default": {}}},
        # Directories that exist (inputs are checked before any job), reached through ".." and absolute paths.
        "model and tokenizer with ..": {
            "model": {
                "base": f"../{outside.name}/model",
                "tokenizer": f"../{outside.name}/../{outside.name}/tokenizer",
            }
        },
        "absolute model": {"model": {"base": str(outside / "model"), "revision": "refs/pr/1"}},
        "source outside the repo": {"dataset": {"source": str(outside / "messages.parquet")}},
        "relative source outside": {"dataset": {"source": f"../{outside.name}/messages.parquet"}},
        "deepspeed outside": {"train": {"deepspeed": str(outside / "zero2.json")}},
    }


def dag_paths(output: str) -> list[str]:
    """Every output, log and benchmark path of the jobs a dry run lists."""
    found = []
    for line in output.splitlines():
        m = re.match(r"^\s+(output|log|benchmark): (.+)$", line)
        if m:
            found += [p.strip() for p in m.group(2).split(", ")]
    return found


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return workflow_copy(tmp_path_factory, "security_paths")


@pytest.mark.parametrize("case", list(REJECTED))
def test_config_names_that_leave_results_are_refused(workdir, tmp_path, case):
    override, key = REJECTED[case]
    config = tmp_path / "adversarial.yaml"
    config.write_text(json.dumps(override))  # JSON is YAML
    result = snakemake(
        workdir, "-n", "--cores", "1", "--configfile", str(FAST_CONFIG), str(config), check=False
    )
    assert result.returncode != 0
    assert "Invalid configuration" in result.output and f"config key '{key}'" in result.output, result.output[
        -2000:
    ]
    assert ALLOWED_TEXT.get(key, "experiment names use letters, digits") in result.output
    with pytest.raises(ConfigError):  # the checks the workflow makes before any job
        check_input_paths(load_config(override), workdir)


@pytest.mark.parametrize("case", list(accepted_configs(Path("x"))))
def test_config_paths_lead_only_into_results(workdir, tmp_path_factory, case):
    outside = tmp_path_factory.mktemp("outside")  # beside the working directory, not inside it
    # What a dry run reads of them: a Parquet file's columns (dataset.format auto), a model's config.json and
    # tokenizer.json (the paths checked before any job).
    pd.DataFrame({"message_id": ["m"], "parent_id": [None], "role": ["prompter"], "text": ["hi"]}).to_parquet(
        outside / "messages.parquet"
    )
    for d, name in (("model", "config.json"), ("tokenizer", "tokenizer.json")):
        (outside / d).mkdir(exist_ok=True)
        (outside / d / name).write_text("{}")
    (outside / "zero2.json").write_text((REPO / "config/deepspeed/zero2.json").read_text())
    override = accepted_configs(outside)[case]
    config = outside / "adversarial.yaml"
    config.write_text(json.dumps(override))
    result = snakemake(workdir, "-n", "--cores", "1", "--configfile", str(FAST_CONFIG), str(config))
    paths = dag_paths(result.output)
    assert {"train", "report"} <= set(result.planned_rules), result.output[-2000:]
    assert len(paths) >= 20, paths
    for path in paths:
        p = PurePosixPath(path)
        assert not p.is_absolute() and ".." not in p.parts, path
        assert p.parts[0] in WRITABLE_ROOTS, path
