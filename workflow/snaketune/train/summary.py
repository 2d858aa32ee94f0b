"""What a training run reports about itself: the lines it logs before its first step and at every logged step,
and summary.json (snaketune.train.trainer writes it; the report reads it), from two values the trainer hands over:
the run as set up (`RunSetup`) and what its training did (`TrainResult`)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from snaketune import device_memory
from snaketune.config.schema import TrainConfig
from snaketune.model import attention
from snaketune.train import engine
from snaketune.train.metrics import alloc_retries, device_name, peak_memory_gib
from snaketune.train.ranks import RankDevice, RunSpec

log = logging.getLogger("snaketune.train")


@dataclass(frozen=True)
class RunSetup:
    """A rank's run once set up (snaketune.train.trainer.Trainer.setup): fixed from then on."""

    spec: RunSpec
    cfg: TrainConfig
    """train's settings as this run applies them (the reference pass: one micro-batch per rank, one step)."""
    rank: int
    world: int
    placed: RankDevice
    """The rank's device and what is measured of its memory."""
    dtype: torch.dtype
    built: engine.Built
    gas: int
    """Gradient accumulation steps: global batch = micro-batch x ranks x gas."""
    total_steps: int
    start_step: int
    """The step this process starts at: 0, or the step of the checkpoint it resumed from."""
    train_rows: int
    val_rows: int
    seq_len: int
    """Positions of one row (a preference row holds both sides of a pair)."""
    loss_summary: str
    """What computes the objective, in words (the trainer's `describe_loss`)."""
    peak_flops: float | None
    """The device's datasheet dense bf16 peak (snaketune.train.metrics.PEAK_BF16_FLOPS); None where unknown."""
    measured_peak: float | None
    """The matmul rate measured on this device (snaketune.train.metrics.measured_matmul_flops)."""

    @property
    def device(self) -> torch.device:
        return self.placed.device

    @property
    def stage(self) -> int:
        """The ZeRO stage DeepSpeed runs at."""
        return self.built.stage

    @property
    def fused_ce(self) -> bool:
        return self.built.loss.fused_cross_entropy

    @property
    def attention_summary(self) -> str:
        return attention.describe(self.built.attention, self.device, self.dtype)


@dataclass(frozen=True)
class TrainResult:
    """What training returns (snaketune.train.trainer.Trainer.train)."""

    last: dict
    """The metrics of the last logged step (metrics.csv's last row; a run resumed at its end: its marker's)."""
    perf: dict
    """Throughput and MFU over every step after the first two of the run (warm-up), not just the last window."""


def log_start(run: RunSetup) -> None:
    """The derived sizes and switches of the run, logged by rank 0 before the first step."""
    if run.rank != 0:
        return
    cfg, b = run.cfg, run.built
    log.info(
        "device: %s x %d (%s), precision %s, ZeRO stage %d",
        device_name(run.device),
        run.world,
        run.device.type,
        run.dtype,
        run.stage,
    )
    log.info(
        "parameters: %s total, %s trainable%s; Adam states: %s",
        f"{b.n_params:,}",
        f"{b.n_trainable:,}",
        "; base weights in 4-bit NF4 (QLoRA)" if cfg.lora.quantize == "nf4" else "",
        states_summary(cfg),
    )
    log.info(
        "fp32 master weights: %s; %s; attention: %s; RMSNorm/RoPE/SwiGLU: %s; torch.compile: %s",
        b.precision_summary,
        run.loss_summary,
        run.attention_summary,
        "Liger kernels" if b.kernels == "liger" else "torch",
        "every decoder layer" if cfg.compile else "off",
    )
    if cfg.fused_cross_entropy and not run.fused_ce:
        log.info("train.fused_cross_entropy is not used under ZeRO-3 (its lm_head weight is partitioned)")
    if b.decayed is not None:
        log.info(
            "weight decay %g on %d tensors (%s elements); optimizer tensors checked on %s",
            cfg.weight_decay,
            b.decayed["tensors"],
            f"{b.decayed['elements']:,}",
            "the host" if engine.offloads(b.ds_config) else run.device,
        )
    log.info(
        "global batch %d = micro-batch %d x %d ranks x %d accumulation",
        cfg.global_batch_size,
        cfg.micro_batch_size,
        run.world,
        run.gas,
    )
    log.info(
        "positions per optimizer step (at most): %s; steps: %d; train rows: %d; validation rows: %d",
        f"{cfg.global_batch_size * run.seq_len:,}",
        run.total_steps,
        run.train_rows,
        run.val_rows,
    )


