"""Bad input catalog, data side: every way the download, conversations, tokenizer and tokenize stages can be
fed wrong data, each run through the stage's own function (what its Snakemake script calls), asserting what
the user reads: the file, the line (JSONL, 1-based) or row (Parquet, 0-based), the field and what is allowed.

Two more properties are checked for every failing case: the error comes before the stage writes anything,
so the previous good outputs stay byte for byte as they were ("lose nothing"), and no temporary file is
left beside them. What is not an error (orphans, loops, empty texts, trees without a reply, NaN ranks, a BOM)
is checked too: counted in stats.json and skipped.
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snaketune.config.choices import ConfigError
from snaketune.config.schema import DatasetConfig
from snaketune.data import download
from snaketune.data.conversations import (
    REQUIRED_COLUMNS,
    DataError,
    build_conversations,
    read_messages,
    write_conversations,
)
from snaketune.data.tokenization import TemplateError, load_tokenizer, tokenize_conversations
from snaketune.data.tokenizer import TokenizerError, conversation_texts, fetch_tokenizer, train_tokenizer
from snaketune.io import sha256_tree

LONG_PROMPT = " ".join(["please explain in detail how this works"] * 2)


def m(message_id: str, parent_id: str | None, role: str, text: str, tree: str, lang: str = "en") -> dict:
    return {
        "message_id": message_id,
        "parent_id": parent_id,
        "role": role,
        "text": text,
        "lang": lang,
        "message_tree_id": tree,
        "created_date": "2023-02-05T14:23:50.983374+00:00",
        "deleted": False,
        "rank": None if parent_id is None else 0.0,
    }


# Three trees (en, en, de), one of them two exchanges deep: every row type-checks and yields conversations.
GOOD = [
    m("r", None, "prompter", LONG_PROMPT, "r"),
    m("r-a", "r", "assistant", "It works by turning the crank until the light goes on.", "r"),
    m("s", None, "prompter", LONG_PROMPT + " again", "s"),
    m("s-a", "s", "assistant", "The long first answer that runs well past twenty characters.", "s"),
    m("s-p", "s-a", "prompter", "And then?", "s"),
    m("s-pa", "s-p", "assistant", "Then it stops.", "s"),
    m("t", None, "prompter", LONG_PROMPT + " bitte", "t", lang="de"),
    m("t-a", "t", "assistant", "Es funktioniert.", "t", lang="de"),
]
BAD_ROW = 3  # s-a: a reply in the middle of the file


def rows(**changes: Any) -> list[dict]:
    """A copy of GOOD with these keys of row BAD_ROW set (None: a JSON null / a Parquet null)."""
    out = copy.deepcopy(GOOD)
    out[BAD_ROW].update(changes)
    return out


def write_jsonl(path: Path, records: list[Any]) -> Path:
    """One JSON value per line, after a first blank line: file lines are not row numbers (row r is line r+2)."""
    lines = [b""] + [r if isinstance(r, bytes) else json.dumps(r).encode() for r in records]
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def line_of(row: int) -> int:
    return row + 2


def write_parquet(path: Path, records: list[dict], types: dict[str, pa.DataType] | None = None) -> Path:
    """A Parquet file whose columns hold exactly these values (a column of mixed types is cast as the type of
    its bad value: others become null, as one Parquet column has one type)."""
    names = dict.fromkeys(k for r in records for k in r)  # every key, in first-seen order
    columns = {k: [r.get(k) for r in records] for k in names}
    arrays = {}
    for name, values in columns.items():
        kinds = {type(v) for v in values if v is not None}
        if len(kinds) > 1:  # keep the odd one out (the bad value), null the rest
            odd = type(records[BAD_ROW][name])
            values = [v if type(v) is odd else None for v in values]
        arrays[name] = pa.array(values, type=(types or {}).get(name))
    pq.write_table(pa.table(arrays), path)
    return path


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    """The download stage's outputs of a good earlier run: a failing run must leave them as they are."""
    out = tmp_path / "results" / "data" / "raw"
    download.materialize(str(write_jsonl(tmp_path / "good.jsonl", GOOD)), out)
    return out


