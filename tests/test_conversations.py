"""Unit tests for snaketune.data.conversations on small hand-made oasst1-format trees (tests/oasst_trees.py): which
root-to-leaf paths become conversations, what is dropped and counted, the conversations' shape, and the input's
validation (the splits, stats and files the stage writes: tests/test_conversation_outputs.py)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from oasst_trees import RICH, RICH_DROPPED, all_rows, by_id, frame, ids, msg, pair, rich
from snaketune.data.conversations import (
    OUTPUT_COLUMNS,
    REQUIRED_COLUMNS,
    DataError,
    build_conversations,
)

# ---- path selection -----------------------------------------------------------------------------------


def test_top1_follows_best_surviving_child_and_trims_trailing_prompter():
    result = rich(paths="top1")
    convs = by_id(result)
    # t1 -> a2 (a1 deleted) -> p5 (rank 2 beats unranked p4) -> leaf; p5 is then trimmed.
    assert convs["a2"] == [
        {"role": "user", "content": "text of t1"},
        {"role": "assistant", "content": "text of a2"},
    ]
    assert ids(result) == ["a2", "t2-a"]
    assert result.stats["paths_trimmed_prompter"] == 1


def test_all_paths_yields_every_root_to_leaf_path():
    result = rich(paths="all")
    convs = by_id(result)
    assert ids(result) == ["a2", "a4", "a5", "t2-a"]
    assert [m["content"] for m in convs["a4"]] == ["text of t1", "text of a2", "text of p4", "text of a4"]
    assert [m["role"] for m in convs["a4"]] == ["user", "assistant", "user", "assistant"]
    assert [m["content"] for m in convs["a5"]] == ["text of t1", "text of a5"]


def test_top1_rank_ties_break_by_created_date_then_message_id():
    rows = [
        msg("r", None, "prompter"),
        msg("c", "r", "assistant", rank=0, created_date="2023-02-02"),
        msg("b", "r", "assistant", rank=0, created_date="2023-02-01"),
        msg("a", "r", "assistant", rank=1, created_date="2023-01-01"),
    ]
    assert ids(build_conversations(frame(*rows))) == ["b"]
    rows[1]["created_date"] = "2023-02-01"  # now c and b tie on rank and date: the smaller id wins
    assert ids(build_conversations(frame(*rows))) == ["b"]
    rows[2]["message_id"] = "d"
    assert ids(build_conversations(frame(*rows))) == ["c"]


def test_top1_orders_dates_as_instants_across_offsets_and_forms():
    """Exports mix UTC offsets and forms; the older reply wins by the instant, not by the string."""
    for older, younger in [
        ("2023-02-05T10:00:00+05:00", "2023-02-05T06:00:00+00:00"),  # 05:00 UTC before 06:00 UTC
        ("2023-02-05T05:00:00Z", "2023-02-05T05:00:00.5+00:00"),  # whole seconds, "Z"
        ("2023-02-05T05:00:00", "2023-02-05T05:00:01+00:00"),  # no offset: UTC
    ]:
        rows = [
            msg("r", None, "prompter"),
            msg("b-younger", "r", "assistant", created_date=younger),
            msg("c-older", "r", "assistant", created_date=older),
        ]
        assert ids(build_conversations(frame(*rows))) == ["c-older"], (older, younger)


def test_top1_unranked_children_ordered_by_date():
    rows = [
        msg("r", None, "prompter"),
        msg("late", "r", "assistant", created_date="2023-03-01T00:00:00+00:00"),
        msg("early", "r", "assistant", created_date="2023-01-01T00:00:00+00:00"),
    ]
    assert ids(build_conversations(frame(*rows))) == ["early"]
    assert ids(build_conversations(frame(*rows), paths="all")) == ["early", "late"]


def test_top1_goes_to_leaf_through_many_turns():
    rows = [msg("m0", None, "prompter")]
    for i in range(1, 6):
        rows.append(msg(f"m{i}", f"m{i - 1}", "assistant" if i % 2 else "prompter", rank=0))
        rows.append(msg(f"x{i}", f"m{i - 1}", "assistant" if i % 2 else "prompter", rank=1))
    result = build_conversations(frame(*rows))
    assert ids(result) == ["m5"]
    assert len(by_id(result)["m5"]) == 6


def test_all_mode_dedupes_prompter_leaves_that_trim_to_the_same_conversation():
    rows = [
        msg("r", None, "prompter"),
        msg("a", "r", "assistant"),
        msg("q1", "a", "prompter"),
        msg("q2", "a", "prompter"),
    ]
    result = build_conversations(frame(*rows), paths="all")
    assert ids(result) == ["a"]
    assert result.stats["paths_dropped"]["duplicate"] == 1


def test_deep_thread_needs_no_recursion():
    depth = 5000  # deeper than Python's default recursion limit
    rows = [msg("m0", None, "prompter")]
    rows += [msg(f"m{i}", f"m{i - 1}", "assistant" if i % 2 else "prompter") for i in range(1, depth)]
    for paths in ("top1", "all"):
        result = build_conversations(frame(*rows), paths=paths)
        assert len(by_id(result)[f"m{depth - 1}"]) == depth


# ---- dropping -----------------------------------------------------------------------------------------


def test_drop_counts_by_reason():
    stats = rich().stats
    assert stats["dropped"] == RICH_DROPPED
    assert stats["messages"] == len(RICH) == 22
    assert stats["messages_kept"] == 11
    assert stats["trees"] == 4


def test_deleted_drops_subtree():
    rows = [*pair("r"), msg("r-a2", "r", "assistant", deleted=True), msg("r-p", "r-a2", "prompter")]
    result = build_conversations(frame(*rows), paths="all")
    assert ids(result) == ["r-a"]
    assert result.stats["dropped"]["deleted"] == 1
    assert result.stats["dropped"]["under_dropped_parent"] == 1


def test_review_failed_drops_subtree_and_null_review_counts_as_passed():
    rows = [
        msg("r", None, "prompter", review_result=None),
        msg("good", "r", "assistant", review_result=True),
        msg("bad", "r", "assistant", review_result=False),
        msg("bad-p", "bad", "prompter", review_result=True),
        msg("bad-a", "bad-p", "assistant"),
    ]
    result = build_conversations(frame(*rows), paths="all")
    assert ids(result) == ["good"]
    assert result.stats["dropped"]["review_failed"] == 1
    assert result.stats["dropped"]["under_dropped_parent"] == 2


def test_empty_or_blank_text_drops_subtree_without_failing():
    rows = [
        *pair("r"),
        msg("blank", "r", "assistant", text=" \n "),
        msg("blank-p", "blank", "prompter"),
        msg("empty", "r", "assistant", text=""),
        msg("none", "r", "assistant", text=None),
    ]
    rows[-1]["text"] = None  # msg() fills in a default text; force a null one
    result = build_conversations(frame(*rows), paths="all")
    assert ids(result) == ["r-a"]
    assert result.stats["dropped"]["empty_text"] == 3
    assert result.stats["dropped"]["under_dropped_parent"] == 1


def test_dropped_root_drops_whole_tree():
    rows = [*pair("r", deleted=True), *pair("s")]
    result = build_conversations(frame(*rows))
    assert ids(result) == ["s-a"]
    assert result.stats["dropped"]["deleted"] == 1
    assert result.stats["dropped"]["under_dropped_parent"] == 1


def test_orphans_and_loops_are_skipped_and_counted():
    rows = [
        *pair("r"),
        msg("o1", "gone", "prompter"),
        msg("o2", "o1", "assistant"),
        msg("o3", "o2", "prompter"),
        msg("self", "self", "prompter"),
        msg("x", "y", "prompter"),
        msg("y", "z", "assistant"),
        msg("z", "x", "prompter"),
        msg("hang", "z", "assistant"),
    ]
    result = build_conversations(frame(*rows))
    assert ids(result) == ["r-a"]
    assert result.stats["dropped"]["orphan"] == 3
    assert result.stats["dropped"]["loop"] == 5
    assert result.stats["trees"] == 1


def test_language_filter_uses_root_language():
    rows = [
        *pair("en1", lang="en"),
        msg("de1", None, "prompter", lang="de"),
        msg("de1-a", "de1", "assistant", lang="en"),  # a reply's own lang does not matter
        msg("de1-b", "de1", "assistant", lang="en"),
        msg("nolang", None, "prompter", lang=None),
        msg("nolang-a", "nolang", "assistant", lang=None),
    ]
    result = build_conversations(frame(*rows), languages=["en"], paths="all")
    assert ids(result) == ["en1-a"]
    assert result.stats["dropped"]["language"] == 5
    assert result.stats["trees_dropped"] == {"language": 2, "tree_state": 0}
    assert result.stats["languages"] == ["en"]
    unknown = build_conversations(frame(*rows), languages=["unknown"])
    assert ids(unknown) == ["nolang-a"]
    assert set(all_rows(unknown)["lang"]) == {"unknown"}


def test_language_absent_column_defaults_to_unknown():
    df = frame(*pair("r"), *pair("s")).drop(columns=["lang"])
    result = build_conversations(df)
    assert set(all_rows(result)["lang"]) == {"unknown"}
    assert result.stats["by_language"]["train"] == {"unknown": len(result.train)}


# ---- conversation shape -------------------------------------------------------------------------------


def test_no_exchange_and_non_alternating_paths_are_counted():
    rows = [
        *pair("ok"),
        msg("lone", None, "prompter"),  # nothing left after trimming the unanswered question
        msg("arootq", None, "assistant"),  # starts with the assistant
        msg("arootq-p", "arootq", "prompter"),
        msg("twice", None, "prompter"),  # two questions in a row
        msg("twice-p", "twice", "prompter"),
        msg("twice-a", "twice-p", "assistant"),
        msg("doublea", None, "prompter"),  # two answers in a row
        msg("doublea-a", "doublea", "assistant"),
        msg("doublea-b", "doublea-a", "assistant"),
    ]
    result = build_conversations(frame(*rows), paths="all")
    assert ids(result) == ["ok-a"]
    assert result.stats["paths_dropped"] == {"non_alternating": 3, "no_exchange": 1, "duplicate": 0}


def test_trailing_prompter_removed_and_roles_mapped():
    rows = [*pair("r"), msg("r-q", "r-a", "prompter")]
    result = build_conversations(frame(*rows))
    conv = by_id(result)["r-a"]
    assert [m["role"] for m in conv] == ["user", "assistant"]
    assert result.stats["paths_trimmed_prompter"] == 1


def test_output_columns_types_and_order():
    rows = [*pair("b"), *pair("a"), msg("a-a2", "a", "assistant", rank=1)]
    result = build_conversations(frame(*rows), paths="all", validation_fraction=0.0)
    for part in (result.train, result.validation):
        assert tuple(part.columns) == OUTPUT_COLUMNS
        keys = list(zip(part["message_tree_id"], part["conversation_id"], strict=True))
        assert keys == sorted(keys)
        assert list(part.index) == list(range(len(part)))
    rows_all = all_rows(result)
    assert rows_all["conversation_id"].is_unique
    assert all(isinstance(v, str) for v in rows_all["message_tree_id"])


def test_message_tree_id_column_is_taken_from_root():
    rows = [*pair("r", message_tree_id="tree-r"), *pair("s")]
    rows[1]["message_tree_id"] = "tree-r"
    result = build_conversations(frame(*rows))
    assert sorted(all_rows(result)["message_tree_id"]) == ["s", "tree-r"]


def test_extra_columns_ignored():
    rows = [{**r, "user_id": "u", "emojis": {"+1": 3}, "synthetic": False} for r in pair("r") + pair("s")]
    assert ids(build_conversations(frame(*rows))) == ["r-a", "s-a"]


# ---- input validation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("column", REQUIRED_COLUMNS)
def test_missing_required_column(column):
    df = frame(*pair("r")).drop(columns=[column])
    with pytest.raises(DataError, match=rf"data\.jsonl: missing required column\(s\) {column}"):
        build_conversations(df, source_name="data.jsonl")


def test_empty_dataframe():
    df = pd.DataFrame(columns=list(REQUIRED_COLUMNS))
    with pytest.raises(DataError, match="x.parquet: no messages"):
        build_conversations(df, source_name="x.parquet")


def test_bad_role_names_value_row_and_allowed():
    rows = [*pair("r"), msg("bad", "r", "user")]
    with pytest.raises(DataError) as err:
        build_conversations(frame(*rows), source_name="m.jsonl")
    text = str(err.value)
    for part in ("m.jsonl", "'role'", "row 2", "'bad'", "'user'", "prompter, assistant"):
        assert part in text


@pytest.mark.parametrize(
    ("column", "value", "allowed"),
    [
        ("text", 5, "a string or null"),
        ("deleted", "yes", "true, false or null"),
        ("deleted", 1, "true, false or null"),
        ("review_result", "false", "true, false or null"),
        ("rank", "first", "a finite number or null"),
        ("rank", True, "a finite number or null"),
        ("parent_id", 7, "a string or null"),
        ("message_id", 3, "a string"),
        ("lang", ["en"], "a string or null"),
        (
            "created_date",
            20230101,
            "an ISO 8601 date string (e.g. 2023-02-05T14:23:50.983374+00:00), a timestamp or null",
        ),
    ],
)
def test_wrong_column_type(column, value, allowed):
    rows = [*pair("r"), msg("x", "r", "assistant")]
    rows[2][column] = value
    with pytest.raises(DataError) as err:
        build_conversations(pd.DataFrame(rows, dtype=object), source_name="m.jsonl")
    text = str(err.value)
    assert "m.jsonl" in text and f"'{column}'" in text and "row 2" in text and allowed in text


def test_null_message_id_is_an_error():
    rows = [*pair("r"), msg(None, "r", "assistant")]  # type: ignore[arg-type]
    with pytest.raises(DataError, match="'message_id', row 2.*a non-null string"):
        build_conversations(frame(*rows))


def test_duplicate_message_id():
    rows = [*pair("r"), msg("r-a", "r", "assistant")]
    with pytest.raises(DataError, match=r"m\.jsonl.*row 2.*duplicate message_id 'r-a'.*first seen in row 1"):
        build_conversations(frame(*rows), source_name="m.jsonl")


def test_nothing_left_names_filters_and_counts():
    rows = [*pair("r"), *pair("s"), msg("t", None, "prompter", lang="fr")]
    with pytest.raises(
        DataError,
        match=r"left no conversations \(dataset\.languages: \['fr'\], dataset\.paths: 'top1'\): 5 messages "
        r"in 3 trees; trees outside dataset\.languages: 2 \(4 messages\);.*paths dropped: no_exchange 1",
    ):
        build_conversations(frame(*rows), languages=["fr"])
    with pytest.raises(DataError, match="no_exchange"):
        build_conversations(frame(msg("r", None, "prompter")))


def test_a_language_no_tree_has_lists_the_languages_there_are():
    rows = [*pair("r"), *pair("s"), *pair("t", lang="de")]
    with pytest.raises(
        DataError,
        match=r"'dataset\.languages': 'fr' occurs in no tree of m\.parquet .*allowed: the languages the data "
        r"has: en \(2 trees\), de \(1 tree\)$",
    ):
        build_conversations(frame(*rows), languages=["en", "fr"], source_name="m.parquet")


def test_bad_arguments():
    df = frame(*pair("r"))
    with pytest.raises(ValueError, match="allowed: top1, all"):
        build_conversations(df, paths="best")
    with pytest.raises(ValueError, match="validation_fraction"):
        build_conversations(df, validation_fraction=1.0)
    with pytest.raises(TypeError):
        build_conversations(df, languages="en")


# ---- oasst1 column types ------------------------------------------------------------------------------


def test_oasst1_types_nan_rank_timestamps_nullable_bools():
    df = frame(
        msg("r", None, "prompter", lang="en"),
        msg("late", "r", "assistant", lang="en"),
        msg("early", "r", "assistant", lang="en"),
        msg("ranked", "r", "assistant", lang="en"),
    )
    df["rank"] = pd.Series([np.nan, np.nan, np.nan, 0.0], dtype="float64")
    df["created_date"] = pd.to_datetime(
        ["2023-01-01T00:00:00Z", "2023-03-01T00:00:00Z", "2023-02-01T00:00:00Z", "2023-04-01T00:00:00Z"]
    )
    df["deleted"] = pd.array([False, False, pd.NA, False], dtype="boolean")
    df["review_result"] = pd.array([True, pd.NA, True, False], dtype="boolean")
    result = build_conversations(df, paths="top1")
    assert ids(result) == ["early"]  # ranked is review-failed; among unranked, the earlier wins
    assert result.stats["dropped"]["review_failed"] == 1
    assert ids(build_conversations(df, paths="all")) == ["early", "late"]
