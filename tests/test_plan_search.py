"""What the preflight plan (snaketune.plan.search) does with the memory model's numbers (tests/test_plan.py):
the plan file, a configuration that does not fit stopping the workflow before training with what would fit,
train.strategy auto and the run it changes, the host-RAM check for offload, and the plan's config keys."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from snaketune.config.choices import ConfigError
from snaketune.config.load import load_config, to_dict
from snaketune.config.schema import TrainConfig, checkpointed_layers
from snaketune.model.architectures import DEEPSEEK_LLM_7B
from snaketune.plan import apply, memory, search, strategies
from snaketune.plan import evaluation as eval_plan
from snaketune.plan.arch import Arch, arch_from_hf_config, resolve_arch
from snaketune.plan.budget import Budget

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED = {name: str(REPO / "config/deepspeed" / name) for name in strategies.STRATEGY_FILES.values()}


def deepseek(layers: int) -> Arch:
    return arch_from_hf_config({**DEEPSEEK_LLM_7B, "num_hidden_layers": layers})


# ---- the plan file ------------------------------------------------------------------------------------------


def train_dict(**overrides) -> dict:
    overrides.setdefault("deepspeed", DEEPSPEED["zero2.json"])
    lora = overrides.pop("lora", None)
    train = to_dict(TrainConfig(**overrides))
    if lora:
        train["lora"].update(lora)
    return train


def make(model: dict, train: dict, *, gib: float | None, max_length: int = 512, host: float = 125.0) -> dict:
    budget = Budget(gib, "test budget" if gib else "no GPU", host)
    return search.make_plan(
        experiment="x",
        model=model,
        train=train,
        max_length=max_length,
        deepspeed_config=train["deepspeed"],
        gpu_memory_gib=gib,
        budget=budget,
        candidate_files=DEEPSPEED,
    )


SEVEN_B = {"base": "arch:deepseek-llm-7b", "num_layers": None, "revision": "main"}
TINY = {"base": "builtin-tiny", "num_layers": None, "revision": "main"}


def test_plan_file_for_the_cpu_default(tmp_path):
    """builtin-tiny on a machine without GPU: nothing to check against, never a reason to stop."""
    out = tmp_path / "plan" / "default.json"
    written = search.write_plan(
        out=out,
        experiment="default",
        model=TINY,
        train=train_dict(gpus=3),
        max_length=256,
        deepspeed_config=DEEPSPEED["zero2.json"],
        gpu_memory_gib=None,
        budget=Budget(None, "no GPU: CPU ranks, nothing to check", 16.0),
        candidate_files=DEEPSPEED,
    )
    on_disk = json.loads(out.read_text())
    assert on_disk == json.loads(json.dumps(written))
    assert on_disk["fits"] is None and on_disk["chosen"]["deepspeed_config"] == DEEPSPEED["zero2.json"]
    assert on_disk["configured"]["setup"]["precision"] == "fp32"  # CPU ranks train in fp32
    assert on_disk["model"]["params"] == resolve_arch(TINY)[0].params()
    assert [c["name"] for c in on_disk["candidates"]] == [s.name for s in strategies.STRATEGIES]
    # With a GPU budget the tiny model fits anything.
    assert make(TINY, train_dict(gpus=3), gib=24)["fits"] is True


def test_a_hub_model_without_network_is_skipped_unless_the_plan_is_asked_for(monkeypatch):
    """An architecture the plan cannot know (a hub model offline, not in the cache): skipped where nothing depends on
    the plan; an error naming why where gpu_memory_gib or train.strategy auto ask for it (it once passed unplanned,
    silently dropping strategy auto)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = {"base": "nobody-here/no-such-model-xyz", "revision": "main"}
    arch, why = resolve_arch(model, allow_download=False)
    assert arch is None and why.startswith("unknown: skipped")
    budget = Budget(24, "24 GiB GPUs", 125.0)
    plan = dict(experiment="x", model=model, max_length=512, candidate_files=DEEPSPEED, budget=budget)
    result = search.make_plan(
        train=train_dict(gpus=3), deepspeed_config=DEEPSPEED["zero2.json"], gpu_memory_gib=None, **plan
    )
    assert result["fits"] is None and result["status"].startswith("unknown: skipped")
    assert result["chosen"]["name"] == "as configured"
    with pytest.raises(
        search.PlanError, match=r"gpu_memory_gib: 24 needs the model's architecture.*downloads are off"
    ):
        make(model, train_dict(gpus=3), gib=24)
    with pytest.raises(search.PlanError, match=r"train.strategy: auto needs the model's architecture"):
        search.make_plan(
            train=train_dict(gpus=3, strategy="auto"),
            deepspeed_config=DEEPSPEED["zero2.json"],
            gpu_memory_gib=None,
            **plan,
        )


