"""A configuration as the memory model sees it: the `Setup` a training with given train settings and DeepSpeed file
runs (snaketune.train.trainer decides the same way), and the plan's entry for one strategy."""

from __future__ import annotations

import dataclasses

from snaketune.config.deepspeed import offloads, uses_master_weights, zero_stage
from snaketune.config.schema import LoraConfig
from snaketune.model import kernels
from snaketune.plan.budget import Budget
from snaketune.plan.memory import Estimate, Setup
from snaketune.plan.strategies import checkpointing_setting

LORA_TARGETS = LoraConfig().targets
"""LoRA's default targets: every linear layer of a decoder layer."""


def setup_from_deepspeed(ds: dict, **fields) -> Setup:
    """A Setup with the ZeRO stage, offload and buckets of a DeepSpeed JSON (DeepSpeed's defaults where absent)."""
    zero = ds.get("zero_optimization") or {}
    stage = zero_stage(ds)
    return Setup(
        zero_stage=stage,
        offload_optimizer=stage > 0 and offloads(ds),
        offload_params=stage == 3 and offloads(ds, "offload_param"),
        reduce_bucket=float(zero.get("reduce_bucket_size", 5e8)),
        prefetch_bucket=float(zero.get("stage3_prefetch_bucket_size", 5e7)),
        sub_group=float(zero.get("sub_group_size", 1e9)),
        overlap_comm=bool(zero.get("overlap_comm", stage == 3)),
        contiguous_gradients=bool(zero.get("contiguous_gradients", True)),
        **fields,
    )


def setup_for(
    train: dict,
    ds: dict,
    *,
    world: int,
    seq_len: int,
    precision: str,
    objective: str = "sft",
    capped: bool = False,
    **changes,
) -> Setup:
    """The Setup a training with these train settings and this DeepSpeed file runs (snaketune.train.trainer decides
    the same way: MasterWeightAdamW at ZeRO-0 in bf16 without offload unless train.bf16_optimizer says
    deepspeed; the fused loss except under ZeRO-3; varlen attention in bf16 unless train.attention is sdpa; Liger's
    kernels in bf16 and the Triton loss where snaketune.model.kernels.planned / triton_planned say the ranks run them).
    The preference objective (snaketune.preference.dpo) ignores train.loss_kernel and train.fused_cross_entropy: its
    per-token log-probabilities are chunked over the tokens like the fused loss, except under ZeRO-3, where they
    come from the whole logits in fp32 (snaketune.preference.logprobs). `capped`: the ranks run under gpu_memory_gib,
    where they turn on the allocator's expandable segments (snaketune.device_memory.allocator_settings), as the step
    in backward does everywhere."""
    lora = train.get("lora") or {}
    stage = zero_stage(ds)
    # The step in backward runs at ZeRO-0 without offload only (snaketune.config.deepspeed.check_in_backward): another
    # stage among the candidates is weighed with the usual step and fp32 or 8-bit states.
    in_backward = (
        train.get("optimizer_step", "after_backward") == "in_backward" and stage == 0 and not offloads(ds)
    )
    states = train.get("optimizer_states", "fp32")
    if states == "4bit" and not in_backward:
        states = "fp32"
    master = not in_backward and uses_master_weights(
        ds, train.get("bf16_optimizer", "auto"), bf16=precision == "bf16"
    )
    world_micro = int(train["micro_batch_size"]) * world
    checkpointing = train.get("gradient_checkpointing")
    partial = None if isinstance(checkpointing, bool) or checkpointing is None else int(checkpointing)
    fields = dict(
        accumulation=max(1, int(train.get("global_batch_size", world_micro)) // world_micro),
        master_weights=master,
        fused_cross_entropy=stage != 3
        and (objective == "preference" or bool(train.get("fused_cross_entropy", False))),
        varlen=precision == "bf16" and train.get("attention", "auto") != "sdpa",
        liger=precision == "bf16" and kernels.planned(train.get("kernels", "auto")),
        triton_loss=objective == "sft" and kernels.triton_planned(train.get("loss_kernel", "auto")),
        objective=objective,
        world=world,
        gradient_checkpointing=bool(checkpointing),
        checkpoint_layers=partial,
        micro_batch=int(train["micro_batch_size"]),
        seq_len=seq_len,
        precision=precision,
        lora_rank=int(lora.get("rank", 16)) if lora.get("enabled") else 0,
        lora_targets=tuple(lora.get("targets") or LORA_TARGETS),
        quantized=bool(lora.get("enabled")) and lora.get("quantize", "none") != "none",
        states_8bit=states == "8bit",
        states_4bit=states == "4bit",
        in_backward=in_backward,
        expandable_segments=in_backward or capped,
        offload_activations=bool(train.get("offload_activations", False)) and bool(checkpointing),
        compiled=bool(train.get("compile", False)),
    )
    if "gradient_checkpointing" in changes:
        fields["checkpoint_layers"] = None  # a candidate strategy (snaketune.plan.strategies): every layer
    fields.update(changes)
    return setup_from_deepspeed(ds, **fields)


def plan_entry(name: str, deepspeed: str, s: Setup, est: Estimate, budget: Budget, **extra) -> dict:
    return {
        "name": name,
        "deepspeed_config": deepspeed,
        "gradient_checkpointing": checkpointing_setting(s),
        "setup": dataclasses.asdict(s),
        "estimate": est.as_dict(),
        "fits": budget.fits(est),
        **extra,
    }


def format_entry(entry: dict) -> str:
    est = entry["estimate"]
    text = f"{entry['name']} needs {est['gpu_gib']:.1f} GiB per GPU"
    if entry["setup"]["offload_optimizer"] or entry["setup"]["offload_params"]:
        text += f" and {est['host_gib']:.0f} GiB host RAM"
    return text
