"""What a training rank trains with: the model, where it lives, its optimizer and the DeepSpeed engine.

One function, `build`, shared by the SFT trainer (snaketune.train.trainer) and the preference trainer
(snaketune.preference.dpo), so both load a hub-format directory, place it, wrap it and optimize it the same way:

- The weights load straight onto the rank's GPU (`from_pretrained(device_map=...)`), or are partitioned
  while they load under ZeRO-3 (transformers' HfDeepSpeedConfig); builtin models are built on the GPU.
  The optimizer is built only afterwards, from parameters that already live where they train, and
  `snaketune.train.optim.check_placement` fails at setup if any master weight or state is elsewhere.
- The model is put in training mode: `from_pretrained` returns it in eval mode, where transformers skips
  gradient checkpointing (and dropout), so a hub model would otherwise train without the checkpointing it
  was planned with.
- QLoRA (`train.lora.quantize: nf4`): the hub model's linear layers load in 4 bits onto the rank's GPU
  (snaketune.model.build.nf4_config); only the adapters train, as with LoRA.
- bf16 at ZeRO stage 0: snaketune.train.optim.MasterWeightAdamW (fp32 masters in the optimizer, bf16 weights and
  gradients); with gradient accumulation it sums the micro-batches' gradients in fp32. Other stages use
  DeepSpeed's own bf16 optimizer.
"""

from __future__ import annotations

import copy
import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

import torch

from snaketune.config.deepspeed import build_ds_config, offloads, uses_master_weights, zero_stage
from snaketune.config.schema import ModelConfig, TrainConfig
from snaketune.model import attention, fp8, kernels
from snaketune.model.build import (
    apply_lora,
    checkpoint_layers,
    compile_layers,
    count_params,
    flop_counts,
    is_quantized,
    load_model,
)
from snaketune.train import adam8bit
from snaketune.train.backward_step import BackwardAdamW
from snaketune.train.optim import MasterWeightAdamW, check_placement, decays, param_groups, resolve_triton

log = logging.getLogger("snaketune.train")


def lr_lambda(train: TrainConfig, total_steps: int):
    """Linear warmup to the peak over `warmup_steps`, then cosine decay that reaches
    `learning_rate * min_lr_ratio` exactly at the last step (step total_steps - 1)."""

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        span = max(1, total_steps - 1 - train.warmup_steps)
        progress = min(1.0, (step - train.warmup_steps) / span)
        return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


@dataclass(frozen=True)
class LossSetup:
    """How the loss module computes (`wrap`'s second argument), decided by `build` from the config, the device and
    the ZeRO stage."""

    packed_attention: bool
    """snaketune.model.attention's varlen kernel: the conversations of a packed row attend only to themselves
    through `cu_seqlens` (else SDPA with a block-diagonal mask)."""
    fused_cross_entropy: bool
    """The loss from the final hidden states and the lm_head weight in chunks, never the whole logits."""
    loss_kernel: str
    """The logits' cross-entropy where fused_cross_entropy is off: `triton` or `torch` (snaketune.model.losses)."""
    zero_stage: int
    """Under ZeRO-3 the lm_head weight is partitioned and only the model's own forward gathers it: a loss that reads
    it directly (the fused loss, the chunked log-probabilities) cannot run there."""


Wrap = Callable[[torch.nn.Module, LossSetup], torch.nn.Module]
"""What turns the causal LM into the module DeepSpeed runs: net -> loss module (the trainer's `wrap`)."""


