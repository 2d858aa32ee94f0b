"""The 4-bit AdamW update in torch: the arithmetic and the rounding of snaketune.train.adam4bit's Triton kernel, for
the tensors with 4-bit states that the kernel does not update (CPU ranks, `train.optimizer_kernel: torch`, a GPU
without Triton). The states are torchao's (`OptimState4bit`: codes packed two per byte, element 2i in the high
nibble, one fp32 absmax scale per block of 128, a sorted 16-entry code map), read and written in place.

The rounding of the new m and v to their codes is snaketune's, not torchao's (ROUNDING):
stochastic, between the two code values around each element, up with probability (x - below) / (above - below).
torchao rounds to the nearest code; with codes 1/16 of the block's max apart, a v that decays by 1 - beta2 = 5% a
step rounds back to the code it had, so below ~10/16 of the block's max v stops decaying (m likewise), and the
weights' steps shrink: on the real SmolLM2-135M, 50 steps, the training loss of the step in backward with 4-bit
states rounded to nearest ran 7.9% above fp32 states' (bench/RESULTS.md, issue #26). Rounded stochastically, m is
its exact average in expectation (tests/test_states4bit.py, tests/test_adam4bit.py).

v rounds stochastically in its fourth root (V_ROUNDED_IN): up with probability (x^(1/4) - below^(1/4)) /
(above^(1/4) - below^(1/4)), so that x^(1/4), not x, is unbiased. Why: the step divides by sqrt(v), and the stored v
is off its exact value by a relative error s that lasts (codes a factor of 2 apart; the EMA keeps most of the stored
value each step). Rounded so that x^p is unbiased, to second order in s, v's mean runs (1 - p) s^2 / 2 high, which
shrinks the steps by (1 - p) s^2 / 4, while 1/sqrt(v) runs (1 + 2p) s^2 / 8 high: the steps' size is off by
(4p - 1) s^2 / 8, zero at p = 1/4. Measured on the real SmolLM2-135M's gradients (bench/v_rounding_shadow.py, 30
steps, the steps' first-order decrease of the loss against fp32 Adam's): up to +5.1% with v unbiased in v (p = 1),
+1.8% for p = 1/2, -1.7% for the log (p = 0), -5.0% for 1/sqrt(v) (p = -1/2), within 0.4% for the fourth root
(the median element's step: up to 1.9% small; in v up to 3.2% large). In the real model's 50-step SFT on a GPU, v
unbiased in v memorized faster than fp32 Adam (training loss -1.6% in the last quarter); with the fourth root every
step is within 1% (two seeds; bench/RESULTS.md, issue #26). v's mean then runs a few % above its exact average
(tests/test_states4bit.py).

Random bits: one 32-bit draw per element from a generator seeded with the update's seed (a stream per step and
tensor): bits 0-15 round a bf16 weight, 16-23 its m, 24-31 its v, as the kernel does with Triton's Philox (another
generator: the same distribution, not the same draws).
"""

from __future__ import annotations

import torch

V_DOMAINS = ("fourth_root", "v")
V_ROUNDED_IN = "fourth_root"
"""Where v's stochastic rounding is unbiased (module docstring): in v^(1/4) (the default), or in v itself
(bench/states_variant.sh's A/B edits this line). m always rounds unbiased in m."""
ROUNDINGS = ("stochastic", "nearest")
ROUNDING = "stochastic"
"""How the new m and v round to their codes here and in adam4bit's kernel: `stochastic` (module docstring) or
`nearest` (torchao's; bench/states_variant.sh's A/B edits this line)."""
V_CODES = tuple(2.0 ** (k - 15) for k in range(16))
"""snaketune's 16 codes for v (the new 4-bit states' map, set by snaketune.train.backward_step): 2^-15 .. 1 of the
block's max, a factor of 2 apart. torchao's map (k/16, k = 1..16) floors every v below 1/16 of its block's max at
1/16 of it: on real weights most of a block's v are there (a gradient's square spans decades within 128 elements), so
their steps shrink. Measured on the real SmolLM2-135M on CPU ranks, 50 steps (bench/RESULTS.md, issue #26): the
training loss against fp32 states' by quarter of the steps, +0.8 / +1.0 / +1.8 / +2.5% with torchao's map, +0.2 /
+0.2 / +0.3 / -0.2% with this one (each step within 1.4%; the held-out loss within 0.1%). In 11-step runs with
torchao's map, m exact and v in 4 bits ran as far above as both in 4 bits (+2.1% at step 6), v exact and m in 4 bits
as close as fp32 states in the step in backward (+1.0%): v's floor was the whole gap. 2^-7.5 .. 1 in steps of
sqrt(2): +0.6% in the last quarter; Li et al.'s rank-1 normalization with torchao's map closed little of it (+1.9% at
step 6, against +2.1%)."""
CHUNK_ELEMENTS = 2**23
"""Elements one pass handles at once: its temporaries (~50 B per element) stay near 0.4 GiB (the 7B's embedding
whole would need ~20 GiB)."""


def zeros(shape, signed: bool, block: int, device, v_codes: tuple[float, ...] | None = V_CODES):
    """A new 4-bit state of zeros in torchao's format (OptimState4bit, blocks of `block`): m (`signed`) with torchao's
    map, v with `v_codes` (None: torchao's k/16, as older checkpoints have)."""
    from torchao.optim.subclass_4bit import OptimState4bit

    state = OptimState4bit.zeros(shape, signed, block, device, dtype=torch.float32)
    if not signed and v_codes is not None:
        state.qmap.copy_(torch.tensor(v_codes, dtype=torch.float32))
    return state


