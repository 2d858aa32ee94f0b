"""FP8 training of the decoder's linear layers (`train.fp8`): torchao's float8 training (`Float8Linear`).

Each converted `nn.Linear` computes its three matmuls (output, input gradient, weight gradient) from float8 copies
of its operands: the input and weight in e4m3, the output gradient in e5m2, each scaled by one factor per tensor
from its absolute maximum at that moment (torchao's "tensorwise" dynamic recipe, the one torchtitan measured +28%
with on Llama-3.1-8B, with torch.compile). The weights, their gradients and the optimizer stay as they were (bf16
or fp32 masters), so everything else in training is unchanged: this is an arithmetic switch, not a storage one.

- `tensorwise` needs a GPU with FP8 tensor cores: compute capability 8.9 (Ada, the RTX 4090) or newer (Hopper,
  Blackwell); elsewhere the run stops with an error naming the key.
- `emulated` runs the same scaling and rounding with matmuls in the original precision (torchao's `emulate`): any
  device, slower than no FP8 at all, for checking on a CPU how the rounding moves the losses.
- Converted: the `nn.Linear` layers inside the decoder whose two dimensions are multiples of 16 (what FP8 matmuls
  take; torchtitan filters the same way), LoRA's frozen base layers included. Not converted: the lm_head (the loss
  kernels read its weight directly, and the logits' precision matters most), LoRA's small adapter matrices, layers
  of other shapes (the builtin tiny model's 344-wide MLP).
- Not with QLoRA (its base layers are 4-bit) nor ZeRO-3 (its partitioned weights were not tested with float8's
  weight casts): both refused by `check`.

Speed needs `train.compile`, which compiles each decoder layer and fuses the scaling and casts into its kernels
(torchtitan's setting). On an H200 (bench/RESULTS.md, "The host-bound step"): the 7B's 24-layer full fine-tune at
18,495 tokens/s compiled (PaLM MFU 0.60 against the bf16 peak; eager bf16 15,643), LoRA of 30 layers 14,791-19,559.
Eagerly each cast is its own kernel and every matmul passes through torchao's tensor subclass on the host: 2.3x
slower than bf16 (the engine warns), with the same losses (within 0.4% of bf16's; "FP8 matmuls").
"""

from __future__ import annotations

import torch

from snaketune.config.choices import FP8 as SETTINGS

MIN_CAPABILITY = (8, 9)
"""FP8 tensor cores: Ada (8.9), Hopper (9.0) and newer."""
ALIGN = 16
"""Both dimensions of an FP8 matmul's operands must be multiples of 16 (cuBLASLt's _scaled_mm)."""
SKIPPED_NAMES = ("lm_head", "lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


def check(setting: str, device: torch.device, *, stage: int = 0, quantize: str = "none") -> None:
    """ValueError naming `train.fp8` where the setting cannot run here."""
    if setting == "none":
        return
    if setting not in SETTINGS:
        raise ValueError(
            f"config key 'train.fp8': {setting!r} is not allowed; allowed: {', '.join(SETTINGS)}"
        )
    if quantize != "none":
        raise ValueError(
            f"config key 'train.fp8': {setting!r} with train.lora.quantize {quantize!r}: the base layers are "
            "4-bit already; allowed with QLoRA: none"
        )
    if stage == 3:
        raise ValueError(
            f"config key 'train.fp8': {setting!r} under ZeRO stage 3 is not supported (untested with partitioned "
            "weights); use ZeRO-0/2 (config/deepspeed/zero0.json, zero2.json) or train.fp8: none"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as e:
        raise ValueError(f"config key 'train.fp8': {setting!r} needs torchao (requirements.txt): {e}") from e
    if setting == "tensorwise":
        if device.type != "cuda":
            raise ValueError(
                f"config key 'train.fp8': 'tensorwise' needs a CUDA GPU with FP8 tensor cores (compute capability "
                f">= 8.9: RTX 4090, H100, H200); this run is on {device.type}. Allowed here: none, emulated"
            )
        capability = torch.cuda.get_device_capability(device)
        if capability < MIN_CAPABILITY:
            raise ValueError(
                f"config key 'train.fp8': 'tensorwise' needs compute capability >= 8.9 (FP8 tensor cores); "
                f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}. Allowed here: none, "
                "emulated"
            )


def eligible(module: torch.nn.Module, name: str) -> bool:
    """Whether torchao converts this module (the module docstring says which and why)."""
    if type(module) is not torch.nn.Linear:  # exactly Linear: not peft's wrappers, not a converted layer
        return False
    if any(part in SKIPPED_NAMES for part in name.split(".")):
        return False
    return module.in_features % ALIGN == 0 and module.out_features % ALIGN == 0


def apply(net: torch.nn.Module, setting: str) -> tuple[int, int]:
    """Convert the eligible linear layers in place; (converted, linear layers in all)."""
    linear = sum(isinstance(m, torch.nn.Linear) for m in net.modules())
    if setting == "none":
        return 0, linear
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    converted = sum(eligible(m, n) for n, m in net.named_modules())
    if converted:
        convert_to_float8_training(
            net, module_filter_fn=eligible, config=Float8LinearConfig(emulate=setting == "emulated")
        )
    return converted, linear
