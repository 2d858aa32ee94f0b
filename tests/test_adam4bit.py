"""The 4-bit AdamW update in one Triton pass (snaketune.train.adam4bit) against torchao's update, whose states it
reads and writes: rounding the states to nearest as torchao does, the same codes and scales and the same weights in
fp32; rounding them stochastically (snaketune's default), m and v's fourth root that follow their exact averages
where nearest rounding leaves them far above, and steps whose size follows fp32 Adam's; unbiased stochastic rounding into bf16, the squared gradient norm; and the step in
backward with the kernel against the step with the same update in torch (snaketune.train.states4bit).

On a CUDA GPU; on a machine without one the kernel tests also run under Triton's interpreter
(`TRITON_INTERPRET=1` with triton installed), which CI's CPU build of torch does not bring.
"""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")  # GPU-only: torch's CUDA build brings it, the CPU build none (Makefile)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from torchao.optim.adam import single_param_adam  # noqa: E402
from torchao.optim.subclass_4bit import OptimState4bit  # noqa: E402

from snaketune.train import adam4bit, states4bit  # noqa: E402
from states4bit_scenarios import (  # noqa: E402
    V_MAPS,
    check_exact_averages,
    check_nearest_is_torchaos,
    check_step_sizes,
    decaying_block,
    step_size_ratios,
)

if torch.cuda.is_available():
    DEVICE = "cuda"
elif os.environ.get("TRITON_INTERPRET") == "1":
    DEVICE = "cpu"
else:
    pytest.skip("needs a CUDA GPU (or TRITON_INTERPRET=1)", allow_module_level=True)

pytestmark = pytest.mark.gpu
LR, BETAS, EPS, DECAY = 1e-2, (0.9, 0.95), 1e-8, 0.1
SHAPE = (98, 256)  # 196 blocks of 128: the last program (ROWS 8 or 16) partly masked


def _states():
    return OptimState4bit.zeros(SHAPE, True, 128, DEVICE), OptimState4bit.zeros(SHAPE, False, 128, DEVICE)


def _grad(step: int, dtype) -> torch.Tensor:
    gen = torch.Generator(device=DEVICE).manual_seed(step)
    return (torch.randn(SHAPE, device=DEVICE, generator=gen) * (1 + step)).to(dtype)


def _torchao_step(p, g, m, v, step, divisor, lr=LR):
    single_param_adam(
        p, g / divisor, torch.tensor(float(step)), m, v, None, torch.tensor(lr, device=DEVICE), *BETAS, DECAY, EPS,
        True, False,
    )  # fmt: skip


def _kernel_step(p, g, m, v, step, divisor, sq, seed=0, lr=LR):
    adam4bit.update(
        p,
        g,
        m,
        v,
        sq_out=sq,
        divisor=divisor,
        step=step,
        lr=lr,
        betas=BETAS,
        eps=EPS,
        weight_decay=DECAY,
        seed=seed,
    )


def test_fp32_weights_and_states_follow_torchaos_update(monkeypatch):
    """Rounded to nearest as torchao does: torchao's codes, scales and weights (check_nearest_is_torchaos), and the
    squared norm of the unclipped gradient written to sq_out."""
    monkeypatch.setattr(states4bit, "ROUNDING", "nearest")

    def step_fn(p, g, m, v, step, divisor, lr):
        sq = torch.zeros((), device=DEVICE)
        _kernel_step(p, g, m, v, step, divisor, sq, lr=lr)
        torch.testing.assert_close(sq, g.square().sum(), rtol=1e-5, atol=0)

    check_nearest_is_torchaos(step_fn, DEVICE)