def fails_and_keeps(out_dir: Path, error: type[Exception], run, *args, **kwargs) -> str:
    """Run a stage function that must fail; check out_dir (and its parent: no temp files) is unchanged."""
    before = sha256_tree(out_dir) if out_dir.exists() else None
    siblings = sorted(p.name for p in out_dir.parent.iterdir()) if out_dir.parent.exists() else []
    with pytest.raises(error) as caught:
        run(*args, **kwargs)
    assert (sha256_tree(out_dir) if out_dir.exists() else None) == before, "a failing stage changed outputs"
    after = sorted(p.name for p in out_dir.parent.iterdir()) if out_dir.parent.exists() else []
    assert after == siblings, "a failing stage left files behind"
    return str(caught.value)


def download_fails(source: Path | str, raw_dir: Path) -> str:
    return fails_and_keeps(raw_dir, DataError, download.materialize, str(source), raw_dir)


def run_conversations(messages: Path, out_dir: Path, **spec: Any) -> None:
    """What workflow/scripts/conversations.py does."""
    result = build_conversations(
        read_messages(messages),
        languages=spec.get("languages", []),
        paths=spec.get("paths", "top1"),
        validation_fraction=spec.get("validation_fraction", 0.05),
        source_name=str(messages),
    )
    write_conversations(result, out_dir)


def data_chain(tmp_path: Path, records: list[dict], **spec: Any) -> Path:
    """download + conversations of records (a JSONL source); the conversations directory."""
    raw, conv = tmp_path / "raw", tmp_path / "conversations"
    tmp_path.mkdir(parents=True, exist_ok=True)
    download.materialize(str(write_jsonl(tmp_path / "src.jsonl", records)), raw)
    run_conversations(raw / "messages.parquet", conv, **spec)
    return conv


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


# ==== download stage: the file itself ====================================================================


def test_malformed_json_line(tmp_path, raw_dir):
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD[0], GOOD[1], b'{"message_id": "x", "text": "unclosed'])
    text = download_fails(src, raw_dir)
    assert text.startswith(f"{src}: line 4: malformed JSON at column 29 (Unterminated string starting at)")
    assert text.endswith("allowed: one JSON object per line")


@pytest.mark.parametrize(
    ("value", "kind"), [(b"[1, 2]", "list"), (b'"just text"', "str"), (b"null", "NoneType")]
)
def test_json_line_that_is_not_an_object(tmp_path, raw_dir, value, kind):
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD[0], value, GOOD[1]])
    assert download_fails(src, raw_dir) == (
        f"{src}: line 3: expected a JSON object (one message or one tree), got {kind}; allowed: one JSON object per line"
    )


def test_invalid_utf8_names_the_line(tmp_path, raw_dir):
    bad = json.dumps(GOOD[1]).encode().replace(b"It works", b"It w\xf6rks")  # latin-1, not UTF-8
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD[0], bad, *GOOD[2:]])
    text = download_fails(src, raw_dir)
    offset = bad.index(b"\xf6")
    assert text == f"{src}: line 3: invalid UTF-8 at byte {offset} of the line; allowed: UTF-8 text"


def test_utf8_bom_on_the_first_line_is_accepted(tmp_path):
    src = tmp_path / "m.jsonl"
    src.write_bytes(b"\xef\xbb\xbf" + b"\n".join(json.dumps(r).encode() for r in GOOD) + b"\n")
    record = download.materialize(str(src), tmp_path / "raw")
    assert record["messages"] == len(GOOD)
    assert read_messages(tmp_path / "raw" / "messages.parquet")["message_id"].tolist()[0] == "r"


def test_utf8_bom_inside_the_file_names_the_line(tmp_path, raw_dir):
    # Two files concatenated, the second saved with a BOM: the BOM lands at the start of a later line.
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD[0], b"\xef\xbb\xbf" + json.dumps(GOOD[1]).encode()])
    assert download_fails(src, raw_dir).startswith(
        f"{src}: line 3: malformed JSON at column 1 (Unexpected UTF-8 BOM"
    )


def test_duplicate_key_in_one_object(tmp_path, raw_dir):
    src = write_jsonl(tmp_path / "m.jsonl", [GOOD[0], b'{"message_id": "a", "text": "x", "text": "y"}'])
    assert download_fails(src, raw_dir) == (
        f"{src}: line 3: key 'text' appears twice in one object; allowed: each key once per object"
    )


