"""Attention over packed rows that never crosses a conversation boundary, without a mask tensor.

A packed row holds several conversations; position ids restart at 0 for each (snaketune.data.tokenization).
The plain path (`train.attention: sdpa`) gives SDPA a (batch, 1, L, L) block-diagonal mask
(snaketune.model.batching.packed_attention_mask), which keeps PyTorch off its FlashAttention kernel. This module
registers an attention function with transformers (`AttentionInterface`, name `IMPLEMENTATION`) that takes
the conversations' boundaries as cumulative lengths over the flattened batch (`cu_seqlens`, as
FlashAttention's varlen API does) and, on CUDA in bf16/fp16, calls PyTorch's FlashAttention varlen kernel with
causal masking inside each conversation: `aten::_flash_attention_forward` directly, whose backward is autograd's own
(FlashAttentionBackward0), the op that `torch.nn.attention.varlen.varlen_attn` (torch >= 2.10) wraps in a Python
custom op. The wrapper (torch.library dispatch, a Python autograd function, one more kernel per call for a dropout
state it never uses) cost the host as much as a layer's seven matmuls: a py-spy sample of the 7B's step in backward
on an H200, where the host bounds the step (bench/RESULTS.md, issue #26).
Elsewhere (CPU ranks, fp32) it runs SDPA with the equivalent block mask, so the same model code runs on the
embedded default and its result is the plain path's.

Pads are position 0 each, hence one-token conversations of their own: real tokens never see them.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

IMPLEMENTATION = "snaketune_packed"
"""The name under which the function is registered (the model's config._attn_implementation)."""
ATTENTION_MODES = ("auto", "varlen", "sdpa")


@functools.cache
def _torch_has_varlen() -> bool:
    """torch >= 2.10 (torch.nn.attention.varlen): the release whose _flash_attention_forward this module calls."""
    try:
        from torch.nn.attention.varlen import varlen_attn  # noqa: F401
    except ImportError:
        return False
    return True


def kernel_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the FlashAttention varlen kernel can run here (CUDA, half precision, torch >= 2.10)."""
    return (
        device.type == "cuda"
        and torch.cuda.is_available()
        and dtype in (torch.bfloat16, torch.float16)
        and _torch_has_varlen()
    )


def resolve(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """`auto` -> `varlen` where the kernel exists, else `sdpa`; `varlen` and `sdpa` as given."""
    if mode not in ATTENTION_MODES:
        raise ValueError(f"config key 'train.attention': {mode!r}; allowed: {', '.join(ATTENTION_MODES)}")
    if mode == "auto":
        return "varlen" if kernel_available(device, dtype) else "sdpa"
    return mode


def describe(mode: str, device: torch.device, dtype: torch.dtype) -> str:
    """What computes the attention of a run with the resolved `mode` here, as its log and summary say it."""
    if mode == "sdpa":
        return "SDPA with a block-diagonal mask"
    if kernel_available(device, dtype):
        return "FlashAttention varlen (aten::_flash_attention_forward)"
    return "varlen boundaries, block-masked SDPA (no varlen kernel on this device)"


def segments(position_ids: torch.Tensor, lengths: Sequence[int] | None = None) -> torch.Tensor:
    """int32 cumulative lengths (n + 1,) of the conversations in a (batch, seq) block of position ids,
    flattened row after row: a conversation starts at each row's start and wherever a position id does not
    follow its predecessor by 1 (transformers' find_packed_sequence_indices rule). With the rows' real
    `lengths`, each row's padding is one segment (pads carry no loss and come after every real token, so
    letting them see each other changes nothing) instead of one per pad. Computed on the host from the
    collated CPU tensor, so it costs no device sync."""
    pos = position_ids.cpu().numpy()
    starts = np.ones(pos.shape, dtype=bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if lengths is not None:
        for row, n in enumerate(lengths):
            starts[row, n + 1 :] = False
    flat = np.flatnonzero(starts.reshape(-1))
    return torch.from_numpy(np.append(flat, pos.size).astype(np.int32))


def _segment_ids(cu_seqlens: torch.Tensor, shape: tuple[int, int], device: torch.device) -> torch.Tensor:
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).to(device=device, dtype=torch.long)
    ids = torch.repeat_interleave(torch.arange(len(lengths), device=device), lengths)
    return ids.view(shape)


def packed_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    cu_seqlens: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: query (batch, heads, seq, dim), key/value (batch, kv_heads, seq, dim);
    returns (batch, seq, heads, dim). `cu_seqlens` / `max_seqlen` come through the model's forward kwargs."""
    if cu_seqlens is None:
        raise ValueError(
            f"attention {IMPLEMENTATION!r} needs cu_seqlens (snaketune.model.attention.segments) in the forward call"
        )
    b, heads, length, dim = query.shape
    kv_heads = key.shape[1]
    if kernel_available(query.device, query.dtype) and dropout == 0.0:
        if kv_heads != heads:  # grouped-query attention: one copy of each KV head per query head
            key = key.repeat_interleave(heads // kv_heads, dim=1)
            value = value.repeat_interleave(heads // kv_heads, dim=1)
        q = query.transpose(1, 2).reshape(b * length, heads, dim)
        k = key.transpose(1, 2).reshape(b * length, heads, dim)
        v = value.transpose(1, 2).reshape(b * length, heads, dim)
        cu = cu_seqlens.to(query.device, torch.int32, non_blocking=True)
        longest = int(max_seqlen or length)
        # (query, key, value, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p, is_causal, return_debug_mask): what
        # varlen_attn passes for causal attention without dropout; its first output is the attention.
        out = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, True, False, scale=scaling
        )[0]
        return out.view(b, length, heads, dim), None
    ids = _segment_ids(cu_seqlens, (b, length), query.device)
    causal = torch.ones(length, length, dtype=torch.bool, device=query.device).tril()
    mask = (ids[:, None, :, None] == ids[:, None, None, :]) & causal
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=mask,
        dropout_p=dropout,
        scale=scaling,
        enable_gqa=kv_heads != heads,
    )
    return out.transpose(1, 2).contiguous(), None


def register() -> str:
    """Register `packed_attention` with transformers (idempotent) and return its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(IMPLEMENTATION, packed_attention)
    return IMPLEMENTATION
