"""Bad input catalog, data side after the download: every way the conversations, tokenizer and tokenize stages
can be fed wrong data, each run through the stage's own function (what its Snakemake script calls), asserting
what the user reads: the file, the field and what is allowed (the download stage's catalog, with lines and rows:
tests/test_bad_sources.py).

Every failing case also loses nothing (tests/bad_data.py's `fails_and_keeps`): the error comes before the stage
writes anything, so the previous good outputs stay byte for byte as they were, and no temporary file is left
beside them. What is not an error (orphans, loops, empty texts, trees without a reply, NaN ranks) is checked too:
counted in stats.json and skipped.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from bad_data import (
    BAD_ROW,
    GOOD,
    LONG_PROMPT,
    data_chain,
    fails_and_keeps,
    m,
    run_conversations,
    write_jsonl,
)
from snaketune.data import download
from snaketune.data.conversations import (
    DataError,
    build_conversations,
    read_messages,
    write_conversations,
)
from snaketune.data.tokenization import TemplateError, load_tokenizer, tokenize_conversations
from snaketune.data.tokenizer import TokenizerError, conversation_texts, fetch_tokenizer, train_tokenizer


def tokenize(conv_dir: Path, tok_dir: Path, out: Path, **settings: Any) -> dict:
    """What workflow/scripts/tokenize_data.py does, with the workflow's default settings."""
    spec = {"max_length": 256, "packing": True, "assistant_only_loss": True, "chat_template": "deepseek"}
    return tokenize_conversations(conv_dir, tok_dir, out, **{**spec, **settings})


def tokenizer_with_template(tmp_path: Path, tok_dir: Path, template: str | None) -> Path:
    """A copy of the tiny tokenizer with its chat template replaced (None: removed)."""
    out = tmp_path / "tok"
    shutil.copytree(tok_dir, out)
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    return out


# ==== conversations stage ================================================================================


def test_orphans_and_loops_are_counted_and_skipped(tmp_path):
    records = [
        *GOOD,
        m("o1", "gone", "prompter", "orphan", "o"),
        m("o2", "o1", "assistant", "orphan's reply", "o"),
        m("l1", "l2", "prompter", "loop", "l"),
        m("l2", "l1", "assistant", "loop", "l"),
        m("self", "self", "prompter", "its own parent", "x"),
    ]
    conv = data_chain(tmp_path, records)
    stats = json.loads((conv / "stats.json").read_text())
    assert stats["dropped"]["orphan"] == 2 and stats["dropped"]["loop"] == 3
    assert sum(stats["conversations"].values()) == 3


def test_empty_and_whitespace_text_drop_the_subtree_and_are_counted(tmp_path):
    records = copy.deepcopy(GOOD)
    records[1]["text"] = ""  # r-a: tree r is left with a lone question
    records[4]["text"] = " \n\t "  # s-p: s keeps its first exchange, s-pa goes with s-p
    conv = data_chain(tmp_path, records, paths="all")
    stats = json.loads((conv / "stats.json").read_text())
    assert stats["dropped"]["empty_text"] == 2 and stats["dropped"]["under_dropped_parent"] == 1
    assert stats["paths_dropped"]["no_exchange"] == 1
    assert sum(stats["conversations"].values()) == 2


def test_nan_rank_is_unranked(tmp_path):
    """s-a, ranked NaN and listed first, is unranked: its sibling s-b, ranked 1 and listed second, comes first and
    top1 takes it (a NaN kept as a number compares neither below nor above 1, leaving s-a first)."""
    line = json.dumps(GOOD[BAD_ROW]).encode().replace(b'"rank": 0.0', b'"rank": NaN')
    sibling = {**m("s-b", "s", "assistant", "The ranked second answer.", "s"), "rank": 1.0}
    records = [*GOOD[:BAD_ROW], line, sibling, *GOOD[BAD_ROW + 1 :]]
    raw = tmp_path / "raw"
    download.materialize(str(write_jsonl(tmp_path / "m.jsonl", records)), raw)
    rank = pq.read_table(raw / "messages.parquet").column("rank").to_pylist()[BAD_ROW]
    assert rank is None or rank != rank  # NaN
    run_conversations(raw / "messages.parquet", tmp_path / "conv")
    assert sum(json.loads((tmp_path / "conv" / "stats.json").read_text())["conversations"].values()) == 3
    tables = [pq.read_table(tmp_path / "conv" / f"{split}.parquet") for split in ("train", "validation")]
    assert sorted(c for t in tables for c in t.column("conversation_id").to_pylist()) == ["r-a", "s-b", "t-a"]


