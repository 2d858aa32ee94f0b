"""The training strategies the memory plan weighs (snaketune.plan): ZeRO stage, offload and gradient checkpointing,
fastest first, and for full fine-tuning the same with 8-bit Adam states.

Speed order for `train.strategy: auto` (fastest first; STRATEGIES): relative throughputs are assumptions,
except offload, which FACTS.md measured: ZeRO-0 1.0 and ZeRO-2 0.97 (the same communication volume:
reduce-scatter + all-gather = all-reduce, DeepSpeed's docs); ZeRO-3 0.8 (weights gathered in forward and
backward: 1.5x the traffic; worse over PCIe); gradient checkpointing x0.75 (a second forward, +1/3 of the
compute); ZeRO-3 + CPU optimizer offload 0.09 and 0.07 with checkpointing (FACTS.md: 928 tok/s for 3.67B
parameters against 8,632 for 5.70B under ZeRO-2). Full fine-tuning or LoRA stays as configured; LoRA is
never planned with ZeRO-3 (the trainer refuses that combination). A full fine-tune with fp32 Adam states also
gets each strategy without offload with 8-bit states (train.optimizer_states), ranked after the fp32 ones and
before offload (snaketune.plan._with_8bit_states).
"""

from __future__ import annotations

from dataclasses import dataclass

from snaketune.memory import Setup


@dataclass(frozen=True)
class Strategy:
    name: str
    deepspeed_file: str
    """A file of config/deepspeed/."""
    gradient_checkpointing: bool
    relative_speed: float


STRATEGIES = (
    Strategy("zero0", "zero0.json", False, 1.00),
    Strategy("zero2", "zero2.json", False, 0.97),
    Strategy("zero3", "zero3.json", False, 0.80),
    Strategy("zero0+ckpt", "zero0.json", True, 0.75),
    Strategy("zero2+ckpt", "zero2.json", True, 0.73),
    Strategy("zero3+ckpt", "zero3.json", True, 0.60),
    Strategy("zero3_offload", "zero3_offload.json", False, 0.09),
    Strategy("zero3_offload+ckpt", "zero3_offload.json", True, 0.07),
)
"""Fastest first (the module docstring says why this order)."""
STRATEGY_FILES = {s.name: s.deepspeed_file for s in STRATEGIES}


def strategy_name(s: Setup) -> str:
    name = f"zero{s.zero_stage}" + ("_offload" if s.offload_optimizer or s.offload_params else "")
    return name + ("+ckpt" if s.gradient_checkpointing else "")


def candidate_strategies(lora: bool) -> list[Strategy]:
    # The trainer refuses LoRA under ZeRO-3 (snaketune.training).
    return [s for s in STRATEGIES if not (lora and s.deepspeed_file.startswith("zero3"))]


SPEED_8BIT = 0.63
"""Relative speed of 8-bit Adam states against fp32 states, measured where the step weighs most: the full 7B at
8 x 512 tokens per optimizer step on one H200, 7,914 against 12,480 tokens/s (bitsandbytes' block-wise update
and the fp32 gradient copy it needs cost 0.19 s per step for 6.9B parameters; bench/RESULTS.md). With more
tokens per step the ratio is closer to 1; it only orders the candidates."""