@dataclass
class Built:
    """The engine and what the trainer reports about it."""

    engine: object
    """deepspeed.DeepSpeedEngine around the loss module."""
    ds_config: dict
    stage: int
    master_weights: bool
    """Built as for snaketune.train.optim.MasterWeightAdamW (bf16 LoRA adapters; without an optimizer no masters)."""
    accumulate_fp32: bool
    loss: LossSetup
    attention: str
    kernels: str
    """`liger` or `torch` (snaketune.model.kernels)."""
    n_params: int
    n_trainable: int
    flops_per_token: float
    """Dense model FLOPs per trained token (PaLM's 6N; 4N with LoRA)."""
    attention_coefficient: float
    """Attention FLOPs per squared conversation length (12 x layers x heads x head_dim)."""
    decayed: dict | None
    """{"weight_decay", "tensors", "elements"}: the optimizer's rate and the parameters it decays (the same under
    every ZeRO stage); None without an optimizer."""

    @property
    def precision_summary(self) -> str:
        opt = self.engine.optimizer
        if self.decayed is None:
            return "none: no optimizer (a pass that takes no step)"
        if isinstance(opt, BackwardAdamW):
            return f"none: the in-backward step updates the weights themselves ({opt.kernel})"
        if isinstance(opt, MasterWeightAdamW):
            acc = ", fp32 gradient accumulation" if self.accumulate_fp32 else ""
            return f"snaketune.train.optim.MasterWeightAdamW ({opt.kernel} kernel{acc})"
        return "DeepSpeed" if self.ds_config.get("bf16", {}).get("enabled") else "none (fp32 weights)"


def check_same_start(net: torch.nn.Module, device: torch.device) -> None:
    """Every rank starts from the same trainable weights (data parallelism assumes it; a rank that drew its own
    would silently train another model): each trainable tensor's sum and sum of squares in float64, equal on every
    rank, or a RuntimeError naming the first that differs. One all-reduce of a few numbers per tensor; tensors
    ZeRO-3 has already partitioned are skipped (their parts differ by design)."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    named = [(n, p) for n, p in net.named_parameters() if p.requires_grad and not hasattr(p, "ds_id")]
    if not named:
        return
    with torch.no_grad():
        stats = torch.stack([torch.stack([p.double().sum(), p.double().square().sum()]) for _, p in named])
    stats = stats.to(device if device.type == "cuda" else "cpu")
    low, high = stats.clone(), stats.clone()
    dist.all_reduce(low, op=dist.ReduceOp.MIN)
    dist.all_reduce(high, op=dist.ReduceOp.MAX)
    differ = (low != high).any(dim=1).nonzero()  # device-to-host: once, before training
    if len(differ):
        name = named[int(differ[0])][0]
        raise RuntimeError(
            f"ranks start from different trainable weights ({len(differ)} tensors differ, first {name}): every rank "
            "must build or load the same model (train.seed seeds a builtin model and LoRA's adapters)"
        )


class OptimizerKind(StrEnum):
    """Which optimizer does a run's arithmetic: resolved once from the settings (`optimizer_kind`), so that what
    builds it (`build_optimizer`) and what reports or checks it read one value."""

    IN_BACKWARD = "in_backward"
    """snaketune.train.backward_step.BackwardAdamW: each tensor updated as backward produces its gradient."""
    MASTER_WEIGHTS = "master_weights"
    """MasterWeightAdamW: fp32 masters of bf16 weights outside DeepSpeed's bf16 path (its states fp32 or 8-bit)."""
    BITSANDBYTES_8BIT = "bitsandbytes_8bit"
    """bitsandbytes' AdamW8bit as DeepSpeed's client optimizer (snaketune.train.adam8bit)."""
    DEEPSPEED_CPU_ADAM = "deepspeed_cpu_adam"
    """DeepSpeed's CPU Adam: the optimizer offloaded to the host of a GPU rank."""
    TORCH_ADAMW = "torch_adamw"
    """torch.optim.AdamW (fused on a GPU)."""


def optimizer_kind(
    cfg: TrainConfig, *, master_weights: bool, offload: bool, device: torch.device
) -> OptimizerKind:
    """The optimizer of a run: the step in backward where train.optimizer_step asks for it, else fp32 masters where
    the DeepSpeed config leaves bf16 to us (snaketune.config.deepspeed.uses_master_weights), else 8-bit states,
    else the host's Adam under optimizer offload from a GPU, else torch's AdamW."""
    if cfg.optimizer_step == "in_backward":
        return OptimizerKind.IN_BACKWARD
    if master_weights:
        return OptimizerKind.MASTER_WEIGHTS
    if cfg.optimizer_states == "8bit":
        return OptimizerKind.BITSANDBYTES_8BIT
    if offload and device.type == "cuda":
        return OptimizerKind.DEEPSPEED_CPU_ADAM
    return OptimizerKind.TORCH_ADAMW