def test_strategy_auto_without_a_gpu_budget_is_an_error():
    """train.strategy auto on a machine without GPUs and without gpu_memory_gib: nothing to choose by."""
    with pytest.raises(search.PlanError, match=r"no CUDA device is visible and gpu_memory_gib is not set"):
        make(TINY, train_dict(gpus=1, strategy="auto"), gib=None)


def test_not_fitting_says_what_would_fit(tmp_path):
    """7B full fine-tuning under ZeRO-2 on three 24 GB GPUs, the README's hardware."""
    train = train_dict(gpus=3, global_batch_size=12, micro_batch_size=2)
    result = make(SEVEN_B, train, gib=24, host=256)
    assert result["fits"] is False
    message = result["message"]
    needs = result["configured"]["estimate"]["gpu_gib"]
    assert f"zero2 needs {needs:.1f} GiB per GPU as configured" in message
    offload = next(c for c in result["candidates"] if c["name"] == "zero3_offload")["estimate"]
    assert (
        f"What would fit: zero3_offload needs {offload['gpu_gib']:.1f} GiB per GPU and "
        f"{offload['host_gib']:.0f} GiB host RAM" in message
    )
    assert "LoRA (train.lora.enabled: true) with zero0" in message
    out = tmp_path / "plan.json"
    with pytest.raises(search.PlanError, match="What would fit"):
        search.write_plan(
            out=out,
            budget=Budget(24, "test budget", 256),
            experiment="x",
            model=SEVEN_B,
            train=train,
            max_length=512,
            deepspeed_config=train["deepspeed"],
            gpu_memory_gib=24,
            candidate_files=DEEPSPEED,
        )
    assert not out.exists()


def test_host_ram_is_checked_for_offload():
    """docs/facts.md: ZeRO-3 + CPU Adam offload of all 30 layers exhausted the H200 host's 125 GiB."""
    train = train_dict(gpus=1, global_batch_size=8, micro_batch_size=4, gradient_checkpointing=True)
    train["deepspeed"] = DEEPSPEED["zero3_offload.json"]
    result = make(SEVEN_B, train, gib=139.8, host=125)
    assert result["fits"] is False
    host = result["configured"]["estimate"]["host_gib"]
    assert f"GiB per GPU and {host:.0f} GiB host RAM as configured" in result["message"]
    assert make({**SEVEN_B, "num_layers": 14}, train, gib=139.8, host=125)["fits"] is True


