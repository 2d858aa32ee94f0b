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
materialized in fp32, and the step went from 3,425 to 5,861 tokens/s. The squared gradient norm (for the next
step's clipping and the log) comes from the same pass: each program's sum, added up in a fixed order by one torch.sum
into the tensor's slot of the step's norms.

What bounds the pass is instruction issue, not memory: the first version took 90 ms per 7B step (610 GB/s) at 332
sm_90 instructions per element (bench/kernels/adam4bit_sass.py), about what 132 SMs issue in that time. This one
takes 191 (wide loads split into a byte's two elements, one Philox draw per byte, v's codes from the exponent, a
binary search for m's, per-row reciprocals, 8 blocks a program). At 189, before _round_up's clamp, it took 65.5 ms on
an H100 against 90.8 for the first in the same call (bench/RESULTS.md, issue #50).
"""

from __future__ import annotations

import weakref

import torch
import triton
import triton.language as tl

from snaketune.model import sizes
from snaketune.train import states4bit

BLOCK = sizes.TORCHAO_BLOCK["4bit"]
"""Elements per quantization block (torchao's AdamW4bit default)."""
ROWS = 8
"""Quantization blocks per Triton program (1,024 elements: 8 per thread of 4 warps). Chosen by the static count of
sm_90 instructions per element (bench/kernels/adam4bit_sass.py: 268 at ROWS 4, 189 at ROWS 8 with 96 registers per
thread, 16 needs 240 registers); bench/kernels/adam4bit_speed.py --sweep times the others on a GPU."""
WARPS = 4
"""Warps per program."""
PHILOX_ROUNDS = 10
"""Rounds of Triton's Philox4x32 per draw (its default, 10; Salmon et al. 2011 found 7 already pass BigCrush)."""
SEARCH = "binary"
"""How a rounded-stochastically state finds the entry at or below it in its map (m always; v in a map other than
snaketune's): `binary`, 4 compares, 3 against gathered entries (32 instructions per element fewer than `compares`
against all 15 entries: bench/kernels/adam4bit_sass.py)."""


@triton.jit
def _quantize(x, table_ptr, rand, STATES_SR: tl.constexpr, BINARY: tl.constexpr):
    """The 4-bit code of x (normalized by its block's absmax, in the domain of `table_ptr`'s 16 sorted entries).
    STATES_SR (the default, snaketune's choice): rounded stochastically between the two entries around x, up with
    probability (x - below) / (above - below) from 8 random bits, so that x is the state's value in expectation. v
    rounds in its fourth root (states4bit.V_ROUNDED_IN): the caller passes x^(1/4) and the map's fourth roots (the
    same codes: the root is monotone), so that x^(1/4) is unbiased instead (snaketune.train.states4bit: why). x below
    the first entry takes the first, beyond the last the last. Else torchao's quantize_4bit_with_qmap: the nearest
    entry (a tie rounded up), by compares against the midpoints as scalars."""
    codes = tl.zeros(x.shape, dtype=tl.int32)
    if STATES_SR:
        if BINARY:  # 4 compares, 3 of them against gathered entries
            codes += 8 * (x >= tl.load(table_ptr + 8)).to(tl.int32)
            codes += 4 * (x >= tl.load(table_ptr + codes + 4)).to(tl.int32)
            codes += 2 * (x >= tl.load(table_ptr + codes + 2)).to(tl.int32)
            codes += (x >= tl.load(table_ptr + codes + 1)).to(tl.int32)
        else:
            for k in tl.static_range(1, 16):  # the last entry at or below x (the first where x is below it)
                codes += (x >= tl.load(table_ptr + k)).to(tl.int32)
        codes = _round_up(x, codes, table_ptr, rand)
    else:
        for k in tl.static_range(15):
            codes += (x >= (tl.load(table_ptr + k) + tl.load(table_ptr + k + 1)) * 0.5).to(tl.int32)
    return codes


@triton.jit
def _round_up(x, codes, table_ptr, rand):
    """`codes` (the entry at or below x) plus one with probability (x - below) / (above - below), from 8 random
    bits; x below the first entry: x - below < 0, never up. At most the last code: the block's largest element
    comes in as its value times the reciprocal of the block's max, which the GPU can round an ulp above the last
    entry (1); code 16 would spill into the byte's other nibble (it did on an H100: the block max's m turned to
    -0.89 of itself, tests/test_adam4bit.py)."""
    below = tl.load(table_ptr + codes)  # 16 entries: gathers from L1
    above = tl.load(table_ptr + tl.minimum(codes + 1, 15))
    u = ((rand & 255).to(tl.float32) + 0.5) * (1.0 / 256.0)
    return tl.minimum(codes + ((x - below) > u * (above - below)).to(tl.int32), 15)


@triton.jit
def _pow2_codes(x):
    """The entry at or below x >= 0 in snaketune's v map, 2^(k - 15) for k = 0..15 (states4bit.V_CODES), read from
    x's exponent bits: a few integer operations where the compares take 30 per element, and exact (x = 2^e takes
    code e + 15, as the compares give). Below 2^-15 (zero and subnormals included) the first, 1 the last. (An
    earlier formula, floor(log2 x), timed 15-19% slower than the compares on an H200 and was not bit-equal to them
    (bench/RESULTS.md, issue #26); that bench read each state's map from the device in every call, which this
    module does once per map tensor, in _v_map.)"""
    exponent = (x.to(tl.int32, bitcast=True) >> 23) - 127
    return tl.minimum(tl.maximum(exponent + 15, 0), 15)


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


@triton.jit
def _pairs(ptr, elem, elem_mask, ROWS: tl.constexpr, HALF: tl.constexpr):
    """A [ROWS, 2 x HALF] tile loaded contiguously (wide loads) as fp32, split into the even and odd elements (the
    two of a code byte)."""
    tile = tl.load(ptr + elem, mask=elem_mask, other=0.0).to(tl.float32)
    return tl.split(tl.reshape(tile, (ROWS, HALF, 2)))


@triton.jit
def _block_max(a, b):
    """Each row's (quantization block's) largest |value| over its even (a) and odd (b) elements, at least 1e-12."""
    return tl.maximum(tl.maximum(tl.max(tl.abs(a), axis=1), tl.max(tl.abs(b), axis=1)), 1e-12)


@triton.jit
def _store_state(codes_ptr, scale_ptr, codes, absmax, byte, mask, rows, row_mask):
    tl.store(codes_ptr + byte, codes.to(tl.uint8), mask=mask)
    tl.store(scale_ptr + rows, absmax, mask=row_mask)


@triton.jit
def _dequantize(codes_ptr, scale_ptr, qmap_ptr, byte, mask, rows, row_mask):
    """A 4-bit state's values for the two elements of each byte (element 2i in the high nibble)."""
    codes = tl.load(codes_ptr + byte, mask=mask, other=0).to(tl.int32)
    scale = tl.load(scale_ptr + rows, mask=row_mask, other=0.0)[:, None]
    return tl.load(qmap_ptr + (codes >> 4)) * scale, tl.load(qmap_ptr + (codes & 15)) * scale


@triton.jit
def _adamw(p, g, m, v, lr, beta1, beta2, eps, decay, step_size, inv_bc2):
    """torchao's single_param_adam, elementwise: decoupled weight decay, lerp of m and v, bias correction
    (step_size = lr / (1 - beta1^t), inv_bc2 = 1 / sqrt(1 - beta2^t)). The new weight, m and v."""
    p = p - lr * decay * p
    m = m + (1.0 - beta1) * (g - m)
    v = v + (1.0 - beta2) * (g * g - v)
    return p - step_size * m / (tl.sqrt(v) * inv_bc2 + eps), m, v


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
    v_table,
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
    V_POW2: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PHILOX_ROUNDS: tl.constexpr,
    BINARY: tl.constexpr,
):
    """ROWS quantization blocks of one tensor, their even and odd elements (a code byte's two) side by side.
    `v_table`: the map v rounds to, `v_qmap` itself or its fourth roots where v rounds in its fourth root (update())."""
    HALF: tl.constexpr = BLOCK // 2
    pid = tl.program_id(0)  # int32 offsets: update() refuses tensors of 2^31 elements or more
    rows = pid * ROWS + tl.arange(0, ROWS)
    row_mask = rows < n_blocks
    elem = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]  # [ROWS, BLOCK]
    elem_mask = row_mask[:, None] & (elem >= 0)
    byte = rows[:, None] * HALF + tl.arange(0, HALF)[None, :]  # [ROWS, HALF]: one byte, two elements
    mask = row_mask[:, None] & (byte >= 0)
    g0, g1 = _pairs(g_ptr, elem, elem_mask, ROWS, HALF)
    tl.store(partial_ptr + pid, tl.sum(tl.sum(g0 * g0 + g1 * g1, axis=1), axis=0))
    inv_divisor = 1.0 / tl.load(divisor_ptr)
    g0, g1 = g0 * inv_divisor, g1 * inv_divisor
    p0, p1 = _pairs(p_ptr, elem, elem_mask, ROWS, HALF)
    m0, m1 = _dequantize(m_codes, m_scale, m_qmap, byte, mask, rows, row_mask)
    v0, v1 = _dequantize(v_codes, v_scale, v_qmap, byte, mask, rows, row_mask)
    inv_bc2 = 1.0 / bc2_sqrt
    p0, m0, v0 = _adamw(p0, g0, m0, v0, lr, beta1, beta2, eps, decay, step_size, inv_bc2)
    p1, m1, v1 = _adamw(p1, g1, m1, v1, lr, beta1, beta2, eps, decay, step_size, inv_bc2)
    m_abs = _block_max(m0, m1)
    v_abs = _block_max(v0, v1)
    m_inv = (1.0 / m_abs)[:, None]
    v_inv = (1.0 / v_abs)[:, None]
    x0, x1 = v0 * v_inv, v1 * v_inv
    # one Philox draw per byte, a word per element: bits 0-15 round the weight, 16-23 its m, 24-31 its v
    r0, r1, _, _ = tl.randint4x(seed, byte, PHILOX_ROUNDS)
    mq0 = _quantize(m0 * m_inv, m_qmap, r0 >> 16, STATES_SR, BINARY)
    mq = (mq0 << 4) | _quantize(m1 * m_inv, m_qmap, r1 >> 16, STATES_SR, BINARY)
    if V_POW2:  # snaketune's map (update()): codes from v's exponent, the same in its fourth root
        c0, c1 = _pow2_codes(x0), _pow2_codes(x1)
    if V_ROOT4:
        x0, x1 = tl.sqrt(tl.sqrt(x0)), tl.sqrt(tl.sqrt(x1))
    if V_POW2:
        vq = (_round_up(x0, c0, v_table, r0 >> 24) << 4) | _round_up(x1, c1, v_table, r1 >> 24)
    else:
        vq = (_quantize(x0, v_table, r0 >> 24, STATES_SR, BINARY) << 4) | _quantize(
            x1, v_table, r1 >> 24, STATES_SR, BINARY
        )
    _store_state(m_codes, m_scale, mq, m_abs, byte, mask, rows, row_mask)
    _store_state(v_codes, v_scale, vq, v_abs, byte, mask, rows, row_mask)
    p = tl.reshape(tl.join(_round_bf16(p0, r0, STOCHASTIC), _round_bf16(p1, r1, STOCHASTIC)), (ROWS, BLOCK))
    tl.store(p_ptr + elem, p.to(p_ptr.dtype.element_ty), mask=elem_mask)


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
    stochastic = states4bit.ROUNDING == "stochastic"
    root4 = stochastic and states4bit.V_ROUNDED_IN == "fourth_root"
    v_table, pow2 = _v_map(exp_avg_sq.qmap, root4)
    _adamw4bit[(programs,)](
        p,
        grad,
        exp_avg.codes,
        exp_avg.scale,
        exp_avg_sq.codes,
        exp_avg_sq.scale,
        exp_avg.qmap,
        exp_avg_sq.qmap,
        v_table,
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
        STATES_SR=stochastic,
        V_ROOT4=root4,
        V_POW2=pow2 and stochastic,
        ROWS=ROWS,
        BLOCK=BLOCK,
        PHILOX_ROUNDS=PHILOX_ROUNDS,
        BINARY=SEARCH == "binary",
        num_warps=WARPS,
    )
    # One launch, no read-modify-write: the host's time per tensor bounds the 7B's step (module docstring).
    torch.sum(partial, dim=0, out=sq_out)


_V_MAPS: dict[tuple[int, bool], tuple[weakref.ref, torch.Tensor | None, bool]] = {}


def _v_map(qmap: torch.Tensor, root4: bool) -> tuple[torch.Tensor, bool]:
    """(the table v's codes round to: its map, or the map's fourth roots where v rounds in its fourth root (the
    kernel compares x^(1/4) against them: two square roots per element instead of six); whether the map is
    snaketune's, 2^(k - 15), whose codes the kernel reads from the exponent). Found once per map tensor while it
    lives (each state holds its own 16 entries; a state saved with torchao's map keeps it)."""
    key = (id(qmap), root4)
    held = _V_MAPS.get(key)
    if held is None or held[0]() is not qmap:
        for dead in [k for k, (ref, _, _) in _V_MAPS.items() if ref() is None]:
            del _V_MAPS[dead]  # maps of states that are gone
        pow2 = torch.equal(qmap.cpu(), torch.tensor(states4bit.V_CODES, dtype=qmap.dtype))
        # the roots, or nothing: holding the map itself would keep it alive
        held = _V_MAPS[key] = (weakref.ref(qmap), qmap.sqrt().sqrt() if root4 else None, pow2)
    return (qmap if held[1] is None else held[1]), held[2]


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