@dataclass(frozen=True)
class _Choices:
    """What `build` decides from the settings before it loads anything."""

    ds_config: dict
    stage: int
    optimizer: OptimizerKind
    """The optimizer this configuration trains with (also for a pass that builds none: the model is built as for it)."""
    accumulate_fp32: bool
    loss: LossSetup
    attention: str

    @property
    def master(self) -> bool:
        """fp32 masters in the optimizer: the model's trainable weights (LoRA's adapters too) stay bf16."""
        return self.optimizer is OptimizerKind.MASTER_WEIGHTS


def _choose(
    cfg: TrainConfig, file_cfg: dict, source: str, world: int, device: torch.device, dtype: torch.dtype
) -> _Choices:
    """The DeepSpeed config, precision path, attention and loss of a run; ValueError for what cannot go together."""
    bf16 = dtype == torch.bfloat16
    in_backward = cfg.optimizer_step == "in_backward"
    # The in-backward step updates the weights themselves: no fp32 masters (snaketune.train.backward_step).
    master = not in_backward and uses_master_weights(file_cfg, cfg.bf16_optimizer, bf16=bf16)
    ds_config = build_ds_config(
        file_cfg, cfg, world_size=world, bf16=bf16, source=source, master_weights=master
    )
    stage = zero_stage(ds_config)
    attn = attention.resolve(cfg.attention, device, dtype)
    loss = LossSetup(
        packed_attention=attn == "varlen",
        fused_cross_entropy=cfg.fused_cross_entropy and stage != 3,
        loss_kernel=resolve_triton("train.loss_kernel", cfg.loss_kernel, device),
        zero_stage=stage,
    )
    if cfg.lora.enabled and stage == 3:
        raise ValueError(
            f"train.lora.enabled with ZeRO stage 3 ({source}) is not supported yet: "
            "use config/deepspeed/zero2.json or zero0.json for LoRA"
        )
    fp8.check(cfg.fp8, device, stage=stage, quantize=cfg.lora.quantize)
    if cfg.optimizer_states == "8bit" and offloads(ds_config):
        raise ValueError(
            f"train.optimizer_states '8bit' with optimizer offload ({source}): DeepSpeed's CPU Adam keeps fp32 "
            "states; allowed with offload: fp32"
        )
    kind = optimizer_kind(cfg, master_weights=master, offload=offloads(ds_config), device=device)
    accumulate_fp32 = master and cfg.accumulation_steps(world) > 1
    return _Choices(ds_config, stage, kind, accumulate_fp32, loss, attn)


def _load(
    model_cfg: ModelConfig, cfg: TrainConfig, c: _Choices, tokenizer, device: torch.device, dtype: torch.dtype
) -> tuple[torch.nn.Module, bool]:
    """The model loaded or built where it trains, in training mode; and whether it is quantized (QLoRA)."""
    net = load_model(
        model_cfg,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=dtype,
        seed=cfg.seed,
        device=device,
        # ZeRO-3 partitions big models while they are built or loaded (the tiny one is cheaper to build whole).
        zero_init_config=c.ds_config if c.stage == 3 and model_cfg.base != "builtin-tiny" else None,
        quantize=cfg.lora.quantize,
    )
    quantized = is_quantized(net)  # loaded onto the device; transformers refuses .to() on it
    if c.stage != 3 and not quantized:
        net.to(device)  # a no-op where it was loaded or built there; builtin-tiny is built on the host
    net.train()  # from_pretrained returns eval mode, where transformers skips gradient checkpointing
    return net, quantized


def _adapt(
    net: torch.nn.Module, cfg: TrainConfig, c: _Choices, quantized: bool, device: torch.device
) -> tuple[torch.nn.Module, str]:
    """Liger's kernels, gradient checkpointing and LoRA's adapters on `net`; returns it and the kernels used."""
    fused = kernels.resolve(cfg.kernels, device, getattr(net.config, "model_type", ""))
    kernels.apply(net, fused)
    checkpointed = checkpoint_layers(net, cfg.gradient_checkpointing, offload=cfg.offload_activations)
    if not cfg.lora.enabled:
        return net, fused
    if checkpointed:
        net.enable_input_require_grads()
    # With fp32 masters in the optimizer the adapters compute in bf16 like the rest of the model; peft's default
    # fp32 adapters would cast every adapted layer's input to fp32 (measured: +13 GiB of activations and 5% slower
    # for LoRA r16 on all linear layers of the 7B, 8 x 512).
    net = apply_lora(net, cfg.lora, fp32_adapters=not c.master, seed=cfg.seed)
    if c.stage != 3 and not quantized:
        net.to(device)  # the adapters are created on the host
    elif quantized:  # peft puts them beside their base layer; check_placement says if not
        for p in net.parameters():
            if p.requires_grad and p.device != device:
                p.data = p.data.to(device)
    return net, fused


