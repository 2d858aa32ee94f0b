"""The optimizer's 4-bit states (torchao's OptimState4bit format) as snaketune.train.states4bit updates them on CPU
ranks and with optimizer_kernel torch: rounded stochastically m and v's fourth root follow their exact averages and
the steps' size follows fp32 Adam's, rounded to the nearest they do not (the bias that made the real model's loss run
+7.9% over fp32 states'), and with torchao's rounding the update is torchao's. tests/test_adam4bit.py runs the same
scenarios on the Triton kernel (GPU or Triton's interpreter)."""

from __future__ import annotations

import pytest
import torch

from snaketune.train import states4bit

pytest.importorskip("torchao")

BETAS = (0.9, 0.95)


V_MAPS = {"torchao": None, "snaketune": states4bit.V_CODES}
"""v's code maps: torchao's linear one (k/16) and snaketune's (2^-15 .. 1), which new states take."""


def decaying_block(
    step_fn, device: str, v_codes: tuple[float, ...] | None = None
) -> tuple[float, float, float]:
    """4-bit m and v over a (96, 256) tensor (192 blocks of 128) against their exact averages: one element per block
    keeps its gradient (so its v, the block's scale, stays put); the others get one gradient, then none for 8 steps,
    so their exact m and v decay by beta1 and beta2 a step. `step_fn(p, g, m, v, step)` runs one update at lr 0; v
    takes `v_codes` as its map (torchao's if None). The mean dequantized m, v and v's fourth root of the decaying
    elements over their exact means."""
    shape = (96, 256)
    torch.manual_seed(3)
    p = torch.zeros(shape, device=device)
    m, v = states4bit.zeros(shape, True, 128, device), states4bit.zeros(shape, False, 128, device, v_codes)
    exact_m, exact_v = torch.zeros(shape, device=device), torch.zeros(shape, device=device)
    first = 2 * (0.3 + 0.7 * torch.rand(shape, device=device)).sqrt()  # v in [0.3, 1) of the block's max
    held = torch.zeros(shape, device=device).view(-1, 128)
    held[:, 0] = 1
    held = held.view(shape).bool()
    for step in range(1, 10):
        g = torch.where(held, 2.0 if step == 1 else 0.2**0.5, first if step == 1 else 0.0)
        step_fn(p, g, m, v, step)
        exact_m.lerp_(g, 1 - BETAS[0])
        exact_v.lerp_(g * g, 1 - BETAS[1])
    others = ~held
    stored_v = v.dequantize().view(shape)[others]
    return (
        (m.dequantize().view(shape)[others].mean() / exact_m[others].mean()).item(),
        (stored_v.mean() / exact_v[others].mean()).item(),
        (stored_v.sqrt().sqrt().mean() / exact_v[others].sqrt().sqrt().mean()).item(),
    )


def check_exact_averages(rounding: str, ratio_m: float, ratio_v: float, ratio_root4: float) -> None:
    """Rounded stochastically, m follows its exact average, and v's fourth root (states4bit.V_ROUNDED_IN) its exact
    fourth root; v itself then runs above its exact average (x^4 is convex; after 8 steps of decay 1.11 with
    snaketune's map, codes a factor of 2 apart), as the steps' size needs (test_the_steps_follow_fp32_adams_in_size).
    Rounded to nearest, both stay far above."""
    print(f"m {ratio_m:.4f}, v {ratio_v:.4f}, v's fourth root {ratio_root4:.4f}")
    if rounding == "stochastic":
        assert abs(ratio_m - 1) < 0.03 and abs(ratio_root4 - 1) < 0.03, (ratio_m, ratio_root4)
        assert 1 < ratio_v < 1.2, ratio_v
    else:  # the bias stochastic rounding removes (the test fails without it): measured 2.35 and 1.27
        assert ratio_m > 1.5 and ratio_v > 1.2, (ratio_m, ratio_v)


@pytest.mark.parametrize("v_map", V_MAPS)
@pytest.mark.parametrize("rounding", ["stochastic", "nearest"])
def test_4bit_states_follow_their_exact_averages_when_the_block_max_holds(rounding, v_map, monkeypatch):
    """The 4-bit states' rounding (snaketune.train.states4bit.ROUNDING), on the CPU's update (the kernel's:
    tests/test_adam4bit.py). A v that decays by 5% a step rounds back to its code when rounded to the nearest (codes
    1/16 of the block's max apart): the lower 10 codes never move, v stays far above its average and the weights'
    steps shrink; m likewise (with snaketune's v map, codes a factor of 2 apart, too). Rounded stochastically, m and
    v follow their exact averages in either map."""
    monkeypatch.setattr(states4bit, "ROUNDING", rounding)
    one = torch.tensor(1.0)

    def step(p, g, m, v, step):
        states4bit.update(
            p, g, m, v, divisor=one, step=step, lr=0.0, betas=BETAS, eps=1e-8, weight_decay=0.0, seed=step
        )

    check_exact_averages(rounding, *decaying_block(step, "cpu", V_MAPS[v_map]))


