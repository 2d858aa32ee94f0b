"""Bad input catalog, download stage: every way a source file can be wrong (the file itself, then its fields),
each run through the stage's own function (what its Snakemake script calls), asserting what the user reads: the
file, the line (JSONL, 1-based) or row (Parquet, 0-based), the field and what is allowed. Every failing case also
loses nothing (tests/bad_data.py's `fails_and_keeps`: the previous download stays byte for byte, no temporary
file beside it). What is not an error here (a BOM, CRLF line ends, only the required keys) is checked too.
The later stages' catalog: tests/test_bad_inputs.py.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bad_data import (
    BAD_ROW,
    GOOD,
    fails_and_keeps,
    line_of,
    rows,
    run_conversations,
    write_jsonl,
    write_parquet,
)
from snaketune.config.choices import ConfigError
from snaketune.config.schema import DatasetConfig
from snaketune.data import download
from snaketune.data.conversations import (
    REQUIRED_COLUMNS,
    DataError,
    read_messages,
)


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    """The download stage's outputs of a good earlier run: a failing run must leave them as they are."""
    out = tmp_path / "results" / "data" / "raw"
    download.materialize(str(write_jsonl(tmp_path / "good.jsonl", GOOD)), out)
    return out


def download_fails(source: Path | str, raw_dir: Path) -> str:
    return fails_and_keeps(raw_dir, DataError, download.materialize, str(source), raw_dir)


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
