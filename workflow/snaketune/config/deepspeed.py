"""DeepSpeed config: the user's JSON (ZeRO stage, offload, buckets) + what the workflow derives.

Batch sizes, accumulation, clipping and precision come from config.yaml (train.*), so one place decides
them and the global batch stays the same for any world size. A JSON that sets them to concrete values
is refused rather than silently overridden.
"""

from __future__ import annotations

import copy

from snaketune.config.choices import ConfigError
from snaketune.config.schema import TrainConfig

# Keys the workflow fills in; allowed in the file only as "auto" (HF convention) or absent.
DERIVED = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "bf16",
    "fp16",
    "optimizer",
    "scheduler",
)
# Top-level keys passed through to DeepSpeed; anything else is most likely a typo.
ALLOWED = (
    "zero_optimization",
    "steps_per_print",
    "wall_clock_breakdown",
    "communication_data_type",
    "prescale_gradients",
    "gradient_predivide_factor",
    "zero_allow_untested_optimizer",
    "zero_force_ds_cpu_optimizer",
    "flops_profiler",
    "comms_logger",
    "data_types",
    "seq_parallel_communication_data_type",
    "torch_autocast",
    "_comment",
)
ZERO_STAGES = (0, 1, 2, 3)


def _is_auto(value) -> bool:
    return value == "auto" or (isinstance(value, dict) and value.get("enabled") == "auto")


def build_ds_config(
    file_cfg: dict,
    train: TrainConfig,
    *,
    world_size: int,
    bf16: bool,
    source: str,
    master_weights: bool = False,
) -> dict:
    """The full DeepSpeed config for a run; errors name the file and the key.

    With `master_weights` (snaketune.train.optim.MasterWeightAdamW: bf16 model, fp32 masters in the optimizer)
    DeepSpeed's own bf16 handling stays off, so that it neither casts the model nor adds fp32 gradient
    copies; the optimizer clips (in fp32), and gradients are all-reduced in fp32 unless the file says
    otherwise (a bf16 sum over ranks would round every step's gradient)."""
    import difflib

    for key, value in file_cfg.items():
        if key in DERIVED:
            if not _is_auto(value):
                raise ConfigError(
                    f"{source}: key '{key}' is set by the workflow from config.yaml (train.*); "
                    f'remove it or set it to "auto"'
                )
        elif key not in ALLOWED:
            guess = difflib.get_close_matches(key, list(ALLOWED) + list(DERIVED), n=1)
            hint = f"; did you mean '{guess[0]}'?" if guess else ""
            raise ConfigError(f"{source}: unknown key '{key}'{hint} allowed: {', '.join(ALLOWED)}")
    cfg = {k: copy.deepcopy(v) for k, v in file_cfg.items() if k not in DERIVED and k != "_comment"}
    zero = cfg.setdefault("zero_optimization", {"stage": 0})
    if zero.get("stage", 0) not in ZERO_STAGES:
        raise ConfigError(f"{source}: zero_optimization.stage {zero.get('stage')!r}; allowed: 0, 1, 2, 3")
    gas = train.accumulation_steps(world_size)
    in_backward = train.optimizer_step == "in_backward"
    own_step = master_weights or in_backward  # the optimizer clips, and the bf16 weights stay as they are
    cfg.update(
        train_batch_size=train.global_batch_size,
        train_micro_batch_size_per_gpu=train.micro_batch_size,
        gradient_accumulation_steps=gas,
        gradient_clipping=0.0 if own_step else train.grad_clip,
        bf16={"enabled": bf16 and not own_step},
        fp16={"enabled": False},
    )
    if in_backward:
        check_in_backward(cfg, train, world_size, source)
    if master_weights:
        if zero_stage(cfg) != 0:
            raise ConfigError(
                f"{source}: train.bf16_optimizer 'snaketune' needs zero_optimization.stage 0 (found "
                f"{zero_stage(cfg)}); use config/deepspeed/zero0.json or train.bf16_optimizer: deepspeed"
            )
        if world_size > 1:
            cfg.setdefault("communication_data_type", "fp32")
    cfg.setdefault("steps_per_print", 10**9)  # our own logger reports; keep DeepSpeed's quiet
    if zero_stage(cfg) and "offload_optimizer" in zero and zero["offload_optimizer"].get("device") == "cpu":
        # A client torch optimizer is fine on CPU-only machines (DeepSpeedCPUAdam would JIT-compile).
        cfg.setdefault("zero_force_ds_cpu_optimizer", False)
    if train.optimizer_states == "8bit" and zero_stage(cfg):
        # bitsandbytes' AdamW8bit over ZeRO's flat fp32 partitions: DeepSpeed lists only its own and torch's
        # Adam as tested (tests/test_quantized.py trains and resumes with it under ZeRO-2).
        cfg.setdefault("zero_allow_untested_optimizer", True)
    return cfg


def check_in_backward(cfg: dict, train: TrainConfig, world_size: int, source: str) -> None:
    """train.optimizer_step: in_backward updates each parameter in backward (snaketune.train.backward_step): ZeRO
    stage 0 without offload, and one micro-batch per rank per optimizer step."""
    if zero_stage(cfg) != 0 or offloads(cfg) or offloads(cfg, "offload_param"):
        raise ConfigError(
            f"{source}: train.optimizer_step 'in_backward' needs zero_optimization.stage 0 without offload (found "
            f"stage {zero_stage(cfg)}); use config/deepspeed/zero0.json or train.optimizer_step: after_backward"
        )
    gas = cfg["gradient_accumulation_steps"]
    if gas > 1:
        per_step = train.micro_batch_size * world_size
        raise ConfigError(
            f"config key 'train.optimizer_step': 'in_backward' applies each micro-batch's gradients at once, so "
            f"it cannot accumulate {gas} micro-batches: train.global_batch_size {train.global_batch_size} must "
            f"equal micro_batch_size x ranks = {train.micro_batch_size} x {world_size} = {per_step} (set "
            f"micro_batch_size to {train.global_batch_size // world_size} or global_batch_size to {per_step})"
        )


def offloads(ds_config: dict, key: str = "offload_optimizer") -> bool:
    """Whether the file puts the optimizer (or, with key offload_param, the weights) in host memory."""
    zero = ds_config.get("zero_optimization") or {}
    return (zero.get(key) or {}).get("device", "none") not in ("none", None)


def uses_master_weights(ds_config: dict, bf16_optimizer: str, *, bf16: bool) -> bool:
    """Whether snaketune.train.optim.MasterWeightAdamW keeps the fp32 masters (train.bf16_optimizer): only in bf16
    (fp32 weights are their own masters); `auto` at ZeRO stage 0 without offload. The trainer and the memory
    plan (snaketune.plan.search) both decide with this."""
    if not bf16:
        return False
    if bf16_optimizer == "auto":
        return zero_stage(ds_config) == 0 and not offloads(ds_config)
    return bf16_optimizer == "snaketune"


def zero_stage(ds_config: dict) -> int:
    return int(ds_config.get("zero_optimization", {}).get("stage", 0))
