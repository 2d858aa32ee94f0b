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

The copies run on a copy stream of their own, beside the compute: in forward, the copy to the host waits for the
layer's input to be computed and the input's memory is not reused before the copy is done (`record_stream`); in
backward, unpacking a layer's input also starts the copy back of the layer before it (backward visits the layers in
reverse), so that copy overlaps this layer's recompute and backward, and the compute stream waits for the copy's
event only where it needs the input. One extra layer input is on the GPU at a time. Before (copies on the compute
stream, nothing overlapped) each layer waited for its input's round trip. PyTorch's caching host allocator keeps
the pinned blocks between steps and records each copy's event before a block is reused. On CPU ranks the "host"
copy is a plain copy and nothing is copied back: the same bookkeeping runs, so its losses and gradients, and which
input is fetched ahead, can be compared with checkpointing alone anywhere (tests/test_offload.py).
"""

from __future__ import annotations

import functools
import weakref

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint


def _pack(tensor: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
    """A host copy of `tensor` (pinned where it is on the GPU), copied on the current stream."""
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=tensor.is_cuda)
    host.copy_(tensor, non_blocking=tensor.is_cuda)
    return tensor.device, host


class _Saved:
    """One offloaded input: its host copy, the copy back once started (`back`, ready at `event`), and the input
    packed just before it in the same forward (a weak reference: the one backward reaches next)."""

    __slots__ = ("__weakref__", "back", "before", "device", "event", "host", "unpacked")

    def __init__(self, device: torch.device, host: torch.Tensor, before: _Saved | None) -> None:
        self.device, self.host = device, host
        self.before = weakref.ref(before) if before is not None else None
        self.back: torch.Tensor | None = None
        self.event = None
        self.unpacked = False


class InputsOnHost(torch.autograd.graph.saved_tensors_hooks):
    """Every tensor autograd saves while this is the innermost hook goes to host memory and comes back when
    backward unpacks it, the one packed before it fetched ahead (counted in `packed` and `fetched_ahead`, for the
    tests and the log)."""

    def __init__(self) -> None:
        self.packed = 0
        self.fetched_ahead = 0
        self._stream = None
        self._last: weakref.ref | None = None
        super().__init__(self._pack, self._unpack)

    def _copy_stream(self, device: torch.device):
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, tensor: torch.Tensor) -> _Saved:
        self.packed += 1
        last = self._last() if self._last is not None else None
        before = last if last is not None and not last.unpacked else None  # the same forward's previous input
        if tensor.is_cuda:
            stream = self._copy_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(stream):
                device, host = _pack(tensor)
            tensor.record_stream(stream)  # its memory is not reused before the copy has read it
        else:
            device, host = _pack(tensor)
        saved = _Saved(device, host, before)
        self._last = weakref.ref(saved)
        return saved

    def _fetch(self, saved: _Saved) -> None:
        """Start the copy back (on the copy stream, after the copy out), unless it has started."""
        if saved.back is not None:
            return
        if saved.device.type == "cpu":
            saved.back = saved.host
            return
        stream = self._copy_stream(saved.device)
        with torch.cuda.stream(stream):
            saved.back = saved.host.to(saved.device, non_blocking=True)
            saved.event = stream.record_event()

    def _unpack(self, saved: _Saved) -> torch.Tensor:
        self._fetch(saved)
        tensor = saved.back
        saved.back, saved.unpacked = None, True
        if saved.event is not None:
            current = torch.cuda.current_stream(saved.device)
            current.wait_event(saved.event)
            tensor.record_stream(current)  # allocated on the copy stream, used (and freed) on this one
            saved.event = None
        before = saved.before() if saved.before is not None else None
        if before is not None and not before.unpacked:
            self._fetch(before)  # backward's next layer: its input on its way while this layer runs
            self.fetched_ahead += 1
        return tensor


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