def step_size_ratios(step_fn, device: str, seed: int, steps: int = 40) -> list[float]:
    """4-bit m and v fed noisy gradients whose scales span decades within each block of 128 (as on real weights),
    `step_fn(p, g, m, v, step)` updating them at lr 0: per step, the first-order decrease of the loss the update
    would make, sum(g * m / sqrt(v)), with v the stored 4-bit v's EMA over the exact one's (m exact in both: v's
    share alone)."""
    n = 128 * 128
    gen = torch.Generator(device=device).manual_seed(seed)
    scale = torch.exp(torch.randn(n, device=device, generator=gen) * 1.5)
    mean = torch.randn(n, device=device, generator=gen) * 0.5
    p = torch.zeros(n, device=device)
    m4, v4 = states4bit.zeros((n,), True, 128, device), states4bit.zeros((n,), False, 128, device)
    m, v = torch.zeros(n, device=device), torch.zeros(n, device=device)
    ratios = []
    for step in range(1, steps + 1):
        g = (mean + torch.randn(n, device=device, generator=gen)) * scale
        m = m.lerp(g, 1 - BETAS[0])
        exact = v.lerp(g * g, 1 - BETAS[1])
        stored = v4.dequantize().view(-1).lerp(g * g, 1 - BETAS[1])
        ratios.append(((g * m / stored.sqrt()).sum() / (g * m / exact.sqrt()).sum()).item())
        v = exact
        step_fn(p, g, m4, v4, step)
    return ratios


def check_step_sizes(domain: str, ratios: list[float]) -> None:
    late = sum(ratios[10:]) / len(ratios[10:])
    if domain == "fourth_root":
        assert abs(late - 1) < 0.02, late
    else:  # the bias the fourth root removes (v unbiased, 1/sqrt(v) not): measured +6.0%
        assert late > 1.04, late


@pytest.mark.parametrize("domain", states4bit.V_DOMAINS)
def test_the_steps_follow_fp32_adams_in_size(domain, monkeypatch):
    """v rounded stochastically so that v is unbiased makes 1/sqrt(v) biased up (Jensen), and the stored v's error
    lasts: on the real model's gradients the steps ran 4.8% larger than fp32 Adam's by step 30, and its run on a
    GPU memorized faster (bench/RESULTS.md, issue #26). Rounded so that v's fourth root is unbiased
    (states4bit.V_ROUNDED_IN), the steps' size follows fp32 Adam's within 2% (measured -0.2%); rounded in v, 4% or
    more above (+6.0%)."""
    monkeypatch.setattr(states4bit, "V_ROUNDED_IN", domain)
    one = torch.tensor(1.0)

    def step(p, g, m, v, step):
        states4bit.update(
            p, g, m, v, divisor=one, step=step, lr=0.0, betas=BETAS, eps=1e-8, weight_decay=0.0, seed=step
        )

    check_step_sizes(domain, step_size_ratios(step, "cpu", seed=0))


@pytest.mark.parametrize("v_map", V_MAPS)
def test_a_v_far_below_its_block_max_keeps_its_size(v_map):
    """One update from zero states: in each block of 128 one gradient of 1, the others 0.03 (v 1/1,111 of the
    block's max, as a gradient's square spans decades within a block of real weights). snaketune's map keeps those v
    near their exact mean (rounded stochastically between 2^-11 and 2^-10 of the max, in the fourth root: 1.6%
    above); torchao's linear map puts every one at its lowest code, 1/16 of the max: 69x too large, and their steps
    8x too small."""
    shape = (96, 256)
    one = torch.tensor(1.0)
    g = torch.full(shape, 0.03)
    g.view(-1, 128)[:, 0] = 1.0
    m, v = (
        states4bit.zeros(shape, True, 128, "cpu"),
        states4bit.zeros(shape, False, 128, "cpu", V_MAPS[v_map]),
    )
    p = torch.zeros(shape)
    states4bit.update(
        p, g, m, v, divisor=one, step=1, lr=0.0, betas=BETAS, eps=1e-8, weight_decay=0.0, seed=5
    )
    small = g != 1.0
    ratio = (v.dequantize().view(shape)[small].mean() / (0.05 * 0.03**2)).item()
    if v_map == "snaketune":
        assert abs(ratio - 1) < 0.03, ratio
    else:
        assert ratio == pytest.approx((1 / 16) / 0.03**2), ratio