def test_bf16_weights_round_stochastically_without_bias():
    """One step of bf16 weights whose update is far below a bf16 ulp (lr 1e-3, weights in [1.25, 1.75): ulp 2^-7):
    round to nearest would leave every weight where it was; stochastic rounding moves each to one of the two bf16
    neighbours of its fp32 result, up with the probability of the dropped bits, so the weights carry no bias.
    Another seed draws other roundings."""
    lr, ulp = 1e-3, 2.0**-7
    torch.manual_seed(1)
    start = (torch.rand(SHAPE, device=DEVICE) * 0.5 + 1.25).bfloat16()
    exact = start.float()
    m_ref, v_ref = _states()
    g = _grad(1, torch.bfloat16)
    one = torch.tensor(1.0, device=DEVICE)
    _torchao_step(exact, g.float(), m_ref, v_ref, 1, one, lr=lr)
    p, p2 = start.clone(), start.clone()
    (m, v), (m2, v2) = _states(), _states()
    sq = torch.zeros((), device=DEVICE)
    _kernel_step(p, g, m, v, 1, one, sq, seed=11, lr=lr)
    _kernel_step(p2, g, m2, v2, 1, one, sq, seed=12, lr=lr)
    below = torch.floor(exact / ulp) * ulp
    assert ((p.float() == below) | (p.float() == below + ulp)).all()
    moved = (p != start).float().mean()
    assert 0.05 < moved < 0.3, moved  # |update| ~ lr = ulp / 7.8
    # Each draw's error is within an ulp, so the mean of 25,088 has a standard deviation under 0.004 ulp.
    bias = (p.float() - exact).mean() / ulp
    assert abs(bias) < 0.02, bias
    assert (p != p2).any() and ((p != start) & (p2 != start)).float().mean() < moved


SPREAD = 1.5
"""How far the kernel's weights may move from the torch update's, as a multiple of how far the torch update's own
weights move when only its random draws change (the kernel's draws are other draws of the same distribution). In
torch on CPU, two seeds' distances from a reference seed's weights were 0.87-1.06x a third seed's, per tensor and
rounding."""


@pytest.mark.skipif(DEVICE != "cuda", reason="BackwardAdamW picks the kernel for CUDA tensors")
@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_the_step_in_backward_with_the_kernel_follows_the_torch_update(rounding, monkeypatch):
    """A small MLP trained 8 steps with the update in backward, 4-bit states, clipping: the Triton kernel's weights
    are as near the same update in torch (states4bit) as the torch update with other random draws is (the weights
    round stochastically into bf16, and with `stochastic` the states too: never equal), and the norm the step
    reports is the same."""
    from snaketune.train.backward_step import BackwardAdamW
    from snaketune.train.optim import param_groups

    monkeypatch.setattr(states4bit, "ROUNDING", rounding)

    def run(kernel, other_draws=False):
        torch.manual_seed(0)
        net = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
        net = net.to(DEVICE, torch.bfloat16)
        opt = BackwardAdamW(
            param_groups(net, 0.1), lr=1e-3, betas=BETAS, grad_clip=1.0, states="4bit", kernel=kernel
        )
        opt._seed += other_draws  # the seed of every (step, tensor) stream
        norms = []
        for step in range(8):
            gen = torch.Generator(device=DEVICE).manual_seed(step)
            x = torch.randn(64, 256, device=DEVICE, generator=gen).bfloat16()
            (net(x).float() - x.float()).pow(2).mean().backward()
            opt.step()
            norms.append(float(opt._global_grad_norm))
        return net, opt, norms

    (ref, ref_opt, ref_norms), (mine, opt, norms) = run("torch"), run("triton")
    other, _, _ = run("torch", other_draws=True)
    assert opt.kernel.startswith("snaketune Triton") and not ref_opt.kernel.startswith("snaketune Triton")
    torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=2e-2, atol=0)
    torch.manual_seed(0)
    init = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    init = init.to(DEVICE, torch.bfloat16)
    for a, b, c, p0 in zip(
        mine.parameters(), ref.parameters(), other.parameters(), init.parameters(), strict=True
    ):
        moved_ref = b.float() - p0.float()
        off, spread = (a.float() - b.float()).norm(), (c.float() - b.float()).norm()
        print(
            f"{rounding} {tuple(p0.shape)}: moved {moved_ref.norm():.4g}, kernel off {off:.4g}, spread {spread:.4g}"
        )
        assert moved_ref.norm() > 0 and spread > 0
        assert off < SPREAD * spread, (off, spread, moved_ref.norm())


@pytest.mark.parametrize("v_map", V_MAPS)
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_4bit_states_follow_their_exact_averages_when_the_block_max_holds(rounding, v_map, monkeypatch):
    """tests/test_states4bit.py's test of the same name, with the kernel, in either map of v."""
    monkeypatch.setattr(states4bit, "ROUNDING", rounding)

    def step(p, g, m, v, step):
        _kernel_step(
            p, g, m, v, step, torch.tensor(1.0, device=DEVICE), torch.zeros((), device=DEVICE), step, 0.0
        )

    check_exact_averages(rounding, *decaying_block(step, DEVICE, V_MAPS[v_map]))


