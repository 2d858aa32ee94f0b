"""What snaketune.data.conversations writes, on small hand-made oasst1-format trees (tests/oasst_trees.py): the
train/validation split (by the tree's hash or a split column), stats.json, the Parquet files and read_messages'
formats, and an oasst1-sized input in seconds (which paths become conversations: tests/test_conversations.py)."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from oasst_trees import RICH, RICH_DROPPED, frame, ids, msg, pair, rich
from snaketune.data.conversations import (
    OUTPUT_COLUMNS,
    DataError,
    build_conversations,
    read_messages,
    split_hash,
    write_conversations,
)
from snaketune.data.tools import MESSAGE


def expected_hash(tree_id: str) -> float:
    # The documented formula, spelled out here independently of the module.
    return int(hashlib.sha256(tree_id.encode()).hexdigest()[:16], 16) / 2**64


# ---- splits -------------------------------------------------------------------------------------------


def test_split_by_hash_matches_formula():
    rows = [r for i in range(200) for r in pair(f"tree{i:03d}")]
    result = build_conversations(frame(*rows), validation_fraction=0.3)
    assert result.stats["split_source"] == "hash"
    assert result.stats["split_fallback"] is None
    for tree_id in result.train["message_tree_id"]:
        assert expected_hash(tree_id) >= 0.3
    for tree_id in result.validation["message_tree_id"]:
        assert expected_hash(tree_id) < 0.3
    assert len(result.train) + len(result.validation) == 200
    assert 20 < len(result.validation) < 100
    assert split_hash("tree000") == expected_hash("tree000")
    # Pinned: the split of a tree may never change between versions, machines or Python's hash seeds (a changed
    # split would move validation trees into training).
    assert split_hash("tree000") == 0.22455684316930288
    oasst1_form = "6ab24d72-0181-4594-a9cd-deaf170242fb"
    assert split_hash(oasst1_form) == 0.7682919485355566


def test_split_keeps_each_tree_in_one_split():
    rows = [msg(f"t{i}", None, "prompter") for i in range(50)]
    rows += [msg(f"t{i}-{j}", f"t{i}", "assistant") for i in range(50) for j in range(3)]
    result = build_conversations(frame(*rows), paths="all", validation_fraction=0.3)
    assert not set(result.train["message_tree_id"]) & set(result.validation["message_tree_id"])
    assert len(result.train) + len(result.validation) == 150


def test_tiny_dataset_still_gets_a_validation_tree():
    result = build_conversations(frame(*pair("r"), *pair("s"), *pair("t")), validation_fraction=0.0)
    smallest = min(["r", "s", "t"], key=expected_hash)
    assert list(result.validation["message_tree_id"]) == [smallest]
    assert result.stats["split_fallback"] == {"message_tree_id": smallest, "moved_to": "validation"}
    assert result.stats["conversations"] == {"train": 2, "validation": 1}


def test_single_tree_is_not_moved():
    result = build_conversations(frame(*pair("r")), validation_fraction=0.0)
    assert len(result.train) == 1 and len(result.validation) == 0
    assert result.stats["split_fallback"] is None


def test_split_column_decides_by_root():
    rows = [
        *pair("r", split="train"),
        *pair("s", split="validation"),
        *pair("t", split="train"),
    ]
    rows[3]["split"] = "train"  # a reply's split does not matter: its root's does
    result = build_conversations(frame(*rows), validation_fraction=0.99)
    assert list(result.train["message_tree_id"]) == ["r", "t"]
    assert list(result.validation["message_tree_id"]) == ["s"]
    assert result.stats["split_source"] == "source"
    assert result.stats["split_fallback"] is None


def test_split_column_all_null_falls_back_to_hash():
    rows = [{**r, "split": None} for r in pair("r") + pair("s")]
    assert build_conversations(frame(*rows)).stats["split_source"] == "hash"


def test_split_column_bad_value():
    rows = [*pair("r", split="train"), *pair("s", split="test")]
    with pytest.raises(
        DataError, match=r"m\.parquet: column 'split', row 2.*'test'.*allowed: train, validation"
    ):
        build_conversations(frame(*rows), source_name="m.parquet")


def test_split_column_null_on_a_root_while_others_have_one():
    rows = [*pair("r", split="train"), *pair("s")]
    with pytest.raises(DataError, match=r"'split', row 2.*root of tree 's' has no split"):
        build_conversations(frame(*rows))


def test_split_column_without_validation_moves_one_tree():
    rows = [*pair("r", split="train"), *pair("s", split="train")]
    result = build_conversations(frame(*rows))
    smallest = min(["r", "s"], key=expected_hash)
    assert list(result.validation["message_tree_id"]) == [smallest]
    assert result.stats["split_source"] == "source"


def test_split_column_without_train_moves_one_tree():
    """Every tree marked validation: the one with the largest hash moves to train, and stats say so."""
    rows = [*pair("r", split="validation"), *pair("s", split="validation")]
    result = build_conversations(frame(*rows))
    assert expected_hash("r") > expected_hash("s")  # 0.271 and 0.017
    assert list(result.train["message_tree_id"]) == ["r"]
    assert list(result.validation["message_tree_id"]) == ["s"]
    assert result.stats["split_fallback"] == {"message_tree_id": "r", "moved_to": "train"}
    assert result.stats["trees_by_split"] == {"train": 1, "validation": 1}


# ---- stats --------------------------------------------------------------------------------------------


def test_stats_full():
    result = rich(paths="all", validation_fraction=0.0)
    smallest = min(["t1", "t2"], key=expected_hash)
    moved_lang = "en" if smallest == "t1" else "de"
    other_lang = "de" if smallest == "t1" else "en"
    n_moved = 3 if smallest == "t1" else 1
    turns = {"t1": (2 + 4 + 2) / 3, "t2": 2.0}
    expected = {
        "paths": "all",
        "languages": [],
        "validation_fraction": 0.0,
        "max_trees": None,
        "trees_sampled_out": 0,
        "trees": 4,
        "messages": 22,
        "messages_kept": 11,
        "dropped": RICH_DROPPED,
        "tree_states": ["ready_for_export"],
        "trees_dropped": {"language": 0, "tree_state": 0},
        "paths_dropped": {"non_alternating": 1, "no_exchange": 1, "duplicate": 0},
        "paths_trimmed_prompter": 1,
        "split_source": "hash",
        "split_fallback": {"message_tree_id": smallest, "moved_to": "validation"},
        "trees_by_split": {"train": 1, "validation": 1},
        "conversations": {"train": 4 - n_moved, "validation": n_moved},
        "by_language": {"train": {other_lang: 4 - n_moved}, "validation": {moved_lang: n_moved}},
        "turns_mean": {
            "train": round(turns["t2" if smallest == "t1" else "t1"], 4),
            "validation": round(turns[smallest], 4),
        },
    }
    assert result.stats == expected
    json.dumps(result.stats)  # JSON-able


# ---- files --------------------------------------------------------------------------------------------


def test_write_is_byte_identical_and_independent_of_row_order(tmp_path):
    df = frame(*RICH)
    first = build_conversations(df, paths="all")
    shuffled = build_conversations(df.sample(frac=1.0, random_state=7).reset_index(drop=True), paths="all")
    write_conversations(first, tmp_path / "a")
    write_conversations(shuffled, tmp_path / "b")
    write_conversations(first, tmp_path / "a")  # overwriting gives the same bytes again
    for name in ("train.parquet", "validation.parquet", "stats.json"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == [
        "stats.json",
        "train.parquet",
        "validation.parquet",
    ]


def test_written_files_round_trip(tmp_path):
    result = build_conversations(frame(*pair("r"), *pair("s")), validation_fraction=0.0)
    write_conversations(result, tmp_path)
    train = pq.read_table(tmp_path / "train.parquet")
    assert train.schema.names == list(OUTPUT_COLUMNS)
    assert train.schema.field("messages").type == pa.list_(MESSAGE)
    # Stored as every stage stores a message (snaketune.data.tools.MESSAGE): oasst's have no tool calls.
    stored = [
        {**row, "messages": [{**m, "tool_calls": None, "tool_call_id": None} for m in row["messages"]]}
        for row in result.train.to_dict("records")
    ]
    assert train.to_pylist() == stored
    assert json.loads((tmp_path / "stats.json").read_text()) == result.stats
    text = (tmp_path / "stats.json").read_text()
    assert text == json.dumps(result.stats, sort_keys=True, indent=2) + "\n"


def test_empty_split_written_with_schema(tmp_path):
    result = build_conversations(frame(*pair("r")), validation_fraction=0.0)
    write_conversations(result, tmp_path)
    validation = pq.read_table(tmp_path / "validation.parquet")
    assert validation.num_rows == 0
    assert validation.schema == pq.read_table(tmp_path / "train.parquet").schema


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def test_read_messages_jsonl(tmp_path):
    lines = [json.dumps(r).encode() for r in pair("r") + pair("s")]
    path = write_lines(tmp_path / "m.jsonl", [lines[0], b"", *lines[1:]])
    df = read_messages(path)
    assert list(df["message_id"]) == ["r", "r-a", "s", "s-a"]
    assert ids(build_conversations(df, source_name=str(path))) == ["r-a", "s-a"]


def test_read_messages_jsonl_malformed_line(tmp_path):
    lines = [json.dumps(r).encode() for r in pair("r")]
    path = write_lines(tmp_path / "m.jsonl", [lines[0], lines[1], b'{"message_id": "x", '])
    with pytest.raises(DataError, match=r"m\.jsonl: line 3: malformed JSON"):
        read_messages(path)


def test_read_messages_jsonl_invalid_utf8(tmp_path):
    lines = [json.dumps(r).encode() for r in pair("r")]
    path = write_lines(tmp_path / "m.jsonl", [lines[0], b'{"text": "caf\xe9"}', lines[1]])
    with pytest.raises(DataError, match=r"m\.jsonl: line 2: invalid UTF-8"):
        read_messages(path)


def test_read_messages_jsonl_line_not_an_object(tmp_path):
    path = write_lines(tmp_path / "m.jsonl", [json.dumps(pair("r")[0]).encode(), b"[1, 2]"])
    with pytest.raises(DataError, match=r"m\.jsonl: line 2: expected a JSON object"):
        read_messages(path)


def test_read_messages_parquet_with_oasst1_types(tmp_path):
    table = pa.table(
        {
            "message_id": ["r", "a0", "a1"],
            "parent_id": [None, "r", "r"],
            "role": ["prompter", "assistant", "assistant"],
            "text": ["q", "best", "second"],
            "lang": ["en", "en", "en"],
            "rank": pa.array([None, 1.0, 0.0], pa.float64()),
            "created_date": pa.array([1, 2, 3], pa.timestamp("us", tz="UTC")),
            "deleted": [False, False, False],
            "review_result": pa.array([True, None, True], pa.bool_()),
        }
    )
    pq.write_table(table, tmp_path / "m.parquet")
    df = read_messages(tmp_path / "m.parquet")
    assert ids(build_conversations(df)) == ["a1"]


def test_read_messages_bad_files(tmp_path):
    with pytest.raises(
        DataError, match=r"unsupported file type '\.csv'; allowed: \.jsonl, \.jsonl\.gz, \.parquet"
    ):
        read_messages(tmp_path / "m.csv")
    (tmp_path / "bad.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="bad.parquet: not a readable Parquet file"):
        read_messages(tmp_path / "bad.parquet")


# ---- scale --------------------------------------------------------------------------------------------


def test_oasst1_sized_input_is_fast():
    # ~90k messages like oasst1: 10k trees of a question, 3 ranked answers, 2 follow-ups, 2 answers.
    rows: list[dict] = []
    for t in range(10_000):
        root = f"t{t}"
        rows.append(msg(root, None, "prompter", lang="en" if t % 3 else "de"))
        for a in range(3):
            rows.append(msg(f"{root}a{a}", root, "assistant", rank=float(a)))
        for p in range(2):
            rows.append(msg(f"{root}p{p}", f"{root}a0", "prompter", rank=float(p)))
            rows.append(msg(f"{root}p{p}a", f"{root}p{p}", "assistant"))
    df = frame(*rows)
    start = time.perf_counter()
    result = build_conversations(df, paths="all")
    elapsed = time.perf_counter() - start
    assert len(result.train) + len(result.validation) == 10_000 * 4
    assert elapsed < 20, f"took {elapsed:.1f} s"


def test_read_messages_jsonl_with_bom(tmp_path):
    lines = [json.dumps(r).encode() for r in pair("r")]
    path = write_lines(tmp_path / "m.jsonl", [b"\xef\xbb\xbf" + lines[0], lines[1]])
    assert list(read_messages(path)["message_id"]) == ["r", "r-a"]
