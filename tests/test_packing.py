"""Packing: whole conversations per block (best-fit decreasing), and a packed row computing what its
conversations compute alone, through position ids or the explicit block mask, with the same loss."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from chat_data import conversation
from snaketune.data.tokenization import IGNORE_INDEX, pack, tokenize_conversation
from snaketune.model.batching import packed_attention_mask


@pytest.fixture(scope="module")
def examples(tok) -> list[dict]:
    rng = random.Random(11)
    return [
        tokenize_conversation(
            tok, conversation(rng, rng.randint(1, 3)), max_length=96, assistant_only_loss=True
        )
        for _ in range(30)
    ]


def segments(block: dict) -> list[dict]:
    """Split a packed block back into conversations at each position id 0."""
    starts = [i for i, p in enumerate(block["position_ids"]) if p == 0] + [len(block["position_ids"])]
    return [
        {key: block[key][a:b] for key in ("input_ids", "labels", "position_ids")}
        for a, b in zip(starts, starts[1:], strict=False)
    ]


def test_packing_keeps_whole_conversations(examples):
    max_length = 128
    blocks = pack(examples, max_length)
    assert all(len(b["input_ids"]) <= max_length for b in blocks)
    assert all(len(b["input_ids"]) == len(b["labels"]) == len(b["position_ids"]) for b in blocks)
    # Each conversation sits whole in exactly one block, with positions 0..n-1; inside a block in input order.
    pieces = [piece for block in blocks for piece in segments(block)]
    key = [tuple(e["input_ids"]) for e in examples]
    assert sorted(tuple(p["input_ids"]) for p in pieces) == sorted(key)
    for block in blocks:
        found = [key.index(tuple(p["input_ids"])) for p in segments(block)]
        assert found == sorted(found)
    assert all(p["position_ids"] == list(range(len(p["input_ids"]))) for p in pieces)
    assert pack(examples, max_length) == blocks
    with pytest.raises(ValueError, match="longer than max_length"):
        pack(examples, 8)


def test_packing_is_best_fit_decreasing():
    def ex(n: int, tag: int) -> dict:
        return {"input_ids": [tag] * n, "labels": [tag] * n}

    # Next-fit in this order needs 4 blocks (6 | 5+4 | 3+2+5 | 5); best-fit decreasing fills 3 to 10.
    lengths = [6, 5, 4, 3, 2, 5, 5]
    blocks = pack([ex(n, i) for i, n in enumerate(lengths)], 10)
    assert sorted(len(b["input_ids"]) for b in blocks) == [10, 10, 10]
    # The longest goes first and each next one where it leaves the least room: 6+4, 5+5, 5+3+2.
    assert sorted(sorted(set(b["input_ids"])) for b in blocks) == [[0, 2], [1, 5], [3, 4, 6]]


@pytest.fixture(scope="module")
def packed_case(tok, examples):
    """A block of three conversations plus a tiny random Llama per attention implementation."""
    block = pack(examples[:3], 4096)[0]
    models = {}
    for impl in ("sdpa", "eager"):
        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=len(tok),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=512,
            attn_implementation=impl,
        )
        models[impl] = LlamaForCausalLM(config).eval()
        assert models[impl].config._attn_implementation == impl
    return block, models


def alone_logits(model, block) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s["input_ids"]])).logits[0] for s in segments(block)]


def split_logits(logits: torch.Tensor, block: dict) -> list[torch.Tensor]:
    sizes = [len(s["input_ids"]) for s in segments(block)]
    return list(torch.split(logits[0], sizes))


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_row_equals_conversations_alone_via_position_ids(packed_case, impl):
    """transformers derives the block-diagonal mask from position_ids: no attention_mask, use_cache=False."""
    block, models = packed_case
    ids, positions = torch.tensor([block["input_ids"]]), torch.tensor([block["position_ids"]])
    with torch.no_grad():
        logits = models[impl](input_ids=ids, position_ids=positions, use_cache=False).logits
    for packed, alone in zip(split_logits(logits, block), alone_logits(models[impl], block), strict=True):
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_packed_row_equals_conversations_alone_via_explicit_mask(packed_case, impl):
    """packed_attention_mask works whatever use_cache is."""
    block, models = packed_case
    positions = torch.tensor([block["position_ids"]])
    with torch.no_grad():
        logits = (
            models[impl](
                input_ids=torch.tensor([block["input_ids"]]),
                position_ids=positions,
                attention_mask=packed_attention_mask(positions),
            )
        ).logits
    for packed, alone in zip(split_logits(logits, block), alone_logits(models[impl], block), strict=True):
        torch.testing.assert_close(packed, alone, atol=1e-5, rtol=0)


def test_packed_detection_is_skipped_with_a_kv_cache(packed_case):
    """Why use_cache=False (or the explicit mask) is required: with the config default use_cache=True the model
    makes a DynamicCache, transformers then skips packed detection and later conversations see earlier ones.
    If this starts failing, transformers has changed and the rule can be relaxed."""
    block, models = packed_case
    ids, positions = torch.tensor([block["input_ids"]]), torch.tensor([block["position_ids"]])
    with torch.no_grad():
        logits = models["sdpa"](input_ids=ids, position_ids=positions).logits
    packed, alone = split_logits(logits, block)[1], alone_logits(models["sdpa"], block)[1]
    assert not torch.allclose(packed, alone, atol=1e-3)


def test_packed_loss_equals_per_conversation_losses(packed_case):
    """Label 0 of each conversation is ignored, so no loss term predicts across a conversation boundary."""
    block, models = packed_case
    model = models["eager"]
    with torch.no_grad():
        packed = model(
            input_ids=torch.tensor([block["input_ids"]]),
            position_ids=torch.tensor([block["position_ids"]]),
            labels=torch.tensor([block["labels"]]),
            use_cache=False,
        ).loss
        total, count = 0.0, 0
        for s in segments(block):
            n = sum(label != IGNORE_INDEX for label in s["labels"][1:])
            loss = model(input_ids=torch.tensor([s["input_ids"]]), labels=torch.tensor([s["labels"]])).loss
            total, count = total + loss.item() * n, count + n
    assert packed.item() == pytest.approx(total / count, abs=1e-5)
