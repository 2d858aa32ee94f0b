"""GPU time of the step in backward's 4-bit AdamW update (snaketune.train.adam4bit) over the tensors of the
deepseek-llm-7b architecture (30 layers), and the bandwidth that implies (8 B per parameter moved: bf16 weight read and
written, bf16 gradient read, 4-bit m and v read and written, their scales). On a CUDA GPU:

    python3 bench/adam4bit_speed.py
"""

from __future__ import annotations

import torch
from torchao.optim.subclass_4bit import OptimState4bit

from snaketune.train import adam4bit

HIDDEN, INTER, VOCAB, LAYERS = 4096, 11008, 102400, 30
SHAPES = {  # shape: tensors of it in the model
    (VOCAB, HIDDEN): 2,  # embedding, lm_head
    (HIDDEN, HIDDEN): 4 * LAYERS,
    (INTER, HIDDEN): 2 * LAYERS,
    (HIDDEN, INTER): LAYERS,
    (HIDDEN,): 2 * LAYERS + 1,
}


def main() -> None:
    dev = torch.device("cuda")
    total_ms, params = 0.0, 0
    sq, divisor = torch.zeros((), device=dev), torch.ones((), device=dev)
    for shape, count in SHAPES.items():
        p = torch.randn(shape, device=dev).bfloat16()
        g = torch.randn(shape, device=dev).bfloat16()
        m, v = OptimState4bit.zeros(shape, True, 128, dev), OptimState4bit.zeros(shape, False, 128, dev)

        def step(i, p=p, g=g, m=m, v=v):
            adam4bit.update(
                p, g, m, v, sq_sum=sq, divisor=divisor, step=i + 1, lr=1e-5, betas=(0.9, 0.95), eps=1e-8,
                weight_decay=0.0, seed=i,
            )  # fmt: skip

        for i in range(3):
            step(i)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for i in range(20):
            step(i)
        end.record()
        torch.cuda.synchronize()
        ms = start.elapsed_time(end) / 20
        total_ms += ms * count
        params += p.numel() * count
        print(f"{str(shape):>16} x {count:3d}: {ms:7.3f} ms each, {8 * p.numel() / ms / 1e6:6.0f} GB/s")
    print(
        f"7B ({params:,} parameters): {total_ms:.1f} ms of GPU time per step, {8 * params / total_ms / 1e6:.0f} GB/s"
    )


if __name__ == "__main__":
    main()
