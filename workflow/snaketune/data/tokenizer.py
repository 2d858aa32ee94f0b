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

from snaketune.data.tools import plain_turns
from snaketune.io import atomic_dir, atomic_path

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


class TokenizerError(ValueError):
    """A tokenizer directory is missing, incomplete or unreadable; the message names it and what is allowed."""


def read_conversations_file(
    parquet_path: str | Path, columns: list[str], optional: tuple[str, ...] = ()
) -> dict[str, list]:
    """The named columns of a conversations file (from the conversations stage) as Python lists; an `optional`
    column the file lacks comes back as nulls.

    Raises ValueError naming the file when it is no such file: another Parquet file put in its place, or a
    split left with no conversations.
    """
    try:
        table = pq.read_table(parquet_path)
    except Exception as e:
        raise ValueError(f"{parquet_path}: not a readable conversations file ({e})") from e
    missing = [c for c in columns if c not in table.column_names and c not in optional]
    if missing:
        raise ValueError(
            f"{parquet_path}: no column(s) {', '.join(missing)}; allowed: a file the conversations stage "
            f"wrote (columns conversation_id, message_tree_id, lang, tools, messages), found: "
            f"{', '.join(table.column_names)}"
        )
    if table.num_rows == 0:
        raise ValueError(
            f"{parquet_path}: no conversations; every split needs at least one, so the data must keep "
            "conversations in at least 2 trees (see trees_by_split in the conversations stage's stats.json)"
        )
    return {
        c: table.column(c).to_pylist() if c in table.column_names else [None] * table.num_rows
        for c in columns
    }


def conversation_texts(parquet_path: str | Path) -> Iterator[str]:
    """Every message of a conversations parquet file as the chat template renders it, without specials (tool parts
    as the project writes them: snaketune.data.tools.plain_turns).

    The file is read (and checked) at the call, not at the first iteration, so an empty or foreign file fails
    here rather than inside the Rust trainer that consumes the texts.
    """
    columns = read_conversations_file(parquet_path, ["messages", "tools"], optional=("tools",))
    return (
        _TURN_FORMAT[m["role"]].format(m["content"])
        for messages, tools in zip(columns["messages"], columns["tools"], strict=True)
        for m in plain_turns(messages, tools)
    )


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
    with atomic_path(out / "tokenizer.json") as tmp:
        tokenizer.save(str(tmp), pretty=True)
    config = json.dumps(tokenizer_config(model_max_length), indent=2, sort_keys=True, ensure_ascii=False)
    with atomic_path(out / "tokenizer_config.json") as tmp:
        tmp.write_text(config + "\n", encoding="utf-8")


def looks_like_a_path(name: str) -> bool:
    """True for names that can only be local paths: a hub id is `name` or `owner/name`, never these."""
    return name.startswith(("/", "./", "../", "~")) or name.count("/") > 1 or "\\" in name


def check_tokenizer_dir(path: str | Path, what: str) -> Path:
    """The directory, if it holds a fast tokenizer's tokenizer.json; else TokenizerError naming ``what``."""
    directory = Path(path).expanduser()
    allowed = "allowed: a directory with a fast tokenizer (tokenizer.json, as save_pretrained writes it)"
    if not directory.is_dir():
        raise TokenizerError(f"{what} {str(path)!r}: no such directory; {allowed}, a hub id, or 'auto'")
    if not (directory / "tokenizer.json").is_file():
        present = ", ".join(sorted(p.name for p in directory.iterdir())[:10]) or "nothing"
        raise TokenizerError(
            f"{what} {str(path)!r}: no tokenizer.json in that directory (it has: {present}); {allowed}"
        )
    return directory


def load_fast_tokenizer(name: str | Path, what: str, *, trust_remote_code: bool = False, **kwargs):
    """The fast tokenizer of a directory or hub id, with a message that names it when the files are bad.

    transformers' generic fast tokenizer (PreTrainedTokenizerFast, TokenizersBackend in transformers 5) reads
    tokenizer.json and tokenizer_config.json as written; transformers 5's AutoTokenizer loads the same class for
    byte-level BPE tokenizers such as DeepSeek's and SmolLM2's, but imports torch on the way (through its config
    classes), which the data stages never do (tests/test_layout.py). A tokenizer class shipped as remote code
    needs AutoTokenizer, and only model.trust_remote_code allows that."""
    if trust_remote_code:
        from transformers import AutoTokenizer as tokenizer_class
    else:
        from transformers import PreTrainedTokenizerFast as tokenizer_class

    try:
        tokenizer = tokenizer_class.from_pretrained(str(name), trust_remote_code=trust_remote_code, **kwargs)
    except Exception as e:  # transformers raises anything from OSError to a Rust parse error here
        raise TokenizerError(
            f"{what} {str(name)!r}: the tokenizer cannot be loaded ({type(e).__name__}: {e}); "
            "allowed: a directory with a readable tokenizer.json (and tokenizer_config.json), or a hub id"
        ) from e
    if not getattr(tokenizer, "is_fast", False):
        raise TokenizerError(
            f"{what} {str(name)!r} has no fast tokenizer (tokenizer.json); assistant masking needs its offsets"
        )
    return tokenizer


def fetch_tokenizer(
    name: str, out_dir: str | Path, *, revision: str = "main", trust_remote_code: bool = False
) -> None:
    """Save the tokenizer of a hub model or local model directory into ``out_dir`` (fast tokenizer files).

    Needs network access for hub ids (not exercised in CI). ``trust_remote_code`` stays off unless the config
    turns it on (model.trust_remote_code): a tokenizer class shipped with a model is code from its authors.
    Hub tokens come from the environment (HF_TOKEN) and are never written anywhere. ``out_dir`` is replaced
    as a whole, and only once the tokenizer has loaded and saved: a failure keeps the previous one.
    """
    what = "model.tokenizer / model.base"
    local = Path(name).expanduser()
    if local.exists() or looks_like_a_path(name):
        check_tokenizer_dir(name, what)
    tokenizer = load_fast_tokenizer(
        local if local.exists() else name,
        what,
        revision=revision,
        trust_remote_code=trust_remote_code,
    )
    with atomic_dir(out_dir) as tmp:
        tokenizer.save_pretrained(tmp)
