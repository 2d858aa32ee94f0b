"""Preflight memory plan: will a training fit on the GPUs it gets, and if not, what would.

The `plan` rule writes results/plan/<experiment>.json before the train rule may start: the estimated peak
memory per GPU and on the host for the configured strategy and for the alternatives, the budget they were
checked against (the top-level config key `gpu_memory_gib`, else the smallest GPU this machine offers the
workflow), and the strategy the train rule will use. A configuration that does not fit stops the workflow
there, with what would fit; with `train.strategy: auto` the plan picks the fastest strategy that fits.
The launcher checks the plan again against the GPUs a job is actually given (`check_devices`).

Memory model, bytes per GPU. P parameters, T of them trained (P, or the LoRA adapters), N ranks, w bytes per
weight (2 bf16, 4 fp32); bf16 training keeps an fp32 master copy (4 B) and Adam's m and v (8 B) per trained
parameter (../shared/FACTS.md: 16 B/param for mixed-precision Adam):
- weights: w*P, or w*P/N under ZeRO-3 (frozen weights too).
- gradients: ZeRO-0 4*T (DeepSpeed's bf16 optimizer accumulates in fp32), or w*T with snaketune's fp32
  masters (snaketune.optim.MasterWeightAdamW: the model's bf16 gradients, cast to fp32 one chunk at a time in
  the step); ZeRO-1 w*T, ZeRO-2/3 w*T/N, none on the GPU with optimizer offload; while backward runs, the
  largest trained tensor's gradient also exists whole before it is reduced (the 102,400 x 4,096 embedding for
  DeepSeek-7B). With snaketune's masters and one micro-batch per step the gradients are freed after every
  step and grow while backward frees the activations, so the peak holds all activations and no gradients.
- optimizer: (4 + 8)*T, divided by N from ZeRO-1 on; on the host with offload.
- buffers, while backward runs (DeepSpeed frees them at its end): ZeRO-1/2 gradient buckets
  (reduce_bucket_size x w, twice with overlap_comm); ZeRO-3 reduce and prefetch buckets, and with N > 1 the
  gathered weights of two layers or an embedding.
- optimizer step (ZeRO-1/2/3 without offload): the trained gradients flattened (w*T/N) and cast to fp32
  (4*T/N) next to everything above. On one GPU ZeRO-2 thus peaks at 22 B/param in the step (FACTS.md).
- activations per token and layer, what autograd saves in a DeepSeek/Llama decoder layer with SDPA
  attention: two RMSNorms (fp32 upcast 4h + normalized and scaled w*h each), q, k, v and the attention
  output (w*(2*q_dim + 2*kv_dim)), the SwiGLU MLP (gate, SiLU, up, product: 4*w*i), LoRA's rank-r
  intermediates; times ACTIVATION_FACTOR for what backward adds (gradient temporaries, kernel
  workspaces, allocator rounding). With gradient checkpointing: each layer's input (w*h) plus one
  layer's activations while it is recomputed.
- logits: 12 B per token and vocabulary entry: the logits (bf16), the contiguous copy the loss slices, the
  fp32 upcast and log-softmax output of the loss (snaketune.batching.token_loss_sum); with the fused loss
  (snaketune.losses) 8 B per entry of one chunk of tokens, the hidden states' gradient and, with several
  chunks, an fp32 sum of the lm_head weight's gradient; and, unless attention is varlen, the packed
  block-diagonal attention mask, micro_batch x seq^2 x (w + 1).
The peak is the larger of forward/backward and the optimizer step; it is what torch's
max_memory_allocated reports (summary.json peak_memory_gib_per_rank). A GPU must hold that plus
FRAGMENTATION of it and CUDA_OVERHEAD_GIB (CUDA context, NCCL and cuBLAS workspaces outside the allocator).
Host memory: HOST_PER_RANK_GIB per rank (a CUDA PyTorch + DeepSpeed process), plus with optimizer offload
18 B per trained parameter (fp32 master 4, Adam 8, fp32 gradients 4, bf16 staging 2); it must stay within
HOST_USABLE of the machine's RAM.

Calibration (tests/test_plan.py): ACTIVATION_FACTOR is fitted to FACTS.md's H200 points where activations
matter (LoRA 30 layers 8 x 512: 45.4 GiB; torch AdamW 24 and 30 layers 4 x 512: 107.6 and 130.6 GiB); the
model then gives 116.8 GiB for ZeRO-2 24 layers (measured 116.8, FACTS.md and bench/RESULTS.md) and 10.9 GiB
GPU / 66.6 GiB host for ZeRO-3 offload 14 layers (measured 10.6 / 69). With snaketune's masters, varlen
attention and the plain loss it gives 101.2 / 119.5 / 36.9 GiB for 24 layers, 30 layers and 30-layer LoRA
(measured 96.2 / 116.2 / 37.6, bench/RESULTS.md issue #7).

Speed order for `train.strategy: auto` (fastest first; STRATEGIES): relative throughputs are assumptions,
except offload, which FACTS.md measured: ZeRO-0 1.0 and ZeRO-2 0.97 (the same communication volume:
reduce-scatter + all-gather = all-reduce, DeepSpeed's docs); ZeRO-3 0.8 (weights gathered in forward and
backward: 1.5x the traffic; worse over PCIe); gradient checkpointing x0.75 (a second forward, +1/3 of the
compute); ZeRO-3 + CPU optimizer offload 0.09 and 0.07 with checkpointing (FACTS.md: 928 tok/s for 3.67B
parameters against 8,632 for 5.70B under ZeRO-2). Full fine-tuning or LoRA stays as configured; LoRA is
never planned with ZeRO-3 (the trainer refuses that combination).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.config import LoraConfig
from snaketune.dsconfig import offloads, uses_master_weights, zero_stage

log = logging.getLogger("snaketune.plan")

GIB = 2**30
ACTIVATION_FACTOR = 1.25
"""Measured / counted activation memory (fitted to FACTS.md's H200 points; see the module docstring)."""
LORA_ACTIVATION_FACTOR = 0.88
"""The same with LoRA. This project's trainer measured 37.6 GiB for LoRA r16 on all linear layers, 30 layers,
8 x 512, ZeRO-2, on one H200 (bench/runs/2026-11-29_h200_plan), where ACTIVATION_FACTOR predicts 45.6: frozen
weights need no saved inputs for weight gradients, and peft's adapters save only their rank-r products.
FACTS.md's 45.4 GiB for that setup came from other training code."""
LOGIT_BYTES = 12
"""Per token and vocabulary entry: bf16 logits 2 + contiguous copy 2 + fp32 upcast 4 + log-softmax 4."""
FUSED_LOGIT_BYTES = 8
"""The same for one chunk of the fused loss (snaketune.losses): bf16 product 2 + fp32 copy 4 + bf16 gradient 2."""
FUSED_CHUNK_BYTES = 2**30
"""snaketune.losses.CHUNK_BYTES (kept here so that the plan does not import torch)."""
MASTER_CHUNK_ELEMENTS = 2**28
"""snaketune.optim.CHUNK_ELEMENTS (the same reason)."""
CUDA_OVERHEAD_GIB = 1.0
"""CUDA context (~0.5 GiB on Hopper), NCCL buffers and workspaces that the caching allocator does not count."""
FRAGMENTATION = 0.05
"""Allocator blocks reserved but not allocated at the peak, as a share of the peak."""
HOST_PER_RANK_GIB = 5.0
"""Host memory of one rank: CUDA PyTorch + DeepSpeed + transformers, pinned buffers, the tokenized data."""
HOST_OFFLOAD_BYTES = 18
"""Host bytes per trained parameter with optimizer offload: fp32 master 4, Adam 8, fp32 grads 4, bf16 2."""
HOST_USABLE = 0.9
"""Share of the machine's RAM a training may plan to use (the OS, Snakemake and page cache keep the rest)."""
ENV_HOST_MEMORY = "SNAKETUNE_HOST_MEMORY_GIB"
"""Host RAM to plan against instead of /proc/meminfo's MemTotal (machines whose MemTotal grows with use)."""
STRATEGY_MODES = ("as_configured", "auto")
LORA_TARGETS = LoraConfig().targets
"""LoRA's default targets: every linear layer of a decoder layer."""


class PlanError(RuntimeError):
    """The training does not fit; the message says what would."""


# ---- the model ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Arch:
    """The sizes of a dense decoder-only transformer of the Llama family (DeepSeek-LLM is one)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear layer of one decoder layer, by module name."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self) -> int:
        embeddings = self.embedding_params() * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden

    def lora_params(self, rank: int, targets: Sequence[str]) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


def arch_from_hf_config(cfg: dict) -> Arch:
    """An Arch from a transformers config.json of a dense Llama-family model; ValueError otherwise."""
    cfg = cfg.get("text_config") or cfg
    moe = [k for k in ("num_experts", "n_routed_experts", "num_local_experts") if cfg.get(k)]
    if moe:
        raise ValueError(f"mixture-of-experts ({moe[0]}={cfg[moe[0]]}) is not modelled")
    missing = [
        k
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        if not cfg.get(k)
    ]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    return Arch(
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


BUILTIN_TOKENIZER_VOCAB = 1024
"""The builtin BPE's size (rule train_tokenizer); builtin-tiny rounds it up to a multiple of 64."""


def resolve_arch(model: dict, *, allow_download: bool = False) -> tuple[Arch | None, str]:
    """The architecture of `model` (config section `model`) and where it came from; (None, why) when it is
    not known here: a hub model whose config.json is neither cached nor downloadable (no network)."""
    from snaketune.architectures import BUILTIN_TINY, DEEPSEEK_LLM_7B

    base = model["base"]
    if base == "builtin-tiny":
        vocab = (BUILTIN_TOKENIZER_VOCAB + 63) // 64 * 64
        return arch_from_hf_config({**BUILTIN_TINY, "vocab_size": vocab}), "builtin-tiny (snaketune.model)"
    if base.startswith("arch:"):
        cfg = dict(DEEPSEEK_LLM_7B)
        if model.get("num_layers"):
            cfg["num_hidden_layers"] = model["num_layers"]
        return arch_from_hf_config(cfg), f"{base} (snaketune.model), {cfg['num_hidden_layers']} layers"
    path = Path(base) / "config.json"
    if not path.is_file():
        found = _hub_config(base, model.get("revision", "main"), allow_download)
        if found is None:
            return None, f"unknown: skipped (no config.json for {base!r} in the hub cache, none downloaded)"
        path = found
    try:
        return arch_from_hf_config(json.loads(path.read_text())), f"{path}"
    except ValueError as e:
        return None, f"unknown: skipped ({path}: {e})"


def _hub_config(repo_id: str, revision: str, allow_download: bool) -> Path | None:
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        return None
    try:
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if isinstance(cached, str):
            return Path(cached)
        if allow_download:
            return Path(hf_hub_download(repo_id, "config.json", revision=revision))
    except Exception as e:  # noqa: BLE001 - no network, bad id, gated repo: the plan is then unknown
        log.info("config.json of %s not available: %s", repo_id, e)
    return None


# ---- a setup and its estimate -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """Everything the memory of one training depends on besides the architecture."""

    world: int
    """Ranks (GPUs)."""
    zero_stage: int
    offload_optimizer: bool = False
    """fp32 master weights, Adam states and gradients in host memory (DeepSpeed offload_optimizer)."""
    offload_params: bool = False
    """Weights in host memory too (DeepSpeed offload_param, ZeRO-3)."""
    gradient_checkpointing: bool = False
    micro_batch: int = 1
    accumulation: int = 1
    """Micro-batches per optimizer step and rank."""
    seq_len: int = 512
    precision: str = "bf16"
    """bf16 | fp32 | autocast (fp32 weights, bf16 autocast: plain torch, FACTS.md's reference runs)."""
    lora_rank: int = 0
    """0: full fine-tuning."""
    lora_targets: tuple[str, ...] = ()
    engine: str = "deepspeed"
    """deepspeed | torch (torch AdamW, no DeepSpeed: FACTS.md's reference runs only)."""
    master_weights: bool = False
    """bf16 weights and gradients, fp32 masters in snaketune.optim.MasterWeightAdamW (ZeRO-0 only)."""
    fused_cross_entropy: bool = False
    """snaketune.losses.fused_linear_cross_entropy: one chunk of logits at a time."""
    varlen: bool = False
    """snaketune.attention's varlen kernel: no (micro_batch, 1, seq, seq) mask tensor."""
    reduce_bucket: float = 5e8
    prefetch_bucket: float = 5e7
    sub_group: float = 1e9
    overlap_comm: bool = False
    contiguous_gradients: bool = True

    def replace(self, **changes) -> Setup:
        return dataclasses.replace(self, **changes)


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


@dataclass(frozen=True)
class Estimate:
    params: int
    trainable: int
    weights_gib: float
    gradients_gib: float
    optimizer_gib: float
    buffers_gib: float
    activations_gib: float
    logits_gib: float
    step_extra_gib: float
    peak_allocated_gib: float
    """What torch.cuda.max_memory_allocated should report (summary.json peak_memory_gib_per_rank)."""
    peak_phase: str
    gpu_gib: float
    """What a GPU must have: the peak, FRAGMENTATION of it, and CUDA_OVERHEAD_GIB."""
    host_gib: float
    """Host memory of the whole node (all ranks)."""
    offload: bool = False
    """Optimizer or weights in host memory: only then is the host memory checked (it is the point)."""

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


def estimate(arch: Arch, s: Setup) -> Estimate:
    """Peak memory per GPU and on the host (see the module docstring for the model)."""
    h, i, n = arch.hidden, arch.intermediate, s.world
    shapes = arch.linear_shapes()
    total = arch.params()
    targets = [t for t in s.lora_targets if t in shapes]
    trained = arch.lora_params(s.lora_rank, targets) if s.lora_rank else total
    torch_engine = s.engine == "torch"
    stage = 0 if torch_engine else s.zero_stage
    w = 2 if s.precision == "bf16" else 4  # bytes per stored weight
    a = 4 if s.precision == "fp32" else 2  # bytes per activation
    master = 4 if s.precision == "bf16" else 0

    weights = 0.0 if s.offload_params else w * total / (n if stage == 3 else 1)
    if s.precision == "autocast":
        weights += 2 * total  # autocast's bf16 copies of the weights, saved for backward
    if s.master_weights and stage == 0:
        grads = float(w * trained)  # the model's own bf16 gradients; fp32 only one chunk at a time
    elif torch_engine or stage == 0:
        grads = 4.0 * trained
    elif stage == 1:
        grads = float(w * trained)
    else:
        grads = 0.0 if s.offload_optimizer else w * trained / n
    if s.offload_optimizer:
        optim = 0.0
    elif torch_engine:
        optim = 8.0 * trained  # the fp32 weights are the master copy
    else:
        optim = (master + 8) * trained / (1 if stage == 0 else n)

    buffers = 0.0
    if stage in (1, 2) and s.contiguous_gradients:
        buffers = s.reduce_bucket * w * (2 if s.overlap_comm else 1)
    elif stage == 3:
        buffers = (s.reduce_bucket + s.prefetch_bucket) * w
        if n > 1:
            buffers += w * max(2 * arch.layer_params(), arch.embedding_params())
    if s.lora_rank:
        largest = max((s.lora_rank * max(shapes[t]) for t in targets), default=0)
    else:
        largest = arch.embedding_params()
    transient_grad = 0.0 if torch_engine else w * largest

    step_extra = 0.0
    if s.master_weights and stage == 0:
        step_extra = 4.0 * min(trained, MASTER_CHUNK_ELEMENTS)  # one chunk of fp32 gradients
    elif not (torch_engine or s.offload_optimizer or stage == 0):
        step_extra = (w + master) * (trained / n if stage < 3 else min(trained / n, s.sub_group))

    tokens = s.micro_batch * s.seq_len
    q, kv = shapes["q_proj"][1], shapes["k_proj"][1]
    # Per RMSNorm: the fp32 upcast, the normalized and the scaled output. Under autocast the residual stream
    # is fp32 already (input and output saved) and the next linear saves its own bf16 cast.
    norm = 8 * h + 2 * h if s.precision == "autocast" else 4 * h + 2 * a * h
    per_layer = 2 * norm + a * (2 * q + 2 * kv) + 4 * a * i + a * s.lora_rank * len(targets)
    residual = 4 if s.precision == "autocast" else a
    factor = LORA_ACTIVATION_FACTOR if s.lora_rank else ACTIVATION_FACTOR
    if s.gradient_checkpointing:
        acts = tokens * arch.layers * residual * h + tokens * per_layer * factor
    else:
        acts = tokens * arch.layers * per_layer * factor
    acts += tokens * norm  # the final norm
    if s.fused_cross_entropy:
        # At the end of the forward pass, on top of every layer's saved activations: one chunk of logits (bf16
        # product, fp32 copy turned into the gradient in place, its bf16 cast), the hidden states' gradient, and
        # with several chunks the fp32 sum of the lm_head weight's gradient (its w-byte result becomes the .grad
        # that `grads` counts).
        chunk = min(tokens, max(256, FUSED_CHUNK_BYTES // (4 * arch.vocab) // 256 * 256))
        logits = FUSED_LOGIT_BYTES * chunk * arch.vocab + a * tokens * h
        if not s.lora_rank and chunk < tokens:
            logits += 4 * arch.vocab * h
    else:
        logits = LOGIT_BYTES * tokens * arch.vocab
    if not s.varlen:
        logits += s.micro_batch * s.seq_len**2 * (a + 1)  # the packed block-diagonal mask

    states = weights + grads + optim
    # The buckets live from the first gradient to the end of backward (DeepSpeed releases them there).
    forward_backward = states + buffers + transient_grad + acts + logits
    if s.master_weights and stage == 0 and s.accumulation == 1:
        # The gradients are freed after every step (DeepSpeed's zero_grad) and, with one micro-batch per step,
        # grow during backward while the activations are freed: the peak is at the start of backward, with
        # all activations and (nearly) no gradients. Measured: 95.5 GiB for 24 layers at 8 x 512 (bench/RESULTS.md).
        forward_backward = weights + optim + max(transient_grad + acts + logits, grads)
    step = states + step_extra
    peak = max(forward_backward, step)
    host = HOST_PER_RANK_GIB * GIB * n
    if s.offload_optimizer:
        host += HOST_OFFLOAD_BYTES * trained
    if s.offload_params:
        host += w * total
    return Estimate(
        params=total,
        trainable=trained,
        weights_gib=weights / GIB,
        gradients_gib=grads / GIB,
        optimizer_gib=optim / GIB,
        buffers_gib=(buffers + transient_grad) / GIB,
        activations_gib=acts / GIB,
        logits_gib=logits / GIB,
        step_extra_gib=step_extra / GIB,
        peak_allocated_gib=peak / GIB,
        peak_phase="optimizer step" if step > forward_backward else "forward/backward",
        gpu_gib=peak / GIB * (1 + FRAGMENTATION) + CUDA_OVERHEAD_GIB,
        host_gib=host / GIB,
        offload=s.offload_optimizer or s.offload_params,
    )


# ---- strategies --------------------------------------------------------------------------------------------


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


# ---- the plan ------------------------------------------------------------------------------------------------


def host_memory_gib(environ=None) -> float | None:
    env = os.environ if environ is None else environ
    if env.get(ENV_HOST_MEMORY):
        return float(env[ENV_HOST_MEMORY])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Budget:
    """What a plan is checked against."""

    gpu_gib: float | None
    """Memory of each GPU; None: no GPU to check against (CPU ranks), nothing is refused."""
    source: str
    host_gib: float | None = None

    def fits(self, est: Estimate) -> bool | None:
        if self.gpu_gib is None:
            return None
        host_ok = not est.offload or self.host_gib is None or est.host_gib <= HOST_USABLE * self.host_gib
        return est.gpu_gib <= self.gpu_gib and host_ok


def detect_budget(gpu_memory_gib: float | None, *, devices=None, host_gib: float | None = None) -> Budget:
    """The budget of the plan rule: `gpu_memory_gib` when set (capped at the GPUs' own memory), else the
    smallest of the GPUs this machine offers the workflow (snaketune.gpus), else none (CPU)."""
    from snaketune import gpus

    if devices is None:
        pool = gpus.candidates()
        devices = [] if pool.fake or not pool.ids else gpus.nvidia_smi_devices(pool.ids)
    host_gib = host_memory_gib() if host_gib is None else host_gib
    real = min((d.total_gib for d in devices), default=None)
    names = ", ".join(sorted({d.name for d in devices}))
    if gpu_memory_gib is not None:
        if real is not None and real < gpu_memory_gib:
            return Budget(
                real, f"{names} ({real:.1f} GiB, less than gpu_memory_gib {gpu_memory_gib:g})", host_gib
            )
        return Budget(float(gpu_memory_gib), f"gpu_memory_gib: {gpu_memory_gib:g}", host_gib)
    if real is not None:
        return Budget(real, f"{names} ({real:.1f} GiB, the smallest of {len(devices)} GPU(s))", host_gib)
    return Budget(None, "no GPU: CPU ranks, nothing to check", host_gib)


def _setup_for(train: dict, ds: dict, *, world: int, seq_len: int, precision: str, **changes) -> Setup:
    """The Setup a training with these train settings and this DeepSpeed file runs (snaketune.training decides
    the same way: MasterWeightAdamW at ZeRO-0 in bf16 without offload unless train.bf16_optimizer says
    deepspeed; the fused loss except under ZeRO-3; varlen attention in bf16 unless train.attention is sdpa)."""
    lora = train.get("lora") or {}
    stage = zero_stage(ds)
    master = uses_master_weights(ds, train.get("bf16_optimizer", "auto"), bf16=precision == "bf16")
    world_micro = int(train["micro_batch_size"]) * world
    fields = dict(
        accumulation=max(1, int(train.get("global_batch_size", world_micro)) // world_micro),
        master_weights=master,
        fused_cross_entropy=bool(train.get("fused_cross_entropy", True)) and stage != 3,
        varlen=precision == "bf16" and train.get("attention", "auto") != "sdpa",
        world=world,
        gradient_checkpointing=bool(train.get("gradient_checkpointing")),
        micro_batch=int(train["micro_batch_size"]),
        seq_len=seq_len,
        precision=precision,
        lora_rank=int(lora.get("rank", 16)) if lora.get("enabled") else 0,
        lora_targets=tuple(lora.get("targets") or LORA_TARGETS),
    )
    fields.update(changes)
    return setup_from_deepspeed(ds, **fields)


def _entry(name: str, deepspeed: str, s: Setup, est: Estimate, budget: Budget, **extra) -> dict:
    return {
        "name": name,
        "deepspeed_config": deepspeed,
        "gradient_checkpointing": s.gradient_checkpointing,
        "setup": dataclasses.asdict(s),
        "estimate": est.as_dict(),
        "fits": budget.fits(est),
        **extra,
    }


def _fmt(entry: dict) -> str:
    est = entry["estimate"]
    text = f"{entry['name']} needs {est['gpu_gib']:.1f} GiB per GPU"
    if entry["setup"]["offload_optimizer"] or entry["setup"]["offload_params"]:
        text += f" and {est['host_gib']:.0f} GiB host RAM"
    return text


def make_plan(
    *,
    experiment: str,
    model: dict,
    train: dict,
    max_length: int,
    deepspeed_config: str,
    gpu_memory_gib: float | None,
    budget: Budget,
    candidate_files: dict[str, str] | None = None,
    allow_download: bool = False,
) -> dict:
    """The plan as a JSON-able dict; `fits` is False when the chosen strategy does not fit (then `message`
    says what would), None when there is nothing to check against."""
    strategy = train.get("strategy", "as_configured")
    plan: dict[str, Any] = {
        "experiment": experiment,
        "strategy": strategy,
        "train_precision": train.get("precision", "auto"),
        "gpu_memory_gib": gpu_memory_gib,
        "budget": dataclasses.asdict(budget),
        "model": {"base": model["base"]},
    }
    arch, source = resolve_arch(model, allow_download=allow_download)
    plan["model"]["source"] = source
    configured_name = "as configured"
    chosen = {
        "name": configured_name,
        "deepspeed_config": deepspeed_config,
        "gradient_checkpointing": bool(train.get("gradient_checkpointing")),
    }
    if arch is None:
        plan.update(arch=None, fits=None, status=source, chosen=chosen, candidates=[], message=None)
        return plan
    precision = train.get("precision", "auto")
    if precision == "auto":
        precision = "fp32" if budget.gpu_gib is None else "bf16"
    world = int(train["gpus"]) * int(train.get("nodes", 1))  # train.gpus is per node
    common = dict(world=world, seq_len=max_length, precision=precision)
    ds = json.loads(Path(deepspeed_config).read_text())
    setup = _setup_for(train, ds, **common)
    est = estimate(arch, setup)
    configured = _entry(strategy_name(setup), deepspeed_config, setup, est, budget, configured=True)
    plan["arch"] = dataclasses.asdict(arch)
    plan["model"].update(params=est.params, trainable=est.trainable)
    plan["configured"] = configured

    lora = bool((train.get("lora") or {}).get("enabled"))
    candidates = []
    for strat in candidate_strategies(lora) if candidate_files else []:
        path = candidate_files.get(strat.deepspeed_file)
        if path is None:
            continue
        s = _setup_for(
            train,
            json.loads(Path(path).read_text()),
            gradient_checkpointing=strat.gradient_checkpointing,
            **common,
        )
        e = estimate(arch, s)
        candidates.append(_entry(strat.name, path, s, e, budget, relative_speed=strat.relative_speed))
    plan["candidates"] = candidates

    if strategy == "auto" and budget.gpu_gib is not None:
        fitting = [c for c in candidates if c["fits"]]
        pick = fitting[0] if fitting else None
    else:
        pick = configured
    if pick is not None:
        chosen = {k: pick[k] for k in ("name", "deepspeed_config", "gradient_checkpointing")}
        chosen["estimate"] = pick["estimate"]
    plan["chosen"] = chosen
    fits = None if budget.gpu_gib is None else bool(pick and pick["fits"])
    plan["fits"] = fits
    plan["message"] = None
    if fits is False:
        plan["message"] = not_fitting_message(plan, arch, train, ds, common, budget, candidate_files)
        plan["status"] = "does not fit"
    elif fits:
        plan["status"] = f"fits: {chosen['name']} on {world} x {budget.gpu_gib:.1f} GiB"
    else:
        plan["status"] = budget.source
    return plan


def _fastest_fitting(
    arch: Arch, train: dict, files: dict[str, str], common: dict, budget: Budget
) -> tuple[str, Setup, Estimate] | None:
    """The fastest strategy (STRATEGIES order) that fits `budget` with these train settings."""
    lora = bool((train.get("lora") or {}).get("enabled"))
    for strat in candidate_strategies(lora):
        if strat.deepspeed_file not in files:
            continue
        ds = json.loads(Path(files[strat.deepspeed_file]).read_text())
        s = _setup_for(train, ds, gradient_checkpointing=strat.gradient_checkpointing, **common)
        e = estimate(arch, s)
        if budget.fits(e):
            return strat.name, s, e
    return None


def not_fitting_message(
    plan: dict,
    arch: Arch,
    train: dict,
    ds: dict,
    common: dict,
    budget: Budget,
    candidate_files: dict[str, str] | None,
) -> str:
    """'... zero2 needs 113.8 GiB per GPU as configured. What would fit: zero3_offload needs 9.6 GiB per GPU
    and 98 GiB host RAM (...); LoRA (train.lora.enabled: true) with zero2 needs 16.2 GiB per GPU.'

    Tried in this order, each with the fastest strategy that fits, at most three kept: the configured
    training with another strategy, LoRA instead of full fine-tuning, micro_batch_size 1, both, more GPUs.
    """
    configured = plan["configured"]
    world = common["world"]
    head = f"train.gpus {world} x {budget.gpu_gib:.1f} GiB ({budget.source})"
    if budget.host_gib is not None:
        head += f", {budget.host_gib:.0f} GiB host RAM"
    where = configured["deepspeed_config"] + (
        ", gradient checkpointing on" if configured["gradient_checkpointing"] else ""
    )
    text = f"{head}: {_fmt(configured)} as configured ({where})"
    if plan["strategy"] == "auto":
        text = f"{head}: no strategy fits; {_fmt(configured)} as configured ({where})"
    files = dict(candidate_files or {})
    files.setdefault(Path(configured["deepspeed_config"]).name, configured["deepspeed_config"])
    full = not (train.get("lora") or {}).get("enabled")
    lora_train = {**train, "lora": {**(train.get("lora") or {}), "enabled": True}}
    micro = int(train["micro_batch_size"])
    variants = [("", train)]
    if full:
        variants.append(("LoRA (train.lora.enabled: true) with ", lora_train))
    if micro > 1:
        variants.append(("micro_batch_size 1 with ", {**train, "micro_batch_size": 1}))
        if full:
            variants.append(("LoRA and micro_batch_size 1 with ", {**lora_train, "micro_batch_size": 1}))
    would = []
    for label, variant in variants:
        found = _fastest_fitting(arch, variant, files, common, budget)
        if found:
            name, s, e = found
            hint = ""
            if not label:
                hint = (
                    f" (train.deepspeed: {files[STRATEGY_FILES[name]]}, gradient_checkpointing: "
                    f"{str(s.gradient_checkpointing).lower()}; or train.strategy: auto)"
                )
            would.append(
                label + _fmt({"name": name, "setup": dataclasses.asdict(s), "estimate": e.as_dict()}) + hint
            )
        if len(would) == 3:
            break
    if not would:
        for more in (2, 4, 8, 16, 32, 64):
            if more > world:
                found = _fastest_fitting(arch, train, files, {**common, "world": more}, budget)
                if found:
                    name, s, e = found
                    would.append(f"{name} on {more} GPUs needs {e.gpu_gib:.1f} GiB per GPU")
                    break
    # A strategy that fits the GPUs but not the host is worth naming: more RAM would do.
    host_short = [
        c
        for c in plan["candidates"]
        if not c["fits"] and c["estimate"]["offload"] and c["estimate"]["gpu_gib"] <= budget.gpu_gib
    ]
    if host_short and budget.host_gib is not None:
        c = host_short[0]
        text += (
            f"; {c['name']} would fit the GPUs ({c['estimate']['gpu_gib']:.1f} GiB) but needs "
            f"{c['estimate']['host_gib']:.0f} GiB host RAM ({HOST_USABLE:.0%} of {budget.host_gib:.0f} GiB "
            f"is usable; {ENV_HOST_MEMORY} overrides the RAM)"
        )
    if would:
        return f"{text}. What would fit: " + "; ".join(would) + "."
    return f"{text}. Nothing tried fits: use more or larger GPUs, a shorter tokenize.max_length or LoRA."


def format_table(plan: dict) -> str:
    """The plan as a text table for the log."""
    rows = ([plan["configured"]] if plan.get("configured") else []) + plan.get("candidates", [])
    lines = [
        f"model {plan['model']['base']} ({plan['model'].get('source')}): "
        f"{plan['model'].get('params', 0):,} parameters, {plan['model'].get('trainable', 0):,} trained",
        f"budget: {plan['budget']['source']}; host RAM {plan['budget'].get('host_gib') or 0:.0f} GiB",
        f"{'strategy':<26}{'speed':>6}{'peak alloc':>12}{'per GPU':>10}{'host':>8}  phase / fits",
    ]
    for r in rows:
        e = r["estimate"]
        name = r["name"] + (" (configured)" if r.get("configured") else "")
        speed = f"{r['relative_speed']:.2f}" if "relative_speed" in r else "-"
        lines.append(
            f"{name:<26}{speed:>6}{e['peak_allocated_gib']:>10.1f}Gi{e['gpu_gib']:>8.1f}Gi"
            f"{e['host_gib']:>6.0f}Gi  {e['peak_phase']} / {r['fits']}"
        )
    lines.append(f"chosen: {plan['chosen']['name']} ({plan['chosen']['deepspeed_config']}); {plan['status']}")
    return "\n".join(lines)


def write_plan(*, out: str | Path, **kwargs) -> dict:
    """The plan rule: make the plan, log it, refuse a training that does not fit, write the JSON."""
    from snaketune.io import write_json

    gpu_memory_gib = kwargs["gpu_memory_gib"]
    budget = kwargs.pop("budget", None) or detect_budget(gpu_memory_gib)
    plan = make_plan(budget=budget, **kwargs)
    if plan.get("configured"):
        log.info("memory plan for %s:\n%s", plan["experiment"], format_table(plan))
    else:
        log.info("memory plan for %s: %s", plan["experiment"], plan["status"])
    if plan["fits"] is False:
        raise PlanError(plan["message"])
    write_json(out, plan)
    return plan


# ---- using the plan -------------------------------------------------------------------------------------------


def apply_plan(run_spec: dict, plan: dict) -> dict:
    """The run spec with the plan's strategy (train.strategy: auto); its run key then names that strategy
    too, so a run never resumes a checkpoint written under another ZeRO stage."""
    from snaketune.io import sha256_file, sha256_text, stable_json

    chosen = plan["chosen"]
    same = (chosen["deepspeed_config"], chosen["gradient_checkpointing"]) == (
        run_spec["deepspeed_config"],
        run_spec["train"]["gradient_checkpointing"],
    )
    if plan.get("strategy") != "auto" or same:
        return run_spec
    train = {**run_spec["train"], "gradient_checkpointing": chosen["gradient_checkpointing"]}
    named = [run_spec["run_key"], chosen["name"], sha256_file(chosen["deepspeed_config"])]
    run_key = sha256_text(stable_json(named))[:16]
    return {**run_spec, "train": train, "deepspeed_config": chosen["deepspeed_config"], "run_key": run_key}


def check_devices(
    plan: dict | None, *, world: int, device_gib: float, host_gib: float | None
) -> tuple[bool, str]:
    """The launcher's check of the plan's chosen strategy against the GPUs a job was given, for the world
    size it really got (Snakemake may grant fewer GPUs than train.gpus). (fits, log line or message)."""
    if not plan or not plan.get("arch") or "setup" not in (plan.get("configured") or {}):
        return True, "memory plan: not available for this model, not checked"
    arch = Arch(**plan["arch"])
    chosen = plan["chosen"]
    entry = next(
        (c for c in [plan["configured"], *plan["candidates"]] if c["name"] == chosen["name"]),
        plan["configured"],
    )
    setup = Setup(**{**entry["setup"], "lora_targets": tuple(entry["setup"]["lora_targets"]), "world": world})
    if setup.precision == "fp32" and plan["train_precision"] == "auto":
        setup = setup.replace(precision="bf16")  # planned without a GPU; the ranks use bf16 on CUDA
    est = estimate(arch, setup)
    cap = plan.get("gpu_memory_gib")
    gib = min(device_gib, cap) if cap else device_gib
    budget = Budget(
        gib, f"{device_gib:.1f} GiB GPUs" + (f", gpu_memory_gib {cap:g}" if cap else ""), host_gib
    )
    fits = budget.fits(est)
    line = (
        f"memory plan: {entry['name']} on {world} GPU(s) needs {est.peak_allocated_gib:.1f} GiB allocated, "
        f"{est.gpu_gib:.1f} GiB per GPU with CUDA context and fragmentation; {budget.source}"
    )
    if est.offload:
        line += f"; host {est.host_gib:.0f} GiB of {host_gib or math.nan:.0f}"
    if fits:
        return True, line
    return False, (
        f"{line}: does not fit. Set gpu_memory_gib: {gib:g} so that the plan rule can choose (train.strategy: "
        "auto), or see results/plan/ for what fits"
    )