@pytest.mark.parametrize(
    ("model", "train", "gib", "expected"),
    [
        # LoRA of all 30 layers on one 24 GiB GPU, micro-batch 8 x 512: only with checkpointing (micro-batch 2 x 4
        # accumulation steps would fit without it, but LoRA at micro-batch 2 measured 2x slower: MICRO_SPEED_LORA).
        (
            SEVEN_B,
            dict(gpus=1, global_batch_size=8, micro_batch_size=8, lora={"enabled": True}),
            24,
            "zero0+ckpt",
        ),
        # Full fine-tuning of 7B on 4 x 80 GiB: ZeRO-0 holds 18 B/param per GPU; ZeRO-2 fits.
        (SEVEN_B, dict(gpus=4, global_batch_size=16, micro_batch_size=4), 80, "zero2"),
        # ... and on 3 x 24 GiB only optimizer offload does.
        (SEVEN_B, dict(gpus=3, global_batch_size=12, micro_batch_size=2), 24, "zero3_offload"),
    ],
    ids=["lora-24g", "full-4x80g", "full-3x24g"],
)
def test_strategy_auto_picks_the_fastest_that_fits(model, train, gib, expected):
    result = make(model, train_dict(strategy="auto", **train), gib=gib, host=256)
    assert result["fits"] is True
    assert result["chosen"]["name"] == expected
    names = [c["name"] for c in result["candidates"]]
    fits = {c["name"]: c["fits"] for c in result["candidates"]}
    # Every faster strategy does not fit; full fine-tuning vs LoRA stays as configured.
    assert not any(fits[n] for n in names[: names.index(expected)])
    assert all(c["setup"]["lora_rank"] == (16 if train.get("lora") else 0) for c in result["candidates"])
    if train.get("lora"):
        assert not any(n.startswith("zero3") for n in names)  # the trainer refuses LoRA under ZeRO-3


def test_checkpointing_some_layers_is_planned_as_configured():
    """train.gradient_checkpointing: N plans N checkpointed layers (between none and all of them), under the
    name zero0+ckptN, and `auto` replaces it by a pick of its own (test_auto_checkpoints_the_fewest_layers_that_fit)."""
    train = train_dict(
        gpus=1, global_batch_size=8, micro_batch_size=8, lora={"enabled": True}, kernels="liger",
        deepspeed=DEEPSPEED["zero0.json"],
    )  # fmt: skip
    # 23.5 GiB: what a process may hold on a 24 GB card (gpu_memory_gib: 24, snaketune.device_memory).
    peaks = {
        n: make(SEVEN_B, {**train, "gradient_checkpointing": n}, gib=23.5, host=256)["configured"]
        for n in (False, 12, 24, True)
    }
    assert [peaks[n]["name"] for n in peaks] == ["zero0", "zero0+ckpt12", "zero0+ckpt24", "zero0+ckpt"]
    gib = [peaks[n]["estimate"]["peak_allocated_gib"] for n in peaks]
    assert gib == sorted(gib, reverse=True) and peaks[24]["gradient_checkpointing"] == 24
    # With what lies outside the allocator counted as measured (issue #22), 24 of 30 layers no longer fit: the
    # 16-layer run that fit an allocator cap of 24 GiB held more than 23.5 GiB of device memory.
    assert [peaks[n]["fits"] for n in peaks] == [False, False, False, True]
    auto = make(SEVEN_B, {**train, "gradient_checkpointing": 24, "strategy": "auto"}, gib=23.5, host=256)
    n = auto["chosen"]["gradient_checkpointing"]
    assert 24 < n < 30 and auto["chosen"]["name"] == f"zero0+ckpt{n}"


def test_auto_halves_the_micro_batch_where_nothing_else_fits():
    """QLoRA at 4,096 tokens under 12 GiB: micro-batch 4 does not fit even with every layer checkpointed; the plan
    halves it (same global batch, twice the accumulation steps), checkpointing as few layers as then fit, and
    `auto` applies that to the run."""
    train = train_dict(
        gpus=1, global_batch_size=8, micro_batch_size=4, kernels="liger", fused_cross_entropy=True,
        deepspeed=DEEPSPEED["zero0.json"], lora={"enabled": True, "quantize": "nf4"},
    )  # fmt: skip
    result = make(SEVEN_B, {**train, "strategy": "auto"}, gib=12, host=256, max_length=4096)
    assert result["fits"] and result["chosen"]["micro_batch_size"] < 4
    n = result["chosen"]["gradient_checkpointing"]
    n_name = "" if n is True else n
    assert result["chosen"]["name"] == f"zero0+ckpt{n_name}+micro{result['chosen']['micro_batch_size']}"
    assert not any(c["fits"] for c in result["candidates"] if c["setup"]["micro_batch"] == 4)
    spec = {"train": train, "deepspeed_config": DEEPSPEED["zero0.json"], "run_key": "abc"}
    applied = apply.apply_plan(spec, result)
    assert applied["train"]["micro_batch_size"] == result["chosen"]["micro_batch_size"]
    assert applied["train"]["gradient_checkpointing"] == n and applied["run_key"] != "abc"
    assert applied["train"]["global_batch_size"] == 8


