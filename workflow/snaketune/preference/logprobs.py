"""Log-probabilities of whole replies and the preference losses built on them (DPO, IPO).

A preference pair is one packed row, ``chosen`` then ``rejected`` (each the conversation so far and one reply,
position ids restarting at 0 for the second), labels only on the two replies (snaketune.data.pairs). One forward
pass gives both replies' summed log-probabilities; varlen attention (or the block mask) keeps them apart.

`token_logprobs` computes log p(target) per token from the final hidden states and the lm_head weight in
chunks of tokens, never holding the [tokens, vocabulary] logits (the method of snaketune.model.losses, with an
upstream gradient per token: backward recomputes one chunk of logits at a time, one extra lm_head matmul).
The reference stage (snaketune.preference.reference), the preference trainer (snaketune.preference.dpo) and the evaluation all
use `pair_logprobs`, so the cached reference log-probabilities are the ones the trainer would compute.

The losses follow Rafailov et al. 2023 (DPO) and Azar et al. 2023 (IPO), as TRL implements them: with
h = (log pi(y_w) - log ref(y_w)) - (log pi(y_l) - log ref(y_l)), DPO is -log sigmoid(beta * h), IPO is
(h - 1 / (2 beta))^2 on length-averaged log-probabilities. Implicit rewards are beta times each reply's log
ratio; a pair counts as ranked right when the chosen reward is larger.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from snaketune.model import attention, batching
from snaketune.model.batching import IGNORE
from snaketune.model.build import PackedLM, causal_lm, lm_inputs
from snaketune.model.losses import causal_targets
from snaketune.model.sizes import chunk_tokens

LOSSES = ("dpo", "ipo")


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, chunk):
        n = hidden.shape[0]
        out = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.zeros(n, dtype=torch.float32, device=hidden.device)
        for start in range(0, n, chunk):
            t = targets[start : start + chunk]
            valid = t != IGNORE
            logits = (hidden[start : start + chunk] @ weight.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            picked = logits.gather(1, torch.where(valid, t, 0)[:, None]).squeeze(1)
            out[start : start + chunk] = torch.where(valid, picked - lse, 0.0)
            lse_all[start : start + chunk] = lse
        ctx.save_for_backward(hidden, weight, targets, lse_all)
        ctx.chunk = chunk
        return out

    @staticmethod
    def backward(ctx, grad_out):
        hidden, weight, targets, lse_all = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.zeros_like(hidden) if need_hidden else None
        grad_weight = (
            torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
        )
        for start in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[start : start + ctx.chunk]
            t = targets[start : start + ctx.chunk]
            valid = t != IGNORE
            coef = torch.where(valid, grad_out[start : start + ctx.chunk].float(), 0.0)
            # d log p(t) / d logits = one_hot(t) - softmax, times the upstream gradient; in place.
            grad = (h @ weight.t()).float().sub_(lse_all[start : start + ctx.chunk, None]).exp_()
            grad.mul_(-coef[:, None]).scatter_add_(1, torch.where(valid, t, 0)[:, None], coef[:, None])
            grad = grad.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start : start + ctx.chunk] = grad @ weight
            if need_weight:
                grad_weight.add_(grad.t() @ h)
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def token_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """(tokens,) fp32 log p(targets) under softmax(hidden @ weight.T), 0 where the target is IGNORE."""
    return _TokenLogprobs.apply(hidden, weight, targets, chunk or chunk_tokens(weight.shape[0]))


def reply_sums(values: torch.Tensor, targets: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """(batch, 2): `values` (batch, seq) summed over the labelled targets of each row's two sequences (the
    sequence a target belongs to is the one its predicting position is in; pads after the second sequence
    carry no target)."""
    segment = ((position_ids == 0).cumsum(dim=1) - 1).clamp(0, 1)
    masked = torch.where(targets != IGNORE, values, torch.zeros((), dtype=values.dtype, device=values.device))
    return torch.zeros(values.shape[0], 2, dtype=values.dtype, device=values.device).scatter_add_(
        1, segment, masked
    )


def pair_logprobs(
    net: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    packed_attention: bool,
    fused: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed log-probabilities (batch, 2) of the chosen and rejected replies of each row, and their token
    counts (batch, 2). `net` is a causal LM (or peft model); `packed_attention`: its attention is
    snaketune.model.attention's and `cu_seqlens` the rows' boundaries; else SDPA with the block mask. `fused`: the
    chunked log-probabilities (not under ZeRO-3, whose lm_head weight only its own forward gathers)."""
    kwargs = lm_inputs(net, input_ids, position_ids, cu_seqlens, packed_attention=packed_attention)
    targets = causal_targets(labels, position_ids)
    if fused:
        lm = causal_lm(net)
        hidden = lm.model(**kwargs).last_hidden_state
        per_token = token_logprobs(hidden.flatten(0, 1), lm.lm_head.weight, targets.flatten()).view(
            targets.shape
        )
    else:
        logits = net(**kwargs).logits.float()
        picked = logits.gather(-1, torch.where(targets != IGNORE, targets, 0)[..., None]).squeeze(-1)
        per_token = picked - torch.logsumexp(logits, dim=-1)
    counts = reply_sums(torch.ones_like(per_token), targets, position_ids)
    return reply_sums(per_token, targets, position_ids), counts


