"""The two official oasst forms (flat message rows and LAION's nested trees), gzip, tree states, and the real
samples in tests/data/oasst: the same data in both forms gives the same conversations."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import REAL_OASST
from snaketune.data import download
from snaketune.data.conversations import build_conversations
from snaketune.data.messages import DataError
from snaketune.data.readers import read_messages


def message(message_id: str, role: str, text: str, *replies: dict, **extra) -> dict:
    return {
        "message_id": message_id,
        "role": role,
        "text": text,
        "lang": "en",
        **extra,
        "replies": list(replies),
    }


def tree(tree_id: str, state: str = "ready_for_export") -> dict:
    """A nested tree: root question, two ranked answers, a follow-up under the better one."""
    return {
        "message_tree_id": tree_id,
        "tree_state": state,
        "prompt": message(
            tree_id,
            "prompter",
            f"Question {tree_id}?",
            message(
                f"{tree_id}-a",
                "assistant",
                "Good answer.",
                message(
                    f"{tree_id}-f", "prompter", "And then?", message(f"{tree_id}-g", "assistant", "Then.")
                ),
                rank=0,
            ),
            message(f"{tree_id}-b", "assistant", "Worse answer.", rank=1),
        ),
    }


def flat(trees: list[dict]) -> list[dict]:
    """The same trees as flat rows, as load_dataset gives them."""
    rows = []

    def walk(m, parent, t):
        rows.append(
            {
                **{k: v for k, v in m.items() if k != "replies"},
                "parent_id": parent,
                "message_tree_id": t["message_tree_id"],
                "tree_state": t["tree_state"],
            }
        )
        for r in m["replies"]:
            walk(r, m["message_id"], t)

    for t in trees:
        walk(t["prompt"], None, t)
    return rows


def write_lines(path: Path, records: list[dict]) -> Path:
    text = "".join(json.dumps(r) + "\n" for r in records)
    if path.name.endswith(".gz"):
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


TREES = [tree("t1"), tree("t2"), tree("t3", state="aborted_low_grade")]


@pytest.mark.parametrize("name", ["x.trees.jsonl", "x.trees.jsonl.gz", "plain-name.jsonl"])
def test_nested_trees_read_as_the_flat_rows(tmp_path, name):
    nested = read_messages(write_lines(tmp_path / name, TREES))
    rows = read_messages(write_lines(tmp_path / "rows.jsonl", flat(TREES)))
    assert nested.attrs["snaketune_form"] == "trees" and rows.attrs["snaketune_form"] == "rows"
    a, b = build_conversations(nested, paths="all"), build_conversations(rows, paths="all")
    assert a.stats == b.stats
    pd.testing.assert_frame_equal(a.train, b.train)
    pd.testing.assert_frame_equal(a.validation, b.validation)
    # parent_id comes from the nesting; the tree's id and state reach every message.
    by_id = nested.set_index("message_id")
    assert by_id.loc["t1-g", "parent_id"] == "t1-f" and by_id.loc["t1", "parent_id"] is None
    assert set(by_id.loc[["t3", "t3-b"], "tree_state"]) == {"aborted_low_grade"}


def test_gzip_rows_and_parquet_read_alike(tmp_path):
    gz = read_messages(write_lines(tmp_path / "m.jsonl.gz", flat(TREES)))
    pq_path = tmp_path / "m.parquet"
    pd.DataFrame(flat(TREES)).to_parquet(pq_path)
    a, b = build_conversations(gz, paths="all"), build_conversations(read_messages(pq_path), paths="all")
    assert a.stats == b.stats
    pd.testing.assert_frame_equal(a.train, b.train)
    pd.testing.assert_frame_equal(a.validation, b.validation)


def test_tree_state_filter_default_keeps_ready_trees_and_counts_the_rest(tmp_path):
    result = build_conversations(read_messages(write_lines(tmp_path / "t.jsonl", TREES)), paths="all")
    assert result.stats["trees_dropped"] == {"language": 0, "tree_state": 1}
    assert result.stats["dropped"]["tree_state"] == 5  # every message of t3
    everything = build_conversations(read_messages(tmp_path / "t.jsonl"), paths="all", tree_states=())
    assert everything.stats["trees_dropped"]["tree_state"] == 0
    n = sum(everything.stats["conversations"].values())
    assert n == sum(result.stats["conversations"].values()) + 2


def test_null_tree_keys_on_messages_inherit_the_tree(tmp_path):
    t = tree("t1", state="growing")
    t["prompt"]["message_tree_id"] = None  # LAION's messages carry these keys as null
    t["prompt"]["tree_state"] = None
    frame = read_messages(write_lines(tmp_path / "t.jsonl", [t]))
    assert frame.loc[0, "message_tree_id"] == "t1" and frame.loc[0, "tree_state"] == "growing"


def test_exact_repeats_of_a_tree_are_skipped_and_recorded(tmp_path):
    again = json.loads(json.dumps(TREES[0]))
    again["prompt"]["CRITERIA"] = {"Relevance": 0.8}  # an annotation nothing reads: still the same tree
    src = write_lines(tmp_path / "t.trees.jsonl", [TREES[0], TREES[1], again])
    frame = read_messages(src)
    assert frame.attrs["snaketune_repeated_trees"] == 1 and len(frame) == 10
    record = download.materialize(str(src), tmp_path / "raw")
    assert record["form"] == "trees" and record["repeated_trees_skipped"] == 1
    # The first copy is the one stored (the annotated repeat is skipped: see the next test for annotations).
    stored = pd.read_parquet(tmp_path / "raw" / "messages.parquet")
    assert stored["message_id"].tolist() == frame["message_id"].tolist()


def annotated_trees(tmp_path: Path) -> Path:
    """Two different trees whose roots carry an annotation of different inner types, as oasst's emojis do."""
    first, second = json.loads(json.dumps(TREES[0])), json.loads(json.dumps(TREES[1]))
    first["prompt"]["emojis"] = {"+1": 3}
    second["prompt"]["emojis"] = {"+1": "many"}
    return write_lines(tmp_path / "t.trees.jsonl", [first, second])


