"""The memory model of the plan: peak GPU and host memory of a training (and of an evaluation) from the
architecture and the setup, without torch (the plan rule runs on the login node).

Bytes per GPU, term by term (each counted by its function below, which says how): the weights (`_weights`), the
gradients (`_gradients`), the optimizer's masters and states (`_optimizer`), DeepSpeed's buckets (`_buffers`), what
autograd saves (`_activations`), the loss's logits (`_logits`) and what the optimizer step adds (`_step_extra`).
P parameters, T of them trained (P, or the LoRA adapters), N ranks, w bytes per weight (2 bf16, 4 fp32); bf16
training keeps an fp32 master copy (4 B) and Adam's m and v (8 B) per trained parameter: 16 B/param for
mixed-precision Adam (docs/facts.md). The peak is the larger of forward/backward and the optimizer step; it is what
torch's max_memory_allocated reports (summary.json peak_memory_gib_per_rank). A GPU must hold that plus
FRAGMENTATION of it (none for the step in backward and for counted LoRA under a cap: expandable segments) and
CUDA_OVERHEAD_GIB (CUDA context, NCCL and cuBLAS workspaces outside the allocator). Host memory: HOST_PER_RANK_GIB per rank (a CUDA PyTorch + DeepSpeed
process), plus with optimizer offload HOST_OFFLOAD_BYTES per trained parameter; it must stay within HOST_USABLE of
the machine's RAM.

Calibration (tests/test_plan.py): ACTIVATION_FACTOR is fitted to the H200 points of docs/facts.md where activations
matter (LoRA 30 layers 8 x 512: 45.4 GiB; torch AdamW 24 and 30 layers 4 x 512: 107.6 and 130.6 GiB); the
model then gives 116.8 GiB for ZeRO-2 24 layers (measured 116.8, docs/facts.md and bench/RESULTS.md) and 11.1 GiB
GPU / 66.6 GiB host for ZeRO-3 offload 14 layers (measured 10.6 / 69). With snaketune's masters, varlen
attention and the plain loss it gives 101.2 / 119.5 / 36.9 GiB for 24 layers, 30 layers and 30-layer LoRA
(measured 96.2 / 116.2 / 37.6, bench/RESULTS.md issue #7). LoRA in bf16 with Liger's kernels and varlen attention
is counted tensor by tensor instead (`counted`): within 0.5% of ten measured peaks (tests/test_plan.py).
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from snaketune.device_memory import LAZY_MODULES_GIB
from snaketune.model.sizes import MASTER_CHUNK_ELEMENTS, STATE_BYTES, chunk_tokens
from snaketune.plan.arch import Arch

log = logging.getLogger("snaketune.plan.search")

GIB = 2**30
ACTIVATION_FACTOR = 1.25
"""Measured / counted activation memory (fitted to the H200 points of docs/facts.md; see the module docstring)."""
LORA_ACTIVATION_FACTOR = 0.88
"""The same with LoRA, fitted to this project's trainer's 37.6 GiB for LoRA r16 on all linear layers, 30 layers,
8 x 512, ZeRO-2, on one H200 (bench/RESULTS.md), where ACTIVATION_FACTOR predicts 45.6: frozen weights need no
saved inputs for weight gradients, and peft's adapters save only their rank-r products."""
COMPILED_SAVED_H = 2.0
"""torch.compile's layers keep about one more bf16 copy of the hidden state per token than eager ones (2h bytes per
token and layer whose activations are kept): +0.78 GiB for the 24-layer full fine-tune at 8 x 512 (88.83 against
88.05 GiB) and +0.91 GiB for LoRA of 30 layers with FP8 (30.25 against 29.34) on one H200 (bench/RESULTS.md,
issue #26). Fitted to those two points, nothing held out: what the compiler saves is its partitioner's choice."""
COUNTED_REST_GIB = 0.1
"""What the count of `_counted_activations` misses (the libraries' workspaces that PyTorch's allocator holds, cuBLAS's
among them, and small temporaries): fitted to the runs at 8 x 512 with 0, 16, 18 and 30 of 30 layers checkpointed
(0.03-0.13 GiB short without it, mean 0.10; bench/RESULTS.md, issue #16); the QLoRA example's three runs at 4,096
tokens per row (0.08-0.19 GiB short without it) are held out (tests/test_plan.py)."""
LOGIT_BYTES = 12
"""Per token and vocabulary entry: bf16 logits 2 + contiguous copy 2 + fp32 upcast 4 + log-softmax 4."""
FUSED_LOGIT_BYTES = 12
"""The same for one chunk of the fused loss (snaketune.model.losses) and of DPO's log-probabilities: the fp32 logits
4, and torch.logsumexp's two fp32 temporaries (logits - max, then its exp: 4 + 4). Counted; the QLoRA example at
2 x 4,096 tokens measured 3.1 GiB above its saved inputs (bench/RESULTS.md, issue #16), 12 B x 2,560 x 102,400 =
3.0 GiB (8 B, the bf16 product, fp32 copy and bf16 gradient, gave 2.0)."""
CUDA_OVERHEAD_GIB = 1.25 + LAZY_MODULES_GIB
"""What a rank holds outside PyTorch's allocator (snaketune.device_memory): the CUDA context, cuBLAS's and NCCL's
buffers and a training step's kernels (1.2-1.3 GiB measured, docs/facts.md "Device memory"), and the room the ranks
leave for kernel modules loaded after their warm-up."""
FRAGMENTATION = 0.05
"""Allocator blocks reserved but not allocated at the peak, as a share of the peak. None for the step in backward,
whose ranks turn on the allocator's expandable segments (snaketune.device_memory.allocator_settings): their free
pages go back to the driver before an allocation over the cap fails, so the allocated peak is what must fit
(docs/facts.md, "Device memory"). A user's own PYTORCH_CUDA_ALLOC_CONF
without expandable segments keeps PyTorch's fixed segments: then the plan is up to 5% short (the rank logs which)."""
HOST_PER_RANK_GIB = 5.0
"""Host memory of one rank: CUDA PyTorch + DeepSpeed + transformers, pinned buffers, the tokenized data."""
HOST_OFFLOAD_BYTES = 18
"""Host bytes per trained parameter with optimizer offload: fp32 master 4, Adam 8, fp32 grads 4, bf16 2."""
NF4_BYTES = 0.5 + 1 / 64 + 4 / (64 * 256)
"""Bytes per 4-bit NormalFloat weight with double quantization (snaketune.model.build.nf4_config), counted."""
STATE_8BIT_BYTES = STATE_BYTES["8bit"]
"""Adam's m and v in 8 bits per trained parameter (snaketune.train.adam8bit, torchao's 8-bit states alike)."""
STATE_4BIT_BYTES = STATE_BYTES["4bit"]
"""Adam's m and v in 4 bits per trained parameter (snaketune.train.backward_step)."""
OFFLOAD_NORM_ELEMENTS = 250_000_000
"""DeepSpeed's ZeRO-3 takes an offloaded gradient partition's norm in float64 pieces of this many elements
(stage3.py, _constant_buffered_norm2's buffer_size; no setting changes it)."""
HOST_USABLE = 0.9
"""Share of the machine's RAM a training may plan to use (the OS, Snakemake and page cache keep the rest)."""
ENV_HOST_MEMORY = "SNAKETUNE_HOST_MEMORY_GIB"
"""Host RAM to plan against instead of /proc/meminfo's MemTotal (machines whose MemTotal grows with use)."""


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
    checkpoint_layers: int | None = None
    """With gradient_checkpointing: the first this many decoder layers recompute (None: every layer)."""
    micro_batch: int = 1
    accumulation: int = 1
    """Micro-batches per optimizer step and rank."""
    seq_len: int = 512
    precision: str = "bf16"
    """bf16 | fp32 | autocast (fp32 weights, bf16 autocast: plain torch, the reference runs of docs/facts.md)."""
    lora_rank: int = 0
    """0: full fine-tuning."""
    lora_targets: tuple[str, ...] = ()
    quantized: bool = False
    """QLoRA: the frozen linear weights in NF4 (train.lora.quantize: nf4)."""
    states_8bit: bool = False
    """Adam's m and v in 8 bits (train.optimizer_states: 8bit)."""
    states_4bit: bool = False
    """Adam's m and v in 4 bits (train.optimizer_states: 4bit; with in_backward only)."""
    in_backward: bool = False
    """train.optimizer_step: in_backward (snaketune.train.backward_step): the weights are their own masters, each
    gradient is applied and freed by its hook (ZeRO-0, one micro-batch per step)."""
    engine: str = "deepspeed"
    """deepspeed | torch (torch AdamW, no DeepSpeed: the reference runs of docs/facts.md only)."""
    master_weights: bool = False
    """bf16 weights and gradients, fp32 masters in snaketune.train.optim.MasterWeightAdamW (ZeRO-0 only)."""
    fused_cross_entropy: bool = False
    """snaketune.model.losses.fused_linear_cross_entropy: one chunk of logits at a time."""
    triton_loss: bool = False
    """snaketune.model.losses.logits_cross_entropy (train.loss_kernel), where the loss is not the fused one."""
    varlen: bool = False
    """snaketune.model.attention's varlen kernel: no (micro_batch, 1, seq, seq) mask tensor."""
    objective: str = "sft"
    """sft: the next-token loss (the fields above say which); preference: DPO's per-token log-probabilities
    (snaketune.preference.logprobs), chunked like the fused loss, or the whole fp32 logits under ZeRO-3."""
    liger: bool = False
    """Liger's RMSNorm, RoPE and SwiGLU (snaketune.model.kernels): less saved for backward (`saved_less` in estimate)."""
    expandable_segments: bool = False
    """The ranks' caching allocator maps its segments page by page (snaketune.device_memory.allocator_settings: the
    step in backward, and every training under gpu_memory_gib): no FRAGMENTATION where the model counts every
    tensor (`_fragmentation`)."""
    offload_activations: bool = False
    """train.offload_activations: checkpointed layers' inputs in host memory (snaketune.model.offload)."""
    compiled: bool = False
    """train.compile: each decoder layer compiled (COMPILED_SAVED_BYTES more saved per token and layer kept)."""
    reduce_bucket: float = 5e8
    prefetch_bucket: float = 5e7
    sub_group: float = 1e9
    overlap_comm: bool = False
    contiguous_gradients: bool = True

    def replace(self, **changes) -> Setup:
        return dataclasses.replace(self, **changes)


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
    activations_host_gib: float = 0.0
    """Checkpointed layers' inputs in pinned host memory (train.offload_activations), all ranks of the node: the host
    memory is checked where there are any."""

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in dataclasses.asdict(self).items()}


