"""Fused kernels for the decoder's pointwise work: RMSNorm, RoPE and SwiGLU from Liger-Kernel (Triton).

The matmuls of a step are cuBLAS/FlashAttention already; what runs unfused is the rest of each layer: two
RMSNorms (fp32 upcast, mean of squares, scale), the rotary embedding of q and k (cat/neg/mul/add), and
SiLU(gate) x up, each a few elementwise kernels that read and write activations from HBM. Liger's kernels do
each in one pass and save less for backward. The math is the same (Liger's `llama` casting mode is
transformers' LlamaRMSNorm); tests/test_kernels.py checks losses and gradients against the plain path on a
GPU, and bench/train_throughput.py measures the switch (bench/RESULTS.md).

`train.kernels`: `torch` (transformers' modules as they are), `liger`, `auto` (liger where it runs: a CUDA
device with liger-kernel and Triton installed; requirements-kernels.txt). Liger needs Triton, which the CPU
build of torch does not bring, so CPU ranks always run `torch`.
"""

from __future__ import annotations

import importlib.util
from typing import TYPE_CHECKING

from snaketune.config.choices import KERNELS  # the values train.kernels allows

if TYPE_CHECKING:  # the memory plan imports this module and must not need torch
    import torch

SUPPORTED_MODEL_TYPES = ("llama",)
"""Model types whose modules Liger's llama patch replaces (deepseek-llm-7b-base is `llama`)."""


def liger_available(device: torch.device) -> tuple[bool, str]:
    """(usable, why not) for Liger's kernels on `device`."""
    if device.type != "cuda":
        return False, f"needs a CUDA device (this rank runs on {device.type})"
    missing = _missing_packages()
    if missing:
        return False, f"needs the {missing[0]} package (pip install --no-deps -r requirements-kernels.txt)"
    return True, ""


def _missing_packages() -> list[str]:
    return [m for m in ("triton", "liger_kernel") if importlib.util.find_spec(m) is None]


def planned(mode: str) -> bool:
    """Whether a GPU rank of this environment runs Liger's kernels under `mode`: what the memory plan assumes
    (it runs before any rank, often on a machine without a GPU, so `auto` counts on the packages, not a
    device). A rank whose environment lacks them uses less-fused modules and more memory than planned only
    where the plan's machine has the packages and the GPU nodes do not."""
    if mode == "liger":
        return True
    return mode == "auto" and not _missing_packages()


def triton_planned(mode: str) -> bool:
    """The same for Triton alone (train.loss_kernel, train.optimizer_kernel: `auto`, `triton` or `torch`)."""
    return mode == "triton" or (mode == "auto" and importlib.util.find_spec("triton") is not None)


def resolve(mode: str, device: torch.device, model_type: str) -> str:
    """`auto` -> `liger` where it runs and the model type is supported, else `torch`; `liger` where it cannot
    run is an error naming the key and why."""
    if mode not in KERNELS:
        raise ValueError(f"config key 'train.kernels': {mode!r}; allowed: {', '.join(KERNELS)}")
    if mode == "torch":
        return "torch"
    usable, why = liger_available(device)
    if usable and model_type not in SUPPORTED_MODEL_TYPES:
        usable, why = (
            False,
            f"supports model_type {', '.join(SUPPORTED_MODEL_TYPES)} (this model: {model_type!r})",
        )
    if mode == "liger" and not usable:
        raise ValueError(f"config key 'train.kernels': liger {why}; allowed here: auto, torch")
    return "liger" if usable else "torch"


def apply(net: torch.nn.Module, mode: str) -> None:
    """Swap the RMSNorm, RoPE and SwiGLU of `net` (a transformers causal LM, before LoRA wraps it) for Liger's.
    The loss stays snaketune's (fused cross-entropy or plain): Liger's own loss patches are not applied."""
    if mode != "liger":
        return
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(
        rope=True,
        rms_norm=True,
        swiglu=True,
        cross_entropy=False,
        fused_linear_cross_entropy=False,
        model=net,
    )
