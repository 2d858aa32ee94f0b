"""Assistant-only masking, truncation, packing without cross-contamination, and reproducible outputs."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from datasets import load_from_disk
from transformers import LlamaConfig, LlamaForCausalLM

from snaketune.data.tokenization import (
    IGNORE_INDEX,
    TemplateError,
    assistant_spans,
    encode_conversation,
    load_tokenizer,
    pack,
    save_rows,
    tokenize_conversation,
    tokenize_conversations,
)
from snaketune.data.tokenizer import BOS, DEEPSEEK_CHAT_TEMPLATE, EOS, conversation_texts, train_tokenizer
from snaketune.model.batching import packed_attention_mask

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "th", "er", "an", "in", "on", "ch"]
WORDS = ["".join(random.Random(i).choice(SYLLABLES) for _ in range(1 + i % 4)) for i in range(300)] + [
    "¿qué",
    "日本語",
    "ok,",
    "why?",
]
# History rewriting, as reasoning templates do (DeepSeek-R1, Qwen3 drop earlier replies' thinking): earlier
# assistant turns render shorter than the same turn rendered last, so prefixes do not line up.
HISTORY_REWRITING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% elif loop.last %}{{ 'Assistant: ' + m['content'] + eos_token }}"
    "{% else %}{{ 'Assistant: ' + m['content'][:3] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


def sentence(rng: random.Random, low: int = 3, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversation(rng: random.Random, exchanges: int, prompt_words: tuple[int, int] = (3, 12)) -> list[dict]:
    return [
        message
        for _ in range(exchanges)
        for message in (
            {"role": "user", "content": sentence(rng, *prompt_words)},
            {"role": "assistant", "content": sentence(rng)},
        )
    ]


def write_conversations(path: Path, conversations: list[list[dict]]) -> Path:
    """A conversations parquet file in the schema the conversations stage writes."""
    n = len(conversations)
    table = pa.table(
        {
            "conversation_id": [f"c{i}" for i in range(n)],
            "message_tree_id": [f"t{i}" for i in range(n)],
            "lang": ["en"] * n,
            "messages": conversations,
        }
    )
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def conv_dir(tmp_path_factory) -> Path:
    rng = random.Random(0)
    directory = tmp_path_factory.mktemp("conversations")
    for split, n in (("train", 120), ("validation", 20)):
        write_conversations(
            directory / f"{split}.parquet", [conversation(rng, rng.randint(1, 3)) for _ in range(n)]
        )
    return directory


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, conv_dir) -> Path:
    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(conversation_texts(conv_dir / "train.parquet"), 320, out)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    return load_tokenizer(tok_dir, "deepseek")


def label_runs(example: dict) -> list[list[int]]:
    """The token ids of each maximal run of labelled positions."""
    runs, current = [], []
    for token_id, label in zip(example["input_ids"], example["labels"], strict=True):
        if label != IGNORE_INDEX:
            assert label == token_id, "labels are not shifted"
            current.append(token_id)
        elif current:
            runs.append(current)
            current = []
    return runs + ([current] if current else [])


@pytest.mark.parametrize("exchanges", [1, 3])
def test_only_assistant_replies_and_their_eos_are_trained(tok, exchanges):
    messages = conversation(random.Random(exchanges), exchanges)
    example = tokenize_conversation(tok, messages, max_length=4096, assistant_only_loss=True)
    assert example is not None and not example["truncated"]
    replies = [m["content"] for m in messages if m["role"] == "assistant"]
    # The generation prompt is `Assistant:`, so the model produces the space, the reply and eos.
    assert [tok.decode(run) for run in label_runs(example)] == [f" {reply}{EOS}" for reply in replies]
    untrained = [
        t for t, label in zip(example["input_ids"], example["labels"], strict=True) if label == IGNORE_INDEX
    ]
    prompts = "".join(f"User: {m['content']}\n\nAssistant:" for m in messages if m["role"] == "user")
    assert tok.decode(untrained) == BOS + prompts


def test_spans_cover_reply_and_eos(tok):
    messages = [{"role": "user", "content": "ka lo"}, {"role": "assistant", "content": "mi ne"}]
    text, spans = assistant_spans(tok, messages)
    assert text == f"{BOS}User: ka lo\n\nAssistant: mi ne{EOS}"
    assert [text[start:end] for start, end in spans] == [f" mi ne{EOS}"]


def test_all_tokens_trained_without_assistant_only_loss(tok):
    messages = conversation(random.Random(7), 2)
    example = tokenize_conversation(tok, messages, max_length=4096, assistant_only_loss=False)
    # Every token but the first, which a causal LM never predicts.
    assert example["labels"] == [IGNORE_INDEX] + example["input_ids"][1:]


def test_truncation_keeps_prefix_and_flags_it(tok):
    messages = conversation(random.Random(3), 3)
    full = tokenize_conversation(tok, messages, max_length=4096, assistant_only_loss=True)
    n_prompt = full["labels"].index(next(label for label in full["labels"] if label != IGNORE_INDEX))
    cut = tokenize_conversation(tok, messages, max_length=n_prompt + 2, assistant_only_loss=True)
    assert cut["truncated"]
    assert cut["input_ids"] == full["input_ids"][: n_prompt + 2]
    assert cut["labels"] == full["labels"][: n_prompt + 2]
    # Cut before the first reply token: no label survives, the caller counts it as dropped.
    assert tokenize_conversation(tok, messages, max_length=n_prompt, assistant_only_loss=True) is None


def test_history_rewriting_template_is_refused(tok_dir):
    tok = load_tokenizer(tok_dir, "deepseek")
    tok.chat_template = HISTORY_REWRITING_TEMPLATE
    single = conversation(random.Random(1), 1)
    assert tokenize_conversation(tok, single, max_length=4096, assistant_only_loss=True) is not None
    with pytest.raises(TemplateError, match="renders turns differently in context"):
        tokenize_conversation(
            tok, conversation(random.Random(1), 3), max_length=4096, assistant_only_loss=True
        )


def test_model_template_missing_is_an_error(tmp_path, tok_dir):
    shutil.copytree(tok_dir, tmp_path / "tok")
    config_path = tmp_path / "tok" / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    del config["chat_template"]
    config_path.write_text(json.dumps(config), encoding="utf-8")
    with pytest.raises(TemplateError, match=r"no chat template.*deepseek, model") as error:
        load_tokenizer(tmp_path / "tok", "model")
    assert str(tmp_path / "tok") in str(error.value)
    assert load_tokenizer(tmp_path / "tok", "deepseek").chat_template == DEEPSEEK_CHAT_TEMPLATE
    assert load_tokenizer(tok_dir, "model").chat_template == DEEPSEEK_CHAT_TEMPLATE  # its own, saved one
    with pytest.raises(TemplateError, match="allowed: deepseek, model"):
        load_tokenizer(tok_dir, "chatml")


def test_deepseek_template_uses_a_foreign_tokenizers_specials(tmp_path, tok_dir):
    """A tokenizer with other specials (here `<s>`/`</s>`) keeps them under the DeepSeek format."""
    (tmp_path / "tok").mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        text = (tok_dir / name).read_text(encoding="utf-8")
        (tmp_path / "tok" / name).write_text(text.replace(BOS, "<s>").replace(EOS, "</s>"), encoding="utf-8")
    tok = load_tokenizer(tmp_path / "tok", "deepseek")
    messages = [{"role": "user", "content": "ka"}, {"role": "assistant", "content": "lo"}]
    text, spans = assistant_spans(tok, messages)
    assert text == "<s>User: ka\n\nAssistant: lo</s>"
    example = tokenize_conversation(tok, messages, max_length=64, assistant_only_loss=True)
    assert tok.decode(label_runs(example)[0]) == " lo</s>"


def test_batches_come_back_in_input_order(tok, monkeypatch):
    """encode_conversations over several batches (3 a batch, 10 conversations: three full, one partial) gives
    each conversation's ids and labels as encoding it alone does, in input order."""
    from snaketune.data import chat

    monkeypatch.setattr(chat, "ENCODE_BATCH", 3)
    rng = random.Random(21)
    conversations = [conversation(rng, 1 + i % 3) for i in range(10)]
    alone = [encode_conversation(tok, c, assistant_only_loss=True) for c in conversations]
    assert len({tuple(ids) for ids, _ in alone}) == 10  # all different: an order mix-up shows
    batched = [
        (ids.tolist(), labels.tolist())
        for ids, labels in chat.encode_conversations(tok, conversations, assistant_only_loss=True)
    ]
    assert batched == alone


