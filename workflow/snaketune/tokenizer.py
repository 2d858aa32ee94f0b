"""The builtin tokenizer: a small byte-level BPE in DeepSeek-LLM's format, trained on the conversations.

DeepSeek-LLM's tokenizer is a 102,400-entry byte-level BPE with bos ``<｜begin▁of▁sentence｜>`` (id 100000) and
eos ``<｜end▁of▁sentence｜>`` (id 100001), pad = eos and bos added to plain text (add_bos_token). The builtin one
keeps everything but the size: the same special-token strings, the same chat template and the same
``tokenizer.json`` + ``tokenizer_config.json`` layout, so every later stage treats it exactly like the real one.

Where the specials sit: ids 0 (bos) and 1 (eos), ahead of the 256 byte tokens and the merges. Nothing
depends on the ids themselves (templates and code use the token strings and ``bos_token_id``), and putting
them first lets ``tokenizers``' trainer count them inside ``vocab_size``, so ``len(tokenizer)`` never
exceeds it.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from pathlib import Path

import pyarrow.parquet as pq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
BUILTIN_VOCAB_SIZE = 1024
"""Vocabulary of the builtin tokenizer, specials included (a multiple of 64 keeps the embedding matmul aligned)."""
MODEL_MAX_LENGTH = 4096
"""deepseek-llm-7b's max_position_embeddings and its tokenizer's model_max_length."""
N_BYTES = 256

# Copied from deepseek-llm-7b-chat's tokenizer_config.json: bos, then `User: ..\n\n` / `Assistant: ..<eos>`
# turns, a system message as bare text + blank line, and `Assistant:` (no trailing space) as generation prompt.
DEEPSEEK_CHAT_TEMPLATE = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)

# What the template puts around each message's content (specials excepted): training on whole turns rather
# than bare contents lets "User", "Assistant" and ":" earn merges at their real frequency.
_TURN_FORMAT = {"user": "User: {}\n\n", "assistant": "Assistant: {}", "system": "{}\n\n"}


def conversation_texts(parquet_path: str | Path) -> Iterator[str]:
    """Every message of a conversations parquet file as the chat template renders it, without specials."""
    table = pq.read_table(parquet_path, columns=["messages"])
    for messages in table.column("messages").to_pylist():
        for message in messages:
            yield _TURN_FORMAT[message["role"]].format(message["content"])


def build_bpe_trainer(vocab_size: int) -> trainers.BpeTrainer:
    """A byte-level BPE trainer whose vocabulary starts with bos, eos and all 256 bytes."""
    if vocab_size < N_BYTES + 2:
        raise ValueError(f"vocab_size {vocab_size} must be >= {N_BYTES + 2} (256 bytes + bos + eos)")
    return trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[BOS, EOS],
        # Every byte in the base vocabulary, so no text is ever out of vocabulary (no unk token needed).
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )


def tokenizer_config(model_max_length: int = MODEL_MAX_LENGTH) -> dict:
    """tokenizer_config.json of the builtin tokenizer, mirroring deepseek-llm-7b-chat's."""
    return {
        "add_bos_token": True,
        "add_eos_token": False,
        "bos_token": BOS,
        "chat_template": DEEPSEEK_CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": EOS,
        "model_max_length": model_max_length,
        # DeepSeek pads with eos: padded positions carry label -100, so the id only has to exist.
        "pad_token": EOS,
        # Not LlamaTokenizerFast: transformers 5 rebuilds that class from vocab + merges with a
        # SentencePiece-style (Metaspace) pre-tokenizer, which would break a byte-level BPE. The generic class
        # loads tokenizer.json as written, in transformers 4 and 5 alike.
        "tokenizer_class": "PreTrainedTokenizerFast",
    }


def train_tokenizer(
    texts: Iterable[str], vocab_size: int, out_dir: str | Path, *, model_max_length: int = MODEL_MAX_LENGTH
) -> None:
    """Train a byte-level BPE on ``texts`` and save it as a transformers fast-tokenizer directory.

    The output is a pure function of ``texts`` and the arguments: the same inputs give byte-identical
    ``tokenizer.json`` and ``tokenizer_config.json``: tokenizers' BPE trainer breaks count ties by the pair's
    token ids, which come from a sorted alphabet, and both files are written with fixed formatting.
    Training stops early when the texts run out of pairs to merge, so the vocabulary can be smaller than
    ``vocab_size``: size the model's embeddings with ``len(tokenizer)``.
    """
    tokenizer = Tokenizer(models.BPE())
    # GPT-2 style: split on the GPT-2 regex, map bytes to printable characters; no prefix space, so the text
    # the chat template renders is tokenized as is.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainer=build_bpe_trainer(vocab_size))
    # add_bos_token as in DeepSeek's tokenizer: plain `tokenizer(text)` starts with bos; chat rendering puts
    # bos in the text itself and is tokenized with add_special_tokens=False.
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"), pretty=True)
    config = json.dumps(tokenizer_config(model_max_length), indent=2, sort_keys=True, ensure_ascii=False)
    (out / "tokenizer_config.json").write_text(config + "\n", encoding="utf-8")


def fetch_tokenizer(
    name: str, out_dir: str | Path, *, revision: str = "main", trust_remote_code: bool = False
) -> None:
    """Save the tokenizer of a hub model or local model directory into ``out_dir`` (fast tokenizer files).

    Needs network access for hub ids (not exercised in CI). ``trust_remote_code`` stays off unless the config
    turns it on (model.trust_remote_code): a tokenizer class shipped with a model is code from its authors.
    Hub tokens come from the environment (HF_TOKEN) and are never written anywhere.
    """
    from transformers import AutoTokenizer

    local = Path(name)
    if local.exists() and not (local / "tokenizer.json").exists():
        raise FileNotFoundError(
            f"model.tokenizer / model.base {name!r}: no tokenizer.json in that directory; "
            "allowed: a directory with a fast tokenizer (tokenizer.json), a hub id, or 'auto'"
        )
    tokenizer = AutoTokenizer.from_pretrained(
        name, revision=revision, trust_remote_code=trust_remote_code, use_fast=True
    )
    if not tokenizer.is_fast:
        raise ValueError(f"{name!r} has no fast tokenizer (tokenizer.json); snaketune needs offsets from one")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(out)
