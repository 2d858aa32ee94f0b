"""Assistant-only masking, truncation, the tokenizer checks, and reproducible outputs (packing:
tests/test_packing.py)."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from datasets import load_from_disk

from chat_data import conversation, write_conversations
from snaketune.data.tokenization import (
    IGNORE_INDEX,
    TemplateError,
    assistant_spans,
    encode_conversation,
    load_tokenizer,
    save_rows,
    tokenize_conversation,
    tokenize_conversations,
)
from snaketune.data.tokenizer import BOS, DEEPSEEK_CHAT_TEMPLATE, EOS

# assistant turns render shorter than the same turn rendered last, so prefixes do not line up.
HISTORY_REWRITING_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% elif loop.last %}{{ 'Assistant: ' + m['content'] + eos_token }}"
    "{% else %}{{ 'Assistant: ' + m['content'][:3] + eos_token }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)


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