def test_truncation_and_padding_of_a_tokenizer_json_are_ignored(tmp_path, tok_dir, tok):
    """A tokenizer.json saved with truncation (8 tokens) and padding (to 300) encodes a conversation whole and
    unpadded: the stages cut and pad themselves."""
    from tokenizers import Tokenizer

    shutil.copytree(tok_dir, tmp_path / "tok")
    backend = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    backend.enable_truncation(8)
    backend.enable_padding(length=300, pad_id=1, pad_token=EOS)
    backend.save(str(tmp_path / "tok" / "tokenizer.json"))
    cut = load_tokenizer(tmp_path / "tok", "deepseek")
    assert cut.backend_tokenizer.truncation["max_length"] == 8  # transformers keeps what the file says
    messages = conversation(random.Random(4), 2)
    whole = encode_conversation(tok, messages, assistant_only_loss=True)
    assert 8 < len(whole[0]) < 300
    assert encode_conversation(cut, messages, assistant_only_loss=True) == whole
    example = tokenize_conversation(cut, messages, max_length=4096, assistant_only_loss=True)
    assert example["input_ids"] == whole[0] and not example["truncated"]


def edited_config(tmp_path: Path, tok_dir: Path, **changes) -> Path:
    """A copy of the tokenizer with keys of tokenizer_config.json set (None: removed)."""
    out = tmp_path / "tok"
    shutil.copytree(tok_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    for key, value in changes.items():
        config.pop(key, None)
        if value is not None:
            config[key] = value
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out


def test_tokenizer_without_eos_is_an_error(tmp_path, tok_dir):
    """No eos token in tokenizer_config.json: refused, naming the tokenizer directory, before any template use."""
    path = edited_config(tmp_path, tok_dir, eos_token=None, pad_token=None)
    with pytest.raises(TemplateError) as error:
        load_tokenizer(path, "deepseek")
    assert str(error.value) == (
        f"tokenizer {str(path)!r} has no eos token, so assistant turns have no end-of-turn token"
    )


def test_bos_that_is_the_unknown_token_is_an_error(tmp_path, tok_dir):
    """The DeepSeek template writes bos as text: a bos that encodes as the unknown token is refused."""
    path = edited_config(tmp_path, tok_dir, unk_token="<unk>", bos_token="<unk>")
    tokenizer_json = json.loads((path / "tokenizer.json").read_text(encoding="utf-8"))
    tokenizer_json["model"]["vocab"]["<unk>"] = len(tokenizer_json["model"]["vocab"])
    tokenizer_json["model"]["unk_token"] = "<unk>"
    (path / "tokenizer.json").write_text(json.dumps(tokenizer_json), encoding="utf-8")
    with pytest.raises(TemplateError) as error:
        load_tokenizer(path, "deepseek")
    assert str(error.value) == f"tokenizer {str(path)!r}: bos_token '<unk>' is not in its vocabulary"


def test_bos_missing_from_the_vocabulary_is_an_error(tmp_path, tok_dir):
    """A bos that tokenizer.json does not have would be rendered as a token the model never learnt (transformers
    adds it as a new id past the vocabulary): refused."""
    path = edited_config(tmp_path, tok_dir, bos_token="<s>")  # tokenizer.json has no <s>
    with pytest.raises(TemplateError, match=r"bos_token '<s>' is not in its vocabulary"):
        load_tokenizer(path, "deepseek")


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


def test_saved_dataset_carries_the_given_fingerprint(tmp_path):
    """state.json holds our fingerprint, not one datasets makes up (which may be random)."""
    row = {"input_ids": [5, 6], "labels": [IGNORE_INDEX, 6], "position_ids": [0, 1]}
    save_rows([row], tmp_path / "d", split="train", fingerprint="0123456789abcdef")
    state = json.loads((tmp_path / "d" / "state.json").read_text(encoding="utf-8"))
    assert state["_fingerprint"] == "0123456789abcdef"
    assert load_from_disk(str(tmp_path / "d")).to_list() == [row]


def tree_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("packing", [True, False])
def test_tokenize_conversations_end_to_end(tmp_path, conv_dir, tok_dir, packing):
    max_length = 96
    settings = {
        "max_length": max_length,
        "packing": packing,
        "assistant_only_loss": True,
        "chat_template": "deepseek",
    }
    stats = tokenize_conversations(conv_dir, tok_dir, tmp_path / "a" / "tokenized", **settings)
    tokenize_conversations(conv_dir, tok_dir, tmp_path / "b" / "tokenized", **settings)
    first, second = tree_bytes(tmp_path / "a" / "tokenized"), tree_bytes(tmp_path / "b" / "tokenized")
    assert {"stats.json", "train/state.json", "train/dataset_info.json", "validation/state.json"} <= set(
        first
    )
    assert first == second, "outputs differ between two runs from scratch"
    assert list((tmp_path / "a").iterdir()) == [tmp_path / "a" / "tokenized"], "temp dir left behind"
    assert json.loads(first["stats.json"]) == stats
    assert stats["settings"] == settings
    assert set(stats["tokenizer_files_sha256"]) == {"tokenizer.json", "tokenizer_config.json"}
    fingerprints = {
        json.loads(first[f"{split}/state.json"])["_fingerprint"] for split in ("train", "validation")
    }
    assert len(fingerprints) == 2, "each split has its own input-derived fingerprint"

    for split in ("train", "validation"):
        s = stats["splits"][split]
        dataset = load_from_disk(str(tmp_path / "a" / "tokenized" / split))
        assert set(dataset.features) == {"input_ids", "labels", "position_ids"}
        assert dataset.features["input_ids"].feature.dtype == "int32"
        rows = dataset.to_list()
        n_conversations = pq.read_metadata(conv_dir / f"{split}.parquet").num_rows
        kept = n_conversations - s["dropped_no_loss_tokens"]
        assert s["conversations"] == n_conversations
        assert s["sequences"] == len(rows) == (s["packed_blocks"] if packing else kept)
        assert all(len(r["input_ids"]) <= max_length for r in rows)
        assert s["tokens"] == sum(len(r["input_ids"]) for r in rows)
        assert s["loss_tokens"] == sum(label != IGNORE_INDEX for r in rows for label in r["labels"])
        assert sum(p == 0 for r in rows for p in r["position_ids"]) == kept
        assert s["pad_fraction_unpadded_to_max"] == pytest.approx(
            1 - s["tokens"] / (kept * max_length), abs=1e-6
        )
        assert s["pad_fraction_packed"] == pytest.approx(
            1 - s["tokens"] / (s["packed_blocks"] * max_length), abs=1e-6
        )
        assert s["pad_fraction_packed"] < s["pad_fraction_unpadded_to_max"]
        assert s["truncated_pct"] == pytest.approx(100 * s["truncated"] / n_conversations, abs=1e-3)
        assert s["max_conversation_tokens"] > max_length and s["truncated"] > 0  # some are cut


def test_a_split_without_rows_is_an_error(tmp_path, tok_dir):
    rng = random.Random(5)
    conv = tmp_path / "conv"
    conv.mkdir()
    write_conversations(conv / "train.parquet", [conversation(rng, 1) for _ in range(5)])
    # Prompts far longer than max_length: no reply token survives truncation.
    write_conversations(conv / "validation.parquet", [conversation(rng, 1, (60, 80)) for _ in range(4)])
    with pytest.raises(
        ValueError,
        match=r"validation\.parquet: tokenize\.max_length 16 keeps none of its 4 conversations",
    ):
        tokenize_conversations(
            conv,
            tok_dir,
            tmp_path / "out" / "tokenized",
            max_length=16,
            packing=True,
            assistant_only_loss=True,
            chat_template="deepseek",
        )
    assert not (tmp_path / "out" / "tokenized").exists()
    assert list((tmp_path / "out").iterdir()) == [], "temp dir left behind"


def test_split_stats_on_known_lengths():
    """stats.json's counts from hand-made lengths (written out, not the module's formulas): three conversations of
    10, 200 and 50 tokens at max_length 96 (the second truncated to 96), packed into two blocks."""
    from snaketune.data.tokenization import _split_stats

    def example(n: int, truncated: bool) -> dict:
        return {"input_ids": [0] * n, "truncated": truncated}

    kept = [example(10, False), example(96, True), example(50, False)]
    stats = _split_stats([10, 200, 50], kept, [example(96, False), example(60, False)], 96, loss_tokens=30)
    assert stats == {
        "conversations": 3,
        "dropped_no_loss_tokens": 0,
        "truncated": 1,
        "truncated_pct": 33.333,
        "tokens": 156,
        "loss_tokens": 30,
        "pad_fraction_unpadded_to_max": 0.458333,  # 1 - 156 / 288
        "packed_blocks": 2,
        "pad_fraction_packed": 0.1875,  # 1 - 156 / 192
        "mean_conversation_tokens": 86.667,
        "max_conversation_tokens": 200,
    }