@dataclass(frozen=True)
class _Counts:
    """What every term of `estimate` is counted from."""

    total: int
    """Parameters of the model."""
    trained: int
    """Parameters trained: all of them, or LoRA's adapters."""
    targets: tuple[str, ...]
    """LoRA's target layers that the architecture has."""
    stage: int
    """The ZeRO stage (0 for plain torch)."""
    torch_engine: bool
    w: int
    """Bytes per stored weight."""
    a: int
    """Bytes per activation."""
    master: int
    """Bytes per fp32 master weight (bf16 training keeps one per trained parameter)."""
    largest: int
    """Elements of the largest trained tensor (its gradient exists whole while backward reduces it)."""


def _counts(arch: Arch, s: Setup) -> _Counts:
    shapes = arch.linear_shapes()
    targets = tuple(t for t in s.lora_targets if t in shapes)
    largest = max((s.lora_rank * max(shapes[t]) for t in targets), default=0)  # LoRA's largest adapter
    return _Counts(
        total=arch.params(),
        trained=arch.lora_params(s.lora_rank, list(targets)) if s.lora_rank else arch.params(),
        targets=targets,
        stage=0 if s.engine == "torch" else s.zero_stage,
        torch_engine=s.engine == "torch",
        w=2 if s.precision == "bf16" else 4,
        a=4 if s.precision == "fp32" else 2,
        master=4 if s.precision == "bf16" else 0,
        largest=largest if s.lora_rank else arch.embedding_params(),
    )


