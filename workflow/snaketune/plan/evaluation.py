"""The evaluate stage's memory (rule plan_eval, snaketune.evaluation.evaluate): one model at a time, no gradients,
its batch size halved until it fits, without torch (the plan rules run on the login node)."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from snaketune.model.sizes import chunk_tokens
from snaketune.plan.arch import Arch
from snaketune.plan.budget import Budget
from snaketune.plan.memory import CUDA_OVERHEAD_GIB, FRAGMENTATION, GIB, NF4_BYTES

log = logging.getLogger("snaketune.plan.search")


@dataclass(frozen=True)
class EvalSetup:
    """What the memory of the evaluate stage depends on besides the architecture: one model at a time, in
    bf16, no gradients (snaketune.evaluation.evaluate)."""

    batch: int
    """Rows per forward pass of the validation loss, prompts per generate() call (eval.batch_size)."""
    seq_len: int
    """Positions of a validation row (packed rows fill tokenize.max_length)."""
    prompt_len: int
    """Tokens of the longest prompt of a generate() call (at most tokenize.max_length)."""
    new_tokens: int
    """eval.max_new_tokens."""
    precision: str = "bf16"
    varlen: bool = True
    """FlashAttention varlen for the validation rows (CUDA): no (batch, 1, L, L) mask."""
    quantized: bool = False
    """The models load in 4 bits (a QLoRA training's train.lora.quantize: nf4)."""


@dataclass(frozen=True)
class EvalEstimate:
    weights_gib: float
    validation_gib: float
    """Peak allocated while the validation loss runs (weights included)."""
    generation_gib: float
    """Peak allocated while generate() runs (weights and KV cache included)."""
    peak_allocated_gib: float
    gpu_gib: float
    """The peak with FRAGMENTATION and CUDA_OVERHEAD_GIB, as a GPU must have it."""

    def as_dict(self) -> dict[str, Any]:
        return {k: round(v, 3) for k, v in dataclasses.asdict(self).items()}


def estimate_eval(arch: Arch, e: EvalSetup) -> EvalEstimate:
    """Peak memory of the evaluate stage. Without gradients nothing is saved for backward: a forward pass holds
    the residual stream, one layer's intermediates at a time and the loss; generation adds the KV cache.

    - validation loss (snaketune.model.build.LossModel with the fused loss), the larger of two phases that do not
      overlap: a decoder layer, per token the residual stream and the layer's input (2 x a*h), the RMSNorm's fp32
      upcast (4h), q, k, v and the attention output (a*(2q+2kv)), the SwiGLU MLP's gate, up and their product
      (3*a*i), and without varlen the packed rows' additive mask (batch x L^2 x (a + 1)); then the loss, the final
      hidden states (a*h per token) and one chunk of the fused loss's logits (bf16 product, fp32 copy,
      logsumexp's fp32 temporary: 10 B per entry). Measured on an H200 (bench/RESULTS.md, issues #13/#15): 15.41
      and 15.44 GiB at 4 and 8 rows of 2,047 tokens, where this gives 15.38 and 15.44 (their sum gave 16.38 and
      17.44: the peak barely moves with the batch, so the phases do not add up).
    - generation (transformers' generate, logits of the last position only): the KV cache for the prompt and
      the new tokens (2 x layers x kv_dim x a per token), the prefill's per-layer intermediates as above over
      the prompt, its causal mask (batch x L^2 x a), and the last position's logits (fp32, 6 B per entry).
    """
    a = 4 if e.precision == "fp32" else 2
    h, i = arch.hidden, arch.intermediate
    q, kv = arch.heads * arch.head_dim, arch.kv_heads * arch.head_dim
    weights = a * arch.params()
    if e.quantized:  # the decoder layers' linear weights in NF4, one dequantized at a time (see `estimate`)
        sizes = [fan_in * fan_out for fan_in, fan_out in arch.linear_shapes().values()]
        linear = arch.layers * sum(sizes)
        weights = a * (arch.params() - linear) + NF4_BYTES * linear + a * max(sizes)
    per_token = 2 * a * h + 4 * h + a * (2 * q + 2 * kv) + 3 * a * i
    tokens = e.batch * e.seq_len
    chunk = min(tokens, chunk_tokens(arch.vocab))
    layer_phase = tokens * per_token + (0 if e.varlen else e.batch * e.seq_len**2 * (a + 1))
    validation = weights + max(layer_phase, tokens * a * h + 10 * chunk * arch.vocab)
    total_len = e.prompt_len + e.new_tokens
    kv_cache = 2 * arch.layers * e.batch * total_len * kv * a
    prefill = e.batch * e.prompt_len * per_token + e.batch * e.prompt_len**2 * a
    generation = weights + kv_cache + prefill + 6 * e.batch * arch.vocab
    peak = max(validation, generation)
    return EvalEstimate(
        weights_gib=weights / GIB,
        validation_gib=validation / GIB,
        generation_gib=generation / GIB,
        peak_allocated_gib=peak / GIB,
        gpu_gib=peak / GIB * (1 + FRAGMENTATION) + CUDA_OVERHEAD_GIB,
    )


def plan_evaluation(arch: Arch, evaluation: dict, *, max_length: int, precision: str, budget: Budget) -> dict:
    """The evaluate stage's memory at eval.batch_size and, where that does not fit, the largest batch size that
    does (halving): the stage then runs with it (`batch_size`), so a recipe that fits training never dies in
    evaluation. Planned for the longest inputs there can be: validation rows and prompts of tokenize.max_length
    (the stage records its own estimate for the lengths it meets beside the measured peak)."""
    requested = int(evaluation["batch_size"])
    new_tokens = int(evaluation["max_new_tokens"])

    def at(batch: int) -> EvalEstimate:
        setup = EvalSetup(
            batch=batch,
            seq_len=max_length,
            prompt_len=max_length,
            new_tokens=new_tokens,
            precision="fp32" if precision == "fp32" else "bf16",
            varlen=precision == "bf16",
            quantized=evaluation.get("quantize", "none") != "none",
        )
        return estimate_eval(arch, setup)

    batch, est = requested, at(requested)
    if budget.gpu_gib is not None:
        while est.gpu_gib > budget.gpu_gib and batch > 1:
            batch //= 2
            est = at(batch)
    fits = None if budget.gpu_gib is None else est.gpu_gib <= budget.gpu_gib
    out = {"requested_batch_size": requested, "batch_size": batch, "estimate": est.as_dict(), "fits": fits}
    if fits is False:
        out["message"] = (
            f"evaluation does not fit {budget.gpu_gib:.1f} GiB ({budget.source}): one {arch.params():,}-parameter "
            f"model in {precision} needs {est.gpu_gib:.1f} GiB per GPU at eval.batch_size 1 with "
            f"{max_length} tokens (weights {est.weights_gib:.1f} GiB); use larger GPUs or a shorter "
            "tokenize.max_length"
        )
    elif batch < requested:
        log.info(
            "evaluation: eval.batch_size %d needs more than %.1f GiB; the evaluate stage uses %d",
            requested,
            budget.gpu_gib,
            batch,
        )
    return out