def quantize(
    x: torch.Tensor, qmap: torch.Tensor, rand: torch.Tensor | None, fourth_root: bool = False
) -> torch.Tensor:
    """Codes (int32) of `x` (normalized by its block's absmax) in the sorted 16-entry `qmap`: with `rand` (int32
    random bits, the low 8 used) rounded stochastically between its neighbouring entries (`fourth_root`, for v: with
    the probability that makes x^(1/4) unbiased instead of x), x beyond the map's ends taking the end; without, the
    nearest entry, a tie rounded up (torchao's quantize_4bit_with_qmap)."""
    if rand is None:
        return torch.bucketize(x, (qmap[:-1] + qmap[1:]) * 0.5, right=True, out_int32=True)
    # the last entry at or below x (0 below the first)
    below = torch.bucketize(x, qmap[1:], right=True, out_int32=True)
    above = (below + 1).clamp_(max=15)
    low, high = qmap[below], qmap[above]
    if fourth_root:  # v >= 0 and the map's entries > 0
        x, low, high = x.sqrt().sqrt(), low.sqrt().sqrt(), high.sqrt().sqrt()
    u = ((rand & 255).to(torch.float32) + 0.5) * (1.0 / 256.0)
    # at most the last code: x an ulp beyond the last entry would round "up" to 16 (adam4bit._round_up: why)
    return (below + ((x - low) > u * (high - low))).clamp_(max=15)


def _unpack(codes: torch.Tensor) -> torch.Tensor:
    codes = codes.int()
    return torch.stack([codes >> 4, codes & 15], dim=-1).flatten()


def _pack(codes: torch.Tensor) -> torch.Tensor:
    pairs = codes.view(-1, 2)
    return ((pairs[:, 0] << 4) | pairs[:, 1]).to(torch.uint8)


def round_bf16(x: torch.Tensor, rand: torch.Tensor) -> torch.Tensor:
    """fp32 -> bf16 rounded stochastically: away from zero with the probability of the 16 bits a bf16 drops (the low
    16 bits of `rand`), as the kernel's _round_bf16 and torchao's _fp32_to_bf16_sr."""
    bits = x.view(torch.int32)
    dropped = bits & 0xFFFF
    kept = bits & -65536
    up = (rand & 0xFFFF).to(torch.int32) < dropped
    return torch.where(up, kept + 0x10000, kept).view(torch.float32).to(torch.bfloat16)


@torch.no_grad()
def update(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg,
    exp_avg_sq,
    *,
    divisor: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    seed: int,
) -> None:
    """One AdamW step of `p` in place with its 4-bit m and v (adam4bit.update's arithmetic: decoupled weight decay,
    lerp of m and v, bias correction; `grad` divided by `divisor`), bf16 weights rounded stochastically. In passes of
    CHUNK_ELEMENTS over whole blocks."""
    if ROUNDING not in ROUNDINGS:
        raise ValueError(f"snaketune.train.states4bit.ROUNDING {ROUNDING!r}; allowed: {', '.join(ROUNDINGS)}")
    if V_ROUNDED_IN not in V_DOMAINS:
        raise ValueError(
            f"snaketune.train.states4bit.V_ROUNDED_IN {V_ROUNDED_IN!r}; allowed: {', '.join(V_DOMAINS)}"
        )
    beta1, beta2 = betas
    block = exp_avg.block_size
    step_size = lr / (1 - beta1**step)
    bc2_sqrt = (1 - beta2**step) ** 0.5
    weights, grads = p.view(-1), grad.reshape(-1)
    stochastic = ROUNDING == "stochastic"
    gen = torch.Generator(device=p.device).manual_seed(seed)
    for start in range(0, p.numel(), CHUNK_ELEMENTS // block * block):
        end = min(start + CHUNK_ELEMENTS // block * block, p.numel())
        blocks = slice(start // block, end // block)
        codes = slice(start // 2, end // 2)
        g = (grads[start:end].float() / divisor).view(-1, block)
        w = weights[start:end].float().view(-1, block)
        m = exp_avg.qmap[_unpack(exp_avg.codes[codes])].view(-1, block) * exp_avg.scale[blocks, None]
        v = exp_avg_sq.qmap[_unpack(exp_avg_sq.codes[codes])].view(-1, block) * exp_avg_sq.scale[blocks, None]
        w = w - lr * weight_decay * w
        m = m + (1 - beta1) * (g - m)
        v = v + (1 - beta2) * (g * g - v)
        w = w - step_size * m / (v.sqrt() / bc2_sqrt + eps)
        # 32 random bits per element (an arithmetic shift keeps the bits it moves down)
        rand = torch.randint(-(2**31), 2**31, g.shape, generator=gen, device=p.device, dtype=torch.int32)
        for state, new, shift, root in (
            (exp_avg, m, 16, False),
            (exp_avg_sq, v, 24, V_ROUNDED_IN == "fourth_root"),
        ):
            absmax = new.abs().amax(dim=1).clamp_(min=1e-12)
            q = quantize(new / absmax[:, None], state.qmap, rand >> shift if stochastic else None, root)
            state.codes[codes] = _pack(q.flatten())
            state.scale[blocks] = absmax
        if p.dtype == torch.bfloat16:
            weights[start:end] = round_bf16(w, rand).flatten()
        else:
            weights[start:end] = w.flatten().to(p.dtype)