def _weights(arch: Arch, s: Setup, c: _Counts) -> tuple[float, float]:
    """The weights: w*P, or w*P/N under ZeRO-3 (frozen weights too). QLoRA (train.lora.quantize: nf4): the decoder
    layers' linear weights at NF4_BYTES each (4-bit codes, an 8-bit absmax per 64, an fp32 absmax per 256 of those),
    the embeddings, lm_head and norms at w; and each matmul dequantizes its weight to a w-byte temporary (the second
    figure: the largest)."""
    weights = 0.0 if s.offload_params else c.w * c.total / (s.world if c.stage == 3 else 1)
    dequantized = 0.0
    if s.quantized:
        sizes = [fan_in * fan_out for fan_in, fan_out in arch.linear_shapes().values()]
        linear = arch.layers * sum(sizes)
        weights = c.w * (c.total - linear) + NF4_BYTES * linear
        dequantized = c.w * max(sizes)  # one weight at a time, in w bytes
    if s.precision == "autocast":
        weights += 2 * c.total  # autocast's bf16 copies of the weights, saved for backward
    return weights, dequantized


def _gradients(s: Setup, c: _Counts) -> float:
    """The gradients kept: ZeRO-0 4*T (DeepSpeed's bf16 optimizer accumulates in fp32), or w*T with snaketune's fp32
    masters (snaketune.train.optim.MasterWeightAdamW: the model's bf16 gradients, cast to fp32 one chunk at a time in
    the step), 4*T with those masters and gradient accumulation (its fp32 accumulation buffer); ZeRO-1 w*T, ZeRO-2/3
    w*T/N, none on the GPU with optimizer offload; none with the step in backward (each is applied and freed by its
    hook). While backward runs, the largest trained tensor's gradient also exists whole before it is reduced (the
    102,400 x 4,096 embedding for DeepSeek-7B: `estimate`'s transient gradient)."""
    if s.in_backward:
        return 0.0  # freed by each hook as it is applied; the one in flight is the transient gradient
    if s.master_weights and c.stage == 0 and s.accumulation > 1:
        return 4.0 * c.trained  # the fp32 accumulation buffer (each bf16 .grad is freed into it as it comes)
    if s.master_weights and c.stage == 0:
        return float(c.w * c.trained)  # the model's own bf16 gradients; fp32 only one chunk at a time
    if c.torch_engine or c.stage == 0:
        return 4.0 * c.trained
    if c.stage == 1:
        return float(c.w * c.trained)
    return 0.0 if s.offload_optimizer else c.w * c.trained / s.world