def preference_loss(
    policy: torch.Tensor,
    reference: torch.Tensor,
    *,
    beta: float,
    loss: str = "dpo",
    counts: torch.Tensor | None = None,
    sft_weight: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-pair loss (batch,) and the implicit rewards of the chosen and the rejected reply (batch,) each.

    policy, reference: (batch, 2) summed log-probabilities of (chosen, rejected); counts: (batch, 2) reply
    tokens, needed by IPO (length-averaged log-probabilities, as TRL) and by `sft_weight`: that times the
    chosen reply's mean next-token loss is added (RPO, Pang et al. 2024; TRL's rpo_alpha), which keeps
    DPO from lowering the likelihood of the chosen replies along with the rejected ones."""
    if loss not in LOSSES:
        raise ValueError(f"config key 'preference.loss': {loss!r}; allowed: {', '.join(LOSSES)}")
    ratios = policy - reference
    rewards = beta * ratios.detach()
    if loss == "dpo":
        losses = -F.logsigmoid(beta * (ratios[:, 0] - ratios[:, 1]))
    else:
        if counts is None:
            raise ValueError("IPO needs the replies' token counts")
        avg = ratios / counts.clamp(min=1)
        losses = (avg[:, 0] - avg[:, 1] - 1 / (2 * beta)) ** 2
    if sft_weight:
        if counts is None:
            raise ValueError("preference.sft_weight needs the replies' token counts")
        losses = losses - sft_weight * policy[:, 0] / counts[:, 0].clamp(min=1)
    return losses, rewards[:, 0], rewards[:, 1]


class PreferenceModel(PackedLM):
    """What DeepSpeed runs in the preference stages: the causal LM plus the preference loss. forward(...) returns the
    summed loss of the micro-batch's pairs (the trainer normalizes by the pairs of the global batch) and the weighted
    sums the metrics are made of; without the reference log-probabilities, the pairs' own log-probabilities."""

    def __init__(
        self,
        net: torch.nn.Module,
        *,
        packed_attention: bool,
        fused: bool,
        beta: float,
        loss: str,
        sft_weight: float = 0.0,
    ):
        super().__init__(net, packed_attention=packed_attention)
        self.sft_weight = sft_weight
        self.fused = fused
        self.beta = beta
        self.loss = loss

    def forward(self, input_ids, labels, position_ids, reference=None, weights=None, cu_seqlens=None):
        """(the summed loss of the micro-batch's pairs, {metric: weighted sum, detached, float64}); without
        `reference`, (the pairs' summed log-probabilities, their token counts) instead, both (pairs, 2): the reference
        stage and the start check call the model the way training does. A tuple, not another type: DeepSpeed's
        ZeRO-3 hooks reach the tensors inside tuples and dicts only."""
        policy, counts = pair_logprobs(
            self.net,
            input_ids,
            labels,
            position_ids,
            cu_seqlens,
            packed_attention=self.packed_attention,
            fused=self.fused,
        )
        if reference is None:
            return policy, counts
        losses, chosen, rejected = preference_loss(
            policy, reference, beta=self.beta, loss=self.loss, counts=counts, sft_weight=self.sft_weight
        )
        w = weights.to(losses.dtype)
        margin = chosen - rejected
        sums = {
            "loss": (losses.detach() * w).sum().double(),
            "reward_accuracy": ((margin > 0).to(w.dtype) * w).sum().double(),
            "margin": (margin * w).sum().double(),
            "chosen_reward": (chosen * w).sum().double(),
            "rejected_reward": (rejected * w).sum().double(),
        }
        return (losses * w).sum(), sums


