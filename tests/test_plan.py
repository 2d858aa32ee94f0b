"""The preflight memory model (snaketune.plan.memory) against measured peaks: docs/facts.md's H200 points, this
project's own H200 runs (the fast path, Liger, the example configs, partial checkpointing under a 24 GiB cap, the
Triton loss, QLoRA, 8-bit states), exact parameter counts and a local model's config.json. Each table says which
runs a constant was fitted to and which it predicts. What the plan does with these numbers (the plan file, a
configuration that does not fit, train.strategy auto): tests/test_plan_search.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from snaketune.config.load import load_config, to_dict
from snaketune.model.architectures import DEEPSEEK_LLM_7B
from snaketune.plan import evaluation, memory, setups, strategies
from snaketune.plan.arch import Arch, arch_from_hf_config, resolve_arch
from snaketune.plan.memory import GIB

REPO = Path(__file__).resolve().parent.parent
DEEPSPEED = {name: str(REPO / "config/deepspeed" / name) for name in strategies.STRATEGY_FILES.values()}
ALL_LINEAR = setups.LORA_TARGETS
H200_RUN = REPO / "bench/log/2026-11-29_h200/zero2_summary.json"
TOLERANCE = 0.10
"""How far over a measured peak the plan may be (a plan that refuses what fits costs speed, not a run)."""
FITTED = 0.02
"""How close the plan must be to the points a constant was fitted to (memory.ACTIVATION_FACTOR, LORA_ACTIVATION_FACTOR)."""


def assert_planned(predicted: float, measured: float, what: object = "") -> None:
    """A planned allocator peak against a measured one: at most TOLERANCE over, and never so far under that the
    plan's own margin (FRAGMENTATION of the peak) does not cover it: such a plan would pass a card that the run
    does not fit."""
    assert predicted * (1 + memory.FRAGMENTATION) >= measured, (
        f"{predicted:.2f} GiB planned, {measured} measured: {what}"
    )
    assert predicted <= measured * (1 + TOLERANCE), (
        f"{predicted:.2f} GiB planned, {measured} measured: {what}"
    )


def deepseek(layers: int) -> Arch:
    return arch_from_hf_config({**DEEPSEEK_LLM_7B, "num_hidden_layers": layers})


def ds_setup(name: str, **fields) -> memory.Setup:
    return setups.setup_from_deepspeed(json.loads(Path(DEEPSPEED[name]).read_text()), **fields)


# The measured points of docs/facts.md (one H200, random-init 7B architecture, seq 512): (what, layers,
# setup, measured GiB, which figure: a GPU peak the model predicts, one a constant was fitted to, host memory). docs/facts.md does not say which DeepSpeed buckets its runs used; these use
# the project's files.
FACTS = [
    ("bf16 ZeRO-2, 4 x 2", 24, ds_setup("zero2.json", world=1, micro_batch=4, seq_len=512), 116.8, "gpu"),
    (
        "LoRA r16 all linear, bf16, 8 x 1",
        30,
        ds_setup("zero2.json", world=1, micro_batch=8, seq_len=512, lora_rank=16, lora_targets=ALL_LINEAR),
        # Measured with this project's trainer (bench/log/2026-11-29_h200_plan); docs/facts.md's 45.4 GiB for the
        # same setup came from other training code. LORA_ACTIVATION_FACTOR is fitted to it.
        37.6,
        "fitted",
    ),
    *[
        (
            "bf16 autocast, torch fused AdamW, no DeepSpeed, 4 x 2",
            layers,
            memory.Setup(
                world=1, zero_stage=0, engine="torch", precision="autocast", micro_batch=4, seq_len=512
            ),
            measured,
            "fitted",  # ACTIVATION_FACTOR is fitted to these two
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
    if which == "fitted":
        assert est.peak_allocated_gib == pytest.approx(measured, rel=FITTED), (
            f"{what}, {layers} layers: {est}"
        )
    elif which == "gpu":
        assert_planned(est.peak_allocated_gib, measured, f"{what}, {layers} layers: {est}")
    else:  # the host keeps 1 - HOST_USABLE of its RAM in reserve
        assert est.host_gib == pytest.approx(measured, rel=TOLERANCE), f"{what}, {layers} layers: {est}"


def test_plan_matches_this_projects_own_h200_run():
    """bench/RESULTS.md: the train rule, 24 layers, ZeRO-2 bf16, micro-batch 4 x 2, seq 512 on one H200."""
    summary = json.loads(H200_RUN.read_text())
    setup = ds_setup("zero2.json", world=1, micro_batch=summary["micro_batch_size"], seq_len=512)
    est = memory.estimate(deepseek(24), setup)
    assert est.params == summary["parameters"] == 5_696_065_536
    assert_planned(est.peak_allocated_gib, summary["peak_memory_gib_per_rank"][0])
    # One GPU under ZeRO-2 peaks in the optimizer step at 22 B/param (docs/facts.md).
    assert est.peak_phase == "optimizer step"
    assert est.peak_allocated_gib * 2**30 / est.params == pytest.approx(22, rel=0.01)


FAST_PATH_RUN = REPO / "bench/log/2026-12-01_h200_final/throughput.json"


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
        # as the run's summary says it ran (the plan's own default for an absent key is the fused loss)
        "fused_cross_entropy": result["settings"]["fused_cross_entropy"],
    }
    if case == "b24_ds_zero2":
        train.update(bf16_optimizer="deepspeed", attention="sdpa")
    setup = setups.setup_for(
        train, json.loads(Path(DEEPSPEED[deepspeed]).read_text()), world=1, seq_len=512, precision="bf16"
    )
    assert setup.master_weights == (case != "b24_ds_zero2") and setup.varlen == (case != "b24_ds_zero2")
    assert setup.accumulation == 8 // micro
    est = memory.estimate(deepseek(layers), setup)
    assert_planned(est.peak_allocated_gib, result["peak_gib"], est)


LIGER_RUN = REPO / "bench/log/2026-12-01_h200_liger/throughput.json"


@pytest.mark.parametrize(("case", "layers", "lora"), [("b24_liger", 24, False), ("lora30_liger", 30, True)])
def test_plan_counts_what_liger_saves(case, layers, lora):
    """bench/RESULTS.md (issue #16): the same runs with Liger's RMSNorm, RoPE and SwiGLU measured 5.1 and 4.4 GiB
    less; the plan counts what those kernels do not save for backward (nothing fitted to these runs). LoRA with
    Liger is counted tensor by tensor (memory.counted: `test_counted_lora_memory_matches_every_run` below), so its
    difference from the fitted torch modules' figure is not a count of Liger's savings: only its peak is checked."""
    result = next(r for r in json.loads(LIGER_RUN.read_text())["results"] if r["case"] == case)
    train = {"micro_batch_size": 8, "global_batch_size": 8, "lora": {"enabled": lora}, "kernels": "liger"}
    train.update(fused_cross_entropy=False, loss_kernel="torch")  # BEST before the Triton loss
    ds = json.loads(Path(DEEPSPEED["zero0.json"]).read_text())
    setup = setups.setup_for(train, ds, world=1, seq_len=512, precision="bf16")
    assert setup.liger
    est = memory.estimate(deepseek(layers), setup)
    assert_planned(est.peak_allocated_gib, result["peak_gib"], est)
    assert memory.counted(setup) == lora
    if lora:
        return
    torch_modules = memory.estimate(deepseek(layers), setup.replace(liger=False))
    baseline = next(
        r for r in json.loads(LIGER_RUN.read_text())["results"] if r["case"] == case[: -len("_liger")]
    )
    saved = torch_modules.peak_allocated_gib - est.peak_allocated_gib
    assert saved == pytest.approx(baseline["peak_gib"] - result["peak_gib"], rel=0.05)


# issue #26's first H200 call (bench/RESULTS.md): the 7B's full fine-tune at 1 x 2,048 packed tokens, every layer
# checkpointed, Liger, the Triton loss; the step in backward with 4-bit states (its update then whole-tensor, since
# chunked: a constant of the update, not of a layer) and ZeRO-3 with DeepSpeed's CPU optimizer offload.
LONG_ROW_RUN = REPO / "bench/log/2026-12-03_h200_in_backward/throughput_call1_unchunked.json"


def _long_row(case: str, **train) -> tuple[memory.Setup, dict]:
    result = next(r for r in json.loads(LONG_ROW_RUN.read_text())["results"] if r["case"] == case)
    train = {"micro_batch_size": 1, "global_batch_size": 1, "kernels": "liger", "loss_kernel": "triton",
             "gradient_checkpointing": True, **train}  # fmt: skip
    ds = json.loads(Path(DEEPSPEED[train.pop("deepspeed")]).read_text())
    return setups.setup_for(train, ds, world=1, seq_len=2048, precision="bf16"), result


def test_plan_matches_zero3_offload_on_an_h200():
    """full20_offload: 13.01 GiB allocated, 20 layers. DeepSpeed reads each offloaded gradient partition back to
    the GPU and takes its norm in float64 pieces: for the embedding, 2.64 GiB the plan missed (11.18 planned)."""
    setup, result = _long_row("full20_offload", deepspeed="zero3_offload.json")
    assert setup.zero_stage == 3 and setup.offload_optimizer and setup.triton_loss
    est = memory.estimate(deepseek(20), setup)
    assert_planned(est.peak_allocated_gib, result["peak_gib"], est)


PLAN_RUNS = str(REPO) + "/bench/log/2026-11-29_h200_plan_{}/plan_vs_measured.json"


@pytest.mark.parametrize(
    ("run", "case", "micro"), [("rerun", "zero3_offload_14", 4), ("zero3", "zero3_offload_14_24g", 2)]
)
def test_plan_matches_zero3_offload_at_smaller_micro_batches(run, case, micro):
    """bench/RESULTS.md (issue #6): 14 layers, 4 x 2 and 2 x 4 rows of 512, checkpointing, the plain loss: 10.69
    and 10.56 GiB allocated. The second was 11.5% over the plan until the offloaded gradient was counted: the
    float64 norm pieces and the GPU copy do not shrink with the micro-batch."""
    result = next(
        r for r in json.loads(Path(PLAN_RUNS.format(run)).read_text())["results"] if r["case"] == case
    )
    setup = ds_setup(
        "zero3_offload.json", world=1, micro_batch=micro, seq_len=512, gradient_checkpointing=True
    )
    est = memory.estimate(deepseek(14), setup)
    assert_planned(est.peak_allocated_gib, result["measured_gib"], est)


def test_ten_layers_of_the_step_in_backward_cost_what_they_measured():
    """full30_inbwd against full20_inbwd of the same call: 24.59 and 18.66 GiB allocated. The planned cost of ten
    layers (bf16 weights, 4-bit states, checkpointed inputs) within 2% of the measured 5.93 GiB; nothing in the
    plan was fitted to these runs."""
    peaks = {}
    for layers in (20, 30):
        setup, result = _long_row(f"full{layers}_inbwd", deepspeed="zero0.json", optimizer_step="in_backward",
                                  optimizer_states="4bit")  # fmt: skip
        assert setup.in_backward and setup.states_4bit
        peaks[layers] = (memory.estimate(deepseek(layers), setup).peak_allocated_gib, result["peak_gib"])
    planned, measured = (peaks[30][i] - peaks[20][i] for i in (0, 1))
    assert planned == pytest.approx(measured, rel=0.02), peaks


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
    assert_planned(est.peak_allocated_gib, measured, est)


def test_parameter_counts_are_exact():
    assert deepseek(30).params() == 6_910_365_696  # docs/facts.md
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


# The 24 GiB LoRA runs of issue #16 (bench/log/2026-12-02_h200_checkpointing; LoRA r16 of the 7B, 8 x 512 per step,
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
    assert_planned(est.peak_allocated_gib, measured, (case, est))


# LoRA r16 of the 7B (30 layers) in bf16 with Liger's kernels and varlen attention, ZeRO-0, one H200: the setups the
# plan counts tensor by tensor (memory.counted), the 24 GB cards' training. (case, train overrides, micro-batch x row,
# measured max_memory_allocated GiB, "fitted" where memory.COUNTED_REST_GIB was fitted to it, else "held out").
COUNTED_LORA_RUNS = [
    # bench/log/2026-12-02_h200_triton_loss calls 2-3 and 2026-12-02_h200_trust call 1: the Triton loss at 8 x 512
    ("0 of 30 checkpointed", {"gradient_checkpointing": False}, (8, 512), 29.337, "fitted"),
    ("16 of 30", {"gradient_checkpointing": 16}, (8, 512), 21.878, "fitted"),
    ("18 of 30", {"gradient_checkpointing": 18}, (8, 512), 20.934, "fitted"),
    ("every layer", {"gradient_checkpointing": True}, (8, 512), 15.269, "fitted"),
    # bench/log/2026-12-02_h200_checkpointing calls 2, 3, 6 and 2026-12-01_h200_liger: the torch loss (12 B per entry)
    (
        "torch loss, 0 of 30",
        {"gradient_checkpointing": False, "loss_kernel": "torch"},
        (8, 512),
        33.203,
        "held out",
    ),
    (
        "torch loss, 24 of 30",
        {"gradient_checkpointing": 24, "loss_kernel": "torch"},
        (8, 512),
        21.904,
        "held out",
    ),
    (
        "torch loss, every layer",
        {"gradient_checkpointing": True, "loss_kernel": "torch"},
        (8, 512),
        19.072,
        "held out",
    ),  # fmt: skip
    # the QLoRA example through Snakemake, rows of 4,096, the fused loss, every layer (QUANTIZED_RUNS below)
    ("QLoRA 2 x 4,096", {"lora": {"enabled": True, "quantize": "nf4"}}, (2, 4096), 10.303, "held out"),
    ("QLoRA 4 x 4,096", {"lora": {"enabled": True, "quantize": "nf4"}}, (4, 4096), 12.494, "held out"),
    ("bf16 base 2 x 4,096", {}, (2, 4096), 18.684, "held out"),
]
COUNTED = 0.01
"""How close the counted LoRA model comes to each of COUNTED_LORA_RUNS (measured: within 0.5%)."""


@pytest.mark.parametrize(
    ("what", "overrides", "rows", "measured", "which"),
    COUNTED_LORA_RUNS,
    ids=[r[0] for r in COUNTED_LORA_RUNS],
)
def test_counted_lora_memory_matches_every_run(what, overrides, rows, measured, which):
    """Every tensor a LoRA decoder layer with Liger's kernels saves, counted (memory._lora_layer), predicts the
    allocator peaks of runs with 0 to 30 of 30 layers checkpointed, three losses and rows of 512 and 4,096 tokens
    within 1%, on either side: what the plan's own pick of checkpointed layers (train.strategy auto) relies on."""
    micro, seq = rows
    # The 8 x 512 runs step after each micro-batch; the QLoRA example accumulates to 8 rows per step.
    batch = micro if seq == 512 else 8
    train = {
        "micro_batch_size": micro,
        "global_batch_size": batch,
        "kernels": "liger",
        "loss_kernel": "triton",
    }
    train.update(lora={"enabled": True}, fused_cross_entropy=seq > 512, gradient_checkpointing=True)
    train.update(overrides)
    setup = setups.setup_for(train, json.loads(Path(DEEPSPEED["zero0.json"]).read_text()), world=1, seq_len=seq,
                             precision="bf16")  # fmt: skip
    assert memory.counted(setup)
    est = memory.estimate(deepseek(30), setup)
    assert est.peak_allocated_gib == pytest.approx(measured, rel=COUNTED), (what, which, est)


# Device memory (NVML) of LoRA runs under gpu_memory_gib 24, the Triton loss at 8 x 512, PyTorch's fixed segments
# (before capped ranks turned on expandable segments): (what, checkpointed layers, measured GiB, where). Nothing in
# the plan is fitted to NVML figures.
CAPPED_DEVICE_RUNS = [
    ("every layer, H200", True, 17.645, "bench/log/2026-12-02_h200_trust/call1_capped (lora30_cap24_auto)"),
    ("24 of 30 layers, H100", 24, 20.96, "issue #50's text: one H100, 2026-12-06, 12,207 tokens/s"),
]


@pytest.mark.parametrize(("what", "layers", "measured", "where"), CAPPED_DEVICE_RUNS)
def test_device_peaks_of_capped_lora_runs(what, layers, measured, where):
    """What the plan says a GPU must hold (allocator peak, FRAGMENTATION, CUDA_OVERHEAD_GIB) against NVML's peak:
    never under it, and at most 0.5 GiB over (the plan's pick then leaves at most about 1 GiB of a card unused)."""
    train = {"micro_batch_size": 8, "global_batch_size": 8, "kernels": "liger", "loss_kernel": "triton",
             "lora": {"enabled": True}, "gradient_checkpointing": layers}  # fmt: skip
    setup = setups.setup_for(train, json.loads(Path(DEEPSPEED["zero0.json"]).read_text()), world=1, seq_len=512,
                             precision="bf16")  # fmt: skip
    assert not setup.expandable_segments  # as they ran
    predicted = memory.estimate(deepseek(30), setup).gpu_gib
    assert measured <= predicted <= measured + 0.5, (what, predicted, where)


TRITON_LOSS_RUNS = REPO / "bench/log/2026-12-02_h200_triton_loss"
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
    assert_planned(est.peak_allocated_gib, result["peak_gib"], est)


# QLoRA and 8-bit Adam states on one H200 (bench/RESULTS.md, issue #16; bench/log/2026-12-01_h200_quantized): the
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
    assert_planned(est.peak_allocated_gib, measured, est)


def test_nf4_weights_are_counted():
    """4 bits per linear weight, an 8-bit absmax per 64 and an fp32 absmax per 256 of those, as bitsandbytes stores
    them (measured here on one weight); embeddings, lm_head and norms in bf16: 4.48 GiB for the 7B against 12.87 in
    bf16 (plus one dequantized weight at a time)."""
    import bitsandbytes.functional as bnb

    weight = torch.randn(4096, 4096, dtype=torch.bfloat16)
    codes, state = bnb.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    stored = sum(t.numel() * t.element_size() for t in (codes, state.absmax, state.state2.absmax))
    assert stored / weight.numel() == pytest.approx(memory.NF4_BYTES, rel=1e-9)
    arch = deepseek(30)
    lora = dict(world=1, zero_stage=0, lora_rank=16, lora_targets=ALL_LINEAR, master_weights=True)
    bf16 = memory.estimate(arch, memory.Setup(**lora))
    nf4 = memory.estimate(arch, memory.Setup(**lora, quantized=True))
    linear = 30 * sum(a * b for a, b in arch.linear_shapes().values())
    assert bf16.weights_gib * GIB == 2 * arch.params()
    assert nf4.weights_gib * GIB == pytest.approx(
        2 * (arch.params() - linear) + stored / 4096**2 * linear, rel=1e-9
    )
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
    assert_planned(est.peak_allocated_gib, measured, (case, est))


# The DPO stage of the 3 x 24 GB LoRA recipe as written (one rank, hub-format 7B, real oasst pairs, 1,024 tokens per
# side, micro-batch 2 x 12, checkpointing): its own plan (rule plan_dpo: objective preference, rows of both sides,
# the chunked log-probabilities), nothing fitted to these.
DPO_RUNS = [
    # (train.kernels, measured max_memory_allocated GiB, where)
    ("torch", 16.59, "bench/log/2026-12-01_h200_realpath_lora"),
    ("liger", 16.54, "bench/log/2026-12-02_h200_trust (bench/RESULTS.md, the 3 x 24 GB recipe's stages)"),
]


@pytest.mark.parametrize(("kernels", "measured", "where"), DPO_RUNS, ids=[r[0] for r in DPO_RUNS])
def test_plan_matches_the_dpo_stage_on_an_h200(kernels, measured, where):
    from snaketune.config.load import merge_config_files

    raw = merge_config_files(
        [REPO / "config/config.yaml", REPO / "config/examples/deepseek-7b-lora-3x24gb.yaml"]
    )
    exp = load_config(raw).experiments["default"]
    train = {**to_dict(exp.dpo_train), "gpus": 1, "kernels": kernels}
    ds = json.loads((REPO / train["deepspeed"]).read_text())
    setup = setups.setup_for(
        train, ds, world=1, seq_len=2 * exp.preference.max_length, precision="bf16", objective="preference"
    )
    assert (setup.micro_batch, setup.accumulation, setup.objective) == (2, 12, "preference")
    assert setup.fused_cross_entropy and not setup.triton_loss  # DPO's chunked log-probabilities
    assert_planned(memory.estimate(deepseek(30), setup).peak_allocated_gib, measured, where)


# The evaluate stage of the LoRA, full fine-tuning and QLoRA recipes on one H200 (bench/RESULTS.md, issues #13/#15/
# #16): the stage's own estimate for the lengths it met (validation rows of max_length - 1 tokens, prompts of at most
# 90, 128 new tokens; results/eval/default/metrics.json's `memory`) against its measured peaks, per phase. Nothing
# fitted.
EVAL_RUNS = [
    # (run, batch, validation row tokens, in 4 bits, measured validation GiB, measured generation GiB)
    ("2026-12-01_h200_realpath_lora", 4, 2047, False, 15.407, 13.309),
    ("2026-12-01_h200_realpath_full", 8, 2047, False, 15.438, 13.714),
    ("2026-12-01_h200_quantized", 2, 4081, True, 7.025, 4.725),  # the QLoRA example: its models in NF4
]


@pytest.mark.parametrize(
    ("run", "batch", "rows", "nf4", "validation", "generation"), EVAL_RUNS, ids=[r[0] for r in EVAL_RUNS]
)
def test_evaluation_estimate_matches_the_measured_peaks(run, batch, rows, nf4, validation, generation):
    setup = evaluation.EvalSetup(batch=batch, seq_len=rows, prompt_len=90, new_tokens=128, quantized=nf4)
    est = evaluation.estimate_eval(deepseek(30), setup)
    assert_planned(est.validation_gib, validation, (run, "validation", est))
    assert_planned(est.generation_gib, generation, (run, "generation", est))
