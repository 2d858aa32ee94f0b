"""GPU time of the step in backward's 4-bit AdamW update (snaketune.train.adam4bit) over the tensors of the
deepseek-llm-7b architecture (30 layers), and the bandwidth that implies (8 B per parameter moved: bf16 weight read and
written, bf16 gradient read, 4-bit m and v read and written, their scales); then the host's time per call, on a tensor
small enough that the GPU keeps up (the step in backward makes 273 such calls per 7B step, inside backward). With
--before FILE, a kernel of another revision (`git show REV:workflow/snaketune/train/adam4bit.py > FILE`) is timed
the same way in the same process; with --sweep, this kernel at other program sizes and searches (adam4bit.ROWS,
WARPS, PHILOX_ROUNDS, SEARCH), with snaketune's rounding and map only. On a CUDA GPU:

    python -m bench adam4bit_speed [--before FILE] [--sweep]
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
from torchao.optim.subclass_4bit import OptimState4bit

from snaketune.train import adam4bit, states4bit

HIDDEN, INTER, VOCAB, LAYERS = 4096, 11008, 102400, 30
SHAPES = {  # shape: tensors of it in the model
    (VOCAB, HIDDEN): 2,  # embedding, lm_head
    (HIDDEN, HIDDEN): 4 * LAYERS,
    (INTER, HIDDEN): 2 * LAYERS,
    (HIDDEN, INTER): LAYERS,
    (HIDDEN,): 2 * LAYERS + 1,
}


V_MAPS = {"snaketune's (states4bit.V_CODES)": states4bit.V_CODES, "torchao's linear": None}


SWEEP = (
    (4, 4, 10, "compares"),
    (8, 4, 10, "compares"),
    (8, 4, 7, "compares"),
    (16, 8, 10, "compares"),
    (8, 2, 10, "compares"),
    (4, 4, 10, "binary"),
    (8, 4, 10, "binary"),
    (8, 4, 7, "binary"),
    (16, 4, 7, "binary"),
)
"""(ROWS, WARPS, PHILOX_ROUNDS, SEARCH) tried by --sweep."""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--before", help="adam4bit.py of another revision, timed beside this one")
    parser.add_argument("--sweep", action="store_true", help="this kernel at each of SWEEP's program sizes")
    args = parser.parse_args()
    dev = torch.device("cuda")
    kernels = {"this revision": adam4bit}
    if args.before:
        spec = importlib.util.spec_from_file_location("adam4bit_before", args.before)
        kernels[f"before ({args.before})"] = module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    for label, kernel in kernels.items():
        # the states' rounding to their codes (snaketune.train.states4bit)
        for rounding in states4bit.ROUNDINGS:
            for name, codes in V_MAPS.items():
                states4bit.ROUNDING = rounding
                print(f"{label}: m and v rounded to their codes: {rounding}; v's map: {name}")
                gpu_times(dev, codes, kernel)
        states4bit.ROUNDING = "stochastic"
    if args.sweep:
        default = (adam4bit.ROWS, adam4bit.WARPS, adam4bit.PHILOX_ROUNDS, adam4bit.SEARCH)
        for adam4bit.ROWS, adam4bit.WARPS, adam4bit.PHILOX_ROUNDS, adam4bit.SEARCH in SWEEP:
            print(
                f"sweep: ROWS {adam4bit.ROWS}, WARPS {adam4bit.WARPS}, PHILOX_ROUNDS {adam4bit.PHILOX_ROUNDS}, "
                f"SEARCH {adam4bit.SEARCH}"
            )
            gpu_times(dev, states4bit.V_CODES, adam4bit)
        adam4bit.ROWS, adam4bit.WARPS, adam4bit.PHILOX_ROUNDS, adam4bit.SEARCH = default
    host_times(dev)


def gpu_times(dev: torch.device, v_codes: tuple[float, ...] | None, kernel=adam4bit) -> None:
    total_ms, params = 0.0, 0
    sq, divisor = torch.zeros((), device=dev), torch.ones((), device=dev)
    for shape, count in SHAPES.items():
        p = torch.randn(shape, device=dev).bfloat16()
        g = torch.randn(shape, device=dev).bfloat16()
        m, v = states4bit.zeros(shape, True, 128, dev), states4bit.zeros(shape, False, 128, dev, v_codes)

        def step(i, p=p, g=g, m=m, v=v):
            kernel.update(
                p, g, m, v, sq_out=sq, divisor=divisor, step=i + 1, lr=1e-5, betas=(0.9, 0.95), eps=1e-8,
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


def host_times(dev: torch.device, calls: int = 2000) -> None:
    """Microseconds of host time per call of the update and of its parts, on a (4,096,) tensor (GPU time per call
    ~10 us: the launch queue never fills, so the loop's wall time is the host's)."""
    import time

    shape = (4096,)
    p, g = torch.randn(shape, device=dev).bfloat16(), torch.randn(shape, device=dev).bfloat16()
    m, v = OptimState4bit.zeros(shape, True, 128, dev), OptimState4bit.zeros(shape, False, 128, dev)
    sq, divisor = torch.zeros((), device=dev), torch.ones((), device=dev)
    partial = torch.zeros(8, device=dev)
    kwargs = dict(sq_out=sq, divisor=divisor, lr=1e-5, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    step = torch.zeros(())

    def whole(i):
        adam4bit.update(p, g, m, v, step=i + 1, seed=i, **kwargs)

    def launch(i):
        adam4bit._adamw4bit[(8,)](
            p, g, m.codes, m.scale, v.codes, v.scale, m.qmap, v.qmap, v.qmap, partial, divisor, 32,
            1e-5, 0.9, 0.95, 1e-8, 0.0, 1e-5, 0.5, i, STOCHASTIC=True, STATES_SR=True, V_ROOT4=True, V_POW2=False,
            ROWS=adam4bit.ROWS, BLOCK=adam4bit.BLOCK, PHILOX_ROUNDS=adam4bit.PHILOX_ROUNDS, BINARY=False,
            num_warps=adam4bit.WARPS,
        )  # fmt: skip

    parts = {
        "adam4bit.update (whole)": whole,
        "its Triton launch alone": launch,
        "the norm's sum into its slot (torch.sum(..., out=sq))": lambda i: torch.sum(partial, 0, out=sq),
        "the norm's sum and add, as before (sq += partial[:8].sum())": lambda i: sq.add_(partial[:8].sum()),
        "one torch op (sq.add_(1.0))": lambda i: sq.add_(1.0),
        "a host tensor's += 1 (the step count)": lambda i: step.add_(1),
    }
    for name, fn in parts.items():
        for i in range(50):
            fn(i)
        torch.cuda.synchronize()
        start = time.perf_counter()
        for i in range(calls):
            fn(i)
        host = (time.perf_counter() - start) / calls * 1e6
        torch.cuda.synchronize()
        print(f"host time per call, {name}: {host:.1f} us")


if __name__ == "__main__":
    main()