def _convert(net: torch.nn.Module, cfg: TrainConfig, rank: int) -> None:
    """FP8 matmuls (train.fp8) and per-layer torch.compile (train.compile), the last changes to the model."""
    converted, linear = fp8.apply(net, cfg.fp8)
    if cfg.fp8 != "none" and rank == 0:
        log.info("FP8 (%s, torchao Float8Linear): %d of %d linear layers", cfg.fp8, converted, linear)
        if cfg.fp8 == "tensorwise" and not cfg.compile:
            log.warning(
                "train.fp8: tensorwise without train.compile: true runs its casts as separate kernels (2.3x slower "
                "than bf16 on an H200; compiled, 18% faster: bench/RESULTS.md)"
            )
    if cfg.compile:
        compile_layers(net)


def build(
    *,
    model_cfg: ModelConfig,
    cfg: TrainConfig,
    file_cfg: dict,
    source: str,
    world: int,
    device: torch.device,
    dtype: torch.dtype,
    tokenizer,
    total_steps: int,
    rank: int,
    wrap: Wrap,
    optimizer: bool = True,
) -> Built:
    """Load or build the model, place it, add LoRA, wrap it with `wrap(net, LossSetup)` (the loss module DeepSpeed
    runs), build the optimizer and the DeepSpeed engine. Without `optimizer` (a pass that never steps) the model is
    built the same way and the engine holds no optimizer: no fp32 masters, no Adam states, no gradient buckets."""
    c = _choose(cfg, file_cfg, source, world, device, dtype)
    net, quantized = _load(model_cfg, cfg, c, tokenizer, device, dtype)
    net, fused = _adapt(net, cfg, c, quantized, device)
    check_same_start(net, device)
    n_params, n_trainable = count_params(net)
    dense_flops, attention_coefficient = flop_counts(net, lora=cfg.lora.enabled)
    _convert(net, cfg, rank)
    torch.manual_seed(cfg.seed + rank)  # dropout differs per rank, deterministic per run
    module = wrap(net, c.loss)
    if optimizer:
        engine, decayed = _training_engine(module, cfg, c, device, world, total_steps)
    else:
        engine, decayed = _scoring_engine(module, c.ds_config), None
    built = Built(
        engine=engine,
        ds_config=c.ds_config,
        stage=c.stage,
        master_weights=c.master,
        accumulate_fp32=c.accumulate_fp32 and optimizer,
        loss=c.loss,
        attention=c.attention,
        kernels=fused,
        n_params=n_params,
        n_trainable=n_trainable,
        flops_per_token=dense_flops,
        attention_coefficient=attention_coefficient,
        decayed=decayed,
    )
    if optimizer:
        check_optimizer(built, device)
    return built


def build_optimizer(
    net: torch.nn.Module,
    kind: OptimizerKind,
    cfg: TrainConfig,
    *,
    device: torch.device,
    accumulate_fp32: bool = False,
) -> torch.optim.Optimizer:
    """The optimizer the trainer hands to deepspeed.initialize, with train's AdamW settings (learning rate, betas,
    weight decay, clipping, states and kernel), built from parameters that already live where they train
    (check_placement says so after DeepSpeed has wrapped it). `accumulate_fp32`: MasterWeightAdamW sums the
    micro-batches' gradients in fp32."""
    groups = param_groups(net, cfg.weight_decay)
    lr, betas = cfg.learning_rate, cfg.adam_betas
    ours = {"lr": lr, "betas": betas, "eps": 1e-8, "grad_clip": cfg.grad_clip, "states": cfg.optimizer_states}
    if kind is OptimizerKind.IN_BACKWARD:
        kernel = resolve_triton("train.optimizer_kernel", cfg.optimizer_kernel, device)
        return BackwardAdamW(groups, **ours, kernel=kernel)
    if kind is OptimizerKind.MASTER_WEIGHTS:
        return MasterWeightAdamW(groups, **ours, kernel=cfg.optimizer_kernel, accumulate_fp32=accumulate_fp32)
    if kind is OptimizerKind.BITSANDBYTES_8BIT:
        return adam8bit.client_optimizer(groups, lr=lr, betas=betas, eps=1e-8)
    if kind is OptimizerKind.DEEPSPEED_CPU_ADAM:
        from deepspeed.ops.adam import DeepSpeedCPUAdam

        return DeepSpeedCPUAdam(groups, lr=lr, betas=betas, adamw_mode=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=1e-8, fused=device.type == "cuda")


