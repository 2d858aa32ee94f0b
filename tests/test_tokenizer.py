"""The builtin byte-level BPE: loadable by transformers, DeepSeek's specials and chat format, deterministic."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from transformers import AutoTokenizer

from chat_data import SYLLABLES
from snaketune.data.tokenizer import (
    BOS,
    DEEPSEEK_CHAT_TEMPLATE,
    EOS,
    MODEL_MAX_LENGTH,
    conversation_texts,
    train_tokenizer,
)

VOCAB = 320  # small enough that the 300 synthetic conversations fill it
# Enough distinct pseudo-words that the BPE fills its vocabulary, plus non-ASCII to exercise the byte fallback.
WORDS = ["".join(random.Random(i).choice(SYLLABLES) for _ in range(1 + i % 4)) for i in range(300)] + [
    "¿qué",
    "tal?",
    "日本語",
    "ok,",
    "fine.",
    "why?",
]


def synthetic_conversations(n: int, seed: int = 0) -> list[list[dict[str, str]]]:
    """n alternating user/assistant conversations of 1-3 exchanges, words drawn from WORDS."""
    rng = random.Random(seed)

    def sentence() -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 12)))

    return [
        [
            {"role": role, "content": sentence()}
            for _ in range(rng.randint(1, 3))
            for role in ("user", "assistant")
        ]
        for _ in range(n)
    ]


def write_conversations(path: Path, conversations: list[list[dict[str, str]]]) -> Path:
    """A conversations parquet file in the schema the conversations stage writes."""
    table = pa.table(
        {
            "conversation_id": [f"c{i}" for i in range(len(conversations))],
            "message_tree_id": [f"t{i}" for i in range(len(conversations))],
            "lang": ["en"] * len(conversations),
            "messages": conversations,
        }
    )
    pq.write_table(table, path)
    return path


@pytest.fixture(scope="module")
def parquet(tmp_path_factory) -> Path:
    return write_conversations(
        tmp_path_factory.mktemp("conv") / "train.parquet", synthetic_conversations(300)
    )


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, parquet) -> Path:
    out = tmp_path_factory.mktemp("tok")
    train_tokenizer(conversation_texts(parquet), VOCAB, out)
    return out


def test_loads_with_autotokenizer_and_deepseek_specials(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    assert tok.is_fast
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (BOS, EOS, EOS)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (0, 1, 1)
    assert len(tok) == VOCAB
    assert tok.model_max_length == MODEL_MAX_LENGTH
    assert tok.chat_template == DEEPSEEK_CHAT_TEMPLATE
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"


def test_plain_text_gets_bos_and_round_trips_bytes(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    text = "¿Qué tal? 日本語 unseen-wörds\n\n  tabs\t!"
    ids = tok(text)["input_ids"]
    assert ids[0] == tok.bos_token_id  # add_bos_token, as DeepSeek's tokenizer
    assert tok.decode(ids[1:]) == text


def test_template_strings_are_compact(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    for word in ("User", "Assistant"):
        assert len(tok(word, add_special_tokens=False)["input_ids"]) == 1, word
    # The specials are single tokens inside rendered text.
    ids = tok(f"{BOS}User: hi{EOS}", add_special_tokens=False)["input_ids"]
    assert ids[0] == 0 and ids[-1] == 1


def test_chat_template_renders_deepseek_format(tok_dir):
    tok = AutoTokenizer.from_pretrained(tok_dir)
    messages = [
        {"role": "user", "content": "Hi there"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Why?"},
        {"role": "assistant", "content": "Because."},
    ]
    expected = f"{BOS}User: Hi there\n\nAssistant: Hello!{EOS}User: Why?\n\nAssistant: Because.{EOS}"
    assert tok.apply_chat_template(messages, tokenize=False) == expected
    prompt = tok.apply_chat_template(messages[:3], tokenize=False, add_generation_prompt=True)
    assert prompt == f"{BOS}User: Hi there\n\nAssistant: Hello!{EOS}User: Why?\n\nAssistant:"
    system = [{"role": "system", "content": "Be brief."}, messages[0]]
    assert tok.apply_chat_template(system, tokenize=False) == f"{BOS}Be brief.\n\nUser: Hi there\n\n"


def test_conversation_texts_renders_turns(parquet):
    texts = list(conversation_texts(parquet))
    first = pq.read_table(parquet).column("messages").to_pylist()[0]
    assert texts[0] == f"User: {first[0]['content']}\n\n"
    assert texts[1] == f"Assistant: {first[1]['content']}"


def test_training_is_deterministic(tmp_path, parquet, tok_dir):
    train_tokenizer(conversation_texts(parquet), VOCAB, tmp_path / "again")
    # Another process with another hash seed: Python and Rust hash maps iterate differently there.
    code = (
        "import sys; from snaketune.data.tokenizer import conversation_texts, train_tokenizer; "
        f"train_tokenizer(conversation_texts(sys.argv[1]), {VOCAB}, sys.argv[2])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": os.pathsep.join(sys.path)}
    subprocess.run([sys.executable, "-c", code, str(parquet), str(tmp_path / "other")], check=True, env=env)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        reference = (tok_dir / name).read_bytes()
        assert (tmp_path / "again" / name).read_bytes() == reference, name
        assert (tmp_path / "other" / name).read_bytes() == reference, name


def test_vocab_size_must_hold_bytes_and_specials(tmp_path):
    with pytest.raises(ValueError, match="vocab_size 100"):
        train_tokenizer(["hello"], 100, tmp_path)


def test_the_real_deepseek_tokenizer_encodes_llama_cpps_test_strings_as_the_hub_did(
    deepseek_tokenizer, llama_cpp_vocab
):
    """The real tokenizer the tests use (rebuilt from the pinned llama-cpp-python's vocabulary file: tests/
    deepseek_tokenizer.py) gives each of llama.cpp's 46 test strings the ids its `.out` file recorded from the
    Hugging Face tokenizer: whitespace runs, digits split one by one, apostrophes, CJK, emoji, and the 13 added
    characters that match literally. bos and eos are DeepSeek's, and a plain encoding starts with bos."""
    from deepseek_tokenizer import vocab_test_strings

    tok = AutoTokenizer.from_pretrained(deepseek_tokenizer)
    cases = vocab_test_strings(llama_cpp_vocab)
    assert len(cases) == 46
    wrong = [(text, ids) for text, ids in cases if tok(text, add_special_tokens=False)["input_ids"] != ids]
    assert not wrong, wrong[:3]
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == (BOS, 100_000, EOS, 100_001)
    assert len(tok) == 100_015 and tok("Hello")["input_ids"][0] == 100_000 and tok.chat_template is None
