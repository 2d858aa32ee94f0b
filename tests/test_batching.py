"""Unit tests of snaketune.model.batching: the sample order, the rank and micro-batch split, padding, the packed
attention mask and the loss that training sums and normalizes."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from snaketune.model import batching
from snaketune.model.batching import (
    IGNORE,
    GlobalOrder,
    TokenizedSplit,
    collate,
    load_split,
    micro_batches,
    packed_attention_mask,
    rank_share,
    steps_for_epochs,
    target_mask,
    token_loss_sum,
)


def make_split(rows: list[tuple[list[int], list[int], list[int]]]) -> TokenizedSplit:
    """A split from (input_ids, labels, position_ids) rows, loss tokens counted as load_split does."""
    ids, labels, positions = ([np.array(row[k], dtype=np.int32) for row in rows] for k in range(3))
    loss = np.array(
        [int(target_mask(lab, pos).sum()) for lab, pos in zip(labels, positions, strict=True)], dtype=np.int64
    )
    return TokenizedSplit(ids, labels, positions, loss)


# ---- GlobalOrder -------------------------------------------------------------------------------


def test_global_order_is_deterministic_and_seeded():
    a, b, c = GlobalOrder(10, seed=3), GlobalOrder(10, seed=3), GlobalOrder(10, seed=4)
    batches_a = [a.global_batch(s, 4).tolist() for s in range(6)]
    assert batches_a == [b.global_batch(s, 4).tolist() for s in range(6)]
    assert batches_a != [c.global_batch(s, 4).tolist() for s in range(6)]
    # Asking for steps out of order (as a resumed run does) gives the same batches.
    assert [a.global_batch(s, 4).tolist() for s in reversed(range(6))] == batches_a[::-1]


def test_every_epoch_is_a_permutation_and_epochs_differ():
    n = 7
    order = GlobalOrder(n, seed=0)
    stream = np.concatenate([order.global_batch(s, 1) for s in range(4 * n)])
    epochs = stream.reshape(4, n)
    for epoch in epochs:
        assert sorted(epoch.tolist()) == list(range(n))
    assert len({tuple(e) for e in epochs}) > 1


def test_batches_cut_one_stream_whatever_the_batch_size():
    """Batch s of size G is stream[s*G:(s+1)*G]: batches cross epoch boundaries without dropping samples."""
    n = 5
    small = np.concatenate([GlobalOrder(n, 1).global_batch(s, 2) for s in range(6)])
    large = np.concatenate([GlobalOrder(n, 1).global_batch(s, 4) for s in range(3)])
    assert small.tolist() == large.tolist()
    assert sorted(small[:n].tolist()) == list(range(n))


def test_global_order_refuses_an_empty_split():
    with pytest.raises(ValueError, match="empty"):
        GlobalOrder(0, seed=0)


def test_steps_for_epochs_rounds_up():
    assert steps_for_epochs(10, 1.0, 4) == 3
    assert steps_for_epochs(10, 2.0, 4) == 5
    assert steps_for_epochs(3, 0.01, 4) == 1


# ---- rank and micro-batch split ----------------------------------------------------------------


@pytest.mark.parametrize("world", [1, 2, 3, 6])
def test_rank_shares_are_contiguous_and_cover_the_batch(world):
    batch = np.arange(100, 112)
    shares = [rank_share(batch, r, world) for r in range(world)]
    assert all(len(s) == len(batch) // world for s in shares)
    assert np.concatenate(shares).tolist() == batch.tolist()


def test_micro_batches_split_in_order():
    parts = micro_batches(np.arange(6), 2)
    assert [p.tolist() for p in parts] == [[0, 1], [2, 3], [4, 5]]
    assert [p.tolist() for p in micro_batches(np.arange(4), 4)] == [[0, 1, 2, 3]]


def test_ranks_and_micro_batches_see_each_sample_of_a_global_batch_once():
    batch = GlobalOrder(50, seed=2).global_batch(3, 12)
    for world, micro in [(1, 12), (1, 1), (2, 3), (3, 2), (4, 1)]:
        seen = [
            i
            for r in range(world)
            for m in micro_batches(rank_share(batch, r, world), micro)
            for i in m.tolist()
        ]
        assert seen == batch.tolist()


# ---- collate -----------------------------------------------------------------------------------


def test_collate_right_pads_with_ignored_labels_and_position_zero():
    split = make_split(
        [
            ([5, 6, 7], [IGNORE, 6, 7], [0, 1, 2]),
            ([8, 9, 10, 11, 12], [IGNORE, 9, IGNORE, 11, 12], [0, 1, 0, 1, 2]),
        ]
    )
    batch = collate(split, np.array([0, 1]), pad_id=99)
    assert {k: v.dtype for k, v in batch.items()} == dict.fromkeys(batch, torch.long)
    assert batch["input_ids"].tolist() == [[5, 6, 7, 99, 99], [8, 9, 10, 11, 12]]
    assert batch["labels"].tolist() == [[IGNORE, 6, 7, IGNORE, IGNORE], [IGNORE, 9, IGNORE, 11, 12]]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0], [0, 1, 0, 1, 2]]
    # Width is the longest row of this micro-batch, not of the split.
    assert collate(split, np.array([0]), pad_id=99)["input_ids"].shape == (1, 3)


# ---- packed attention mask ---------------------------------------------------------------------


def test_packed_attention_mask_is_block_diagonal_and_causal():
    # Two conversations (3 and 2 tokens) and two pads, each pad a sequence of its own.
    position_ids = torch.tensor([[0, 1, 2, 0, 1, 0, 0]])
    segment = [0, 0, 0, 1, 1, 2, 3]
    mask = packed_attention_mask(position_ids, torch.float32)
    assert mask.shape == (1, 1, 7, 7) and mask.dtype == torch.float32
    expected = torch.tensor(
        [
            [0.0 if k <= q and segment[k] == segment[q] else torch.finfo(torch.float32).min for k in range(7)]
            for q in range(7)
        ]
    )
    assert torch.equal(mask[0, 0], expected)
    # Every query may attend at least to itself: no fully masked row (softmax would give NaN).
    assert (mask[0, 0].diagonal() == 0).all()
    assert packed_attention_mask(position_ids, torch.bfloat16).dtype == torch.bfloat16


def test_packed_row_gives_the_logits_of_its_conversations_run_alone():
    """The mask keeps packed conversations apart: the logits of a packed row equal those of each
    conversation (and a pad) run separately through a tiny Llama."""
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    convs = [[1, 5, 9, 13], [1, 7, 3], [1, 22, 40, 41, 42]]
    ids = torch.tensor([[t for c in convs for t in c] + [0]])
    pos = torch.tensor([[p for c in convs for p in range(len(c))] + [0]])
    with torch.no_grad():
        packed = model(
            input_ids=ids, position_ids=pos, attention_mask=packed_attention_mask(pos, torch.float32)
        ).logits[0]
        start = 0
        for c in convs:
            alone = model(input_ids=torch.tensor([c])).logits[0]
            torch.testing.assert_close(packed[start : start + len(c)], alone, rtol=1e-5, atol=1e-5)
            start += len(c)


# ---- loss --------------------------------------------------------------------------------------


def reference_loss(
    logits: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor
) -> tuple[float, int]:
    """Loop over every target: a token t > 0 is predicted from t-1 when labelled and not a sequence start."""
    total, count = 0.0, 0
    for b in range(labels.shape[0]):
        for t in range(1, labels.shape[1]):
            if labels[b, t] != IGNORE and position_ids[b, t] != 0:
                total -= F.log_softmax(logits[b, t - 1].double(), -1)[labels[b, t]].item()
                count += 1
    return total, count


def test_token_loss_sum_masks_targets_at_sequence_starts():
    split = make_split(
        [
            # Labels deliberately set at position 0 of the second conversation: it must not be a target
            # (it would be predicted from the previous conversation's last token).
            ([1, 5, 6, 1, 7, 8, 9], [IGNORE, 5, 6, 1, 7, IGNORE, 9], [0, 1, 2, 0, 1, 2, 3]),
            ([1, 3, 4], [IGNORE, 3, 4], [0, 1, 2]),
        ]
    )
    batch = collate(split, np.array([0, 1]), pad_id=0)
    torch.manual_seed(0)
    logits = torch.randn(2, batch["input_ids"].shape[1], 16)
    got = token_loss_sum(logits, batch["labels"], batch["position_ids"])
    expected, count = reference_loss(logits, batch["labels"], batch["position_ids"])
    assert got.dtype == torch.float32
    assert got.item() == pytest.approx(expected, rel=1e-6)
    # Targets: 5, 6, 7, 9 in row 0 (the label 1 at position 0 is dropped) and 3, 4 in row 1.
    assert count == 6 == int(split.loss_tokens.sum())
    assert split.loss_tokens.tolist() == [4, 2]


def test_target_mask_counts_shifted_labelled_targets():
    labels = np.array([IGNORE, 5, IGNORE, 7, 8, 9])
    positions = np.array([0, 1, 2, 0, 1, 2])
    assert target_mask(labels, positions).tolist() == [True, False, False, True, True]
    assert int(target_mask(labels, positions).sum()) == 3
    assert int(target_mask(np.array([IGNORE]), np.array([0])).sum()) == 0


def test_load_split_counts_the_loss_tokens_the_tokenizer_stage_reports(tiny_data):
    """The cache's stats.json counts labelled tokens; training normalizes by its own count of targets.
    They agree because the tokenize stage never labels a conversation's first token."""
    stats = json.loads((tiny_data.data_dir / "stats.json").read_text())
    for name in ("train", "validation"):
        split = load_split(tiny_data.data_dir / name)
        assert len(split) == stats["splits"][name]["sequences"]
        assert int(split.loss_tokens.sum()) == stats["splits"][name]["loss_tokens"]
        assert int(split.lengths.sum()) == stats["splits"][name]["tokens"]
        assert max(split.lengths) <= tiny_data.max_length


def test_a_split_without_rows_loads_empty(tmp_path):
    """datasets writes a split of no rows (a small dataset can leave no validation pair) as no data file, and its
    load_from_disk cannot read that back; the ranks get an empty split."""
    from snaketune.data.tokenization import save_rows

    save_rows([], tmp_path / "validation", split="validation", fingerprint="0" * 16)
    split = batching.load_split(tmp_path / "validation")
    assert len(split) == 0 and split.loss_tokens.shape == (0,) and split.lengths.shape == (0,)
