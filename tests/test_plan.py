"""The preflight memory plan (snaketune.plan.search): its numbers against measured H200 peaks, the plan file, a
configuration that does not fit stopping the workflow before training with what would fit, and
train.strategy auto."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from snaketune.config.choices import ConfigError
from snaketune.config.load import load_config, to_dict
from snaketune.config.schema import TrainConfig, checkpointed_layers
from snaketune.model.architectures import DEEPSEEK_LLM_7B
from snaketune.plan import apply, memory, search, setups, strategies
from snaketune.plan.arch import Arch, arch_from_hf_config, resolve_arch
from snaketune.plan.budget import Budget
from snaketune.plan.memory import GIB

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED = {name: str(REPO / "config/deepspeed" / name) for name in strategies.STRATEGY_FILES.values()}
ALL_LINEAR = setups.LORA_TARGETS
H200_RUN = REPO / "bench/runs/2026-11-29_h200/zero2_summary.json"
TOLERANCE = 0.10


def deepseek(layers: int) -> Arch:
    return arch_from_hf_config({**DEEPSEEK_LLM_7B, "num_hidden_layers": layers})


def ds_setup(name: str, **fields) -> memory.Setup:
    return memory.setup_from_deepspeed(json.loads(Path(DEEPSPEED[name]).read_text()), **fields)


# The measured points of ../shared/FACTS.md (one H200, random-init 7B architecture, seq 512): (what, layers,
# setup, measured GiB, which figure). FACTS.md does not say which DeepSpeed buckets its runs used; these use
# the project's files.
FACTS = [
    ("bf16 ZeRO-2, 4 x 2", 24, ds_setup("zero2.json", world=1, micro_batch=4, seq_len=512), 116.8, "gpu"),
    (
        "LoRA r16 all linear, bf16, 8 x 1",
        30,
        ds_setup("zero2.json", world=1, micro_batch=8, seq_len=512, lora_rank=16, lora_targets=ALL_LINEAR),
        # Measured with this project's trainer (bench/runs/2026-11-29_h200_plan); FACTS.md's 45.4 GiB for the
        # same setup came from other training code.
        37.6,
        "gpu",
    ),
    *[
        (
            "bf16 autocast, torch fused AdamW, no DeepSpeed, 4 x 2",
            layers,
            memory.Setup(
                world=1, zero_stage=0, engine="torch", precision="autocast", micro_batch=4, seq_len=512
            ),
            measured,
            "gpu",
        )
        for layers, measured in ((24, 107.6), (30, 130.6))
    ],
    *[
        (
            "ZeRO-3 + CPU Adam offload, 4 x 2, grad checkpointing",
            14,
            ds_setup("zero3_offload.json", world=1, micro_batch=4, seq_len=512, gradient_checkpointing=True),
            measured,
            which,
        )
        for measured, which in ((10.6, "gpu"), (69.0, "host"))
    ],
]


@pytest.mark.parametrize(
    ("what", "layers", "setup", "measured", "which"), FACTS, ids=[f"{f[1]}L-{f[4]}-{f[3]}" for f in FACTS]
)
def test_plan_matches_the_measured_h200_peaks(what, layers, setup, measured, which):
    est = memory.estimate(deepseek(layers), setup)
    predicted = est.peak_allocated_gib if which == "gpu" else est.host_gib
    assert predicted == pytest.approx(measured, rel=TOLERANCE), f"{what}, {layers} layers: {est}"


def test_plan_matches_this_projects_own_h200_run():
    """bench/RESULTS.md: the train rule, 24 layers, ZeRO-2 bf16, micro-batch 4 x 2, seq 512 on one H200."""
    summary = json.loads(H200_RUN.read_text())
    setup = ds_setup("zero2.json", world=1, micro_batch=summary["micro_batch_size"], seq_len=512)
    est = memory.estimate(deepseek(24), setup)
    assert est.params == summary["parameters"] == 5_696_065_536
    assert est.peak_allocated_gib == pytest.approx(summary["peak_memory_gib_per_rank"][0], rel=TOLERANCE)
    # One GPU under ZeRO-2 peaks in the optimizer step at 22 B/param (FACTS.md).
    assert est.peak_phase == "optimizer step"
    assert est.peak_allocated_gib * 2**30 / est.params == pytest.approx(22, rel=0.01)


FAST_PATH_RUN = REPO / "bench/runs/2026-12-01_h200_final/throughput.json"


@pytest.mark.parametrize(
    ("case", "layers", "micro", "lora", "deepspeed"),
    [
        ("b24", 24, 8, False, "zero0.json"),
        # b30 (30 layers, 4 x 2) was measured when MasterWeightAdamW accumulated in bf16 (116.2 GiB); it now
        # accumulates in fp32 (+2 B per parameter), which the issue #13 device run measures.
        ("lora30", 30, 8, True, "zero0.json"),
        ("b24_ds_zero2", 24, 4, False, "zero2.json"),
    ],
)
def test_plan_matches_the_fast_path_on_an_h200(case, layers, micro, lora, deepspeed):
    """bench/RESULTS.md (issue #7): the train rule with the shipped defaults (fp32 masters in
    MasterWeightAdamW at ZeRO-0, varlen attention, logits + cross-entropy), 8 x 512 per step, one H200; the
    Setup comes from the train settings the way the plan rule builds it."""
    result = next(r for r in json.loads(FAST_PATH_RUN.read_text())["results"] if r["case"] == case)
    train = {
        "gpus": 1,
        "micro_batch_size": micro,
        "global_batch_size": 8,
        "lora": {"enabled": lora, "rank": 16},
        "kernels": "torch",  # before Liger's kernels (train.kernels)
        "loss_kernel": "torch",  # and before the Triton loss (train.loss_kernel)
    }
    if case == "b24_ds_zero2":
        train.update(bf16_optimizer="deepspeed", attention="sdpa")
    setup = setups.setup_for(
        train, json.loads(Path(DEEPSPEED[deepspeed]).read_text()), world=1, seq_len=512, precision="bf16"
    )
    assert setup.master_weights == (case != "b24_ds_zero2") and setup.varlen == (case != "b24_ds_zero2")
    assert setup.accumulation == 8 // micro
    est = memory.estimate(deepseek(layers), setup)
    assert est.peak_allocated_gib == pytest.approx(result["peak_gib"], rel=TOLERANCE), est


LIGER_RUN = REPO / "bench/runs/2026-12-01_h200_liger/throughput.json"


@pytest.mark.parametrize(("case", "layers", "lora"), [("b24_liger", 24, False), ("lora30_liger", 30, True)])
def test_plan_counts_what_liger_saves(case, layers, lora):
    """bench/RESULTS.md (issue #16): the same runs with Liger's RMSNorm, RoPE and SwiGLU measured 5.1 and 4.4 GiB
    less; the plan counts what those kernels do not save for backward (nothing fitted to these runs)."""
    result = next(r for r in json.loads(LIGER_RUN.read_text())["results"] if r["case"] == case)
    train = {"micro_batch_size": 8, "global_batch_size": 8, "lora": {"enabled": lora}, "kernels": "liger"}
    train.update(fused_cross_entropy=False, loss_kernel="torch")  # BEST before the Triton loss
    ds = json.loads(Path(DEEPSPEED["zero0.json"]).read_text())
    setup = setups.setup_for(train, ds, world=1, seq_len=512, precision="bf16")
    assert setup.liger
    est = memory.estimate(deepseek(layers), setup)
    assert est.peak_allocated_gib == pytest.approx(result["peak_gib"], rel=TOLERANCE), est
    torch_modules = memory.estimate(deepseek(layers), setup.replace(liger=False))
    baseline = next(
        r for r in json.loads(LIGER_RUN.read_text())["results"] if r["case"] == case[: -len("_liger")]
    )
    saved = torch_modules.peak_allocated_gib - est.peak_allocated_gib
    assert saved == pytest.approx(baseline["peak_gib"] - result["peak_gib"], rel=0.05)


# The user's path on one H200 (bench/RESULTS.md, issues #13/#15): config/examples/*.yaml as written, through
# Snakemake, on a hub-format 7B directory and real oasst rows at 2,048 tokens, before train.kernels existed.
EXAMPLE_RUNS = [
    # (example, overrides, measured max_memory_allocated GiB)
    ("deepseek-7b-lora-3x24gb", {"gpus": 1}, 18.746),
    ("deepseek-7b-full-h200", {"gpus": 1}, 105.737),
    ("deepseek-7b-full-h200", {"gpus": 1, "micro_batch_size": 4}, 122.590),
]


@pytest.mark.parametrize(("example", "overrides", "measured"), EXAMPLE_RUNS)
def test_plan_matches_the_example_configs_on_an_h200(example, overrides, measured):
    cfg = yaml.safe_load((REPO / "config/examples" / f"{example}.yaml").read_text())
    train = {**cfg["train"], **overrides, "kernels": "torch"}
    ds = json.loads((REPO / train["deepspeed"]).read_text())
    max_length = int(cfg["tokenize"]["max_length"])
    setup = setups.setup_for(train, ds, world=1, seq_len=max_length, precision="bf16")
    est = memory.estimate(deepseek(30), setup)
    assert est.peak_allocated_gib == pytest.approx(measured, rel=TOLERANCE), est


def test_parameter_counts_are_exact():
    assert deepseek(30).params() == 6_910_365_696  # FACTS.md
    assert deepseek(30).lora_params(16, ALL_LINEAR) == 37_478_400


def test_parameter_counts_match_the_built_models():
    from snaketune.config.schema import LoraConfig, ModelConfig
    from snaketune.model.build import apply_lora, count_params, load_model

    arch, _ = resolve_arch({"base": "builtin-tiny"})
    net = load_model(
        ModelConfig(), vocab_size=1024, bos_token_id=0, eos_token_id=1, dtype=torch.float32, seed=0
    )
    assert count_params(net)[0] == arch.params()
    lora = apply_lora(net, LoraConfig(rank=4))
    assert count_params(lora)[1] == arch.lora_params(4, ALL_LINEAR)


def test_config_json_of_a_local_model(tmp_path):
    cfg = {**DEEPSEEK_LLM_7B, "num_hidden_layers": 2, "num_key_value_heads": 8, "model_type": "llama"}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    arch, source = resolve_arch({"base": str(tmp_path)})
    assert (arch.kv_heads, arch.layers, source) == (8, 2, str(tmp_path / "config.json"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "n_routed_experts": 64}))
    arch, source = resolve_arch({"base": str(tmp_path)})
    assert arch is None and "mixture-of-experts" in source


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


def test_a_hub_model_without_network_is_skipped_not_failed(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    model = {"base": "nobody-here/no-such-model-xyz", "revision": "main"}
    arch, why = resolve_arch(model, allow_download=False)
    assert arch is None and why.startswith("unknown: skipped")
    result = make(model, train_dict(gpus=3), gib=24)
    assert result["fits"] is None and result["status"].startswith("unknown: skipped")
    assert result["chosen"]["name"] == "as configured"


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
    """FACTS.md: ZeRO-3 + CPU Adam offload of all 30 layers exhausted the H200 host's 125 GiB."""
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


# The 24 GiB LoRA runs of issue #16 (bench/runs/2026-12-02_h200_checkpointing; LoRA r16 of the 7B, 8 x 512 per step,
# Liger's kernels, one H200 capped at 24 GiB): nothing fitted to these.
CAPPED_LORA_RUNS = [
    # (case, train overrides, measured max_memory_allocated GiB)
    ("lora30_cap24_ckpt24", {"gradient_checkpointing": 24}, 21.904),  # the first 24 of 30 layers checkpointed
    ("lora30_cap24_auto", {"micro_batch_size": 2}, 18.554),  # micro-batch 2 x 4, no checkpointing
]


@pytest.mark.parametrize(
    ("case", "overrides", "measured"), CAPPED_LORA_RUNS, ids=[r[0] for r in CAPPED_LORA_RUNS]
)
def test_plan_counts_partial_checkpointing_and_accumulation(case, overrides, measured):
    train = {"micro_batch_size": 8, "global_batch_size": 8, "lora": {"enabled": True}, "kernels": "liger"}
    train.update(overrides, fused_cross_entropy=False, loss_kernel="torch")  # BEST before the Triton loss
    setup = setups.setup_for(
        train, json.loads(Path(DEEPSPEED["zero0.json"]).read_text()), world=1, seq_len=512, precision="bf16"
    )
    assert setup.checkpoint_layers == overrides.get("gradient_checkpointing")
    est = memory.estimate(deepseek(30), setup)
    assert est.peak_allocated_gib == pytest.approx(measured, rel=TOLERANCE), (case, est)


TRITON_LOSS_RUNS = REPO / "bench/runs/2026-12-02_h200_triton_loss"
TRITON_LOSS_CASES = [
    # (case, layers, train overrides), as bench/throughput_cases.py defines them; 8 x 512, Liger kernels
    ("b24_liger", 24, {}),
    ("b24_liger_torch_loss", 24, {"loss_kernel": "torch"}),
    ("b30_liger", 30, {}),
    ("lora30_liger", 30, {"lora": {"enabled": True}}),
    ("lora30_cap24_ckpt16", 30, {"lora": {"enabled": True}, "gradient_checkpointing": 16}),
    ("lora30_cap24_ckpt18", 30, {"lora": {"enabled": True}, "gradient_checkpointing": 18}),
    ("lora30_cap24_auto", 30, {"lora": {"enabled": True}, "gradient_checkpointing": True}),
]


@pytest.mark.parametrize(
    ("case", "layers", "overrides"), TRITON_LOSS_CASES, ids=[c[0] for c in TRITON_LOSS_CASES]
)
def test_plan_counts_the_triton_loss(case, layers, overrides):
    """bench/RESULTS.md (issue #16, 2026-12-02): the runs with train.loss_kernel triton, whose 2 B per token and
    vocabulary entry (the bf16 logits, then their gradient in the same memory) are counted, not fitted; the
    torch loss beside them in the same device call."""
    results = [
        r
        for call in sorted(TRITON_LOSS_RUNS.glob("throughput_call*.json"))
        for r in json.loads(call.read_text())["results"]
    ]
    result = next(r for r in results if r["case"] == case)
    train = {"micro_batch_size": 8, "global_batch_size": 8, "kernels": "liger", "fused_cross_entropy": False}
    train.update({"loss_kernel": "triton", **overrides})
    assert result["settings"]["loss_kernel"] == train["loss_kernel"]
    ds = json.loads(Path(DEEPSPEED["zero0.json"]).read_text())
    setup = setups.setup_for(train, ds, world=1, seq_len=512, precision="bf16")
    assert setup.triton_loss == (train["loss_kernel"] == "triton")
    est = memory.estimate(deepseek(layers), setup)
    assert est.peak_allocated_gib == pytest.approx(result["peak_gib"], rel=TOLERANCE), est
    if setup.triton_loss:
        assert est.logits_gib == pytest.approx((2 * 4096 * 102400 + 8 * 4096) / 2**30)


def test_checkpointing_some_layers_is_planned_as_configured():
    """train.gradient_checkpointing: N plans N checkpointed layers (between none and all of them), under the
    name zero0+ckptN, and `auto` replaces it by a strategy of its own (every layer or none)."""
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
    assert auto["chosen"]["name"] == "zero0+ckpt" and auto["chosen"]["gradient_checkpointing"] is True


def test_auto_halves_the_micro_batch_where_nothing_else_fits():
    """QLoRA at 4,096 tokens under 12 GiB: micro-batch 4 does not fit even with every layer checkpointed; the plan
    halves it (same global batch, twice the accumulation steps) and `auto` applies that to the run."""
    train = train_dict(
        gpus=1, global_batch_size=8, micro_batch_size=4, kernels="liger", fused_cross_entropy=True,
        deepspeed=DEEPSPEED["zero0.json"], lora={"enabled": True, "quantize": "nf4"},
    )  # fmt: skip
    result = make(SEVEN_B, {**train, "strategy": "auto"}, gib=12, host=256, max_length=4096)
    assert result["fits"] and result["chosen"]["micro_batch_size"] < 4
    assert result["chosen"]["name"] == f"zero0+ckpt+micro{result['chosen']['micro_batch_size']}"
    assert not any(c["fits"] for c in result["candidates"] if c["setup"]["micro_batch"] == 4)
    spec = {"train": train, "deepspeed_config": DEEPSPEED["zero0.json"], "run_key": "abc"}
    applied = apply.apply_plan(spec, result)
    assert applied["train"]["micro_batch_size"] == result["chosen"]["micro_batch_size"]
    assert applied["train"]["gradient_checkpointing"] is True and applied["run_key"] != "abc"
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
    from test_gpus import copy_workflow

    workdir = copy_workflow(tmp_path / "wf")
    extra = tmp_path / "big.yaml"
    extra.write_text(TOO_BIG)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", memory.ENV_HOST_MEMORY: "256"}
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "results/train/default/summary.json",
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
    assert (
        "ERROR in rule plan: PlanError: train.gpus 3 x 23.5 GiB (gpu_memory_gib: 24 (less 0.5 GiB for the driver))"
        in proc.stderr
    )
    assert "What would fit: zero3_offload needs" in proc.stderr, proc.stderr[-3000:]
    # The plan runs first (priority) and its failure stops the workflow: no other job ran.
    assert "Finished jobid" not in proc.stderr
    assert not (workdir / "logs/train").exists() and not (workdir / "results/plan/default.json").exists()


# QLoRA and 8-bit Adam states on one H200 (bench/RESULTS.md, issue #16; bench/runs/2026-12-01_h200_quantized): the
# QLoRA example as written through Snakemake (hub-format 7B, real oasst rows, 4,096 tokens, Liger kernels), and
# bench/train_throughput.py's 30-layer cases. NF4's and 8-bit states' bytes are counted, nothing was fitted to these.
QUANTIZED_RUNS = [
    # (overrides of the QLoRA example's train section, measured max_memory_allocated GiB)
    ({}, 10.303),  # gpu_memory_gib 16: micro-batch 2 x 4, checkpointing (the plan's pick)
    ({"micro_batch_size": 4}, 12.494),  # gpu_memory_gib 24: micro-batch 4 x 2
    ({"lora": {"enabled": True, "rank": 16, "alpha": 32, "quantize": "none"}}, 18.684),  # the bf16 base, 24
]


@pytest.mark.parametrize(
    ("overrides", "measured"), QUANTIZED_RUNS, ids=["qlora16", "qlora24-mb4", "lora-bf16"]
)
def test_plan_matches_the_qlora_example_on_an_h200(overrides, measured):
    cfg = yaml.safe_load((REPO / "config/examples/deepseek-7b-qlora-16gb.yaml").read_text())
    train = {**cfg["train"], **overrides, "kernels": "liger", "gradient_checkpointing": True}
    ds = json.loads((REPO / train["deepspeed"]).read_text())
    setup = setups.setup_for(train, ds, world=1, seq_len=int(cfg["tokenize"]["max_length"]), precision="bf16")
    est = memory.estimate(deepseek(30), setup)
    assert est.peak_allocated_gib == pytest.approx(measured, rel=TOLERANCE), est


def test_nf4_weights_are_counted():
    """4 bits per linear weight, an 8-bit absmax per 64 and an fp32 absmax per 256 of those; embeddings, lm_head
    and norms in bf16: 4.48 GiB for the 7B against 12.87 in bf16 (plus one dequantized weight at a time)."""
    arch = deepseek(30)
    lora = dict(world=1, zero_stage=0, lora_rank=16, lora_targets=ALL_LINEAR, master_weights=True)
    bf16 = memory.estimate(arch, memory.Setup(**lora))
    nf4 = memory.estimate(arch, memory.Setup(**lora, quantized=True))
    linear = 30 * sum(a * b for a, b in arch.linear_shapes().values())
    assert bf16.weights_gib * GIB == 2 * arch.params()
    assert nf4.weights_gib * GIB == pytest.approx(2 * (arch.params() - linear) + 0.515869 * linear, rel=1e-6)
    assert nf4.weights_gib == pytest.approx(4.48, abs=0.01)


# bench/train_throughput.py on one H200, 30 layers, 8 x 512, Liger kernels, snaketune's fp32 masters.
STATES_RUNS = [
    # (case, setup changes, measured GiB)
    ("b30_liger", {}, 109.980),
    ("b30_8bit", {"states_8bit": True}, 71.602),
    ("b30_8bit_auto80", {"states_8bit": True, "gradient_checkpointing": True}, 66.230),
]


@pytest.mark.parametrize(("case", "changes", "measured"), STATES_RUNS, ids=[r[0] for r in STATES_RUNS])
def test_plan_counts_8bit_states(case, changes, measured):
    setup = ds_setup(
        "zero0.json",
        world=1,
        micro_batch=8,
        seq_len=512,
        master_weights=True,
        varlen=True,
        liger=True,
        **changes,
    )
    est = memory.estimate(deepseek(30), setup)
    assert est.peak_allocated_gib == pytest.approx(measured, rel=TOLERANCE), (case, est)


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
        evaluation={"batch_size": 8, "max_new_tokens": 128, "quantize": "nf4"},
    )
    assert result["fits"] and result["chosen"]["name"] == "zero0+ckpt"
    assert result["evaluate"]["fits"] and result["evaluate"]["estimate"]["weights_gib"] < 5
    # The same evaluation in bf16 would not fit 16 GiB even at batch size 1.
    bf16_eval = search.plan_evaluation(
        deepseek(30),
        {"batch_size": 8, "max_new_tokens": 128},
        max_length=4096,
        precision="bf16",
        budget=budget,
    )
    assert bf16_eval["fits"] is False