def _optimizer(s: Setup, c: _Counts) -> float:
    """The optimizer's masters and states: (4 + 8)*T, divided by N from ZeRO-1 on; on the host with offload. With 8-bit
    states (train.optimizer_states: 8bit) m and v take STATE_8BIT_BYTES instead of 8. The step in backward
    (train.optimizer_step: in_backward): no masters, m and v at 8, STATE_8BIT_BYTES or STATE_4BIT_BYTES."""
    state_bytes = STATE_4BIT_BYTES if s.states_4bit else STATE_8BIT_BYTES if s.states_8bit else 8.0
    if s.offload_optimizer:
        return 0.0
    if s.in_backward:
        return state_bytes * c.trained  # no masters: the weights are updated in place
    if c.torch_engine:
        return 8.0 * c.trained  # the fp32 weights are the master copy
    return (c.master + state_bytes) * c.trained / (1 if c.stage == 0 else s.world)


def _buffers(arch: Arch, s: Setup, c: _Counts) -> float:
    """DeepSpeed's buffers while backward runs (it frees them at its end): ZeRO-1/2 gradient buckets
    (reduce_bucket_size x w, twice with overlap_comm); ZeRO-3 reduce and prefetch buckets, and with N > 1 the
    gathered weights of two layers or an embedding."""
    if c.stage in (1, 2) and s.contiguous_gradients:
        return s.reduce_bucket * c.w * (2 if s.overlap_comm else 1)
    if c.stage == 3:
        gathered = c.w * max(2 * arch.layer_params(), arch.embedding_params()) if s.world > 1 else 0.0
        return (s.reduce_bucket + s.prefetch_bucket) * c.w + gathered
    return 0.0


def _step_extra(s: Setup, c: _Counts) -> float:
    """What the optimizer step adds beside the states. ZeRO-1/2/3 without offload: the trained gradients flattened
    (w*T/N) and cast to fp32 (4*T/N); on one GPU ZeRO-2 thus peaks at 22 B/param in the step (docs/facts.md).
    snaketune's masters: one chunk of fp32 gradients (MASTER_CHUNK_ELEMENTS), or with 8-bit states one tensor's (the
    largest: the embedding)."""
    if s.master_weights and c.stage == 0 and s.states_8bit:
        # One tensor's fp32 gradient at a time (snaketune.train.optim.MasterWeightAdamW._step_8bit).
        return 4.0 * c.largest
    if s.master_weights and c.stage == 0 and s.accumulation == 1:
        return 4.0 * min(c.trained, MASTER_CHUNK_ELEMENTS)  # one chunk of fp32 gradients
    if not (c.torch_engine or s.offload_optimizer or c.stage == 0):
        return (c.w + c.master) * (
            c.trained / s.world if c.stage < 3 else min(c.trained / s.world, s.sub_group)
        )
    return 0.0