def test_checkpointed_layers_beyond_the_model_are_refused():
    train = train_dict(gpus=1, global_batch_size=8, micro_batch_size=8, gradient_checkpointing=31)
    with pytest.raises(ConfigError, match="'train.gradient_checkpointing': 31 layers, but the model has 30"):
        make(SEVEN_B, train, gib=24, host=256)
    with pytest.raises(ConfigError, match="'train.gradient_checkpointing': -1 is not allowed"):
        load_config({"train": {"gradient_checkpointing": -1}})
    twelve = load_config({"train": {"gradient_checkpointing": 12}}).experiments["default"].train
    assert checkpointed_layers(twelve.gradient_checkpointing, 30) == 12


def test_auto_changes_the_run_and_its_checkpoint_key():
    auto = make(
        SEVEN_B,
        train_dict(strategy="auto", gpus=3, global_batch_size=12, micro_batch_size=2),
        gib=24,
        host=256,
    )
    spec = {"train": train_dict(gpus=3), "deepspeed_config": DEEPSPEED["zero2.json"], "run_key": "abc"}
    applied = apply.apply_plan(spec, auto)
    assert applied["deepspeed_config"] == DEEPSPEED["zero3_offload.json"]
    assert applied["run_key"] != "abc" and len(applied["run_key"]) == 16
    configured = make(SEVEN_B, train_dict(gpus=1, global_batch_size=8), gib=None)
    assert apply.apply_plan(spec, configured) is spec  # as_configured: the run as given


def test_launch_time_check_uses_the_granted_world_size():
    """The plan is made for train.gpus; Snakemake may grant fewer, and ZeRO then needs more per GPU."""
    result = make({**SEVEN_B, "num_layers": 8}, train_dict(gpus=4, global_batch_size=16), gib=None)
    ok, line = apply.check_devices(result, world=4, device_gib=80.0, host_gib=256)
    assert ok and "zero2 on 4 GPU(s) needs" in line
    ok, message = apply.check_devices(result, world=1, device_gib=24.0, host_gib=256)
    assert not ok and "does not fit" in message
    # gpu_memory_gib caps a larger GPU: 2 ranks would fit 139.8 GiB but not 24.
    assert apply.check_devices(result, world=2, device_gib=139.8, host_gib=256)[0]
    capped = {**result, "gpu_memory_gib": 24}
    ok, message = apply.check_devices(capped, world=2, device_gib=139.8, host_gib=256)
    assert not ok and "gpu_memory_gib 24" in message
    assert apply.check_devices(None, world=1, device_gib=24, host_gib=None)[0]


def test_config_keys():
    cfg = load_config({"gpu_memory_gib": 24, "gpu_ids": [0, "GPU-1"], "train": {"strategy": "auto"}})
    assert (cfg.gpu_memory_gib, cfg.gpu_ids) == (24.0, ("0", "GPU-1"))
    assert cfg.experiments["default"].train.strategy == "auto"
    with pytest.raises(
        ConfigError, match="'train.strategy': 'fastest' is not allowed; allowed: as_configured, auto"
    ):
        load_config({"train": {"strategy": "fastest"}})
    with pytest.raises(ConfigError, match="'gpu_memory_gib'"):
        load_config({"gpu_memory_gib": -1})
    with pytest.raises(ConfigError, match="'gpu_ids'"):
        load_config({"gpu_ids": "0,1"})


# ---- the workflow ----------------------------------------------------------------------------------------------

