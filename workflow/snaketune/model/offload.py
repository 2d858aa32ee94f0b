"""Checkpointed layers' inputs in host memory until backward (`train.offload_activations`).

With gradient checkpointing a decoder layer keeps only its input for backward, which recomputes the layer from it:
a*hidden bytes per token and layer (8 KiB for the 7B), 3.75 GiB for 30 layers of one 16,384-token row, the largest
term of a long row's memory after the weights (snaketune.plan.memory). Here that input waits in pinned host memory:
`checkpoint` runs torch's non-reentrant checkpoint inside a saved-tensor hook whose pack copies to the host and
whose unpack copies back. The checkpoint saves the layer's inputs as saved tensors before it installs its own hook
for what the layer saves inside (torch.utils.checkpoint: `_CheckpointFrame.save_inputs`, then `_checkpoint_hook`),
so the outer hook sees the inputs only: what the layer saves during its recompute stays on the GPU, as without
offload. TRL documents the same idea (activation offloading) for long rows; torchtune's OffloadActivations offloads
every saved tensor instead.

The copies are asynchronous on the compute stream (pinned memory, non_blocking): each layer waits for its input's
copy to the GPU in backward, not overlapped with compute (the plan's OFFLOAD_ACTIVATIONS_SPEED is an assumption).
PyTorch's caching host allocator keeps the pinned blocks between steps and records each copy's event before a block
is reused. On CPU ranks the "host" copy is a plain copy: the same path runs, so its losses and gradients can be
compared with checkpointing alone anywhere (tests/test_offload.py).
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint


def _pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return tensor.device, host


def _unpack(packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
    device, host = packed
    if device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)


class InputsOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Every tensor autograd saves while this is the innermost hook goes to host memory and comes back when
    backward unpacks it (counted in `packed`, for the tests and the log)."""

    def __init__(self) -> None:
        self.packed = 0
        super().__init__(self._counting_pack, _unpack)

    def _counting_pack(self, tensor: torch.Tensor):
        self.packed += 1
        return _pack(tensor)


def checkpoint(function, *args, hooks: InputsOnHost | None = None, **kwargs):
    """torch's non-reentrant checkpoint of `function(*args, **kwargs)` whose saved inputs wait in host memory: the
    drop-in for transformers' `_gradient_checkpointing_func` (called as checkpoint(partial(forward, ...), hidden))."""
    with hooks if hooks is not None else InputsOnHost():
        return torch_checkpoint(function, *args, use_reentrant=False, **kwargs)


def offload_inputs(layers) -> InputsOnHost:
    """Make every checkpointed layer of `layers` (transformers' GradientCheckpointingLayer with
    `gradient_checkpointing` set) keep its input in host memory; returns the hook they share."""
    hooks = InputsOnHost()
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            layer._gradient_checkpointing_func = functools.partial(checkpoint, hooks=hooks)
    return hooks