def check_nearest_is_torchaos(step_fn, device: str) -> None:
    """With torchao's rounding (states4bit.ROUNDING nearest, set by the caller), six steps of fp32 weights clipped by
    a divisor, with weight decay: `step_fn(p, g, m, v, step, divisor, lr)` gives torchao's single_param_adam's 4-bit
    codes (the quantizer's choices), scales and weights up to fp32 rounding."""
    from torchao.optim.adam import single_param_adam
    from torchao.optim.subclass_4bit import OptimState4bit

    shape, lr, decay = (96, 256), 1e-2, 0.1
    divisor = torch.tensor(1.7, device=device)
    torch.manual_seed(0)
    start = torch.randn(shape, device=device)
    ref, mine = start.clone(), start.clone()
    (m_ref, v_ref), (m, v) = [
        (OptimState4bit.zeros(shape, True, 128, device), OptimState4bit.zeros(shape, False, 128, device))
        for _ in range(2)
    ]
    for step in range(1, 7):
        gen = torch.Generator(device=device).manual_seed(step)
        g = torch.randn(shape, device=device, generator=gen) * step
        single_param_adam(
            ref, g / divisor, torch.tensor(float(step)), m_ref, v_ref, None, torch.tensor(lr, device=device), *BETAS,
            decay, 1e-8, True, False,
        )  # fmt: skip
        step_fn(mine, g, m, v, step, divisor, lr)
        assert (m.codes == m_ref.codes).float().mean() > 0.999 and (
            v.codes == v_ref.codes
        ).float().mean() > 0.999
        torch.testing.assert_close(m.scale, m_ref.scale, rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(v.scale, v_ref.scale, rtol=1e-5, atol=1e-12)
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-6)
    assert (ref - start).abs().mean() > lr  # the weights did move (random gradients: a random walk)


def test_the_4bit_update_rounded_to_nearest_is_torchaos(monkeypatch):
    """states4bit.update with torchao's rounding is torchao's update (check_nearest_is_torchaos), in passes of fewer
    elements than the tensor."""
    monkeypatch.setattr(states4bit, "ROUNDING", "nearest")
    monkeypatch.setattr(states4bit, "CHUNK_ELEMENTS", 128 * 50)  # four passes, the last a part

    def step_fn(p, g, m, v, step, divisor, lr):
        states4bit.update(
            p, g, m, v, divisor=divisor, step=step, lr=lr, betas=BETAS, eps=1e-8, weight_decay=0.1, seed=0
        )

    check_nearest_is_torchaos(step_fn, "cpu")


def test_bf16_weights_round_stochastically_without_bias():
    """states4bit.update on bf16 weights (CPU ranks, optimizer_kernel torch), as tests/test_adam4bit.py checks the
    kernel: an update far below a bf16 ulp (lr 1e-3, weights in [1.25, 1.75): ulp 2^-7) moves each weight to one of
    the two bf16 neighbours of its fp32 result, up with the probability of the dropped bits, so the weights carry no
    bias (round to nearest would move none; truncation would bias every one down). Another seed draws others."""
    lr, ulp, shape = 1e-3, 2.0**-7, (96, 256)
    torch.manual_seed(1)
    start = (torch.rand(shape) * 0.5 + 1.25).bfloat16()
    grad = (torch.randn(shape) * 2).bfloat16()

    def step(p: torch.Tensor, seed: int) -> torch.Tensor:
        m, v = states4bit.zeros(shape, True, 128, "cpu"), states4bit.zeros(shape, False, 128, "cpu")
        states4bit.update(
            p, grad, m, v, divisor=torch.tensor(1.0), step=1, lr=lr, betas=BETAS, eps=1e-8, weight_decay=0.1,
            seed=seed,
        )  # fmt: skip
        return p

    exact = step(start.float(), 0)  # fp32 weights take the update as computed
    p, p2 = step(start.clone(), 11), step(start.clone(), 12)
    below = torch.floor(exact / ulp) * ulp
    assert ((p.float() == below) | (p.float() == below + ulp)).all()
    moved = (p != start).float().mean()
    assert 0.05 < moved < 0.3, moved  # |update| ~ 1.15 lr = ulp / 6.8
    # Each draw's error is within an ulp, so the mean of 24,576 has a standard deviation under 0.004 ulp.
    bias = (p.float() - exact).mean() / ulp
    assert abs(bias) < 0.02, bias
    assert (p != p2).any()