TOO_BIG = """
model: {base: "arch:deepseek-llm-7b"}
tokenize: {max_length: 512}
train: {gpus: 3, global_batch_size: 12, micro_batch_size: 2}
gpu_memory_gib: 24
"""


@pytest.mark.slow
def test_a_config_that_does_not_fit_stops_before_training(tmp_path):
    from conftest import copy_workflow

    workdir = copy_workflow(tmp_path / "wf")
    extra = tmp_path / "big.yaml"
    extra.write_text(TOO_BIG)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", memory.ENV_HOST_MEMORY: "256"}
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "--cores",
        "1",
        "--resources",
        "gpu=3",
        "--configfile",
        str(REPO / "tests/configs/fast.yaml"),
        str(extra),
    ]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # The SFT plan or the DPO stage's (both first, both refuse it: the DPO stage inherits train's settings).
    assert re.search(
        r"ERROR in rule plan(_dpo)?: PlanError: train.gpus 3 x 23.5 GiB \(gpu_memory_gib: 24 \(less 0.5 GiB for the "
        r"driver\)\)",
        proc.stderr,
    ), proc.stderr[-3000:]
    assert "What would fit: zero3_offload needs" in proc.stderr, proc.stderr[-3000:]
    # The plans run first (priority) and a failure stops the workflow: no stage ran (a plan that fits may have).
    assert not (workdir / "results/data").exists() and not (workdir / "logs/train").exists()
    assert not (workdir / "results/plan/default.json").exists() or not (workdir / "results/plan/dpo").exists()


def test_8bit_states_make_a_full_fine_tune_fit_without_offload():
    """The full 7B on one 80 GiB GPU (A100/H100 80 GB), 8 x 512: with fp32 states only CPU offload fits (10x
    slower); train.strategy auto now picks ZeRO-0 with checkpointing and 8-bit states (measured on an H200 capped
    at 80 GiB: 66.2 GiB, 6,513 tokens/s), and the run spec says so."""
    train = train_dict(gpus=1, global_batch_size=8, micro_batch_size=8, kernels="liger")
    as_8bit = make(SEVEN_B, {**train, "optimizer_states": "8bit"}, gib=80, host=256)
    assert as_8bit["fits"] is False  # 8-bit states as configured (no checkpointing) do not fit 80 GiB either
    configured = make(SEVEN_B, train, gib=80, host=256)
    assert configured["fits"] is False
    # The message names the 8-bit states that would fit, before LoRA.
    message = configured["message"]
    assert "8-bit Adam states (train.optimizer_states: 8bit) with zero0+ckpt needs" in message
    assert message.index("optimizer_states: 8bit") < message.index("LoRA (train.lora.enabled: true)")
    assert not any(c["fits"] for c in configured["candidates"] if not c["estimate"]["offload"])
    auto = make(SEVEN_B, {**train, "strategy": "auto"}, gib=80, host=256)
    names = [c["name"] for c in auto["candidates"]]
    assert auto["fits"] and auto["chosen"]["name"] == "zero0+ckpt+8bit"
    assert auto["chosen"]["optimizer_states"] == "8bit"
    # fp32 strategies without offload first, then the same with 8-bit states, then offload.
    assert names.index("zero3+ckpt") < names.index("zero0+8bit") < names.index("zero3_offload")
    spec = {"train": train, "deepspeed_config": DEEPSPEED["zero2.json"], "run_key": "abc"}
    applied = apply.apply_plan(spec, auto)
    assert applied["train"]["optimizer_states"] == "8bit" and applied["train"]["gradient_checkpointing"]
    assert applied["run_key"] != "abc"
    # Configured with 8-bit states, `auto` never offers CPU offload, which the trainer refuses with them.
    auto_8bit = make(SEVEN_B, {**train, "strategy": "auto", "optimizer_states": "8bit"}, gib=24, host=256)
    assert auto_8bit["candidates"] and not any(c["estimate"]["offload"] for c in auto_8bit["candidates"])
    assert "offload" not in auto_8bit["message"].split("What would fit")[1].split("LoRA")[0]
    # LoRA keeps its fp32 states: its adapters' states are small.
    lora = make(SEVEN_B, {**train, "strategy": "auto", "lora": {"enabled": True}}, gib=24, host=256)
    assert not any(c["setup"]["states_8bit"] for c in lora["candidates"])