def test_trees_without_an_assistant_reply_are_counted_then_fatal_when_nothing_is_left(tmp_path):
    lone = [m("q1", None, "prompter", "question one", "q1"), m("q2", None, "prompter", "question two", "q2")]
    stats = json.loads((data_chain(tmp_path / "ok", [*GOOD, *lone]) / "stats.json").read_text())
    assert stats["paths_dropped"]["no_exchange"] == 2

    raw, conv = tmp_path / "raw", tmp_path / "conversations"
    download.materialize(str(write_jsonl(tmp_path / "m.jsonl", lone)), raw)
    src = raw / "messages.parquet"
    text = fails_and_keeps(conv, DataError, run_conversations, src, conv)
    assert text.startswith(
        f"{src}: the filters left no conversations (dataset.languages: all, dataset.paths: 'top1'): 2 messages "
        "in 2 trees; "
    )
    assert (
        "paths dropped: no_exchange 2 (a conversation needs a prompter message answered by an assistant"
        in text
    )


def test_filters_that_leave_nothing_name_themselves_and_the_counts(tmp_path):
    records = copy.deepcopy(GOOD)
    for r in records:
        if r["lang"] == "en" and r["parent_id"] is None:
            r["deleted"] = True
    raw, conv = tmp_path / "raw", tmp_path / "conversations"
    download.materialize(str(write_jsonl(tmp_path / "m.jsonl", records)), raw)
    conv.mkdir()
    write_conversations(build_conversations(read_messages(raw / "messages.parquet")), conv)  # a good run
    src = raw / "messages.parquet"
    text = fails_and_keeps(conv, DataError, run_conversations, src, conv, languages=["en"])
    assert text == (
        f"{src}: the filters left no conversations (dataset.languages: ['en'], dataset.paths: 'top1'): "
        "8 messages in 3 trees; trees outside dataset.languages: 1 (2 messages); messages dropped with their "
        "subtrees: deleted 2, under_dropped_parent 4; messages skipped as orphans or loops: none; paths "
        "dropped: none (a conversation needs a prompter message answered by an assistant reply, roles "
        "alternating from a prompter root); allowed: data where at least one tree keeps such an exchange"
    )


def test_language_that_no_tree_has(tmp_path):
    raw, conv = tmp_path / "raw", tmp_path / "conversations"
    download.materialize(str(write_jsonl(tmp_path / "m.jsonl", GOOD)), raw)
    src = raw / "messages.parquet"
    text = fails_and_keeps(conv, DataError, run_conversations, src, conv, languages=["en", "pt", "fr"])
    assert text == (
        f"config key 'dataset.languages': 'fr', 'pt' occur in no tree of {src} (the filter reads the lang of "
        "each tree's root message); allowed: the languages the data has: en (2 trees), de (1 tree)"
    )


# ==== tokenizer stages ===================================================================================


