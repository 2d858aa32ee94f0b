"""The loss on the logits alone, on the GPU: forward + backward of the next-token cross-entropy over
(tokens, 102,400) bf16 logits as the train stage runs it with train.loss_kernel `torch` (fp32 upcast +
F.cross_entropy, snaketune.model.batching.token_loss_sum's arithmetic), with `triton` (snaketune.model.losses.
logits_cross_entropy) at several launch configurations, and with Liger-Kernel's cross-entropy (the field's
kernel, where liger-kernel is installed); memory beyond the logits themselves, and the bandwidth that
reading and writing the bf16 logits once each would take as the reference.

    python -m bench cross_entropy [--tokens 4096] [--repeat 10]    (needs CUDA and triton; prints a table)

Why: the step profile of the 24-layer full fine-tune (bench/RESULTS.md, issue #16) spends about 7 ms of a
266 ms step in the loss's softmax, upcast and copies, and the loss holds 12 B per token and vocabulary entry
(4.7 GiB at 4,096 tokens) on top of every layer's activations, at the step's memory peak.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))

from snaketune.model import losses  # noqa: E402
from snaketune.model.batching import IGNORE  # noqa: E402


def measure(fn, logits: torch.Tensor, repeat: int) -> tuple[float, float]:
    """(median ms of forward + backward, peak GiB allocated beyond the logits' input copy)."""
    times, extra = [], 0
    for i in range(repeat + 1):
        x = logits.clone().requires_grad_()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        y = x * 1  # a non-leaf, as the lm_head's output is; its gradient flows into x.grad (one logits size)
        fn(y).backward()
        end.record()
        torch.cuda.synchronize()
        if i:
            times.append(start.elapsed_time(end))
        extra = max(extra, torch.cuda.max_memory_allocated() - base)
        del x, y
    return sorted(times)[len(times) // 2], extra / 2**30


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--vocab", type=int, default=102400)
    ap.add_argument("--repeat", type=int, default=10)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(0)
    logits = (3 * torch.randn(args.tokens, args.vocab, device=dev, generator=gen)).bfloat16()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=dev, generator=gen)
    targets[::50] = IGNORE
    n = int((targets != IGNORE).sum())

    def torch_loss(y):
        return F.cross_entropy(y.float(), targets, ignore_index=IGNORE, reduction="sum") / n

    def triton_loss(y):
        return losses.logits_cross_entropy(y, targets) / n

    # The x * 1 product and its backward (a logits-sized write and read) are in every row: the loss's own
    # share is the row minus this one.
    rows = [
        (
            "x * 1, a sum and their backward (every row has them)",
            *measure(lambda y: y.sum(), logits, args.repeat),
        )
    ]
    rows.append(
        (
            "torch: fp32 upcast + F.cross_entropy (loss_kernel torch)",
            *measure(torch_loss, logits, args.repeat),
        )
    )
    current = (losses.CE_BLOCK, losses.CE_WARPS)
    for block in (4096, 8192, 16384, 32768):
        for warps in (8, 16, 32):
            losses.CE_BLOCK, losses.CE_WARPS = block, warps
            mark = " (current)" if (block, warps) == current else ""
            rows.append(
                (f"triton BLOCK={block} num_warps={warps}{mark}", *measure(triton_loss, logits, args.repeat))
            )
    losses.CE_BLOCK, losses.CE_WARPS = current
    if importlib.util.find_spec("liger_kernel"):
        from liger_kernel.ops.cross_entropy import LigerCrossEntropyFunction

        def liger_loss(y):
            return LigerCrossEntropyFunction.apply(y, targets, None, IGNORE, 0.0, 0.0, "sum")[0] / n

        rows.append(("Liger-Kernel cross-entropy (reduction sum)", *measure(liger_loss, logits, args.repeat)))
    bytes_ = logits.numel() * logits.element_size()
    ideal_ms = (
        2 * bytes_ / 4.0e12 * 1e3
    )  # read + write once at 4.0 TB/s (the copy rate of bench/kernels/optimizer_step.py)
    print(
        f"{torch.cuda.get_device_name()}, {args.tokens} tokens x {args.vocab} vocabulary, bf16 logits "
        f"{bytes_ / 2**30:.2f} GiB; reading and writing them once at 4.0 TB/s: {ideal_ms:.2f} ms"
    )
    print("| what | ms (forward + backward) | GiB beyond the input logits |\n|---|---:|---:|")
    for what, t, gib in rows:
        print(f"| {what} | {t:.2f} | {gib:.2f} |")
    # The loss values agree (fp32, same logits).
    ref = torch_loss(logits).item()
    got = triton_loss(logits).item()
    print(f"loss torch {ref:.6f}, triton {got:.6f} (relative difference {abs(got - ref) / ref:.1e})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