def _training_engine(
    module: torch.nn.Module, cfg: TrainConfig, c: _Choices, device: torch.device, world: int, total_steps: int
) -> tuple[object, dict]:
    """DeepSpeed's engine with the run's optimizer and schedule; and what the optimizer decays (Built.decayed)."""
    import deepspeed

    trained = [p for p in module.parameters() if p.requires_grad]
    decayed = [p for p in trained if decays(p)]
    optimizer = build_optimizer(module, c.optimizer, cfg, device=device, accumulate_fp32=c.accumulate_fp32)
    schedule = lr_lambda(cfg, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        config=c.ds_config,
    )
    in_backward = c.optimizer is OptimizerKind.IN_BACKWARD
    if c.accumulate_fp32 or in_backward or (world == 1 and c.stage == 0):
        # The fp32 buffer is all-reduced by the optimizer itself, and the in-backward step's hooks all-reduce each
        # gradient before they apply and free it. And one rank has nothing to all-reduce; DeepSpeed would still
        # flatten every gradient into buckets and copy it back (two passes per step).
        engine.enable_backward_allreduce = False
    return engine, {
        # The rate as the optimizer holds it (a setting lost on its way there shows here), the tensors it applies
        # to by snaketune.train.optim.decays.
        "weight_decay": max(g["weight_decay"] for g in optimizer.param_groups),
        "tensors": len(decayed),
        "elements": sum(math.prod(_shape(p)) for p in decayed),
    }


def scoring_config(ds_config: dict) -> dict:
    """The DeepSpeed config of an engine without an optimizer. ZeRO-1 and -2 partition only what training adds
    (gradients, optimizer states) and DeepSpeed refuses them without an optimizer: stage 0 computes the same
    forward with the same whole weights. ZeRO-3 stays (its weights are partitioned; DeepSpeed then runs its
    parameter gathering alone, DeepSpeedZeRoOffload), with any offload_param; offload_optimizer goes."""
    out = copy.deepcopy(ds_config)
    zero = out.setdefault("zero_optimization", {})
    zero.pop("offload_optimizer", None)
    if zero_stage(out) in (1, 2):
        zero["stage"] = 0
    return out


def _scoring_engine(module: torch.nn.Module, ds_config: dict) -> object:
    import deepspeed

    engine, _, _, _ = deepspeed.initialize(model=module, config=scoring_config(ds_config))
    return engine


def _shape(p: torch.Tensor) -> tuple[int, ...]:
    return tuple(getattr(p, "ds_shape", p.shape))


def check_optimizer(built: Built, device: torch.device) -> int:
    """snaketune.train.optim.check_placement on the optimizer that does the arithmetic: ours, the torch optimizer
    DeepSpeed's ZeRO / bf16 optimizers wrap (on the host with optimizer offload), or a plain torch AdamW.
    fp32 everywhere: bf16 training keeps fp32 masters and states."""
    opt = built.engine.optimizer
    inner = opt if isinstance(opt, MasterWeightAdamW | BackwardAdamW) else getattr(opt, "optimizer", opt)
    where = torch.device("cpu") if offloads(built.ds_config) else device
    # The in-backward step's parameters are the model's (bf16 on a GPU) and m and v may be quantized: where
    # they are is checked, not their dtype.
    return check_placement(
        inner, device=where, dtype=None if isinstance(opt, BackwardAdamW) else torch.float32
    )