def _activations(arch: Arch, s: Setup, c: _Counts) -> float:
    """What autograd saves for backward, per token and layer of a DeepSeek/Llama decoder with SDPA attention: two
    RMSNorms (fp32 upcast 4h + normalized and scaled w*h each), q, k, v and the attention output
    (w*(2*q_dim + 2*kv_dim)), the SwiGLU MLP (gate, SiLU, up, product: 4*w*i), LoRA's rank-r intermediates; times
    ACTIVATION_FACTOR for what backward adds (gradient temporaries, kernel workspaces, allocator rounding). With
    gradient checkpointing: each layer's input (w*h) plus one layer's activations while it is recomputed; on the
    first k layers only (train.gradient_checkpointing: k), k inputs plus the other layers' activations. Liger's kernels
    (train.kernels) save less, counted per layer and not scaled: 4h per RMSNorm (no fp32 upcast; (4 - w)h with LoRA,
    whose frozen norm weights need no normalized output) and w*i in SwiGLU (SiLU(gate) recomputed in backward)."""
    h, i, a = arch.hidden, arch.intermediate, c.a
    shapes = arch.linear_shapes()
    tokens = s.micro_batch * s.seq_len
    q, kv = shapes["q_proj"][1], shapes["k_proj"][1]
    # Per RMSNorm: the fp32 upcast, the normalized and the scaled output. Under autocast the residual stream
    # is fp32 already (input and output saved) and the next linear saves its own bf16 cast.
    norm = 8 * h + 2 * h if s.precision == "autocast" else 4 * h + 2 * a * h
    per_layer = 2 * norm + a * (2 * q + 2 * kv) + 4 * a * i + a * s.lora_rank * len(c.targets)
    residual = 4 if s.precision == "autocast" else a
    factor = LORA_ACTIVATION_FACTOR if s.lora_rank else ACTIVATION_FACTOR
    # Liger's RMSNorm saves its bf16 input and the row's rstd instead of the fp32 upcast (and, where the norm's
    # weight trains, the normalized output); its SwiGLU recomputes SiLU(gate) in backward instead of saving it.
    # Counted, not fitted: 5.02 / 4.39 GiB less for b24 / lora30, measured 5.08 / 4.39 (bench/RESULTS.md, #16).
    saved_less = (2 * (4 * h if not s.lora_rank else (4 - a) * h) + a * i) if s.liger else 0
    layer = per_layer * factor - saved_less + (COMPILED_SAVED_H * h if s.compiled else 0)
    if s.gradient_checkpointing:
        # k layers keep only their input; the others all their activations until backward reaches them, and
        # while a checkpointed layer is recomputed (the uncheckpointed ones are done by then) one layer's worth.
        k = _checkpointed(arch, s)
        kept = 1 if s.offload_activations else k  # offloaded: the one on its way back for its recompute
        acts = tokens * kept * residual * h + tokens * max(arch.layers - k, 1) * layer
    else:
        acts = tokens * arch.layers * layer
    return acts + tokens * norm  # the final norm


def counted(s: Setup) -> bool:
    """Whether `_activations` counts every saved tensor (`_lora_layer`) instead of scaling a count by a fitted
    factor: LoRA in bf16 with Liger's kernels and varlen attention, the 24 GB cards' training, where every tensor a
    decoder layer saves is known (frozen weights need no saved inputs of their own, Liger's kernels save their inputs
    only, FlashAttention q, k, v, the output and a logsumexp)."""
    return bool(s.lora_rank and s.liger and s.varlen and s.precision == "bf16")


