"""How the 4-bit v's stochastic rounding changes the size of Adam's steps on the real model (issue #26; CPU, ~15 min):
the real SmolLM2-135M trained by fp32 AdamW (lr 1e-4, betas 0.9/0.95, clipping at 1.0) on 88 real oasst rows
repeated (batches of 8 packed rows, 11 steps a pass, as the GPU's 50-step runs repeat theirs), and beside it, fed the
same gradients, 4-bit v states (states4bit.V_CODES, blocks of 128) rounded stochastically so that x^p is unbiased,
for each p of --powers (1: v itself, 0.25: its fourth root, snaketune's states4bit.V_ROUNDED_IN; 0: its log).
Per step, for each p, over the embedding and the matrices of layers 0, 15 and 29, with v the EMA of the stored 4-bit
v and m exact: the first-order decrease of the loss an update would make, sum(g * m / sqrt(v)), over the exact v's
("loss"; the large gradients weigh most), and the median element's step, sqrt(exact v / v), from a fixed sample of
2^20 elements ("median"). Then the spread of v within its blocks (the exact v's share per octave below its block's
max).

    .venv/bin/python bench/convergence/v_rounding_shadow.py MODEL_DIR TOKENIZED_TRAIN_DIR [--steps 30] [--powers 1 0.5 0.25 0 -0.5]

MODEL_DIR: the workflow's imported model (results/models/SmolLM2-135M-Instruct-Q4-1-*); TOKENIZED_TRAIN_DIR: its
tokenized rows at 256 tokens (results/tokenized/*/train of the workflow copy that `python -m bench converge_cpu_real`
leaves in its $OUT/wf).
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from snaketune.train import states4bit

B1, B2, BLOCK, BATCH, ROWS = 0.9, 0.95, 128, 8, 88
LAYERS = (".layers.0.", ".layers.15.", ".layers.29.", "embed_tokens")


def quantize(x: torch.Tensor, qmap: torch.Tensor, rand: torch.Tensor, power: float) -> torch.Tensor:
    """x's codes rounded stochastically so that x^power (log x for 0) is unbiased: snaketune's own quantize for
    1 and 0.25, the same arithmetic in another domain for the others."""
    if power in (1.0, 0.25):
        return states4bit.quantize(x, qmap, rand, fourth_root=power == 0.25)
    below = torch.bucketize(x, qmap[1:], right=True, out_int32=True)
    above = (below + 1).clamp_(max=15)

    def f(t):
        t = t.clamp(min=qmap[0].item())
        return t.log() if power == 0 else t.pow(power)

    low, high = f(qmap[below]), f(qmap[above])
    u = ((rand & 255).to(torch.float32) + 0.5) * (1.0 / 256.0)
    return below + (
        (f(x) - low) * math.copysign(1, power or 1) > u * (high - low) * math.copysign(1, power or 1)
    )


def main() -> None:
    from datasets import load_from_disk
    from transformers import AutoModelForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("tokenized")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--powers", type=float, nargs="+", default=[1.0, 0.5, 0.25, 0.0, -0.5])
    args = ap.parse_args()
    torch.manual_seed(0)
    rows = load_from_disk(args.tokenized)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    named = dict(model.named_parameters())
    params = [
        p for n, p in named.items() if p.dim() == 2 and p.numel() % BLOCK == 0 and any(k in n for k in LAYERS)
    ]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, betas=(B1, B2), weight_decay=0.0)
    shadows = {q: [states4bit.zeros((p.numel(),), False, BLOCK, "cpu") for p in params] for q in args.powers}
    exact_v = [torch.zeros(p.numel()) for p in params]
    exact_m = [torch.zeros(p.numel()) for p in params]
    order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(0))[:ROWS].tolist()
    total = sum(p.numel() for p in params)
    sample = torch.randperm(total, generator=torch.Generator().manual_seed(1))[: 2**20]
    print(f"{total:,} parameters shadowed; rows {ROWS} of {len(rows)}, {BATCH} a step")
    for step in range(1, args.steps + 1):
        start = time.time()
        batch = rows[[order[(step * BATCH + i) % ROWS] for i in range(BATCH)]]
        length = max(len(r) for r in batch["input_ids"])
        ids = torch.tensor([r + [0] * (length - len(r)) for r in batch["input_ids"]])
        labels = torch.tensor([r + [-100] * (length - len(r)) for r in batch["labels"]])
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        bc2 = math.sqrt(1 - B2**step)
        ratios, medians = {}, {}
        for power, states in shadows.items():
            mine = exact = 0.0
            per_element = []
            for p, state, v, m in zip(params, states, exact_v, exact_m, strict=True):
                g = p.grad.view(-1)
                m_new = B1 * m + (1 - B1) * g
                stored = state.dequantize().view(-1).lerp(g * g, 1 - B2)
                mine += (g * m_new / (stored.sqrt() / bc2 + 1e-8)).sum().item()
                exact_new = B2 * v + (1 - B2) * g * g
                exact += (g * m_new / (exact_new.sqrt() / bc2 + 1e-8)).sum().item()
                per_element.append((exact_new.sqrt() / bc2 + 1e-8) / (stored.sqrt() / bc2 + 1e-8))
                blocks = stored.view(-1, BLOCK)
                absmax = blocks.amax(dim=1).clamp_(min=1e-12)
                rand = torch.randint(-(2**31), 2**31, blocks.shape, dtype=torch.int32)
                codes = quantize(blocks / absmax[:, None], state.qmap, rand >> 24, power)
                state.codes.copy_(states4bit._pack(codes.flatten()))  # torchao's nibble order, as the update
                state.scale.copy_(absmax)
            ratios[power] = mine / exact
            medians[power] = torch.cat(per_element)[sample].median().item()
        for p, v, m in zip(params, exact_v, exact_m, strict=True):
            g = p.grad.view(-1)
            v.mul_(B2).add_(g * g, alpha=1 - B2)
            m.mul_(B1).add_(g, alpha=1 - B1)
        opt.step()
        opt.zero_grad()
        shown = " ".join(f"p={q:g} {r:.4f} {medians[q]:.4f}" for q, r in ratios.items())
        print(
            f"step {step} loss {loss.item():.4f} | steps' size vs fp32 Adam (loss, median): {shown} "
            f"({time.time() - start:.0f} s)"
        )
    v = torch.cat(exact_v).view(-1, BLOCK)
    octave = torch.log2((v / v.amax(dim=1, keepdim=True).clamp_min(1e-30)).clamp_min(2**-40))
    weight = v.sqrt()
    for top in range(0, -16, -1):
        inside = (octave <= top) & (octave > top - 1)
        print(
            f"v in ({top - 1}, {top}] octaves of its block's max: {inside.float().mean().item():.3f} of the elements, "
            f"{(weight * inside).sum().item() / weight.sum().item():.3f} weighted by sqrt(v)"
        )


if __name__ == "__main__":
    main()