@torch.no_grad()
def split_logprobs(
    net: torch.nn.Module, split, *, pad_id: int, batch_size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, 2) summed log-probabilities (float64) and token counts of chosen and rejected of every pair of a
    split, `batch_size` pairs at a time, by a model outside a trainer (the evaluate stage scores its models so)."""
    param = next(net.parameters())
    varlen = attention.kernel_available(param.device, param.dtype)
    if varlen:
        causal_lm(net).set_attn_implementation(attention.register())
    sums, counts = [], []
    try:
        for start in range(0, len(split), batch_size):
            rows = np.arange(start, min(len(split), start + batch_size))
            batch = batching.device_batch(split, rows, pad_id, param.device, varlen=varlen)
            lp, n = pair_logprobs(net, **batch, packed_attention=varlen)
            sums.append(lp.double().cpu())
            counts.append(n.long().cpu())
    finally:
        if varlen:
            causal_lm(net).set_attn_implementation("sdpa")
    if not sums:
        return torch.zeros(0, 2, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.long)
    return torch.cat(sums), torch.cat(counts)


START_TOLERANCE = {
    torch.float32: {"per_token_mean": 1e-5, "per_reply": (1e-4, 1e-3)},
    torch.bfloat16: {"per_token_mean": 5e-3, "per_reply": (0.05, 0.5)},
}
"""How far the policy's log-probabilities at DPO's first step may be from the reference's, which the reference stage
computed with the same model, kernels, attention and precision (snaketune.preference.reference): they differ only
by rounding, where the batches differ (other rows beside a pair, other padding, so other matmul tilings). Two
bounds (`start_check`): the mean log-ratio per reply token over the micro-batch, where rounding errors of either
sign cancel and a systematic difference does not (another precision, quantized weights on one side: the bound is
well below what 4-bit against bf16 weights costs a token, bench/RESULTS.md), and each reply's own log-ratio,
at most a + b per token: (b, a) = `per_reply`, generous in bf16 (whose logits carry 8 bits), tight in fp32."""


def start_check(
    policy: torch.Tensor, reference: torch.Tensor, counts: torch.Tensor, *, dtype: torch.dtype, beta: float
) -> dict:
    """The policy's summed log-probabilities (rows, 2) against the reference's at the first DPO step, as sums over
    this rank's replies (the trainer adds them over the ranks and applies START_TOLERANCE[dtype]["per_token_mean"]):
    {"ratio_sum", "tokens", "replies", "violations" (replies over the per-reply bound), "max_abs_ratio",
    "worst_tokens", "dpo_loss_sum" (the DPO loss of these pairs at `beta`, ln 2 each when the ratios are 0),
    "pairs"}."""
    tol = START_TOLERANCE.get(dtype, START_TOLERANCE[torch.bfloat16])
    per_token, absolute = tol["per_reply"]
    signed = policy.double() - reference.double()
    ratios = signed.abs()
    allowed = per_token * counts.double() + absolute
    worst = int(torch.argmax(ratios / allowed)) if ratios.numel() else 0
    return {
        "ratio_sum": float(signed.sum()),
        "tokens": int(counts.sum()),
        "replies": int(ratios.numel()),
        "violations": int((ratios > allowed).sum()),
        "max_abs_ratio": float(ratios.max()) if ratios.numel() else 0.0,
        "worst_tokens": int(counts.flatten()[worst]) if ratios.numel() else 0,
        "dpo_loss_sum": float((-F.logsigmoid(beta * (signed[:, 0] - signed[:, 1]))).sum()),
        "pairs": len(signed),
    }


REFERENCE_COLUMNS = ("split", "row", "chosen", "rejected", "chosen_tokens", "rejected_tokens")
"""The reference stage's parquet file: one row per pair of each split, in row order."""


def read_reference(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """{split: {"logprobs": (rows, 2) float64, "tokens": (rows, 2) long}} from the reference stage's parquet file."""
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pydict()
    out = {}
    for split in ("train", "validation"):
        idx = [i for i, s in enumerate(table["split"]) if s == split]
        rows = [table["row"][i] for i in idx]
        if rows != list(range(len(rows))):
            raise ValueError(f"{path}: the {split} rows are not 0..n-1 in order; rerun the reference stage")
        out[split] = {
            "logprobs": torch.tensor(
                [[table["chosen"][i], table["rejected"][i]] for i in idx], dtype=torch.float64
            ),
            "tokens": torch.tensor(
                [[table["chosen_tokens"][i], table["rejected_tokens"][i]] for i in idx], dtype=torch.long
            ),
        }
    return out
