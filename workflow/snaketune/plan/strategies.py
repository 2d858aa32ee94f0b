"""The training strategies the memory plan weighs (snaketune.plan.search): ZeRO stage, offload and gradient checkpointing,
fastest first, and for full fine-tuning the same with 8-bit Adam states, then with the step in backward.

Speed order for `train.strategy: auto` (fastest first; STRATEGIES): relative throughputs are assumptions,
except offload, which was measured (docs/facts.md): ZeRO-0 1.0 and ZeRO-2 0.97 (the same communication volume:
reduce-scatter + all-gather = all-reduce, DeepSpeed's docs); ZeRO-3 0.8 (weights gathered in forward and
backward: 1.5x the traffic; worse over PCIe); gradient checkpointing x0.75 (a second forward, +1/3 of the
compute: RECOMPUTE); ZeRO-3 + CPU optimizer offload 0.09 (docs/facts.md: 928 tok/s for 3.67B parameters against
8,632 for 5.70B under ZeRO-2). Full fine-tuning or LoRA stays as configured; LoRA is
never planned with ZeRO-3 (the trainer refuses that combination). A full fine-tune with fp32 Adam states also
gets each strategy without offload with 8-bit states (train.optimizer_states), ranked after the fp32 ones and
before offload (snaketune.plan.candidates._with_8bit_states); after those, ZeRO-0 with and without checkpointing with the
optimizer step in backward and 4-bit states (train.optimizer_step: in_backward), at one micro-batch per step, still
before offload (snaketune.plan.candidates._with_backward_step). A strategy that does not fit at the configured micro-batch is
tried at its halvings (the same global batch, more accumulation steps; MICRO_SPEED, MICRO_SPEED_LORA per halving)
and the candidates of each group are then ordered by speed (snaketune.plan.candidates._by_speed).

Checkpointing only the first N layers (train.gradient_checkpointing: N): `train.strategy: auto` picks N (and the
micro-batch) where the memory model counts every saved tensor (snaketune.plan.memory: LoRA in bf16 with Liger's
kernels and varlen attention, within 0.7% of the runs with 0, 16, 18 and 30 of 30 layers checkpointed), under
gpu_memory_gib (whose ranks use expandable segments: no reserved-but-unallocated blocks), keeping PICK_MARGIN_GIB of
the budget free; elsewhere every layer, as before. Why not before: the QLoRA example narrowed to 25 of 30 layers under
16 GiB (planned 13.7 GiB allocated) ran out of memory asking for 1,000 MiB with 13.6 GiB allocated and 1.4 GiB
reserved but unallocated by fixed segments (bench/RESULTS.md, issue #16). Speed of N layers: `checkpointed_speed`.
"""

from __future__ import annotations

from dataclasses import dataclass

from snaketune.plan.memory import Setup


@dataclass(frozen=True)
class Strategy:
    name: str
    deepspeed_file: str
    """A file of config/deepspeed/."""
    gradient_checkpointing: bool
    relative_speed: float


RECOMPUTE = 1 / 3
"""Gradient checkpointing's extra compute against a step without it, full fine-tuning: a second forward pass of
every checkpointed layer (forward is a third of forward + backward): 1 / (1 + 1/3) = 0.75 of the speed without it."""
CHECKPOINTED = 1 / (1 + RECOMPUTE)
RECOMPUTE_LORA = 0.55
"""The same for LoRA, whose backward computes no gradients for the frozen weights, so that a second forward weighs
more: LoRA r16 of the 7B at 8 x 512 on one H200, every layer checkpointed 0.382 s per step against 0.247 without
(bench/RESULTS.md, issue #16, the Triton loss's calls 2-3): 0.382 / 0.247 - 1 = 0.55. Predicts the runs it was not
fitted to: 16 and 18 of 30 layers 0.319 and 0.328 s (measured 0.303, 0.331), 24 of 30 against 30 of 30 on an H100
1.076x (measured 12,207 against 11,392 tokens/s: 1.072x)."""
PICK_MARGIN_GIB = 0.25
"""What the plan's own pick of fewer checkpointed layers (`train.strategy: auto`) leaves of the budget beyond its
estimate: the counted model's largest under-estimate of a measured allocator peak (0.13 GiB, 0.7%: the runs with
16, 18 and 30 of 30 layers checkpointed, bench/RESULTS.md issue #16) twice. With the 2.0 GiB the plan counts outside
the allocator (1.72 measured with the kernels loaded later) a pick then leaves 0.5-1.0 GiB of the card unused."""
OFFLOAD_ACTIVATIONS_SPEED = 0.8
"""Relative speed of train.offload_activations (each checkpointed layer's input to host memory and back, one copy
each way per layer and step, on a copy stream of their own, the next layer's input fetched back ahead): measured
0.85 for the 7B's full fine-tune at one 2,048-token row per step, the step in backward (6,288 against 7,433
tokens/s on an H100, bench/RESULTS.md, issue #50); 0.8 for rows of other lengths and LoRA, unmeasured. The plan
offers it only where no setup without it fits (long rows), so it orders nothing that fits without it."""


