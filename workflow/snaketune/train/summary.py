"""What a training run reports about itself: the lines it logs before its first step and at every logged step,
and summary.json (snaketune.train.trainer writes it; the report reads it)."""

from __future__ import annotations

import logging
import time

import torch.distributed as dist

from snaketune import device_memory
from snaketune.train import engine
from snaketune.train.metrics import alloc_retries, device_name, peak_memory_gib

log = logging.getLogger("snaketune.train")


def log_start(trainer) -> None:
    """The derived sizes and switches of the run, logged by rank 0 before the first step."""
    if trainer.rank != 0:
        return
    cfg, b = trainer.cfg, trainer.built
    log.info(
        "device: %s x %d (%s), precision %s, ZeRO stage %d",
        device_name(trainer.device),
        trainer.world,
        trainer.device.type,
        trainer.dtype,
        trainer.stage,
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
        trainer.loss_summary,
        trainer.attention_summary,
        "Liger kernels" if b.kernels == "liger" else "torch",
        "every decoder layer" if cfg.compile else "off",
    )
    if cfg.fused_cross_entropy and not trainer.fused_ce:
        log.info("train.fused_cross_entropy is not used under ZeRO-3 (its lm_head weight is partitioned)")
    if b.decayed is not None:
        log.info(
            "weight decay %g on %d tensors (%s elements); optimizer tensors checked on %s",
            cfg.weight_decay,
            b.decayed["tensors"],
            f"{b.decayed['elements']:,}",
            "the host" if engine.offloads(b.ds_config) else trainer.device,
        )
    log.info(
        "global batch %d = micro-batch %d x %d ranks x %d accumulation",
        cfg.global_batch_size,
        cfg.micro_batch_size,
        trainer.world,
        trainer.gas,
    )
    log.info(
        "positions per optimizer step (at most): %s; steps: %d; train rows: %d; validation rows: %d",
        f"{cfg.global_batch_size * trainer.seq_len:,}",
        trainer.total_steps,
        len(trainer.train_split),
        len(trainer.val_split),
    )


def log_progress(trainer, done: int, t_start: float, m: dict) -> None:
    """One line per logged step: losses, learning rate, throughput, MFU, time left."""
    elapsed = time.perf_counter() - t_start
    eta = elapsed / max(1, done - trainer.start_step) * (trainer.total_steps - done)
    parts = [f"step {done}/{trainer.total_steps}"]
    parts += [f"{k.replace('/', ' ')} {v:.4f}" for k, v in m.items() if k.endswith("loss") and v is not None]
    parts.append(f"lr {m['train/lr']:.2e}")
    if m.get("perf/tokens_per_s_per_gpu"):
        parts.append(f"{m['perf/tokens_per_s_per_gpu']:,.0f} tok/s/rank")
    if m.get("perf/mfu"):
        parts.append(f"MFU {m['perf/mfu']:.3f}")
    parts.append(f"ETA {eta:,.0f}s")
    log.info(" | ".join(parts))


def run_summary(trainer, last: dict, wall: float) -> dict:
    """summary.json of a training run: its setup, final losses, throughput and MFU over the run, memory per rank.
    Collective: every rank takes part in gathering the per-rank figures."""
    mem = [None] * trainer.world
    dist.all_gather_object(mem, peak_memory_gib(trainer.device))
    retries = [None] * trainer.world
    dist.all_gather_object(retries, alloc_retries(trainer.device))
    devices = [None] * trainer.world
    dist.all_gather_object(
        devices, device_memory.record(trainer.device_peak, trainer.device, trainer.device_budget)
    )
    b = trainer.built
    return {
        "experiment": trainer.spec.experiment,
        "steps": trainer.total_steps,
        "resumed_from_step": trainer.start_step,
        "world_size": trainer.world,
        "device": device_name(trainer.device),
        "precision": str(trainer.dtype).removeprefix("torch."),
        "zero_stage": trainer.stage,
        "deepspeed_config": trainer.spec.deepspeed_config,
        "global_batch_size": trainer.cfg.global_batch_size,
        "micro_batch_size": trainer.cfg.micro_batch_size,
        "gradient_accumulation_steps": trainer.gas,
        "parameters": b.n_params,
        "trainable_parameters": b.n_trainable,
        "weight_decay_parameters": b.decayed,
        "lora": trainer.cfg.lora.enabled,
        "lora_quantize": trainer.cfg.lora.quantize,
        "optimizer_states": trainer.cfg.optimizer_states,
        "optimizer_step": trainer.cfg.optimizer_step,
        "fp8": trainer.cfg.fp8,
        "fp32_master_weights": b.precision_summary,
        "fp32_gradient_accumulation": b.accumulate_fp32,
        "fused_cross_entropy": trainer.fused_ce,
        "loss_kernel": None if trainer.fused_ce else b.loss.loss_kernel,
        "attention": trainer.attention_summary,
        "kernels": b.kernels,
        "compile": trainer.cfg.compile,
        "gradient_checkpointing": trainer.cfg.gradient_checkpointing,
        "offload_activations": trainer.cfg.offload_activations and bool(trainer.cfg.gradient_checkpointing),
        "final_train_loss": last.get("train/loss"),
        "final_val_loss": last.get("val/loss"),
        # Over every step after the first two of this process (warm-up), not just the last window.
        "tokens_per_s_per_gpu": trainer.run_perf.get("perf/tokens_per_s_per_gpu"),
        "loss_tokens_per_s_per_gpu": trainer.run_perf.get("perf/loss_tokens_per_s_per_gpu"),
        "padded_tokens_per_s_per_gpu": trainer.run_perf.get("perf/padded_tokens_per_s_per_gpu"),
        "step_time_s": trainer.run_perf.get("perf/step_time_s"),
        # PaLM's MFU: 6N (4N with LoRA) per real token + attention over each conversation's length, against
        # the datasheet's dense bf16 peak; the share of the matmul rate measured on this device beside it.
        "mfu": trainer.run_perf.get("perf/mfu"),
        "mfu_definition": "PaLM: (6 x non-embedding parameters"
        + (" [4 x with LoRA: no weight gradients]" if trainer.cfg.lora.enabled else "")
        + " x real tokens + 12 x layers x heads x head_dim x sum of squared conversation lengths) / time / "
        + "datasheet dense bf16 peak (snaketune.train.metrics.PEAK_BF16_FLOPS)",
        "model_tflops_per_gpu": trainer.run_perf.get("perf/model_tflops_per_gpu"),
        "flops_share_of_measured_matmul": trainer.run_perf.get("perf/flops_share_of_measured_matmul"),
        "peak_flops": trainer.peak,
        "peak_memory_gib_per_rank": mem,
        # NVML's device peak per rank beside the allocator's, the budget and what lay outside the allocator.
        "device_memory_per_rank": devices,
        # cudaMalloc retries after freeing the allocator's cache: each one stalls a step (a full card).
        "cuda_alloc_retries_per_rank": retries,
        "wall_time_s": wall,
        "seed": trainer.cfg.seed,
        "run_key": trainer.spec.run_key,
    }


def states_summary(cfg) -> str:
    """Adam's m and v and, for the in-backward step, where the update runs (snaketune.train.backward_step)."""
    if cfg.optimizer_step == "in_backward":
        rounded = ", rounded stochastically" if cfg.optimizer_states == "4bit" else ""
        return f"{cfg.optimizer_states} (torchao's format, block-wise where quantized{rounded}), updated in backward"
    return "8-bit (bitsandbytes, block-wise)" if cfg.optimizer_states == "8bit" else "fp32"
