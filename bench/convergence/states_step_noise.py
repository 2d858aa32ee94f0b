"""The 4-bit AdamW update's steps against fp32 Adam's on synthetic gradients (issue #26; CPU, about a minute):
per-element gradient scales spanning decades within each block of 128 (as on real weights), a mean beside the
noise, 300 steps at lr 1e-4, fp32 weights; snaketune.train.states4bit.update against torch's arithmetic of AdamW.
Prints, for each rounding of the states (stochastic with v unbiased in its fourth root, snaketune's, or in v; nearest):
the mean |step| over steps 51-300 against fp32 Adam's, the drift along the gradients' mean against fp32 Adam's, E[v]
and the median 1/sqrt(v) of the stored v against the exact v.

    python -m bench states_step_noise
"""

from __future__ import annotations

import math

import torch

from snaketune.train import states4bit

N, BLOCK, STEPS, WARM = 128 * 512, 128, 300, 50
BETAS, EPS, LR = (0.9, 0.999), 1e-8, 1e-4


def main() -> None:
    torch.manual_seed(0)
    scale = torch.exp(torch.randn(N) * 1.5) * 1e-3
    for rounding, domain in (("stochastic", "fourth_root"), ("stochastic", "v"), ("nearest", "v")):
        states4bit.ROUNDING, states4bit.V_ROUNDED_IN = rounding, domain
        w4, w = torch.zeros(N), torch.zeros(N)
        m4 = states4bit.zeros((N,), True, BLOCK, "cpu")
        v4 = states4bit.zeros((N,), False, BLOCK, "cpu")
        m, v = torch.zeros(N), torch.zeros(N)
        gen = torch.Generator().manual_seed(1)
        ratios = []
        for step in range(1, STEPS + 1):
            g = (torch.randn(N, generator=gen) + 0.3) * scale
            before = w4.clone()
            states4bit.update(w4, g, m4, v4, divisor=torch.tensor(1.0), step=step, lr=LR, betas=BETAS, eps=EPS,
                              weight_decay=0.0, seed=step)  # fmt: skip
            m = BETAS[0] * m + (1 - BETAS[0]) * g
            v = BETAS[1] * v + (1 - BETAS[1]) * g * g
            d = LR / (1 - BETAS[0] ** step) * m / (v.sqrt() / math.sqrt(1 - BETAS[1] ** step) + EPS)
            w -= d
            if step > WARM:
                ratios.append(((before - w4).abs().mean() / d.abs().mean()).item())
        stored = v4.dequantize().view(-1)
        print(
            f"{rounding} (v unbiased in {domain}): mean |step| / fp32 Adam's (steps {WARM + 1}-{STEPS}) "
            f"{sum(ratios) / len(ratios):.3f}; "
            f"drift along the mean {(w4.mean() / w.mean()).item():.3f}; E[v] {(stored.mean() / v.mean()).item():.3f}; "
            f"median 1/sqrt(v) {(stored.clamp_min(1e-30).rsqrt().median() / v.rsqrt().median()).item():.3f}"
        )


if __name__ == "__main__":
    main()
