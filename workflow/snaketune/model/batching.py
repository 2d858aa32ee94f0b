"""Training data: the tokenized Arrow splits -> deterministic global batches -> per-rank micro-batches.

The order of samples depends only on the seed and the optimizer step, never on the world size or the
micro-batch size: global batch s is samples [s*G, (s+1)*G) of an endless stream whose epoch e is a
permutation seeded by (seed, e). Each rank takes a contiguous share of every global batch. That is what
makes 1 rank = N ranks, micro-batch x accumulation equivalence and exact resume hold: a checkpoint only
needs the step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from snaketune.model import attention

IGNORE = -100


@dataclass
class TokenizedSplit:
    """One split of the tokenized cache, with per-row counts precomputed for loss normalization."""

    input_ids: list[np.ndarray]
    labels: list[np.ndarray]
    position_ids: list[np.ndarray]
    loss_tokens: np.ndarray
    """Tokens per row that carry a loss after the causal shift (see `target_mask`)."""

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def lengths(self) -> np.ndarray:
        return np.fromiter((len(x) for x in self.input_ids), dtype=np.int64, count=len(self))

    def attention_units(self, rows) -> int:
        """Sum over the rows' conversations of their squared lengths: what PaLM's attention FLOPs grow with
        (snaketune.model.build.flop_counts). Pads are one-token sequences of their own and count nothing."""
        total = 0
        for r in rows:
            pos = self.position_ids[r]
            starts = np.flatnonzero(pos == 0)
            lengths = np.diff(np.append(starts, len(pos)))
            total += int((lengths.astype(np.int64) ** 2).sum())
        return total

    def lengths_of(self, rows) -> np.ndarray:
        """Real tokens of the given rows (pads excluded)."""
        return np.fromiter((len(self.input_ids[r]) for r in rows), dtype=np.int64, count=len(rows))


def load_split(path: str | Path) -> TokenizedSplit:
    """Read a split saved by the tokenize stage (datasets.save_to_disk) into numpy arrays."""
    import datasets  # deferred: import is slow and only ranks need it

    state = Path(path) / "state.json"
    if state.is_file() and not json.loads(state.read_text()).get("_data_files", True):
        # datasets writes a split without rows as no file at all, and cannot read that back (a small dataset can
        # leave no validation pair): an empty split.
        return TokenizedSplit([], [], [], np.zeros(0, dtype=np.int64))
    ds = datasets.load_from_disk(str(path)).with_format("numpy")
    cols = {c: list(ds[c]) for c in ("input_ids", "labels", "position_ids")}
    loss = np.array(
        [
            int(target_mask(lab, pos).sum())
            for lab, pos in zip(cols["labels"], cols["position_ids"], strict=True)
        ],
        dtype=np.int64,
    )
    return TokenizedSplit(cols["input_ids"], cols["labels"], cols["position_ids"], loss)


def target_mask(labels: np.ndarray, position_ids: np.ndarray) -> np.ndarray:
    """Which next-token targets (positions 1..n-1) carry a loss: labelled, and not the first token of a
    packed conversation (its predecessor belongs to another conversation)."""
    return (labels[1:] != IGNORE) & (position_ids[1:] != 0)


class GlobalOrder:
    """Endless deterministic stream of sample indices; epoch e is a permutation seeded by (seed, e)."""

    def __init__(self, n: int, seed: int):
        if n <= 0:
            raise ValueError("the training split is empty")
        self.n = n
        self.seed = seed
        self._epoch = -1
        self._perm = np.empty(0, dtype=np.int64)

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            gen = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = torch.randperm(self.n, generator=gen).numpy()
            self._epoch = epoch
        return self._perm

    def global_batch(self, step: int, size: int) -> np.ndarray:
        start = step * size
        out = np.empty(size, dtype=np.int64)
        for i in range(size):
            epoch, pos = divmod(start + i, self.n)
            out[i] = self._permutation(epoch)[pos]
        return out


def rank_share(batch: np.ndarray, rank: int, world: int) -> np.ndarray:
    per_rank = len(batch) // world
    return batch[rank * per_rank : (rank + 1) * per_rank]


def micro_batches(indices: np.ndarray, micro: int) -> list[np.ndarray]:
    return [indices[i : i + micro] for i in range(0, len(indices), micro)]


def padded_shard(n: int, rank: int, world: int, micro: int) -> list[tuple[list[int], list[float]]]:
    """A rank's contiguous share of rows 0 .. n-1 in micro-batches, each row with a weight, for a pass over a whole
    split (evaluation, the reference log-probabilities). Every rank runs the same number of forward passes, as
    ZeRO-3 needs (its weights are gathered by every rank together): a share short of ceil(n / world) rows is
    filled with row 0 at weight 0, which must add nothing to what is measured."""
    per_rank = -(-n // world)
    ids = list(range(rank * per_rank, min(n, (rank + 1) * per_rank)))
    weights = [1.0] * len(ids) + [0.0] * (per_rank - len(ids))
    ids += [0] * (per_rank - len(ids))
    return [(ids[i : i + micro], weights[i : i + micro]) for i in range(0, per_rank, micro)]


def collate(split: TokenizedSplit, indices: np.ndarray, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest row. Pads get label -100 and position id 0, so each pad is its own
    one-token sequence: causal attention keeps real tokens from ever seeing them."""
    width = max(len(split.input_ids[i]) for i in indices)
    n = len(indices)
    input_ids = torch.full((n, width), pad_id, dtype=torch.long)
    labels = torch.full((n, width), IGNORE, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    for row, i in enumerate(indices):
        k = len(split.input_ids[i])
        input_ids[row, :k] = torch.from_numpy(split.input_ids[i].astype(np.int64))
        labels[row, :k] = torch.from_numpy(split.labels[i].astype(np.int64))
        position_ids[row, :k] = torch.from_numpy(split.position_ids[i].astype(np.int64))
    return {"input_ids": input_ids, "labels": labels, "position_ids": position_ids}


def pad_id(tokenizer) -> int:
    """The id rows are padded with: pad, or eos when the tokenizer has none (pads carry no loss)."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def device_batch(split: TokenizedSplit, rows, pad: int, device, *, varlen: bool) -> dict[str, torch.Tensor]:
    """A collated micro-batch on `device`; with varlen attention also the conversations' boundaries
    (`cu_seqlens`, snaketune.model.attention.segments), computed on the host from the CPU tensors.

    On CUDA the host tensors are pinned first: a copy from pageable memory makes the host wait until the
    stream has run everything queued before it, i.e. the previous step's optimizer kernels, and only then
    launch this step's forward pass. Measured on one H200 (bench/RESULTS.md, issue #16): a 5.4-5.8 ms idle
    GPU gap per step before the embedding, 2% of the 24-layer full fine-tune's step; pinned, the GPU idles 2.0%
    of the step in all, against 4.3%."""
    cpu = collate(split, rows, pad)
    if varlen:
        cpu["cu_seqlens"] = attention.segments(cpu["position_ids"], split.lengths_of(rows).tolist())
    pin = torch.device(device).type == "cuda"
    return {k: (v.pin_memory() if pin else v).to(device, non_blocking=True) for k, v in cpu.items()}


def packed_attention_mask(position_ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Block-diagonal causal attention mask, (batch, 1, L, L) additive, for rows of packed conversations.

    transformers 5 builds this mask itself from position_ids, but only when the forward gets no
    attention_mask AND no KV cache; LlamaConfig's default use_cache=True makes the model create a
    DynamicCache even in training (without gradient checkpointing), and the packed detection is then
    skipped silently, so conversations attend to each other. Either call the model with ``use_cache=False``
    and no attention_mask, or pass this mask (4D masks are used as given, cache or not; works for eager and
    sdpa; flash-attention takes position_ids instead). A conversation starts wherever a position id does not
    follow its predecessor by 1, the rule transformers' ``find_packed_sequence_indices`` uses.
    ``dtype`` must be the attention's compute dtype (default float32): eager adds the mask to the scores.
    """
    dtype = dtype or torch.float32
    first = position_ids[:, :1] - 1
    segment = (torch.diff(position_ids, prepend=first, dim=-1) != 1).cumsum(-1)
    length = position_ids.shape[-1]
    causal = torch.ones(length, length, dtype=torch.bool, device=position_ids.device).tril()
    allowed = (segment[:, :, None] == segment[:, None, :]) & causal
    mask = torch.zeros(allowed.shape, dtype=dtype, device=position_ids.device)
    mask.masked_fill_(~allowed, torch.finfo(dtype).min)
    return mask[:, None, :, :]


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Sum of next-token cross-entropy over targets that carry a loss (fp32 for a stable softmax)."""
    targets = labels[:, 1:].clone()
    targets[position_ids[:, 1:] == 0] = IGNORE
    return F.cross_entropy(
        logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )


def steps_for_epochs(n: int, epochs: float, global_batch: int) -> int:
    return max(1, int(np.ceil(epochs * n / global_batch)))