def log_progress(run: RunSetup, done: int, t_start: float, m: dict) -> None:
    """One line per logged step: losses, learning rate, throughput, MFU, time left."""
    elapsed = time.perf_counter() - t_start
    eta = elapsed / max(1, done - run.start_step) * (run.total_steps - done)
    parts = [f"step {done}/{run.total_steps}"]
    parts += [f"{k.replace('/', ' ')} {v:.4f}" for k, v in m.items() if k.endswith("loss") and v is not None]
    parts.append(f"lr {m['train/lr']:.2e}")
    if m.get("perf/tokens_per_s_per_gpu"):
        parts.append(f"{m['perf/tokens_per_s_per_gpu']:,.0f} tok/s/rank")
    if m.get("perf/mfu"):
        parts.append(f"MFU {m['perf/mfu']:.3f}")
    parts.append(f"ETA {eta:,.0f}s")
    log.info(" | ".join(parts))


def run_summary(run: RunSetup, result: TrainResult, wall: float) -> dict:
    """summary.json of a training run: its setup, final losses, throughput and MFU over the run, memory per rank.
    Collective: every rank takes part in gathering the per-rank figures."""
    last, perf = result.last, result.perf
    mem = [None] * run.world
    dist.all_gather_object(mem, peak_memory_gib(run.device))
    retries = [None] * run.world
    dist.all_gather_object(retries, alloc_retries(run.device))
    devices = [None] * run.world
    dist.all_gather_object(devices, device_memory.record(run.placed.peak, run.device, run.placed.budget))
    b = run.built
    return {
        "experiment": run.spec.experiment,
        "steps": run.total_steps,
        "resumed_from_step": run.start_step,
        "world_size": run.world,
        "device": device_name(run.device),
        "precision": str(run.dtype).removeprefix("torch."),
        "zero_stage": run.stage,
        "deepspeed_config": run.spec.deepspeed_config,
        "global_batch_size": run.cfg.global_batch_size,
        "micro_batch_size": run.cfg.micro_batch_size,
        "gradient_accumulation_steps": run.gas,
        "parameters": b.n_params,
        "trainable_parameters": b.n_trainable,
        "weight_decay_parameters": b.decayed,
        "lora": run.cfg.lora.enabled,
        "lora_quantize": run.cfg.lora.quantize,
        "optimizer_states": run.cfg.optimizer_states,
        "optimizer_step": run.cfg.optimizer_step,
        "fp8": run.cfg.fp8,
        "fp32_master_weights": b.precision_summary,
        "fp32_gradient_accumulation": b.accumulate_fp32,
        "fused_cross_entropy": run.fused_ce,
        "loss_kernel": None if run.fused_ce else b.loss.loss_kernel,
        "attention": run.attention_summary,
        "kernels": b.kernels,
        "compile": run.cfg.compile,
        "gradient_checkpointing": run.cfg.gradient_checkpointing,
        "offload_activations": run.cfg.offload_activations and bool(run.cfg.gradient_checkpointing),
        "final_train_loss": last.get("train/loss"),
        "final_val_loss": last.get("val/loss"),
        # Over every step after the first two of this process (warm-up), not just the last window.
        "tokens_per_s_per_gpu": perf.get("perf/tokens_per_s_per_gpu"),
        "loss_tokens_per_s_per_gpu": perf.get("perf/loss_tokens_per_s_per_gpu"),
        "padded_tokens_per_s_per_gpu": perf.get("perf/padded_tokens_per_s_per_gpu"),
        "step_time_s": perf.get("perf/step_time_s"),
        # PaLM's MFU: 6N (4N with LoRA) per real token + attention over each conversation's length, against
        # the datasheet's dense bf16 peak; the share of the matmul rate measured on this device beside it.
        "mfu": perf.get("perf/mfu"),
        "mfu_definition": "PaLM: (6 x non-embedding parameters"
        + (" [4 x with LoRA: no weight gradients]" if run.cfg.lora.enabled else "")
        + " x real tokens + 12 x layers x heads x head_dim x sum of squared conversation lengths) / time / "
        + "datasheet dense bf16 peak (snaketune.train.metrics.PEAK_BF16_FLOPS)",
        "model_tflops_per_gpu": perf.get("perf/model_tflops_per_gpu"),
        "flops_share_of_measured_matmul": perf.get("perf/flops_share_of_measured_matmul"),
        "peak_flops": run.peak_flops,
        "peak_memory_gib_per_rank": mem,
        # NVML's device peak per rank beside the allocator's, the budget and what lay outside the allocator.
        "device_memory_per_rank": devices,
        # cudaMalloc retries after freeing the allocator's cache: each one stalls a step (a full card).
        "cuda_alloc_retries_per_rank": retries,
        "wall_time_s": wall,
        "seed": run.cfg.seed,
        "run_key": run.spec.run_key,
    }


def states_summary(cfg) -> str:
    """Adam's m and v and, for the in-backward step, where the update runs (snaketune.train.backward_step)."""
    if cfg.optimizer_step == "in_backward":
        rounded = ", rounded stochastically" if cfg.optimizer_states == "4bit" else ""
        return f"{cfg.optimizer_states} (torchao's format, block-wise where quantized{rounded}), updated in backward"
    return "8-bit (bitsandbytes, block-wise)" if cfg.optimizer_states == "8bit" else "fp32"
