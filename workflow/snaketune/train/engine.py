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

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass

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
from snaketune.train.backward_step import BackwardAdamW
from snaketune.train.optim import MasterWeightAdamW, build_optimizer, check_placement, decays, resolve_triton

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


@dataclass
class Built:
    """The engine and what the trainer reports about it."""

    engine: object
    """deepspeed.DeepSpeedEngine around the loss module."""
    ds_config: dict
    stage: int
    master_weights: bool
    accumulate_fp32: bool
    fused_cross_entropy: bool
    loss_kernel: str
    """The logits' cross-entropy where fused_cross_entropy is off: `triton` or `torch` (snaketune.model.losses)."""
    attention: str
    kernels: str
    """`liger` or `torch` (snaketune.model.kernels)."""
    n_params: int
    n_trainable: int
    flops_per_token: float
    """Dense model FLOPs per trained token (PaLM's 6N; 4N with LoRA)."""
    attention_coefficient: float
    """Attention FLOPs per squared conversation length (12 x layers x heads x head_dim)."""
    decayed: dict
    """{"weight_decay", "tensors", "elements"}: the optimizer's rate and the parameters it decays (the same under
    every ZeRO stage)."""

    @property
    def precision_summary(self) -> str:
        opt = self.engine.optimizer
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
    wrap: Callable[[torch.nn.Module, bool, bool, str], torch.nn.Module],
) -> Built:
    """Load or build the model, place it, add LoRA, wrap it with `wrap(net, packed_attention, fused_ce,
    loss_kernel)` (the loss module DeepSpeed trains), build the optimizer and the DeepSpeed engine."""
    import deepspeed

    bf16 = dtype == torch.bfloat16
    in_backward = cfg.optimizer_step == "in_backward"
    # The in-backward step updates the weights themselves: no fp32 masters (snaketune.train.backward_step).
    master = not in_backward and uses_master_weights(file_cfg, cfg.bf16_optimizer, bf16=bf16)
    ds_config = build_ds_config(
        file_cfg, cfg, world_size=world, bf16=bf16, source=source, master_weights=master
    )
    stage = zero_stage(ds_config)
    accumulate_fp32 = master and cfg.accumulation_steps(world) > 1
    fused_ce = cfg.fused_cross_entropy and stage != 3
    loss_kernel = resolve_triton("train.loss_kernel", cfg.loss_kernel, device)
    attn = attention.resolve(cfg.attention, device, dtype)
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
    net = load_model(
        model_cfg,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=dtype,
        seed=cfg.seed,
        device=device,
        # ZeRO-3 partitions big models while they are built or loaded (the tiny one is cheaper to build whole).
        zero_init_config=ds_config if stage == 3 and model_cfg.base != "builtin-tiny" else None,
        quantize=cfg.lora.quantize,
    )
    quantized = is_quantized(net)  # loaded onto the device; transformers refuses .to() on it
    if stage != 3 and not quantized:
        net.to(device)  # a no-op where it was loaded or built there; builtin-tiny is built on the host
    net.train()  # from_pretrained returns eval mode, where transformers skips gradient checkpointing
    fused = kernels.resolve(cfg.kernels, device, getattr(net.config, "model_type", ""))
    kernels.apply(net, fused)
    checkpointed = checkpoint_layers(net, cfg.gradient_checkpointing)
    if cfg.lora.enabled:
        if checkpointed:
            net.enable_input_require_grads()
        # With fp32 masters in the optimizer the adapters compute in bf16 like the rest of the model;
        # peft's default fp32 adapters would cast every adapted layer's input to fp32 (measured: +13 GiB
        # of activations and 5% slower for LoRA r16 on all linear layers of the 7B, 8 x 512).
        net = apply_lora(net, cfg.lora, fp32_adapters=not master, seed=cfg.seed)
        if stage != 3 and not quantized:
            net.to(device)  # the adapters are created on the host
        elif quantized:  # peft puts them beside their base layer; check_placement says if not
            for p in net.parameters():
                if p.requires_grad and p.device != device:
                    p.data = p.data.to(device)
    check_same_start(net, device)
    n_params, n_trainable = count_params(net)
    dense_flops, attention_coefficient = flop_counts(net, lora=cfg.lora.enabled)
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
    torch.manual_seed(cfg.seed + rank)  # dropout differs per rank, deterministic per run
    module = wrap(net, attn == "varlen", fused_ce, loss_kernel)
    trained = [p for p in module.parameters() if p.requires_grad]
    decayed = [p for p in trained if decays(p)]
    optimizer = build_optimizer(
        module,
        lr=cfg.learning_rate,
        betas=cfg.adam_betas,
        weight_decay=cfg.weight_decay,
        device=device,
        master_weights=master,
        grad_clip=cfg.grad_clip,
        kernel=cfg.optimizer_kernel,
        offload=offloads(ds_config),
        accumulate_fp32=accumulate_fp32,
        states=cfg.optimizer_states,
        in_backward=in_backward,
    )
    schedule = lr_lambda(cfg, total_steps)
    engine, _, _, _ = deepspeed.initialize(
        model=module,
        optimizer=optimizer,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
        config=ds_config,
    )
    if accumulate_fp32 or in_backward or (world == 1 and stage == 0):
        # The fp32 buffer is all-reduced by the optimizer itself, and the in-backward step's hooks all-reduce each
        # gradient before they apply and free it. And one rank has nothing to all-reduce; DeepSpeed would still
        # flatten every gradient into buckets and copy it back (two passes per step).
        engine.enable_backward_allreduce = False
    built = Built(
        engine=engine,
        ds_config=ds_config,
        stage=stage,
        master_weights=master,
        accumulate_fp32=accumulate_fp32,
        fused_cross_entropy=fused_ce,
        loss_kernel=loss_kernel,
        attention=attn,
        kernels=fused,
        n_params=n_params,
        n_trainable=n_trainable,
        flops_per_token=dense_flops,
        attention_coefficient=attention_coefficient,
        decayed={
            # The rate as the optimizer holds it (a setting lost on its way there shows here), the tensors it
            # applies to by snaketune.train.optim.decays.
            "weight_decay": max(g["weight_decay"] for g in optimizer.param_groups),
            "tensors": len(decayed),
            "elements": sum(math.prod(_shape(p)) for p in decayed),
        },
    )
    check_optimizer(built, device)
    return built


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