def test_qlora_example_plans_training_and_evaluation_in_16_gib():
    cfg = yaml.safe_load((REPO / "config/examples/deepseek-7b-qlora-16gb.yaml").read_text())
    train = {**to_dict(TrainConfig()), **cfg["train"]}
    train["lora"] = {**to_dict(TrainConfig()).get("lora"), **cfg["train"]["lora"]}
    train["deepspeed"] = str(REPO / train["deepspeed"])
    budget = Budget(16.0, "gpu_memory_gib: 16", 125.0)
    result = search.make_plan(
        experiment="default",
        model={"base": "arch:deepseek-llm-7b"},
        train=train,
        max_length=4096,
        deepspeed_config=train["deepspeed"],
        gpu_memory_gib=16,
        budget=budget,
        candidate_files=DEEPSPEED,
    )
    assert result["fits"] and result["chosen"]["name"] == "zero0+ckpt"
    # The evaluate stage's own plan (rule plan_eval): QLoRA's models evaluated in 4 bits.
    evaluation = search.make_plan(
        experiment="default",
        model={"base": "arch:deepseek-llm-7b"},
        train={"lora": {"quantize": "nf4"}},
        max_length=4096,
        deepspeed_config=None,
        gpu_memory_gib=16,
        budget=budget,
        evaluation={"batch_size": 8, "max_new_tokens": 128},
        objective="evaluate",
    )
    assert evaluation["fits"] and evaluation["evaluate"]["estimate"]["weights_gib"] < 5
    # The same evaluation in bf16 would not fit 16 GiB even at batch size 1.
    bf16_eval = eval_plan.plan_evaluation(
        deepseek(30),
        {"batch_size": 8, "max_new_tokens": 128},
        max_length=4096,
        precision="bf16",
        budget=budget,
    )
    assert bf16_eval["fits"] is False


# ---- the plan's own pick under a memory cap, and the longest row (issue #50) -------------------------------------

CAPPED_LORA = dict(
    gpus=1, global_batch_size=8, micro_batch_size=8, lora={"enabled": True}, kernels="liger", loss_kernel="triton",
    deepspeed=DEEPSPEED["zero0.json"], strategy="auto",
)  # fmt: skip
"""LoRA r16 of the 7B at 8 x 512 with Liger's kernels and the Triton loss: what a 24 GB card trains (its memory is
counted tensor by tensor, tests/test_plan.py)."""
USABLE_24 = 23.5
"""gpu_memory_gib: 24 less the driver's 0.5 GiB (snaketune.device_memory)."""


def pick(gib: float, **changes) -> dict:
    return make(SEVEN_B, train_dict(**{**CAPPED_LORA, **changes}), gib=gib, host=125)