def _lora_layer(arch: Arch, s: Setup, c: _Counts) -> tuple[float, float]:
    """Bytes per token of one decoder layer under `counted`: (what it saves for backward, what its backward adds
    while it runs). Saved: the layer's input and the attention block's residual sum (Liger's RMSNorm saves its input
    and an fp32 rstd per row), both norms' outputs (the adapted projections' input), q, k and v after RoPE and the
    attention output (FlashAttention, with an fp32 logsumexp per head), the gate and up projections (Liger's SwiGLU
    recomputes SiLU) and their product (down_proj's input), each adapter's rank-r intermediate: a*(4h + 2q + 2kv)
    + 3a*i + a*r per target. Backward adds, for the layer it is in, the output's and the residual's gradients (2a*h),
    the MLP product's (a*i: Liger's SwiGLU writes the gate's and up's over their saved values), FlashAttention's
    dq, dk, dv (a*(q + 2kv)) and its fp32 dq accumulator (4q). 0.503 GiB saved per layer at 8 x 512 for the 7B,
    measured 0.497-0.503 between the runs with 0, 16 and 18 of 30 layers checkpointed (bench/RESULTS.md, issue #16);
    with torch.compile COMPILED_SAVED_H more."""
    h, i, a = arch.hidden, arch.intermediate, c.a
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    saved = a * (4 * h + 2 * q + 2 * kv) + 3 * a * i + a * s.lora_rank * len(c.targets) + 8 + 4 * arch.heads
    if s.compiled:
        saved += COMPILED_SAVED_H * h
    backward = 2 * a * h + a * i + a * (q + 2 * kv) + 4 * q
    return saved, backward


def _counted_activations(arch: Arch, s: Setup, c: _Counts) -> tuple[float, float]:
    """`counted` setups: (what stays saved until backward, what backward adds at its largest). Saved: each
    checkpointed layer's input (a*h per token; none with train.offload_activations, which keeps it on the host, but
    one layer's, whose copy to the GPU backward waits for), every other layer's saved tensors (`_lora_layer`) and the
    final norm's input and output. Backward adds, where every layer is checkpointed, one of them recomputed with its
    backward's temporaries; else the last layer's temporaries. The loss's logits are gone by then: `estimate` takes
    the larger of this and `_logits`, not their sum (the QLoRA example's rows: the loss's 3.1 GiB at 2 x 4,096
    tokens, a layer's backward 3.2 at 4 x 4,096; measured 3.1 and 3.3 above the saved inputs)."""
    h, a = arch.hidden, c.a
    tokens = s.micro_batch * s.seq_len
    k = _checkpointed(arch, s)
    saved, backward = _lora_layer(arch, s, c)
    kept = 1 if s.offload_activations and k else k  # offloaded: the one on its way back for recompute
    acts = tokens * (kept * a * h + (arch.layers - k) * saved + 2 * a * h) + COUNTED_REST_GIB * GIB
    extra = tokens * (backward + (saved if k == arch.layers else 0))
    return acts, extra


def _checkpointed(arch: Arch, s: Setup) -> int:
    """The decoder layers that recompute in backward (train.gradient_checkpointing)."""
    if not s.gradient_checkpointing:
        return 0
    return arch.layers if s.checkpoint_layers is None else min(s.checkpoint_layers, arch.layers)


def _offloaded_activations(arch: Arch, s: Setup, c: _Counts) -> float:
    """Host bytes per rank of train.offload_activations: every checkpointed layer's input (a*h per token)."""
    if not s.offload_activations:
        return 0.0
    return float(s.micro_batch * s.seq_len * _checkpointed(arch, s) * c.a * arch.hidden)


def _logits(arch: Arch, s: Setup, c: _Counts) -> float:
    """The loss's logits: 12 B per token and vocabulary entry (LOGIT_BYTES: the bf16 logits, the contiguous copy the
    loss slices, the fp32 upcast and log-softmax output of snaketune.model.batching.token_loss_sum); with the Triton
    loss (train.loss_kernel, snaketune.model.losses.logits_cross_entropy) 2 B, the logits that become their own
    gradient, and 8 B per token (its loss and logsumexp in fp32); with the fused loss (snaketune.model.losses)
    FUSED_LOGIT_BYTES per entry of one chunk of tokens, the hidden states' gradient and, with several chunks, an fp32
    sum of the lm_head weight's gradient (its w-byte result becomes the .grad that the gradients count). And, unless
    attention is varlen, the packed block-diagonal mask, micro_batch x seq^2 x (w + 1)."""
    tokens = s.micro_batch * s.seq_len
    if s.fused_cross_entropy:
        chunk = min(tokens, chunk_tokens(arch.vocab))
        logits = FUSED_LOGIT_BYTES * chunk * arch.vocab + c.a * tokens * arch.hidden
        if not s.lora_rank and chunk < tokens:
            logits += 4 * arch.vocab * arch.hidden
    elif s.triton_loss:
        logits = c.a * tokens * arch.vocab + 8 * tokens
    else:
        logits = LOGIT_BYTES * tokens * arch.vocab
    if not s.varlen:
        logits += s.micro_batch * s.seq_len**2 * (c.a + 1)  # the packed block-diagonal mask
    return logits