def test_only_the_required_keys_and_crlf_line_ends_are_enough(tmp_path):
    # message_tree_id, lang, rank, ... are optional: the root's message_id is the tree id, lang "unknown".
    records = [{k: r[k] for k in REQUIRED_COLUMNS} for r in GOOD]
    src = tmp_path / "m.jsonl"
    src.write_bytes(b"".join(json.dumps(r).encode() + b"\r\n" for r in records))
    download.materialize(str(src), tmp_path / "raw")
    run_conversations(tmp_path / "raw" / "messages.parquet", tmp_path / "conv")
    stats = json.loads((tmp_path / "conv" / "stats.json").read_text())
    assert sum(stats["conversations"].values()) == 3
    assert set(stats["by_language"]["train"]) | set(stats["by_language"]["validation"]) == {"unknown"}


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_where_the_source_lies_leaves_no_trace_in_the_output(tmp_path, suffix):
    # read_messages keeps the file name and lines in DataFrame.attrs for the messages above; pandas would
    # store them in the Parquet's metadata, and a path there makes the bytes differ between checkouts.
    write = write_jsonl if suffix == ".jsonl" else write_parquet
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        download.materialize(str(write(tmp_path / name / f"m{suffix}", GOOD)), tmp_path / name / "raw")
    a, b = (tmp_path / n / "raw" / "messages.parquet" for n in ("a", "b"))
    assert a.read_bytes() == b.read_bytes()


def test_very_long_line_is_read(tmp_path):
    long = rows(text="word " * 200_000)  # a 1 MB line
    record = download.materialize(str(write_jsonl(tmp_path / "m.jsonl", long)), tmp_path / "raw")
    assert record["messages"] == len(GOOD)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"], ids=["zero-bytes", "blank-lines"])
def test_empty_jsonl(tmp_path, raw_dir, content):
    src = tmp_path / "m.jsonl"
    src.write_bytes(content)
    assert download_fails(src, raw_dir) == (
        f"{src}: no messages (the file is empty or has only blank lines); allowed: one JSON object per line"
    )


def test_empty_parquet(tmp_path, raw_dir):
    zero = tmp_path / "zero.parquet"
    zero.write_bytes(b"")
    assert download_fails(zero, raw_dir).startswith(f"{zero}: not a readable Parquet file (")
    no_rows = tmp_path / "no_rows.parquet"
    pq.write_table(pa.table({c: pa.array([], pa.string()) for c in REQUIRED_COLUMNS}), no_rows)
    assert download_fails(no_rows, raw_dir) == (
        f"{no_rows}: no messages (the table is empty); allowed: one row per message"
    )


def test_parquet_file_that_is_not_parquet(tmp_path, raw_dir):
    src = write_jsonl(tmp_path / "m.parquet", GOOD)  # JSONL under a .parquet name
    text = download_fails(src, raw_dir)
    assert text.startswith(f"{src}: not a readable Parquet file (")
    assert "magic bytes not found" in text and text.endswith("allowed: a Parquet file")


def test_unsupported_extension(tmp_path, raw_dir):
    src = tmp_path / "m.csv"
    src.write_text("message_id,parent_id,role,text\n", encoding="utf-8")
    assert (
        download_fails(src, raw_dir)
        == f"{src}: unsupported file type '.csv'; allowed: .jsonl, .jsonl.gz, .parquet"
    )
    # Caught earlier still, when the config is read, before any job runs:
    with pytest.raises(ConfigError, match=r"'dataset\.source': 'm\.csv' is not allowed; allowed: builtin"):
        DatasetConfig(source="m.csv")


@pytest.mark.parametrize("kind", ["missing", "directory"])
def test_source_file_missing_or_a_directory(tmp_path, raw_dir, kind):
    src = tmp_path / "m.jsonl"
    if kind == "directory":
        src.mkdir()
    what = "does not exist" if kind == "missing" else "is a directory"
    assert download_fails(src, raw_dir) == (
        f"config key 'dataset.source': {str(src)!r} {what}; allowed: builtin | hub:<dataset id> | "
        "an existing .jsonl or .parquet file"
    )