def stored_annotations(raw: Path) -> dict:
    """message_id -> the stored emojis value of download's messages.parquet."""
    table = pq.read_table(raw / "messages.parquet", columns=["message_id", "emojis"])
    return dict(zip(*table.to_pydict().values(), strict=True))


def test_annotations_of_differing_inner_types_are_stored_as_json_text(tmp_path):
    """A dict column whose values differ in inner type cannot be one Parquet struct: download stores it as JSON
    text, and json.loads gives each message's value back."""
    record = download.materialize(str(annotated_trees(tmp_path)), tmp_path / "raw")
    assert (
        record["repeated_trees_skipped"] == 0 and record["messages"] == 10 and "emojis" in record["columns"]
    )
    column = pq.read_schema(tmp_path / "raw" / "messages.parquet").field("emojis").type
    assert pa.types.is_string(column) or pa.types.is_large_string(column)
    stored = stored_annotations(tmp_path / "raw")
    assert json.loads(stored["t1"]) == {"+1": 3} and json.loads(stored["t2"]) == {"+1": "many"}


def test_messages_without_the_annotation_store_null(tmp_path):
    """A message without the annotation (NaN where pandas filled the column) is stored as null, not as the text
    'NaN', which is no JSON."""
    download.materialize(str(annotated_trees(tmp_path)), tmp_path / "raw")
    stored = stored_annotations(tmp_path / "raw")
    assert {k: v for k, v in stored.items() if k not in ("t1", "t2")} == dict.fromkeys(
        ["t1-a", "t1-f", "t1-g", "t1-b", "t2-a", "t2-f", "t2-g", "t2-b"]
    )