def test_auto_checkpoints_the_fewest_layers_that_fit():
    """Under gpu_memory_gib 24 the plan checkpoints the fewest of the 30 layers that leave PICK_MARGIN_GIB of the
    budget (it used to checkpoint all 30 and leave 6 GiB of the card unused), writes what it chose and the device
    peak it predicts, and the run takes it. One layer fewer would not leave the margin; what it predicts leaves at
    most 1 GiB of the budget unused."""
    result = pick(USABLE_24)
    chosen = result["chosen"]
    n = chosen["gradient_checkpointing"]
    assert isinstance(n, int) and not isinstance(n, bool) and 0 < n < 30, chosen
    assert chosen["name"] == f"zero0+ckpt{n}" and chosen["micro_batch_size"] == 8
    predicted = chosen["estimate"]["gpu_gib"]
    assert USABLE_24 - 1.0 <= predicted <= USABLE_24 - strategies.PICK_MARGIN_GIB
    assert f"{predicted:.2f} GiB per GPU predicted" in chosen["why"]
    one_fewer = pick(USABLE_24, strategy="as_configured", gradient_checkpointing=n - 1)["configured"]
    assert one_fewer["estimate"]["gpu_gib"] > USABLE_24 - strategies.PICK_MARGIN_GIB
    # Every layer checkpointed (what the plan picked before) is among the slower candidates, and fits.
    every = pick(USABLE_24, strategy="as_configured", gradient_checkpointing=True)["configured"]
    assert every["fits"] and every["estimate"]["gpu_gib"] < predicted - 3
    spec = {"train": train_dict(**CAPPED_LORA), "deepspeed_config": DEEPSPEED["zero0.json"], "run_key": "abc"}
    applied = apply.apply_plan(spec, result)
    assert applied["train"]["gradient_checkpointing"] == n and applied["run_key"] != "abc"
    # The same training uncapped (the budget of a detected card, whose ranks keep fixed segments): every layer.
    uncapped = search.make_plan(
        experiment="x", model=SEVEN_B, train=train_dict(**CAPPED_LORA), max_length=512,
        deepspeed_config=DEEPSPEED["zero0.json"], gpu_memory_gib=None, budget=Budget(USABLE_24, "a 24 GB card", 125),
        candidate_files=DEEPSPEED,
    )  # fmt: skip
    assert uncapped["chosen"]["gradient_checkpointing"] is True


def test_the_pick_follows_the_budget():
    """More memory, fewer checkpointed layers, down to none; each pick within its budget less the margin."""
    layers = []
    for gib in (20.0, 22.0, USABLE_24, 26.0, 30.0, 40.0):
        chosen = pick(gib)["chosen"]
        setting = chosen["gradient_checkpointing"]
        layers.append(30 if setting is True else int(setting))
        assert chosen["estimate"]["gpu_gib"] <= gib - (
            strategies.PICK_MARGIN_GIB if 0 < layers[-1] < 30 else 0
        )
    assert layers == sorted(layers, reverse=True) and len(set(layers)) == len(layers), layers
    assert layers[-1] == 0  # 40 GiB: no checkpointing at all


def test_a_row_longer_than_fits_is_refused_naming_the_longest():
    """One row per step of LoRA under gpu_memory_gib 24, every layer checkpointed, the chunked loss: the plan records
    the longest tokenize.max_length that fits; that length fits, one step more is refused with a message naming it,
    and what train.strategy auto (the checkpointed inputs in host memory) would reach."""
    train = train_dict(**{**CAPPED_LORA, "strategy": "as_configured", "global_batch_size": 1, "micro_batch_size": 1,
                          "gradient_checkpointing": True, "fused_cross_entropy": True})  # fmt: skip
    longest = make(SEVEN_B, train, gib=USABLE_24, max_length=1024)["longest_row"]
    rows = longest["max_length"]
    assert rows >= 16384 and rows % search.ROW_STEP == 0, longest
    assert make(SEVEN_B, train, gib=USABLE_24, max_length=rows)["fits"] is True
    too_long = make(SEVEN_B, train, gib=USABLE_24, max_length=rows + search.ROW_STEP)
    assert too_long["fits"] is False
    message = too_long["message"]
    assert (
        f"tokenize.max_length {rows + search.ROW_STEP:,} is longer than the longest row that fits: {rows:,}"
        in message
    )
    auto = make(SEVEN_B, {**train, "strategy": "auto"}, gib=USABLE_24, max_length=1024)["longest_row"]
    assert auto["max_length"] > rows and auto["offload_activations"], auto
    assert f"{auto['max_length']:,} with train.strategy: auto" in message
    with pytest.raises(search.PlanError, match=f"longest row that fits: {rows:,}"):
        search.write_plan(
            out=Path("/nonexistent/never-written.json"), experiment="x", model=SEVEN_B, train=train,
            max_length=rows + search.ROW_STEP, deepspeed_config=train["deepspeed"], gpu_memory_gib=24,
            budget=Budget(USABLE_24, "test budget", 125), candidate_files=DEEPSPEED,
        )  # fmt: skip
    # strategy auto at a row only activation offload fits: the plan turns it on, and the run takes it.
    offloaded = make(SEVEN_B, {**train, "strategy": "auto"}, gib=USABLE_24, max_length=auto["max_length"])
    assert offloaded["fits"] and offloaded["chosen"]["offload_activations"] is True
    spec = {"train": train, "deepspeed_config": DEEPSPEED["zero0.json"], "run_key": "abc"}
    assert apply.apply_plan(spec, offloaded)["train"]["offload_activations"] is True