@pytest.mark.parametrize("domain", states4bit.V_DOMAINS)
def test_the_steps_follow_fp32_adams_in_size(domain, monkeypatch):
    """tests/test_states4bit.py's test of the same name, with the kernel: v rounded in its fourth root keeps the
    steps' size within 2% of fp32 Adam's; rounded in v, 4% or more above."""
    monkeypatch.setattr(states4bit, "V_ROUNDED_IN", domain)
    one, sq = torch.tensor(1.0, device=DEVICE), torch.zeros((), device=DEVICE)

    def step(p, g, m, v, step):
        _kernel_step(p, g, m, v, step, one, sq, seed=step, lr=0.0)

    check_step_sizes(domain, step_size_ratios(step, DEVICE, seed=0))


@pytest.mark.parametrize("domain", states4bit.V_DOMAINS)
def test_v_codes_read_from_the_exponent_are_the_compares_codes(domain, monkeypatch):
    """snaketune's v map (2^(k - 15)) takes its codes from x's exponent bits (adam4bit._pow2_codes) instead of 15
    compares: the same codes bit for bit, with the same random draws, over v spanning 2^-40 .. 1 of the block's max
    (below the first code, on exact powers of 2 and between them), in v and in its fourth root."""
    monkeypatch.setattr(states4bit, "V_ROUNDED_IN", domain)
    gen = torch.Generator(device=DEVICE).manual_seed(3)
    g = torch.randn(SHAPE, device=DEVICE, generator=gen) * 2.0 ** torch.randint(
        -20, 1, SHAPE, device=DEVICE, generator=gen
    )
    g[:, ::7] = 2.0 ** torch.randint(
        -20, 1, (SHAPE[0], len(range(0, SHAPE[1], 7))), device=DEVICE, generator=gen
    )
    g[:, 5] = 0.0
    one = torch.tensor(1.0, device=DEVICE)
    results = []
    v_map = adam4bit._v_map
    for pow2 in (True, False):
        if not pow2:  # the compares, as for any other map
            monkeypatch.setattr(adam4bit, "_v_map", lambda qmap, root4: (v_map(qmap, root4)[0], False))
        p = torch.ones(SHAPE, device=DEVICE)
        m = states4bit.zeros(SHAPE, True, 128, DEVICE)
        v = states4bit.zeros(SHAPE, False, 128, DEVICE)
        for step in (1, 2):
            _kernel_step(p, g * step, m, v, step, one, torch.zeros((), device=DEVICE), seed=step)
        results.append((v.codes.clone(), v.scale.clone(), m.codes.clone(), p.clone()))
    (codes, scale, m_codes, p), (codes_ref, scale_ref, m_codes_ref, p_ref) = results
    assert len(set(codes.flatten().tolist())) > 100  # many byte values: codes across the map
    assert torch.equal(codes, codes_ref) and torch.equal(scale, scale_ref)
    assert torch.equal(m_codes, m_codes_ref) and torch.equal(p, p_ref)


@triton.jit
def _round_up_kernel(x_ptr, table_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    codes = tl.full((N,), 15, tl.int32)
    rand = tl.full((N,), 0, tl.uint32) + (i * 37).to(tl.uint32)  # u across (0, 1)
    tl.store(out_ptr + i, adam4bit._round_up(tl.load(x_ptr + i), codes, table_ptr, rand))


def test_a_value_an_ulp_above_the_last_entry_keeps_the_last_code():
    """The block's max, times the reciprocal of the max, can come out an ulp above 1 on a GPU: it keeps code 15
    (before: 16 for every draw, which spilled into the byte's other nibble)."""
    table = torch.tensor(states4bit.V_CODES, device=DEVICE)
    x = torch.full((8,), 1.0, device=DEVICE)
    x[:4] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).item()  # 1 + 2^-23
    out = torch.zeros(8, dtype=torch.int32, device=DEVICE)
    _round_up_kernel[(1,)](x, table, out, N=8)
    assert out.tolist() == [15] * 8