def test_a_tree_repeated_with_other_messages_is_refused(tmp_path):
    other = json.loads(json.dumps(TREES[0]))
    other["prompt"]["replies"][0]["text"] = "Another answer."
    src = write_lines(tmp_path / "t.jsonl", [TREES[0], other])
    with pytest.raises(
        DataError, match=r"t\.jsonl: line 2: tree 't1' appears again with other messages \(first on line 1\)"
    ):
        read_messages(src)


def test_nested_tree_errors_name_line_path_and_key(tmp_path):
    bad = json.loads(json.dumps(TREES[0]))
    del bad["prompt"]["replies"][1]["text"]
    with pytest.raises(DataError, match=r"line 2, prompt\.replies\[1\]: missing required key\(s\) text"):
        read_messages(write_lines(tmp_path / "a.jsonl", [TREES[1], bad]))
    wrong_parent = json.loads(json.dumps(TREES[0]))
    wrong_parent["prompt"]["replies"][0]["parent_id"] = "elsewhere"
    with pytest.raises(
        DataError, match=r"line 1, prompt\.replies\[0\] \(message_id 't1-a'\), key 'parent_id': 'elsewhere'"
    ):
        read_messages(write_lines(tmp_path / "b.jsonl", [wrong_parent]))
    with pytest.raises(DataError, match=r"line 2: a message row in a file of nested trees"):
        read_messages(write_lines(tmp_path / "c.jsonl", [TREES[0], flat(TREES)[0]]))
    with pytest.raises(DataError, match=r"line 2: a nested tree in a file of message rows"):
        read_messages(write_lines(tmp_path / "d.jsonl", [flat(TREES)[0], TREES[0]]))
    with pytest.raises(DataError, match=r"key 'prompt': 'text' is not allowed"):
        read_messages(write_lines(tmp_path / "e.jsonl", [{"message_tree_id": "x", "prompt": "text"}]))


def test_broken_gzip_is_named(tmp_path):
    src = tmp_path / "m.jsonl.gz"
    src.write_bytes(b"not gzip at all")
    with pytest.raises(DataError, match=r"m\.jsonl\.gz: not a readable gzip file"):
        read_messages(src)


# ---- the real samples --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("trees", "rows"),
    [
        ("en_100_tree.jsonl.gz", "en_100.hf_rows.jsonl.gz"),
        ("openpaws_oasst2.trees.jsonl.gz", "openpaws_oasst2.hf_rows.jsonl.gz"),
    ],
)
@pytest.mark.parametrize("paths", ["top1", "all"])
def test_real_samples_give_the_same_conversations_in_both_forms(trees, rows, paths):
    a = build_conversations(read_messages(REAL_OASST / trees), paths=paths)
    b = build_conversations(read_messages(REAL_OASST / rows), paths=paths)
    assert a.stats == b.stats
    pd.testing.assert_frame_equal(a.train, b.train)
    pd.testing.assert_frame_equal(a.validation, b.validation)


def test_real_oasst2_sample_counts():
    """What tests/data/README.md says the sample holds, as the stages count it."""
    frame = read_messages(REAL_OASST / "openpaws_oasst2.trees.jsonl.gz")
    assert frame.attrs["snaketune_repeated_trees"] == 31 and len(frame) == 1500
    stats = build_conversations(frame, paths="all").stats
    assert stats["trees"] == 520
    assert stats["trees_dropped"]["tree_state"] == 426  # not ready_for_export
    assert stats["dropped"]["deleted"] > 0 and stats["dropped"]["review_failed"] > 0
    everything = build_conversations(frame, paths="all", tree_states=()).stats
    assert len(everything["by_language"]["train"]) >= 15


def test_early_export_without_review_fields_reads():
    """test.jsonl: an early export without review_result, deleted or tree_state."""
    stats = build_conversations(read_messages(REAL_OASST / "test.jsonl.gz")).stats
    assert stats["trees"] == 21 and sum(stats["conversations"].values()) == 20