def test_the_step_in_backward_takes_2048_token_rows_under_24_gib_with_offload():
    """The 7B's full fine-tune with the step in backward and 4-bit states, one 2,048-token row per step, every layer
    checkpointed, the Triton loss, under gpu_memory_gib 24: as configured the plan refuses it (23.75 GiB planned,
    23.46 measured uncapped on an H100); with strategy auto it keeps the checkpointed inputs in host memory and takes
    it (the run: 22.97 GiB on the device, bench/RESULTS.md issue #50), and the longest row grows."""
    train = train_dict(deepspeed=DEEPSPEED["zero0.json"], kernels="liger", loss_kernel="triton",
                       optimizer_step="in_backward", optimizer_states="4bit", gradient_checkpointing=True,
                       micro_batch_size=1, global_batch_size=1)  # fmt: skip
    configured = make(SEVEN_B, train, gib=USABLE_24, max_length=2048)
    assert configured["fits"] is False
    auto = make(SEVEN_B, {**train, "strategy": "auto"}, gib=USABLE_24, max_length=2048)
    chosen = auto["chosen"]
    assert (
        auto["fits"] and chosen["offload_activations"] is True and chosen["optimizer_step"] == "in_backward"
    )
    assert 22.97 <= chosen["estimate"]["gpu_gib"] <= USABLE_24, chosen["estimate"]
    assert auto["longest_row"]["max_length"] > configured["longest_row"]["max_length"] >= 1536


# The README's recipe table: the longest row each 7B recipe fits as written (Liger's kernels and the Triton loss,
# what its GPU ranks run; the QLoRA recipe's strategy auto may offload activations), planned on its own budget.
RECIPE_ROWS = {
    "deepseek-7b-lora-3x24gb": 4352,
    "deepseek-7b-qlora-16gb": 37120,
    "deepseek-7b-full-h200": 10240,
}


@pytest.mark.parametrize(("example", "longest"), RECIPE_ROWS.items(), ids=list(RECIPE_ROWS))
def test_each_7b_recipe_records_the_longest_row_it_fits(example, longest):
    from snaketune.config.load import merge_config_files
    from snaketune.device_memory import card_gib, usable_gib

    cfg = load_config(
        merge_config_files([REPO / "config/config.yaml", REPO / "config/examples" / f"{example}.yaml"])
    )
    exp = cfg.experiments["default"]
    train = {**to_dict(exp.train), "kernels": "liger", "loss_kernel": "triton"}
    train["deepspeed"] = str(REPO / train["deepspeed"])
    card = cfg.gpu_memory_gib or card_gib(
        "h200"
    )  # the full fine-tune's example plans for the card it runs on
    result = search.make_plan(
        experiment=example, model=SEVEN_B, train=train, max_length=exp.tokenize.max_length,
        deepspeed_config=train["deepspeed"], gpu_memory_gib=cfg.gpu_memory_gib,
        budget=Budget(usable_gib(card), example, 125), candidate_files=DEEPSPEED,
    )  # fmt: skip
    assert result["fits"] and result["longest_row"]["max_length"] == longest >= exp.tokenize.max_length
    assert f"| {longest:,} tokens" in (REPO / "README.md").read_text()