def _fragmentation(s: Setup) -> float:
    """FRAGMENTATION, or none: for the step in backward, and for counted setups (`counted`) on ranks with expandable
    segments. Elsewhere it also covers the fitted factors' under-estimates (tests/test_plan.py allows them 5%), so
    expandable segments alone do not drop it."""
    return 0.0 if s.in_backward or (s.expandable_segments and counted(s)) else FRAGMENTATION


def estimate(arch: Arch, s: Setup) -> Estimate:
    """Peak memory per GPU and on the host (see the module docstring for the model)."""
    c = _counts(arch, s)
    weights, dequantized = _weights(arch, s, c)
    grads, optim = _gradients(s, c), _optimizer(s, c)
    buffers = _buffers(arch, s, c)
    transient_grad = (0.0 if c.torch_engine else c.w * c.largest) + dequantized
    step_extra = _step_extra(s, c)
    logits = _logits(arch, s, c)
    if counted(s):
        acts, backward = _counted_activations(arch, s, c)
        weights += c.w * c.trained  # the adapters themselves (bf16 beside their fp32 masters)
        after_forward = max(
            logits, backward
        )  # the loss's logits, then a layer's backward: one after the other
    else:
        acts = _activations(arch, s, c)
        after_forward = logits
    states = weights + grads + optim
    forward_backward = states + buffers + transient_grad + acts + after_forward
    if s.in_backward:
        # No step after backward; while backward runs, the gradient being applied (the largest: the embedding,
        # in the weights' dtype) beside the activations not yet freed. The update's fp32 temporaries (one row chunk of
        # 2^25 elements at a time, snaketune.train.backward_step) are not counted: 21.48 GiB measured against 21.75
        # planned for the 30-layer 7B at 1 x 2,048 on one H200 (bench/RESULTS.md, issue #26).
        forward_backward = weights + optim + transient_grad + acts + after_forward
    elif c.stage == 3 and s.offload_optimizer:
        # The largest gradient's partition on its way to the host (DeepSpeed 0.19, stage3.py: partition_grads,
        # _offload_grad_partition_at_boundary): its GPU copy read back from the pinned host buffer (w bytes) and its
        # squared norm in float64 pieces of OFFLOAD_NORM_ELEMENTS (_constant_buffered_norm2), with every activation
        # still saved but the logits gone. For the 7B's embedding on one rank 0.78 + 1.86 GiB: with it the plan
        # gives 13.3 GiB for 20 layers at 1 x 2,048, measured 13.01 (bench/RESULTS.md, issue #26; 11.2 without).
        part = c.largest / s.world
        offload = c.w * part + 8 * min(part, OFFLOAD_NORM_ELEMENTS)
        forward_backward = max(
            forward_backward, states + s.reduce_bucket * c.w + transient_grad + offload + acts
        )
    elif s.master_weights and c.stage == 0 and s.accumulation == 1:
        # The gradients are freed after every step (DeepSpeed's zero_grad) and, with one micro-batch per step,
        # grow during backward while the activations are freed: the peak is at the start of backward, with
        # all activations and (nearly) no gradients. Measured: 95.5 GiB for 24 layers at 8 x 512 (bench/RESULTS.md).
        forward_backward = weights + optim + max(transient_grad + acts + after_forward, grads)
    step = states + step_extra
    peak = max(forward_backward, step)
    host = HOST_PER_RANK_GIB * GIB * s.world
    if s.offload_optimizer:
        host += HOST_OFFLOAD_BYTES * c.trained
    if s.offload_params:
        host += c.w * c.total
    on_host = _offloaded_activations(arch, s, c) * s.world
    host += on_host
    return Estimate(
        params=c.total,
        trainable=c.trained,
        weights_gib=weights / GIB,
        gradients_gib=grads / GIB,
        optimizer_gib=optim / GIB,
        buffers_gib=(buffers + transient_grad) / GIB,
        activations_gib=acts / GIB,
        logits_gib=logits / GIB,
        step_extra_gib=step_extra / GIB,
        peak_allocated_gib=peak / GIB,
        peak_phase="optimizer step" if step > forward_backward else "forward/backward",
        gpu_gib=peak / GIB * (1 + _fragmentation(s)) + CUDA_OVERHEAD_GIB,
        host_gib=host / GIB,
        offload=s.offload_optimizer or s.offload_params,
        activations_host_gib=on_host / GIB,
    )
