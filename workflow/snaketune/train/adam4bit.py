"""AdamW with 4-bit states in one Triton pass per parameter: the update of `train.optimizer_step: in_backward` with
`train.optimizer_states: 4bit` on a CUDA GPU (`train.optimizer_kernel: auto | triton`; snaketune.train.backward_step).

The states stay torchao's (`OptimState4bit`: codes packed two per byte, element 2i in the high nibble, one fp32
absmax scale per block of 128 elements, a 16-entry code map), so checkpoints do not change; this kernel reads and
writes their `codes` and `scale` buffers and reads the codes' values from the state's own map (new v states carry
snaketune's, states4bit.V_CODES; a state saved with torchao's goes on with it). The arithmetic is torchao's
`single_param_adam` (decoupled weight decay, lerp of m and v, bias correction, stochastic rounding into bf16
weights); the new m and v round to their codes stochastically, v in its fourth root (snaketune.train.states4bit:
why, and the same update in torch for the CPU), or to the nearest code as torchao's `quantize_4bit_with_qmap` does
where states4bit.ROUNDING says `nearest`.

Why not torchao's compiled update: measured on one H200 (bench/RESULTS.md, issue #26), its kernels per tensor
(chunked to bound the fp32 temporaries) took 122 ms of GPU time per step of the 30-layer 7B, and the host's work per
hook (a compiled-function guard check, tensor-subclass slicing, the norm's three launches) took 449 of an 816 ms
profiled step: the GPU was idle most of it. Here a tensor costs one pass over its bytes (the bf16 weight and
gradient read, the weight written, the 4-bit m and v and their scales read and written, ~8 B per parameter), nothing
materialized in fp32: 90 ms of GPU time for the 7B's 6.9B parameters (610 GB/s, an eighth of the H200's 4.8 TB/s;
what bounds it was not profiled), and the step went from 3,425 to 5,861 tokens/s. The squared gradient norm (for the
next step's clipping and the log) comes from the same pass: each program's sum, added up in a fixed order by one
torch.sum into the tensor's slot of the step's norms. The host's time per tensor (53 us on the H200, 35 of them
Triton's launch) is what bounds the 7B's step now, 273 tensors a step.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from snaketune.model import sizes
from snaketune.train import states4bit

BLOCK = sizes.TORCHAO_BLOCK["4bit"]
"""Elements per quantization block (torchao's AdamW4bit default)."""
ROWS = 4
"""Quantization blocks per Triton program: 512 elements, 4 per thread of 4 warps (more per program spills registers)."""


@triton.jit
def _quantize(x, qmap_ptr, rand, STATES_SR: tl.constexpr, ROOT4: tl.constexpr):
    """The 4-bit code of x (normalized by its block's absmax) in the sorted 16-entry map. STATES_SR (the default,
    snaketune's choice): rounded stochastically between the two entries around x, up with probability (x - below) /
    (above - below) from 8 random bits, so the dequantized state is x in expectation; with ROOT4 (v, where
    states4bit.V_ROUNDED_IN says fourth_root) the same in x^(1/4), so that x^(1/4) is unbiased instead
    (snaketune.train.states4bit: why). x below the first entry takes the first, beyond the last the last. Else
    torchao's quantize_4bit_with_qmap: the nearest entry (a tie rounded up), by compares against the midpoints as
    scalars. (Codes in closed form for a known map, k/16 or 2^(k - 15), took 17-24% more GPU time than these compares
    on an H200: bench/RESULTS.md, issue #26.)"""
    codes = tl.zeros(x.shape, dtype=tl.int32)
    if STATES_SR:
        for k in tl.static_range(1, 16):  # the last entry at or below x (the first where x is below it)
            codes += (x >= tl.load(qmap_ptr + k)).to(tl.int32)
        below = tl.load(qmap_ptr + codes)  # 16 entries: gathers from L1
        above = tl.load(qmap_ptr + tl.minimum(codes + 1, 15))
        u = ((rand & 255).to(tl.float32) + 0.5) * (1.0 / 256.0)
        if ROOT4:  # v >= 0 and the map's entries > 0
            x = tl.sqrt(tl.sqrt(x))
            below = tl.sqrt(tl.sqrt(below))
            above = tl.sqrt(tl.sqrt(above))
        # x below the first entry: x - below < 0, never up; at or above the last: above == below
        codes += ((x - below) > u * (above - below)).to(tl.int32)
    else:
        for k in tl.static_range(15):
            codes += (x >= (tl.load(qmap_ptr + k) + tl.load(qmap_ptr + k + 1)) * 0.5).to(tl.int32)
    return codes


@triton.jit
def _round_bf16(x, rand, STOCHASTIC: tl.constexpr):
    """fp32 -> the value a bf16 store keeps: rounded away from zero with the probability of the 16 bits a bf16
    drops (torchao's _fp32_to_bf16_sr, from the low 16 random bits), else unchanged (the store rounds to nearest)."""
    if STOCHASTIC:
        bits = x.to(tl.int32, bitcast=True)
        dropped = bits & 0xFFFF
        kept = bits & -65536
        up = (rand & 0xFFFF).to(tl.int32) < dropped
        x = tl.where(up, kept + 0x10000, kept).to(tl.float32, bitcast=True)
    return x


@triton.jit(do_not_specialize=["seed"])
def _adamw4bit(
    p_ptr,
    g_ptr,
    m_codes,
    m_scale,
    v_codes,
    v_scale,
    m_qmap,
    v_qmap,
    partial_ptr,
    divisor_ptr,
    n_blocks,
    lr,
    beta1,
    beta2,
    eps,
    decay,
    step_size,
    bc2_sqrt,
    seed,
    STOCHASTIC: tl.constexpr,
    STATES_SR: tl.constexpr,
    V_ROOT4: tl.constexpr,
    ROWS: tl.constexpr,
    HALF: tl.constexpr,
):
    pid = tl.program_id(0)  # int32 offsets: update() refuses tensors of 2^31 elements or more
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_blocks
    byte = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [ROWS, HALF]: one byte, two elements
    mask = row_mask[:, None] & (byte >= 0)
    even = byte * 2
    odd = even + 1
    g0 = tl.load(g_ptr + even, mask=mask, other=0.0).to(tl.float32)
    g1 = tl.load(g_ptr + odd, mask=mask, other=0.0).to(tl.float32)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(g0 * g0 + g1 * g1, axis=1), axis=0))
    divisor = tl.load(divisor_ptr)
    g0 = g0 / divisor
    g1 = g1 / divisor
    p0 = tl.load(p_ptr + even, mask=mask, other=0.0).to(tl.float32)
    p1 = tl.load(p_ptr + odd, mask=mask, other=0.0).to(tl.float32)
    mc = tl.load(m_codes + byte, mask=mask, other=0).to(tl.int32)
    vc = tl.load(v_codes + byte, mask=mask, other=0).to(tl.int32)
    ms = tl.load(m_scale + rows, mask=row_mask, other=0.0)[:, None]
    vs = tl.load(v_scale + rows, mask=row_mask, other=0.0)[:, None]
    m0 = tl.load(m_qmap + (mc >> 4)) * ms
    m1 = tl.load(m_qmap + (mc & 15)) * ms
    v0 = tl.load(v_qmap + (vc >> 4)) * vs
    v1 = tl.load(v_qmap + (vc & 15)) * vs
    p0 = p0 - lr * decay * p0
    p1 = p1 - lr * decay * p1
    m0 = m0 + (1.0 - beta1) * (g0 - m0)
    m1 = m1 + (1.0 - beta1) * (g1 - m1)
    v0 = v0 + (1.0 - beta2) * (g0 * g0 - v0)
    v1 = v1 + (1.0 - beta2) * (g1 * g1 - v1)
    p0 = p0 - step_size * m0 / (tl.sqrt(v0) / bc2_sqrt + eps)
    p1 = p1 - step_size * m1 / (tl.sqrt(v1) / bc2_sqrt + eps)
    m_abs = tl.maximum(tl.maximum(tl.max(tl.abs(m0), axis=1), tl.max(tl.abs(m1), axis=1)), 1e-12)
    v_abs = tl.maximum(tl.maximum(tl.max(tl.abs(v0), axis=1), tl.max(tl.abs(v1), axis=1)), 1e-12)
    # one 32-bit draw per element: bits 0-15 round the weight, 16-23 its m, 24-31 its v
    r0 = tl.randint(seed, even).to(tl.uint32)
    r1 = tl.randint(seed, odd).to(tl.uint32)
    mq = (_quantize(m0 / m_abs[:, None], m_qmap, r0 >> 16, STATES_SR, False) << 4) | _quantize(
        m1 / m_abs[:, None], m_qmap, r1 >> 16, STATES_SR, False
    )
    vq = (_quantize(v0 / v_abs[:, None], v_qmap, r0 >> 24, STATES_SR, V_ROOT4) << 4) | _quantize(
        v1 / v_abs[:, None], v_qmap, r1 >> 24, STATES_SR, V_ROOT4
    )
    tl.store(m_codes + byte, mq.to(tl.uint8), mask=mask)
    tl.store(v_codes + byte, vq.to(tl.uint8), mask=mask)
    tl.store(m_scale + rows, m_abs, mask=row_mask)
    tl.store(v_scale + rows, v_abs, mask=row_mask)
    p0 = _round_bf16(p0, r0, STOCHASTIC)
    p1 = _round_bf16(p1, r1, STOCHASTIC)
    tl.store(p_ptr + even, p0.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(p_ptr + odd, p1.to(p_ptr.dtype.element_ty), mask=mask)


def supports(p: torch.Tensor, exp_avg: torch.Tensor) -> bool:
    """Whether this kernel updates `p`: a CUDA tensor whose m is torchao's 4-bit state in blocks of BLOCK (the small
    and odd-sized tensors keep fp32 states and torchao's update)."""
    return (
        p.is_cuda
        and type(exp_avg).__name__ == "OptimState4bit"
        and exp_avg.block_size == BLOCK
        and p.numel() % BLOCK == 0
    )


def update(
    p: torch.Tensor,
    grad: torch.Tensor,
    exp_avg,
    exp_avg_sq,
    *,
    sq_out: torch.Tensor,
    divisor: torch.Tensor,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
    seed: int,
) -> None:
    """One AdamW step of `p` (in place, with its 4-bit m and v): `grad` divided by `divisor` (a device scalar: the
    clipping), its squared norm (before that division) written to `sq_out` (a 0-d fp32 tensor, e.g. this tensor's slot
    of a step's vector of norms); bf16 weights rounded stochastically with `seed`."""
    if not (p.is_contiguous() and grad.is_contiguous()):
        raise ValueError("adam4bit.update needs contiguous weights and gradients")
    if p.numel() >= 2**31:
        raise ValueError(
            f"adam4bit.update takes tensors of fewer than 2^31 elements (this one: {p.numel():,})"
        )
    beta1, beta2 = betas
    n_blocks = p.numel() // BLOCK
    programs = (n_blocks + ROWS - 1) // ROWS
    partial = _scratch(programs, p.device)
    _adamw4bit[(programs,)](
        p,
        grad,
        exp_avg.codes,
        exp_avg.scale,
        exp_avg_sq.codes,
        exp_avg_sq.scale,
        exp_avg.qmap,
        exp_avg_sq.qmap,
        partial,
        divisor,
        n_blocks,
        lr,
        beta1,
        beta2,
        eps,
        weight_decay,
        lr / (1 - beta1**step),
        (1 - beta2**step) ** 0.5,
        seed,
        STOCHASTIC=p.dtype == torch.bfloat16,
        STATES_SR=states4bit.ROUNDING == "stochastic",
        V_ROOT4=states4bit.V_ROUNDED_IN == "fourth_root",
        ROWS=ROWS,
        HALF=BLOCK // 2,
    )
    # One launch, no read-modify-write: the host's time per tensor bounds the 7B's step (module docstring).
    torch.sum(partial, dim=0, out=sq_out)


_SCRATCH: dict[torch.device, torch.Tensor] = {}
_VIEWS: dict[tuple[torch.device, int], torch.Tensor] = {}


def _scratch(size: int, device: torch.device) -> torch.Tensor:
    """`size` fp32 slots for each program's sum of squared gradients, summed in a fixed order afterwards (atomics on
    one address serialize and their order varies): the first `size` of one buffer per device, grown to the largest
    tensor's programs (0.8M for the 7B's embedding); kernels on the same stream use it one after the other. The
    views are kept per size (a decoder has a handful), so that a call costs no slicing."""
    buf = _SCRATCH.get(device)
    if buf is None or buf.numel() < size:
        _SCRATCH[device] = buf = torch.empty(size, dtype=torch.float32, device=device)
        for key in [k for k in _VIEWS if k[0] == device]:
            del _VIEWS[key]  # views of the smaller buffer
    view = _VIEWS.get((device, size))
    if view is None:
        _VIEWS[(device, size)] = view = buf[:size]
    return view