def test_malformed_hub_dataset_id_is_caught_with_the_config():
    with pytest.raises(ConfigError) as caught:
        DatasetConfig(source="hub:Open Assistant/oasst1")
    assert str(caught.value) == (
        "config key 'dataset.source': 'hub:Open Assistant/oasst1' is not a hub dataset id "
        "(expected hub:<owner>/<name>)"
    )


# ==== download stage: the fields =========================================================================


@pytest.mark.parametrize("key", REQUIRED_COLUMNS)
def test_missing_required_key_jsonl(tmp_path, raw_dir, key):
    records = rows()
    del records[BAD_ROW][key]
    src = write_jsonl(tmp_path / "m.jsonl", records)
    assert download_fails(src, raw_dir) == (
        f"{src}: line {line_of(BAD_ROW)}: missing required key(s) {key}; required on every line: "
        "message_id, parent_id, role, text (parent_id null for a root); or one nested tree per line "
        "(LAION's *.trees.jsonl: message_tree_id, prompt with replies)"
    )


@pytest.mark.parametrize("key", REQUIRED_COLUMNS)
def test_missing_required_column_parquet(tmp_path, raw_dir, key):
    src = write_parquet(tmp_path / "m.parquet", [{k: v for k, v in r.items() if k != key} for r in GOOD])
    assert download_fails(src, raw_dir) == (
        f"{src}: missing required column(s) {key}; required: message_id, parent_id, role, text "
        "(optional: lang, created_date, rank, deleted, review_result, message_tree_id, tree_state, split)"
    )


# key, bad value, what the message says is allowed
CELL_CASES = [
    ("text", 5, "a string or null"),
    ("parent_id", 7, "a string or null"),
    ("deleted", "yes", "true, false or null"),
    ("review_result", 0, "true, false or null"),
    ("rank", "first", "a finite number or null"),
    ("role", "user", "prompter, assistant"),
    ("role", None, "prompter, assistant"),
    ("lang", 1, "a string or null"),
    ("message_tree_id", 9, "a string or null"),
    (
        "created_date",
        "last tuesday",
        "an ISO 8601 date string (e.g. 2023-02-05T14:23:50.983374+00:00), a timestamp or null",
    ),
    ("split", "test", "train, validation or null"),
]
CELL_IDS = [f"{key}={value!r}" for key, value, _ in CELL_CASES]


def shown(value: Any) -> str:
    return "null" if value is None else f"{value!r} ({type(value).__name__})"


@pytest.mark.parametrize(("key", "value", "allowed"), CELL_CASES, ids=CELL_IDS)
def test_wrong_value_jsonl(tmp_path, raw_dir, key, value, allowed):
    src = write_jsonl(tmp_path / "m.jsonl", rows(**{key: value}))
    assert download_fails(src, raw_dir) == (
        f"{src}: line {line_of(BAD_ROW)} (message_id 's-a'), key {key!r}: {shown(value)} is not allowed; "
        f"allowed: {allowed}"
    )


@pytest.mark.parametrize(("key", "value", "allowed"), CELL_CASES, ids=CELL_IDS)
def test_wrong_value_parquet(tmp_path, raw_dir, key, value, allowed):
    src = write_parquet(tmp_path / "m.parquet", rows(**{key: value}))
    text = download_fails(src, raw_dir)
    # The value as the file has it: an int column with nulls is not read as floats (7, not 7.0).
    assert text == (
        f"{src}: column {key!r}, row {BAD_ROW} (message_id 's-a'): {shown(value)} is not allowed; "
        f"allowed: {allowed}"
    )


@pytest.mark.parametrize("value", [None, 42], ids=["null", "number"])
def test_bad_message_id(tmp_path, raw_dir, value):
    src = write_jsonl(tmp_path / "m.jsonl", rows(message_id=value))
    allowed = "a non-null string" if value is None else "a string"
    assert download_fails(src, raw_dir) == (
        f"{src}: line {line_of(BAD_ROW)}, key 'message_id': {shown(value)} is not allowed; allowed: {allowed}"
    )