def checkpointed_speed(lora: bool, layers: int, checkpointed: int) -> float:
    """Speed of a step with `checkpointed` of `layers` decoder layers recomputed, against none: each one adds its
    share of RECOMPUTE (RECOMPUTE_LORA for LoRA). Every layer: CHECKPOINTED for full fine-tuning."""
    return 1 / (1 + (RECOMPUTE_LORA if lora else RECOMPUTE) * checkpointed / layers)


STRATEGIES = (
    Strategy("zero0", "zero0.json", False, 1.00),
    Strategy("zero2", "zero2.json", False, 0.97),
    Strategy("zero3", "zero3.json", False, 0.80),
    Strategy("zero0+ckpt", "zero0.json", True, 1.00 * CHECKPOINTED),
    Strategy("zero2+ckpt", "zero2.json", True, 0.97 * CHECKPOINTED),
    Strategy("zero3+ckpt", "zero3.json", True, 0.80 * CHECKPOINTED),
    Strategy("zero3_offload", "zero3_offload.json", False, 0.09),
    Strategy("zero3_offload+ckpt", "zero3_offload.json", True, 0.09 * CHECKPOINTED),
)
"""Fastest first (the module docstring says why this order)."""
STRATEGY_FILES = {s.name: s.deepspeed_file for s in STRATEGIES}


MICRO_SPEED = 0.94
"""Relative speed of each halving of the micro-batch (twice the accumulation steps, the same tokens per optimizer
step): measured on one H200, the 24-layer full fine-tune at 4 x 2 against 8 x 1, 11,413 against 12,180 tokens/s
(bench/runs/2026-12-01_h200_explore2). Only orders the candidates of `train.strategy: auto`."""
MICRO_SPEED_LORA = 0.57
"""The same for LoRA, where the host is the bottleneck at small micro-batches (peft's adapters add a dozen small
kernels per linear layer): LoRA r16 of the 7B on one H200 capped at 24 GiB, micro-batch 2 x 4 ran at 0.759 s per
step against 0.248 s at 8 x 1 uncapped, 0.327 for two halvings (TRL + Liger: 1.582 against 0.367 s), and slower than
every layer checkpointed at 8 x 1 (0.379 s with 24 of 30 layers) (bench/RESULTS.md, issue #16). So LoRA halves its
micro-batch only where checkpointing alone does not fit."""


def strategy_name(s: Setup, micro: int | None = None) -> str:
    """zero2, zero0+ckpt (every layer), zero0+ckpt12 (the first 12), "+offload_activations" (their inputs in host
    memory), and with `micro` (the configured micro-batch size) "+micro2" where the setup's micro-batch differs."""
    name = f"zero{s.zero_stage}" + ("_offload" if s.offload_optimizer or s.offload_params else "")
    if s.gradient_checkpointing and s.checkpoint_layers is not None:
        name += f"+ckpt{s.checkpoint_layers}"  # the first N layers (train.gradient_checkpointing: N)
    elif s.gradient_checkpointing:
        name += "+ckpt"
    if s.offload_activations:
        name += "+offload_activations"
    if micro is not None and s.micro_batch != micro:
        name += f"+micro{s.micro_batch}"
    if s.in_backward:
        name += "+in_backward"
    return name


def checkpointing_setting(s: Setup) -> bool | int:
    """train.gradient_checkpointing for this setup: true, false or the number of (first) layers."""
    if s.gradient_checkpointing and s.checkpoint_layers is not None:
        return s.checkpoint_layers
    return s.gradient_checkpointing


def candidate_strategies(lora: bool, states_8bit: bool = False) -> list[Strategy]:
    """The strategies the trainer accepts: it refuses LoRA under ZeRO-3 and 8-bit Adam states with optimizer
    offload (DeepSpeed's CPU Adam keeps fp32 states; snaketune.train.engine)."""
    return [
        s
        for s in STRATEGIES
        if not (lora and s.deepspeed_file.startswith("zero3"))
        and not (states_8bit and "offload" in s.deepspeed_file)
    ]


SPEED_IN_BACKWARD = 0.8
"""Relative speed of the in-backward step with 4-bit states (snaketune.train.backward_step) against the same strategy
with fp32 masters: an assumption (one hook and one compiled update per tensor inside backward, no separate step),
placed between 8-bit states and CPU offload (0.09); it only orders the candidates."""

SPEED_8BIT = 0.63
"""Relative speed of 8-bit Adam states against fp32 states, measured where the step weighs most: the full 7B at
8 x 512 tokens per optimizer step on one H200, 7,914 against 12,480 tokens/s (bitsandbytes' block-wise update
and the fp32 gradient copy it needs cost 0.19 s per step for 6.9B parameters; bench/RESULTS.md). With more
tokens per step the ratio is closer to 1; it only orders the candidates."""
