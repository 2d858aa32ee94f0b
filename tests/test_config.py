"""Config: shipped files validate against the schema; bad values fail naming the key and allowed values."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import jsonschema
import pytest
import yaml

from snaketune.config.choices import ConfigError
from snaketune.config.deepspeed import build_ds_config
from snaketune.config.load import load_config
from snaketune.config.schema import TrainConfig

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = yaml.safe_load((ROOT / "workflow/schemas/config.schema.yaml").read_text())
SHIPPED = (
    sorted((ROOT / "config").glob("*.yaml"))
    + sorted((ROOT / "tests/configs").glob("*.yaml"))
    + [ROOT / ".test" / "config.yaml"]
)


def default_config() -> dict:
    return yaml.safe_load((ROOT / "config/config.yaml").read_text())


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    raw = yaml.safe_load(path.read_text())
    jsonschema.validate(raw, SCHEMA)
    cfg = load_config(raw)
    assert cfg.experiments


LAYERED = {"smollm2-135m-cpu.yaml": "smollm2-135m-real.yaml"}
"""Examples that go after another one on the command line (their header says so)."""


@pytest.mark.parametrize("path", sorted((ROOT / "config/examples").glob("*.yaml")), ids=lambda p: p.name)
def test_example_configs_load_over_the_defaults(path, tmp_path, monkeypatch):
    """Each example as `--configfile config/examples/<file>` gives it: merged key by key over config.yaml. A GGUF
    model.base is the file its header copies into the working directory (an empty stand-in here)."""
    from snaketune.config.load import merge_config_files

    under = [ROOT / "config/examples" / LAYERED[path.name]] if path.name in LAYERED else []
    raw = merge_config_files([ROOT / "config/config.yaml", *under, path])
    monkeypatch.chdir(tmp_path)
    if raw["model"]["base"].endswith(".gguf"):
        (tmp_path / raw["model"]["base"]).touch()
    jsonschema.validate(raw, SCHEMA)
    assert load_config(raw).experiments["default"].train.gpus >= 1


def test_defaults_match_config_yaml():
    """config.yaml spells out the dataclass defaults, so reading it or omitting it gives the same run."""
    from_file = load_config(default_config()).experiments["default"]
    from_defaults = load_config({}).experiments["default"]
    assert from_file == from_defaults


@pytest.mark.parametrize(
    ("path", "value", "expected"),
    [
        (
            ("dataset", "paths"),
            "best",
            "config key 'dataset.paths': 'best' is not allowed; allowed: top1, all",
        ),
        (("dataset", "source"), "data.csv", "allowed: builtin | hub:<dataset id>"),
        (
            ("dataset", "validation_fraction"),
            1.5,
            "config key 'dataset.validation_fraction': 1.5 must be > 0 and < 1",
        ),
        (("dataset", "languages"), ["English"], "'English' is not a language code"),
        (("tokenize", "chat_template"), "chatml", "allowed: deepseek, model"),
        (("tokenize", "max_length"), 4, "config key 'tokenize.max_length': 4 must be between 16 and 131072"),
        (("train", "precision"), "fp16", "allowed: auto, bf16, fp32"),
        (("train", "global_batch_size"), 10, "not a multiple of train.micro_batch_size 4"),
        (("model", "base"), "arch:llama-70b", "allowed arch: models: arch:deepseek-llm-7b"),
        (("train", "bf16_optimizer"), "apex", "allowed: auto, snaketune, deepspeed"),
        (
            ("train", "attention"),
            "flash",
            "'train.attention': 'flash' is not allowed; allowed: auto, varlen, sdpa",
        ),
        (("train", "optimizer_kernel"), "cuda", "allowed: auto, triton, torch"),
        (
            ("train", "loss_kernel"),
            "liger",
            "'train.loss_kernel': 'liger' is not allowed; allowed: auto, triton, torch",
        ),
        # Wrong types (a --config value arrives as a string) name the key and the type, not a TypeError.
        (
            ("dataset", "builtin_trees"),
            "1500",
            "config key 'dataset.builtin_trees': '1500' (str) is not allowed; allowed: an integer",
        ),
        (("train", "gradient_checkpointing"), "yes", "'yes' (str) is not allowed; allowed: true or false"),
        (
            ("train", "adam_betas"),
            [0.9, "x"],
            "'train.adam_betas': 'x' (str) is not allowed; allowed: a number",
        ),
        (("train", "max_steps"), 1.5, "allowed: an integer or null"),
        (("model", "revision"), "../../etc", "'model.revision': '../../etc' is not a git revision"),
    ],
)
def test_bad_values_name_key_and_allowed(path, value, expected):
    raw = default_config()
    raw[path[0]][path[1]] = value
    with pytest.raises(ConfigError, match=None) as e:
        load_config(raw)
    assert expected in str(e.value)


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (
            lambda c: c["train"].update(learning_rat=1e-3),
            "'train.learning_rat': unknown key; did you mean 'learning_rate'?",
        ),
        (lambda c: c.update(trian={}), "'trian': unknown key; did you mean 'train'?"),
        (lambda c: c["train"]["lora"].update(rnak=8), "'train.lora.rnak': unknown key; did you mean 'rank'?"),
        (lambda c: c["experiments"].update(x={"tokenise": {}}), "unknown key; did you mean 'tokenize'?"),
        (lambda c: c["train"].update(epochs=2), "set exactly one of train.max_steps and train.epochs"),
    ],
)
def test_typos_and_contradictions(mutate, expected):
    raw = default_config()
    mutate(raw)
    with pytest.raises(ConfigError) as e:
        load_config(raw)
    assert expected in str(e.value)


def test_schema_rejects_typos_too():
    raw = default_config()
    raw["train"]["learning_rat"] = 1e-3
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, SCHEMA)


def test_experiment_overrides_merge_deeply():
    raw = default_config()
    raw["experiments"] = {"a": {}, "b": {"train": {"learning_rate": 1e-4, "lora": {"enabled": True}}}}
    cfg = load_config(raw)
    a, b = cfg.experiments["a"], cfg.experiments["b"]
    assert a.train.learning_rate == 3e-3 and b.train.learning_rate == 1e-4
    assert b.train.lora.enabled and b.train.lora.rank == a.train.lora.rank
    assert a.tokenize == b.tokenize


@pytest.mark.parametrize(("world", "gas"), [(1, 6), (2, 3), (3, 2)])
def test_accumulation_follows_world_size(world, gas):
    assert TrainConfig().accumulation_steps(world) == gas


def test_accumulation_error_names_the_fix():
    with pytest.raises(ConfigError, match="choose a multiple of 16"):
        TrainConfig().accumulation_steps(4)


@pytest.mark.parametrize("name", ["zero0", "zero2", "zero3", "zero3_offload"])
def test_shipped_deepspeed_configs(name):
    path = ROOT / f"config/deepspeed/{name}.json"
    ds = build_ds_config(
        json.loads(path.read_text()), TrainConfig(), world_size=3, bf16=False, source=str(path)
    )
    assert ds["train_batch_size"] == 24 and ds["gradient_accumulation_steps"] == 2
    assert ds["train_micro_batch_size_per_gpu"] == 4 and ds["bf16"] == {"enabled": False}


@pytest.mark.parametrize(
    ("file_cfg", "expected"),
    [
        (
            {"zero_optimisation": {"stage": 2}},
            "unknown key 'zero_optimisation'; did you mean 'zero_optimization'?",
        ),
        ({"train_batch_size": 32}, "key 'train_batch_size' is set by the workflow"),
        ({"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "key 'fp16' is set by the workflow"),
        ({"zero_optimization": {"stage": 4}}, "zero_optimization.stage 4; allowed: 0, 1, 2, 3"),
    ],
)
def test_bad_deepspeed_configs(file_cfg, expected):
    with pytest.raises(ConfigError) as e:
        build_ds_config(copy.deepcopy(file_cfg), TrainConfig(), world_size=1, bf16=False, source="x.json")
    assert expected in str(e.value) and "x.json" in str(e.value)


def test_master_weights_need_zero_stage_0():
    with pytest.raises(ConfigError) as e:
        build_ds_config(
            {"zero_optimization": {"stage": 2}},
            TrainConfig(),
            world_size=1,
            bf16=True,
            source="x.json",
            master_weights=True,
        )
    assert "x.json: train.bf16_optimizer 'snaketune' needs zero_optimization.stage 0 (found 2)" in str(
        e.value
    )
    # With fp32 masters DeepSpeed leaves precision and clipping to the optimizer; several ranks reduce in fp32.
    ds = build_ds_config({}, TrainConfig(), world_size=3, bf16=True, source="x.json", master_weights=True)
    assert ds["bf16"] == {"enabled": False} and ds["gradient_clipping"] == 0.0
    assert ds["communication_data_type"] == "fp32"


def test_auto_values_are_accepted():
    ds = build_ds_config(
        {"train_batch_size": "auto", "bf16": {"enabled": "auto"}},
        TrainConfig(),
        world_size=2,
        bf16=True,
        source="x.json",
    )
    assert ds["train_batch_size"] == 24 and ds["bf16"] == {"enabled": True}


def test_config_readme_explains_every_key_of_config_yaml():
    """Every setting config.yaml spells out is in config/README.md's section for its top-level key, as `name` or
    `parent.name` (a top-level one such as gpu_ids: in the GPUs section; preference.train's, which are train
    keys for the DPO stage: in the train section)."""
    readme = (ROOT / "config/README.md").read_text()
    sections = {
        heading.split()[0].lower(): body
        for heading, body in (s.split("\n", 1) for s in readme.split("\n## ")[1:])
    }

    def settings(d: dict, path: tuple[str, ...]):
        for key, value in d.items():
            if isinstance(value, dict) and value:
                yield from settings(value, (*path, key))
            else:
                yield (*path, key)

    missing = []
    for path in settings({k: v for k, v in default_config().items() if k != "experiments"}, ()):
        if len(path) == 1:
            section = sections["gpus"]
        elif path[:2] == ("preference", "train"):
            section = sections["train"]
        else:
            section = sections[path[0]]
        if not re.search(rf"`(?:[\w.]+\.)?{re.escape(path[-1])}`", section):
            missing.append(".".join(path))
    assert len(missing) == 0, f"config/README.md does not explain {missing}"