@pytest.mark.parametrize("literal", [b"Infinity", b"-Infinity"])
def test_infinite_rank_jsonl(tmp_path, raw_dir, literal):
    # json.loads reads these non-standard literals; an infinite rank would silently sort first or last.
    line = json.dumps(GOOD[BAD_ROW]).encode().replace(b'"rank": 0.0', b'"rank": ' + literal)
    src = write_jsonl(tmp_path / "m.jsonl", [*GOOD[:BAD_ROW], line, *GOOD[BAD_ROW + 1 :]])
    assert download_fails(src, raw_dir).endswith("is not allowed; allowed: a finite number or null")


def test_text_stored_as_binary_in_parquet(tmp_path, raw_dir):
    src = write_parquet(tmp_path / "m.parquet", GOOD, types={"text": pa.binary()})
    text = download_fails(src, raw_dir)
    assert text.startswith(f"{src}: column 'text', row 0 (message_id 'r'): b'please explain")
    assert text.endswith("(bytes) is not allowed; allowed: a string or null")


def test_extra_column_with_mixed_types_jsonl(tmp_path, raw_dir):
    # Nothing reads user_id, but one Parquet column holds one type: say which lines disagree.
    records = copy.deepcopy(GOOD)
    records[1]["user_id"] = 17
    records[4]["user_id"] = "u-4"
    src = write_jsonl(tmp_path / "m.jsonl", records)
    assert download_fails(src, raw_dir) == (
        f"{src}: column 'user_id' cannot be stored in Parquet: its values have several types "
        f"(int first at {src}: line 3, key 'user_id'; str first at {src}: line 6, key 'user_id'); "
        "allowed: one type per column (and null)"
    )


def test_duplicate_message_id_names_both_places(tmp_path, raw_dir):
    records = rows(message_id="r-a")  # the id of row 1
    jsonl = write_jsonl(tmp_path / "m.jsonl", records)
    assert download_fails(jsonl, raw_dir) == (
        f"{jsonl}: line {line_of(BAD_ROW)}, key 'message_id': duplicate message_id 'r-a' "
        f"(first seen in line {line_of(1)}); message ids must be unique"
    )
    parquet = write_parquet(tmp_path / "m.parquet", records)
    assert download_fails(parquet, raw_dir) == (
        f"{parquet}: column 'message_id', row {BAD_ROW}: duplicate message_id 'r-a' (first seen in row 1); "
        "message ids must be unique"
    )


def test_reply_whose_parent_is_in_another_tree(tmp_path, raw_dir):
    src = write_jsonl(tmp_path / "m.jsonl", rows(message_tree_id="r"))  # s-a answers s, of tree s
    assert download_fails(src, raw_dir) == (
        f"{src}: line {line_of(BAD_ROW)} (message_id 's-a'), key 'message_tree_id': 'r' differs from the tree "
        f"of its parent 's' (line {line_of(2)}: 's'); allowed: the parent's message_tree_id"
    )


def test_tree_with_two_roots(tmp_path, raw_dir):
    records = copy.deepcopy(GOOD)
    for r in records[6:]:  # tree t becomes a second root of tree r
        r["message_tree_id"] = "r"
    src = write_parquet(tmp_path / "m.parquet", records)
    assert download_fails(src, raw_dir) == (
        f"{src}: column 'message_tree_id', row 6 (message_id 't'): tree 'r' has a second root "
        "(parent_id null); its first root is 'r' (row 0); allowed: one root per message_tree_id"
    )


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
    line = json.dumps(GOOD[BAD_ROW]).encode().replace(b'"rank": 0.0', b'"rank": NaN')
    records = [*GOOD[:BAD_ROW], line, *GOOD[BAD_ROW + 1 :]]
    raw = tmp_path / "raw"
    download.materialize(str(write_jsonl(tmp_path / "m.jsonl", records)), raw)
    rank = pq.read_table(raw / "messages.parquet").column("rank").to_pylist()[BAD_ROW]
    assert rank is None or rank != rank  # NaN
    run_conversations(raw / "messages.parquet", tmp_path / "conv")
    assert sum(json.loads((tmp_path / "conv" / "stats.json").read_text())["conversations"].values()) == 3


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