def test_model_directory_without_a_tokenizer(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text("{}", encoding="utf-8")
    (model / "model.safetensors").write_bytes(b"")
    out = tmp_path / "results" / "tokenizer" / "my-model"
    text = fails_and_keeps(out, TokenizerError, fetch_tokenizer, str(model), out)
    assert text == (
        f"model.tokenizer / model.base {str(model)!r}: no tokenizer.json in that directory (it has: config.json, "
        "model.safetensors); allowed: a directory with a fast tokenizer (tokenizer.json, as save_pretrained "
        "writes it)"
    )


def test_local_model_path_that_does_not_exist(tmp_path):
    out = tmp_path / "results" / "tokenizer" / "x"
    text = fails_and_keeps(out, TokenizerError, fetch_tokenizer, "./models/no/such", out)
    assert text.startswith("model.tokenizer / model.base './models/no/such': no such directory; allowed: ")


def test_unreadable_tokenizer_json_keeps_the_previous_tokenizer(tmp_path, tiny_data):
    model = tmp_path / "my-model"
    shutil.copytree(tiny_data.tokenizer_dir, model)
    out = tmp_path / "results" / "tokenizer" / "my-model"
    fetch_tokenizer(str(model), out)  # a good run first
    assert (out / "tokenizer.json").is_file()
    (model / "tokenizer.json").write_text('{"version": "1.0", "model": ', encoding="utf-8")
    text = fails_and_keeps(out, TokenizerError, fetch_tokenizer, str(model), out)
    assert text.startswith(f"model.tokenizer / model.base {str(model)!r}: the tokenizer cannot be loaded (")
    assert text.endswith(
        "allowed: a directory with a readable tokenizer.json (and tokenizer_config.json), or a hub id"
    )


def test_tokenize_with_a_directory_without_tokenizer_json(tmp_path, tiny_data):
    tok = tmp_path / "tok"
    tok.mkdir()
    (tok / "tokenizer_config.json").write_text("{}", encoding="utf-8")
    out = tmp_path / "tokenized"
    text = fails_and_keeps(out, TokenizerError, tokenize, tiny_data.conversations_dir, tok, out)
    assert text.startswith(f"tokenizer directory {str(tok)!r}: no tokenizer.json in that directory")


def test_builtin_tokenizer_with_an_empty_train_split(tmp_path):
    records = [{**r, "split": "validation"} for r in GOOD[:2]]  # one tree, in validation: train is empty
    conv = data_chain(tmp_path, records)
    out = tmp_path / "tokenizer"
    train_parquet = conv / "train.parquet"
    text = fails_and_keeps(
        out, ValueError, lambda: train_tokenizer(conversation_texts(train_parquet), 512, out)
    )
    assert text.startswith(f"{train_parquet}: no conversations; every split needs at least one")


# ==== tokenize stage =====================================================================================


@pytest.fixture
def conv_dir(tmp_path) -> Path:
    return data_chain(tmp_path / "data", GOOD, validation_fraction=0.5)


@pytest.fixture
def tokenized(tmp_path, conv_dir, tiny_data) -> Path:
    """A good tokenized cache from an earlier run, which failing runs must keep."""
    out = tmp_path / "results" / "tokenized" / "key"
    tokenize(conv_dir, tiny_data.tokenizer_dir, out)
    return out


def test_model_chat_template_missing(tmp_path, conv_dir, tokenized, tiny_data):
    tok = tokenizer_with_template(tmp_path, tiny_data.tokenizer_dir, None)
    text = fails_and_keeps(
        tokenized, TemplateError, tokenize, conv_dir, tok, tokenized, chat_template="model"
    )
    assert text == (
        f"tokenizer {str(tok)!r} has no chat template of its own (tokenize.chat_template: model needs one in "
        "tokenizer_config.json or chat_template.jinja); set tokenize.chat_template to one of: deepseek, model "
        "(deepseek uses the DeepSeek-LLM chat format)"
    )


def test_unknown_chat_template_setting(tiny_data):
    with pytest.raises(
        TemplateError, match=r"^tokenize\.chat_template 'chatml' is not allowed; allowed: deepseek, model$"
    ):
        load_tokenizer(tiny_data.tokenizer_dir, "chatml")


SKIPS_ASSISTANT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
DROPS_CONTENT = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% else %}{{ 'Assistant: ok' + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# Keeps only the first 20 characters of earlier replies (as reasoning templates drop earlier thinking).
REWRITES_HISTORY = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% elif loop.last %}{{ 'Assistant: ' + m['content'] + eos_token }}"
    "{% else %}{{ 'Assistant: ' + m['content'][:20] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
RAISES = "{{ raise_exception('Conversations must start with a system message') }}"


@pytest.mark.parametrize(
    ("template", "expected"),
    [
        (SKIPS_ASSISTANT, "the chat template renders assistant message 1 without its reply"),
        (
            DROPS_CONTENT,
            "the chat template does not put the assistant's reply 'It is 4.' in the assistant's turn",
        ),
        (RAISES, "the chat template cannot render a user/assistant conversation ("),
    ],
    ids=["skips-assistant", "drops-content", "raises"],
)
def test_template_that_cannot_mark_assistant_turns(
    tmp_path, conv_dir, tokenized, tiny_data, template, expected
):
    tok = tokenizer_with_template(tmp_path, tiny_data.tokenizer_dir, template)
    text = fails_and_keeps(
        tokenized, TemplateError, tokenize, conv_dir, tok, tokenized, chat_template="model"
    )
    assert text.startswith(expected)
    assert "tokenize.chat_template: deepseek" in text
    if template == RAISES:
        assert "Conversations must start with a system message" in text


def test_template_that_rewrites_history_names_the_conversation(tmp_path, conv_dir, tokenized, tiny_data):
    # The probe's replies are shorter than 20 characters, so only a real two-exchange conversation shows it.
    tok = tokenizer_with_template(tmp_path, tiny_data.tokenizer_dir, REWRITES_HISTORY)
    text = fails_and_keeps(
        tokenized, TemplateError, tokenize, conv_dir, tok, tokenized, chat_template="model"
    )
    split = (
        "train"
        if "s" in pq.read_table(conv_dir / "train.parquet").column("message_tree_id").to_pylist()
        else "validation"
    )
    assert text.startswith(
        f"{conv_dir / (split + '.parquet')}: conversation 's-pa': the chat template renders turns differently in "
        "context"
    )


def test_max_length_too_small_for_any_exchange(tmp_path, tokenized, tiny_data):
    # Train: a long question first, then a shorter one; the message must name the shorter (the minimum).
    records = [
        m("a", None, "prompter", LONG_PROMPT + " " + LONG_PROMPT, "a"),
        m("a-a", "a", "assistant", "Yes.", "a"),
        m("b", None, "prompter", LONG_PROMPT, "b"),
        m("b-a", "b", "assistant", "No.", "b"),
        m("c", None, "prompter", "Short?", "c"),
        m("c-a", "c", "assistant", "Short.", "c"),
    ]
    records = [{**r, "split": "validation" if r["message_tree_id"] == "c" else "train"} for r in records]
    conv = data_chain(tmp_path / "data", records)
    train = conv / "train.parquet"
    text = fails_and_keeps(
        tokenized, ValueError, tokenize, conv, tiny_data.tokenizer_dir, tokenized, max_length=8
    )
    need = int(text.rsplit(">= ", 1)[1])
    assert need > 16  # the config's own lower bound does not catch this one
    assert text == (
        f"{train}: tokenize.max_length 8 keeps none of its 2 conversations (no loss token survives truncation); "
        f"the shortest first user->assistant exchange needs {need} tokens (conversation 'b-a'); "
        f"allowed: tokenize.max_length >= {need}"
    )
    # The number is exact: one token fewer keeps nothing, that many keeps b's first reply token.
    below = fails_and_keeps(
        tokenized, ValueError, tokenize, conv, tiny_data.tokenizer_dir, tokenized, max_length=need - 1
    )
    assert below.startswith(f"{train}: tokenize.max_length {need - 1} keeps none of its 2 conversations")
    stats = tokenize(conv, tiny_data.tokenizer_dir, tmp_path / "at_need", max_length=need)
    assert (
        stats["splits"]["train"]["sequences"] == 1 and stats["splits"]["train"]["dropped_no_loss_tokens"] == 1
    )


def test_max_length_that_cuts_some_conversations_counts_them(tmp_path, tiny_data):
    records = [
        *GOOD,
        m("long", None, "prompter", "short question", "long"),
        m("long-a", "long", "assistant", "a very long answer " * 200, "long"),
        m("late", None, "prompter", LONG_PROMPT * 8, "late"),  # its reply starts past max_length
        m("late-a", "late", "assistant", "too late", "late"),
    ]
    # Splits fixed by the data, so that neither split is left with only the dropped conversation.
    records = [{**r, "split": "validation" if r["message_tree_id"] == "t" else "train"} for r in records]
    conv = data_chain(tmp_path, records)
    stats = tokenize(conv, tiny_data.tokenizer_dir, tmp_path / "tokenized", max_length=128)
    counts = {k: sum(s[k] for s in stats["splits"].values()) for k in ("truncated", "dropped_no_loss_tokens")}
    assert counts == {"truncated": 1, "dropped_no_loss_tokens": 1}


def test_empty_validation_split(tmp_path, tiny_data):
    conv = data_chain(tmp_path, GOOD[:2], validation_fraction=0.0)  # one tree: validation stays empty
    out = tmp_path / "tokenized"
    text = fails_and_keeps(out, ValueError, tokenize, conv, tiny_data.tokenizer_dir, out)
    assert text.startswith(f"{conv / 'validation.parquet'}: no conversations; every split needs at least one")
