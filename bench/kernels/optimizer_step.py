"""The optimizer step alone, on the GPU: snaketune.train.optim's Triton AdamW at several launch configurations, the
gradient norm, and a plain copy as the memory-bandwidth reference, over the parameter shapes of the DeepSeek-7B
architecture (bf16 weights and gradients, fp32 masters, m and v; 28 B of traffic per parameter for AdamW).

    python -m bench optimizer_step [--layers 24] [--repeat 5]    (needs CUDA and triton; prints a table)

Why: the step profile of the 24-layer full fine-tune (bench/RESULTS.md, issue #16) spends 48.5 ms of a 273 ms
step in the optimizer (AdamW 43.7 ms, gradient norm 4.8 ms); this measures what launch configuration and norm
kernel come closest to the bandwidth a copy reaches.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))

from snaketune.train import optim  # noqa: E402


def shapes(layers: int, hidden=4096, inter=11008, vocab=102400) -> list[tuple[int, ...]]:
    per_layer = [(hidden, hidden)] * 4 + [(inter, hidden)] * 2 + [(hidden, inter)] + [(hidden,)] * 2
    return [(vocab, hidden)] + per_layer * layers + [(hidden,), (vocab, hidden)]


def timed(fn, repeat: int) -> float:
    """Median milliseconds of `fn` over `repeat` runs after one warm-up (CUDA events)."""
    fn()
    times = []
    for _ in range(repeat):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    sh = shapes(args.layers)
    weights = [torch.randn(s, device=dev, dtype=torch.bfloat16) for s in sh]
    grads = [torch.randn(s, device=dev, dtype=torch.bfloat16) * 1e-3 for s in sh]
    masters = [w.float() for w in weights]
    ms = [torch.zeros_like(m) for m in masters]
    vs = [torch.zeros_like(m) for m in masters]
    n_params = sum(w.numel() for w in weights)
    divisor = torch.ones((), device=dev)
    kernel = optim._triton_adamw()

    def adamw(block: int, warps: int):
        def run():
            for w, g, p, m, v in zip(weights, grads, masters, ms, vs, strict=True):
                n = p.numel()
                kernel[((n + block - 1) // block,)](
                    w, g, p, m, v, divisor, n, 1e-5, 0.9, 0.95, 1e-8, 0.1, 1e-5, 0.5,
                    HAS_DIVISOR=True, BLOCK=block, num_warps=warps,
                )  # fmt: skip

        return run

    rows = []
    gb = 1e9

    def add(what: str, ms_: float, bytes_per_param: float):
        rows.append((what, ms_, bytes_per_param * n_params / gb / (ms_ / 1e3)))

    pair = [torch.empty(n_params // 4, device=dev, dtype=torch.float32) for _ in range(2)]
    # N/4 fp32 values read and written: 2 B per parameter.
    add("copy of N/4 fp32 (the bandwidth reference)", timed(lambda: pair[1].copy_(pair[0]), args.repeat), 2)
    pair.clear()
    current = (optim.TRITON_BLOCK, 4)
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            if block // (32 * warps) < 4:
                continue  # fewer than 4 elements per thread: not a vector load
            mark = " (current)" if (block, warps) == current else ""
            add(
                f"AdamW triton BLOCK={block} num_warps={warps}{mark}",
                timed(adamw(block, warps), args.repeat),
                28,
            )
    add(
        "gradient norm: torch._foreach_norm (bf16 -> fp32)",
        timed(lambda: torch._foreach_norm(grads, 2, dtype=torch.float32), args.repeat),
        2,
    )
    add(
        "gradient norm: linalg.vector_norm fp32 per tensor",
        timed(lambda: [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads], args.repeat),
        2,
    )
    flat = torch.empty(n_params, device=dev, dtype=torch.bfloat16)
    add(
        "gradient norm: one flat bf16 tensor, linalg.vector_norm fp32",
        timed(lambda: torch.linalg.vector_norm(flat, dtype=torch.float32), args.repeat),
        2,
    )
    print(f"{torch.cuda.get_device_name()}, {len(sh)} tensors, {n_params / 1e9:.3f}B parameters")
    print("| what | ms | GB/s |\n|---|---:|---:|")
    for what, t, bw in rows:
        print(f"| {what} | {t:.2f} | {bw:,.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
