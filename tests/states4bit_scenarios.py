"""The 4-bit states' scenarios that the torch update (tests/test_states4bit.py) and the Triton kernel
(tests/test_adam4bit.py) both run: each builds its inputs, runs a caller's `step_fn` and checks what the states or
weights became, so the two implementations face the same numbers."""

from __future__ import annotations

import torch

from snaketune.train import states4bit

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
