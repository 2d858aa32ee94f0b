"""The training loss: sum of next-token cross-entropy over the targets that carry a loss.

Two implementations of the same number:
- `token_loss_sum` (snaketune.model.batching): logits from the model's lm_head, then cross-entropy in fp32. For
  DeepSeek's 102,400-token vocabulary that materializes, per micro-batch token, the bf16 logits, their fp32
  upcast and log-softmax and, in backward, fp32 gradients of the same size (12+ bytes per token and vocabulary
  entry: 4.7 GiB at 4,096 tokens).
- `fused_linear_cross_entropy`: the lm_head matmul and the cross-entropy chunk by chunk of tokens, with the
  gradients of the hidden states and of the lm_head weight computed in the forward pass (the method of
  Liger-Kernel's FusedLinearCrossEntropy, Hsu et al. 2024, in plain PyTorch): at most one chunk of logits
  exists at a time (snaketune.model.sizes.CHUNK_BYTES of fp32), and backward only scales the stored gradients. Same FLOPs as the
  plain path (one forward and two backward matmuls).
- `logits_cross_entropy` (train.loss_kernel `triton`): the first path's cross-entropy as two Triton kernels on the
  bf16 logits, without their fp32 upcast, log-softmax or fp32 gradient: the forward keeps one logsumexp per token,
  the backward writes the gradient over the logits themselves (2 bytes per token and vocabulary entry in all,
  against 12; 0.8 against 4.7 GiB at 4,096 tokens) and reads and writes them once each. The same fp32 arithmetic
  as F.cross_entropy on the upcast logits; tests/test_kernels.py compares both on a GPU.
"""

from __future__ import annotations

import functools

import torch

from snaketune.model.batching import IGNORE
from snaketune.model.sizes import chunk_tokens

CE_BLOCK = 16384
"""Vocabulary entries per iteration of the Triton cross-entropy's row loop (bench/cross_entropy.py)."""
CE_WARPS = 8


def causal_targets(labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, seq) next-token targets aligned with the inputs: position t predicts labels[t + 1]; IGNORE where
    that label is ignored, where t + 1 starts another packed conversation (position id 0), and at the end."""
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    targets[:, :-1][position_ids[:, 1:] == 0] = IGNORE
    return targets


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk, need_hidden_grad, need_weight_grad):
        n = hidden.shape[0]
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        grad_hidden = torch.empty_like(hidden) if need_hidden_grad else None
        one_chunk = n <= chunk
        grad_weight = None
        if need_weight_grad and not one_chunk:
            # Summed over chunks in fp32; each chunk's product is rounded to the weight's dtype once.
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, n, chunk):
            h = hidden[start : start + chunk]
            t = targets[start : start + chunk]
            valid = t != IGNORE
            safe = torch.where(valid, t, 0)
            logits = (h @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, safe[:, None]).squeeze(1)
            loss += torch.where(valid, lse - picked, 0.0).sum()
            if not (need_hidden_grad or need_weight_grad):
                continue
            # d(sum of losses)/d(logits) = softmax - one_hot(target), zero on ignored rows; in place.
            grad = logits.sub_(lse[:, None]).exp_()
            grad.scatter_add_(1, safe[:, None], torch.full_like(lse[:, None], -1.0))
            grad.mul_(valid[:, None])
            grad = grad.to(hidden.dtype)
            if need_hidden_grad:
                grad_hidden[start : start + chunk] = grad @ weight
            if need_weight_grad:
                if one_chunk:
                    grad_weight = grad.t() @ h
                else:
                    grad_weight.add_(grad.t() @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        ctx.save_for_backward(grad_hidden, grad_weight)
        return loss

    @staticmethod
    def backward(ctx, grad_output):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_output.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_output.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Sum over rows of cross_entropy(hidden @ weight.T, targets) in fp32, IGNORE rows excluded.

    hidden: (tokens, hidden) final hidden states; weight: (vocab, hidden) lm_head weight; targets: (tokens,)."""
    chunk = chunk or chunk_tokens(weight.shape[0])
    grad_on = torch.is_grad_enabled()
    return _FusedLinearCrossEntropy.apply(
        hidden,
        weight,
        targets,
        chunk,
        grad_on and hidden.requires_grad,
        grad_on and weight.requires_grad,
    )


@functools.cache
def _triton_cross_entropy():
    """(forward, backward) Triton kernels, one program per token row of the logits."""
    import triton
    import triton.language as tl

    @triton.jit
    def cross_entropy_forward(
        logits_ptr, stride, targets_ptr, loss_ptr, lse_ptr, n_cols, ignore, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        top = float("-inf")
        total = 0.0
        for start in range(0, n_cols, BLOCK):  # online logsumexp in fp32
            x = tl.load(base + start + cols, mask=start + cols < n_cols, other=float("-inf")).to(tl.float32)
            new_top = tl.maximum(top, tl.max(x, 0))
            total = total * tl.exp(top - new_top) + tl.sum(tl.exp(x - new_top), 0)
            top = new_top
        lse = top + tl.log(total)
        tl.store(lse_ptr + row, lse)
        target = tl.load(targets_ptr + row)
        valid = target != ignore
        picked = tl.load(base + tl.where(valid, target, 0)).to(tl.float32)
        tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))

    @triton.jit
    def cross_entropy_backward(
        logits_ptr, stride, targets_ptr, lse_ptr, scale_ptr, n_cols, ignore, BLOCK: tl.constexpr
    ):
        # d(scale x loss)/d(logits) = scale x (softmax - one_hot(target)), zero on ignored rows, over the logits.
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        target = tl.load(targets_ptr + row)
        scale = tl.where(target != ignore, tl.load(scale_ptr).to(tl.float32), 0.0)
        lse = tl.load(lse_ptr + row)
        for start in range(0, n_cols, BLOCK):
            offs = start + cols
            mask = offs < n_cols
            x = tl.load(base + offs, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(offs == target, 1.0, 0.0)
            tl.store(base + offs, (grad * scale).to(logits_ptr.dtype.element_ty), mask=mask)

    return cross_entropy_forward, cross_entropy_backward


class _LogitsCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets):
        n, vocab = logits.shape
        forward, _ = _triton_cross_entropy()
        loss = torch.empty(n, dtype=torch.float32, device=logits.device)
        lse = torch.empty(n, dtype=torch.float32, device=logits.device)
        block = min(CE_BLOCK, 1 << (vocab - 1).bit_length())
        forward[(n,)](
            logits, logits.stride(0), targets, loss, lse, vocab, IGNORE, BLOCK=block, num_warps=CE_WARPS
        )
        ctx.save_for_backward(logits, targets, lse)
        ctx.block = block
        return loss.sum()

    @staticmethod
    def backward(ctx, grad_output):
        logits, targets, lse = ctx.saved_tensors
        _, backward = _triton_cross_entropy()
        n, vocab = logits.shape
        scale = grad_output.detach().float().reshape(1)
        # In place: after the loss nothing reads the logits (the lm_head's backward needs its input and weight,
        # not its output), and the graph is not run backward twice.
        backward[(n,)](
            logits, logits.stride(0), targets, lse, scale, vocab, IGNORE, BLOCK=ctx.block, num_warps=CE_WARPS
        )
        return logits, None


def logits_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Sum over rows of cross_entropy(logits, targets) in fp32, IGNORE rows excluded, by the Triton kernels above
    (CUDA). logits: (tokens, vocab) straight from the lm_head, consumed (their memory becomes their gradient);
    targets: (tokens,) int64."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return _LogitsCrossEntropy.apply(logits, targets.contiguous())
