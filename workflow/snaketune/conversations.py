"""oasst1-format message trees -> chat conversations (train / validation) with stats.

One row of input is one message in the oasst1 schema (message_id, parent_id, role, text, lang, rank, ...);
``parent_id`` links a reply to the message it answers and is null for a tree's root. This module checks
the input, drops messages that must not be trained on (with their whole subtree, because a reply makes no
sense without what it answers), turns the surviving trees into root-to-leaf conversations (``top1`` or
``all``), and splits them by tree so that no tree is in both splits.

Every decision is deterministic (sorted iteration, hash-based split, fixed Parquet options), so the same
input always gives byte-identical outputs and Snakemake reruns change nothing downstream.
"""

from __future__ import annotations

import hashlib
import json
import math
import numbers
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.io import write_json, write_parquet

REQUIRED_COLUMNS = ("message_id", "parent_id", "role", "text")
OPTIONAL_COLUMNS = ("lang", "created_date", "rank", "deleted", "review_result", "message_tree_id", "split")
ROLES = {"prompter": "user", "assistant": "assistant"}
SPLITS = ("train", "validation")
PATHS_MODES = ("top1", "all")
UNKNOWN_LANG = "unknown"

# Reasons a message is dropped, in the order they are checked; stats list every one (0 included) so the
# stats file has the same keys whatever the data.
MESSAGE_DROP_REASONS = (
    "orphan",
    "loop",
    "language",
    "deleted",
    "review_failed",
    "empty_text",
    "under_dropped_parent",
)
PATH_DROP_REASONS = ("non_alternating", "no_exchange", "duplicate")

OUTPUT_SCHEMA = pa.schema(
    [
        ("conversation_id", pa.string()),
        ("message_tree_id", pa.string()),
        ("lang", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ]
)
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)


class DataError(ValueError):
    """The input messages are wrong; the message names the file, the field, the row and what is allowed."""


@dataclass(frozen=True)
class Conversations:
    """The result of :func:`build_conversations`."""

    train: pd.DataFrame
    """Columns conversation_id, message_tree_id, lang, messages; sorted by tree id, then conversation id."""
    validation: pd.DataFrame
    """Same columns as ``train``; trees here never appear in ``train``."""
    stats: dict[str, Any]
    """JSON-able counts: what was dropped and why, conversations per split and language."""


@dataclass(frozen=True, slots=True)
class _Message:
    row: int
    message_id: str
    parent_id: str | None
    role: str
    text: str | None
    lang: str
    created_date: str
    rank: float | None
    deleted: bool
    review_result: bool
    message_tree_id: str | None
    split: str | None


# ---- input checks -------------------------------------------------------------------------------------


def _is_null(value: Any) -> bool:
    # pd.isna is not used on purpose: on a list (a wrong-typed cell) it returns an array, not a bool.
    return (
        value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and math.isnan(value))
    )


SOURCE_ATTR = "snaketune_source"
"""``DataFrame.attrs`` key under which :func:`read_messages` keeps the file name (the default source_name)."""
LINES_ATTR = "snaketune_source_lines"
"""``DataFrame.attrs`` key under which :func:`read_messages` keeps the 1-based line of each JSONL row, so
that errors found later (in :func:`check_messages`) name the line of the text file, not a row number."""


@dataclass(frozen=True)
class _Source:
    """Where the rows came from: a file name and, for a text file, the line of each row."""

    name: str
    lines: np.ndarray | None = None

    def at(self, row: int) -> str:
        return f"line {self.lines[row]}" if self.lines is not None else f"row {row}"


def _source(messages: pd.DataFrame, source_name: str) -> _Source:
    lines = messages.attrs.get(LINES_ATTR)
    # Only trust the line numbers when the table is still the one read_messages made.
    ok = isinstance(lines, np.ndarray) and len(lines) == len(messages)
    return _Source(source_name, lines if ok else None)


def _where(src: _Source, column: str, row: int, message_id: Any = None) -> str:
    who = "" if message_id is None else f" (message_id {message_id!r})"
    if src.lines is not None:
        return f"{src.name}: {src.at(row)}{who}, key {column!r}"
    return f"{src.name}: column {column!r}, {src.at(row)}{who}"


def where(messages: pd.DataFrame, source_name: str, column: str, row: int) -> str:
    """How an error names a cell: ``file: line N, key 'k'`` for JSONL, ``file: column 'k', row N`` else."""
    return _where(_source(messages, source_name), column, row)


# Where a cell sits: (source, row, message_id); message_id is None until it has been read.
_At = tuple[_Source, int, Any]


def _bad_value(at: _At, column: str, value: Any, allowed: str) -> DataError:
    # One word for every kind of null: pandas shows a missing string as None, NaN or <NA> by dtype and version.
    shown = "null" if _is_null(value) else f"{value!r} ({type(value).__name__})"
    return DataError(f"{_where(at[0], column, at[1], at[2])}: {shown} is not allowed; allowed: {allowed}")


def _column(messages: pd.DataFrame, name: str) -> list[Any]:
    """The column as Python values (one conversion for the whole column), or all-None when absent."""
    if name in messages.columns:
        return messages[name].tolist()
    return [None] * len(messages)


def _check_columns(messages: pd.DataFrame, source_name: str) -> None:
    if not isinstance(messages, pd.DataFrame):
        raise DataError(
            f"{source_name}: expected a pandas DataFrame of messages, got {type(messages).__name__}"
        )
    # Empty first: a file without rows has no columns either, and "missing column" would mislead.
    if len(messages) == 0:
        raise DataError(f"{source_name}: no messages (the table is empty); allowed: one row per message")
    missing = [c for c in REQUIRED_COLUMNS if c not in messages.columns]
    if missing:
        raise DataError(
            f"{source_name}: missing required column(s) {', '.join(missing)}; "
            f"required: {', '.join(REQUIRED_COLUMNS)} (optional: {', '.join(OPTIONAL_COLUMNS)})"
        )
    duplicated = messages.columns[messages.columns.duplicated()].tolist()
    if duplicated:
        raise DataError(f"{source_name}: column(s) {', '.join(map(str, duplicated))} appear more than once")


def _as_str(value: Any, nullable: bool, at: _At, column: str) -> str | None:
    if _is_null(value):
        if nullable:
            return None
        raise _bad_value(at, column, value, "a non-null string")
    if not isinstance(value, str):
        raise _bad_value(at, column, value, "a string" + (" or null" if nullable else ""))
    return value


def _as_bool(value: Any, default: bool, at: _At, column: str) -> bool:
    if _is_null(value):
        return default
    # Strict on purpose: a 0/1 or "false" column means the export is not what we think it is.
    if not isinstance(value, (bool, np.bool_)):
        raise _bad_value(at, column, value, "true, false or null")
    return bool(value)


def _as_rank(value: Any, at: _At) -> float | None:
    if _is_null(value):
        return None  # unranked; oasst1 parquet stores this as NaN in a float column (JSON NaN reads the same)
    # Infinity would sort before (or after) every real rank: refused rather than silently best or worst.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or math.isinf(value):
        raise _bad_value(at, "rank", value, "a finite number or null")
    return float(value)


_DATE_ALLOWED = "an ISO 8601 date string (e.g. 2023-02-05T14:23:50.983374+00:00), a timestamp or null"


def _as_date(value: Any, at: _At) -> str:
    if _is_null(value):
        return ""
    if isinstance(value, str):
        # Dates order siblings (rank ties); a string that is no date would order them by its letters.
        try:
            datetime.fromisoformat(value)
        except ValueError:
            raise _bad_value(at, "created_date", value, _DATE_ALLOWED) from None
        return value
    # pd.Timestamp is a datetime; isoformat matches oasst1's string form (2023-02-05T14:23:50.983374+00:00).
    if isinstance(value, datetime):
        return value.isoformat()
    raise _bad_value(at, "created_date", value, _DATE_ALLOWED)


def _parse_row(cols: dict[str, list[Any]], row: int, src: _Source, has_split: bool) -> _Message:
    """One row, type-checked, with the defaults of absent optional columns filled in."""
    message_id = _as_str(cols["message_id"][row], False, (src, row, None), "message_id")
    at: _At = (src, row, message_id)
    role = cols["role"][row]
    if not isinstance(role, str) or role not in ROLES:
        raise _bad_value(at, "role", role, ", ".join(ROLES))
    split = _as_str(cols["split"][row], True, at, "split") if has_split else None
    if split is not None and split not in SPLITS:
        raise _bad_value(at, "split", split, ", ".join(SPLITS) + " or null")
    return _Message(
        row=row,
        message_id=message_id,  # type: ignore[arg-type]
        parent_id=_as_str(cols["parent_id"][row], True, at, "parent_id"),
        role=role,
        text=_as_str(cols["text"][row], True, at, "text"),
        lang=_as_str(cols["lang"][row], True, at, "lang") or UNKNOWN_LANG,
        created_date=_as_date(cols["created_date"][row], at),
        rank=_as_rank(cols["rank"][row], at),
        deleted=_as_bool(cols["deleted"][row], False, at, "deleted"),
        # oasst1 leaves review_result null for messages not yet reviewed; they were exported, so keep them.
        review_result=_as_bool(cols["review_result"][row], True, at, "review_result"),
        message_tree_id=_as_str(cols["message_tree_id"][row], True, at, "message_tree_id"),
        split=split,
    )


def _parse_messages(messages: pd.DataFrame, src: _Source) -> list[_Message]:
    """Check every cell once and return typed messages (row = 0-based position in the table)."""
    _check_columns(messages, src.name)
    has_split = "split" in messages.columns and bool(messages["split"].notna().any())
    cols = {name: _column(messages, name) for name in REQUIRED_COLUMNS + OPTIONAL_COLUMNS}
    out: list[_Message] = []
    first_row: dict[str, int] = {}
    for row in range(len(messages)):
        message = _parse_row(cols, row, src, has_split)
        if message.message_id in first_row:
            raise DataError(
                f"{_where(src, 'message_id', row)}: duplicate message_id {message.message_id!r} "
                f"(first seen in {src.at(first_row[message.message_id])}); message ids must be unique"
            )
        first_row[message.message_id] = row
        out.append(message)
    return out


def _tree_id(root: _Message) -> str:
    return root.message_tree_id or root.message_id  # oasst1: the tree id is the root's message id


def _check_tree_ids(parsed: list[_Message], src: _Source) -> None:
    """A reply is in its parent's tree, and a tree has one root.

    Either break means the export's tree ids and its parent links disagree. Conversations carry their root's
    tree id and are split by it, so two roots under one id would pass as one tree, and a reply filed under
    another tree says the links are not what the ids claim; no guess repairs that, so it is an error.
    """
    by_id = {m.message_id: m for m in parsed}
    for m in parsed:
        parent = by_id.get(m.parent_id) if m.parent_id is not None else None
        if parent is None or m.message_tree_id is None or parent.message_tree_id is None:
            continue
        if m.message_tree_id != parent.message_tree_id:
            raise DataError(
                f"{_where(src, 'message_tree_id', m.row, m.message_id)}: {m.message_tree_id!r} differs from "
                f"the tree of its parent {parent.message_id!r} ({src.at(parent.row)}: "
                f"{parent.message_tree_id!r}); allowed: the parent's message_tree_id"
            )
    first_root: dict[str, _Message] = {}
    for m in parsed:
        if m.parent_id is not None:
            continue
        tree_id = _tree_id(m)
        other = first_root.setdefault(tree_id, m)
        if other is not m:
            raise DataError(
                f"{_where(src, 'message_tree_id', m.row, m.message_id)}: tree {tree_id!r} has a second root "
                f"(parent_id null); its first root is {other.message_id!r} ({src.at(other.row)}); "
                "allowed: one root per message_tree_id"
            )


def _parse(messages: pd.DataFrame, source_name: str | None) -> tuple[list[_Message], _Source]:
    """Every check on the messages' own data: cell types, unique ids, tree ids; the typed messages."""
    if not isinstance(messages, pd.DataFrame):
        _check_columns(messages, str(source_name or "<messages>"))
    name = source_name if source_name is not None else str(messages.attrs.get(SOURCE_ATTR, "<messages>"))
    src = _source(messages, name)
    parsed = _parse_messages(messages, src)
    _check_tree_ids(parsed, src)
    return parsed, src


def check_messages(messages: pd.DataFrame, source_name: str | None = None) -> None:
    """Raise DataError for anything in the messages' own data that :func:`build_conversations` would refuse.

    The download stage calls it on the source as read, so an error names the source file (and the line of
    a JSONL file) rather than the Parquet file it would have written. Settings (languages, paths) are not
    checked here: they belong to the conversations stage. source_name defaults to the file read_messages
    read, else ``<messages>``.
    """
    _parse(messages, source_name)


# ---- tree structure -----------------------------------------------------------------------------------


def _find_roots(by_id: dict[str, _Message]) -> tuple[dict[str, str], dict[str, str]]:
    """Map each message to its root id, or to 'orphan' / 'loop' when no root is reachable.

    Walks each parent chain once and memoizes every message on it, so the whole pass is O(n) and a
    cycle (a -> b -> a, or a message that is its own parent) ends the walk instead of looping forever.
    """
    root_of: dict[str, str] = {}
    unreachable: dict[str, str] = {}
    for start in by_id:
        chain: list[str] = []
        on_chain: set[str] = set()
        current: str | None = start
        while True:
            if current in root_of:
                root, reason = root_of[current], None
                break
            if current in unreachable:
                root, reason = None, unreachable[current]
                break
            if current in on_chain:
                root, reason = None, "loop"
                break
            message = by_id.get(current)  # type: ignore[arg-type]
            if message is None:
                root, reason = None, "orphan"  # the chain names a parent that is not in the data
                break
            chain.append(message.message_id)
            on_chain.add(message.message_id)
            if message.parent_id is None:
                root, reason = message.message_id, None
                break
            current = message.parent_id
        for message_id in chain:
            if root is not None:
                root_of[message_id] = root
            else:
                unreachable[message_id] = reason  # type: ignore[assignment]
    return root_of, unreachable


def _sibling_order(message: _Message) -> tuple[bool, float, str, str]:
    """Best child first: numbered ranks (0 = best) before unranked, then older, then by id for ties."""
    return (message.rank is None, message.rank or 0.0, message.created_date, message.message_id)


def _own_drop_reason(message: _Message) -> str | None:
    if message.deleted:
        return "deleted"
    if not message.review_result:
        return "review_failed"
    if message.text is None or not message.text.strip():
        return "empty_text"
    return None


def _prune_tree(
    root: _Message, children: dict[str, list[_Message]], dropped: dict[str, int]
) -> dict[str, list[_Message]]:
    """Drop bad messages with their subtrees; return the surviving children of each surviving message.

    Dropping happens before any path is chosen, so ``top1`` follows the best *surviving* child.
    """
    kept_children: dict[str, list[_Message]] = {}
    stack: list[tuple[_Message, bool]] = [(root, False)]
    while stack:  # iterative: oasst1 threads can be deeper than Python's recursion limit allows for
        message, parent_dropped = stack.pop()
        reason = "under_dropped_parent" if parent_dropped else _own_drop_reason(message)
        if reason is not None:
            dropped[reason] += 1
        else:
            kept_children[message.message_id] = []
        for child in children.get(message.message_id, ()):
            stack.append((child, reason is not None))
    for message_id, kept in kept_children.items():
        kept.extend(c for c in children.get(message_id, ()) if c.message_id in kept_children)
    return kept_children


def _top1_path(root: _Message, kept_children: dict[str, list[_Message]]) -> Iterator[list[_Message]]:
    path = [root]
    while kept_children[path[-1].message_id]:
        path.append(kept_children[path[-1].message_id][0])  # children are sorted best first
    yield path


def _all_paths(root: _Message, kept_children: dict[str, list[_Message]]) -> Iterator[list[_Message]]:
    stack: list[list[_Message]] = [[root]]
    while stack:
        path = stack.pop()
        kids = kept_children[path[-1].message_id]
        if not kids:
            yield path
        stack.extend(path + [child] for child in reversed(kids))


def _to_conversation(path: list[_Message]) -> tuple[list[_Message] | None, str | None]:
    """The path as a trainable conversation, or None and the reason it is not one."""
    for i, message in enumerate(path):
        if message.role != ("prompter" if i % 2 == 0 else "assistant"):
            return None, "non_alternating"
    if path[-1].role == "prompter":
        path = path[:-1]  # an unanswered question teaches nothing; the exchanges before it still do
    if len(path) < 2:
        return None, "no_exchange"
    return path, None


# ---- splits -------------------------------------------------------------------------------------------


def split_hash(message_tree_id: str) -> float:
    """A tree's position in [0, 1): stable across runs, machines and Python versions (unlike hash())."""
    return int(hashlib.sha256(message_tree_id.encode("utf-8")).hexdigest()[:16], 16) / 2**64


def _assign_splits(
    tree_roots: dict[str, _Message], validation_fraction: float, use_source: bool, src: _Source
) -> tuple[dict[str, str], dict[str, str] | None]:
    """Split per tree id; return the assignment and the fallback move made (if any)."""
    assignment: dict[str, str] = {}
    for tree_id, root in sorted(tree_roots.items()):
        if use_source:
            if root.split is None:
                raise DataError(
                    f"{_where(src, 'split', root.row, root.message_id)}: "
                    f"the root of tree {tree_id!r} has no split while other rows have one; "
                    f"allowed: {', '.join(SPLITS)}"
                )
            assignment[tree_id] = root.split
        else:
            assignment[tree_id] = "validation" if split_hash(tree_id) < validation_fraction else "train"
    fallback = None
    if len(assignment) >= 2:
        # Tiny datasets (or filters that remove every held-out tree) must still give both splits, since
        # training evaluates on validation; move one tree, chosen by hash so the choice is stable.
        by_hash = sorted(assignment, key=lambda t: (split_hash(t), t))
        if "validation" not in assignment.values():
            fallback = {"message_tree_id": by_hash[0], "moved_to": "validation"}
        elif "train" not in assignment.values():
            fallback = {"message_tree_id": by_hash[-1], "moved_to": "train"}
        if fallback is not None:
            assignment[fallback["message_tree_id"]] = fallback["moved_to"]
    return assignment, fallback


# ---- build --------------------------------------------------------------------------------------------


@dataclass
class _Counts:
    """What was dropped and why, filled in as the trees are walked."""

    dropped: dict[str, int]
    paths_dropped: dict[str, int]
    trees_dropped_language: int = 0
    trimmed: int = 0


def _children_map(parsed: list[_Message], root_of: dict[str, str]) -> dict[str, list[_Message]]:
    """Children of every message, best first. One pass over the rows: O(n log k), no per-row filtering."""
    children: dict[str, list[_Message]] = {}
    for m in parsed:
        if m.parent_id is not None and m.message_id in root_of:
            children.setdefault(m.parent_id, []).append(m)
    for kids in children.values():
        kids.sort(key=_sibling_order)
    return children


def _tree_rows(
    root: _Message, kept_children: dict[str, list[_Message]], paths: str, counts: _Counts
) -> list[dict[str, Any]]:
    """The output rows of one pruned tree."""
    tree_id = _tree_id(root)
    select = _top1_path if paths == "top1" else _all_paths
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    for path in select(root, kept_children):
        conversation, reason = _to_conversation(path)
        if conversation is None:
            counts.paths_dropped[reason] += 1  # type: ignore[index]
            continue
        counts.trimmed += len(conversation) < len(path)
        conversation_id = conversation[-1].message_id
        if conversation_id in seen:
            # Two unanswered prompter leaves under one reply trim to the same conversation: keep one.
            counts.paths_dropped["duplicate"] += 1
            continue
        seen.add(conversation_id)
        rows.append(
            {
                "conversation_id": conversation_id,
                "message_tree_id": tree_id,
                "lang": root.lang,
                "messages": [{"role": ROLES[m.role], "content": m.text} for m in conversation],
            }
        )
    return rows


def _frame(rows: list[dict[str, Any]]) -> pd.DataFrame:
    rows = sorted(rows, key=lambda r: (r["message_tree_id"], r["conversation_id"]))
    frame = pd.DataFrame({c: pd.Series([r[c] for r in rows], dtype=object) for c in OUTPUT_COLUMNS})
    for c in ("conversation_id", "message_tree_id", "lang"):
        frame[c] = frame[c].astype(str)
    return frame


def _split_stats(rows: list[dict[str, Any]]) -> tuple[dict[str, int], float]:
    by_lang: dict[str, int] = {}
    for r in rows:
        by_lang[r["lang"]] = by_lang.get(r["lang"], 0) + 1
    # A turn is one message (user or assistant); rounded so the JSON does not carry float noise.
    turns = sum(len(r["messages"]) for r in rows) / len(rows) if rows else 0.0
    return dict(sorted(by_lang.items())), round(turns, 4)


def _counted(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items() if v) or "none"


def _check_languages(wanted: set[str], roots: list[_Message], src: _Source) -> None:
    """A wanted language that no tree has is a typo (pt for pt-BR) or the wrong file: say what there is."""
    have: dict[str, int] = {}
    for root in roots:
        have[root.lang] = have.get(root.lang, 0) + 1
    absent = sorted(wanted - have.keys())
    if absent:
        listing = ", ".join(
            f"{lang} ({n} tree{'s' * (n != 1)})"
            for lang, n in sorted(have.items(), key=lambda x: (-x[1], x[0]))
        )
        codes = ", ".join(map(repr, absent))
        raise DataError(
            f"config key 'dataset.languages': {codes} {'occurs' if len(absent) == 1 else 'occur'} in no tree "
            f"of {src.name} (the filter reads the lang of each tree's root message); allowed: the languages "
            f"the data has: {listing}"
        )


def _nothing_left(
    src: _Source, wanted: set[str], paths: str, n_messages: int, n_trees: int, counts: _Counts
) -> DataError:
    dropped = dict(counts.dropped)
    unreachable = {k: dropped.pop(k) for k in ("orphan", "loop")}
    in_language = dropped.pop("language")
    return DataError(
        f"{src.name}: the filters left no conversations (dataset.languages: {sorted(wanted) or 'all'}, "
        f"dataset.paths: {paths!r}): {n_messages} messages in {n_trees} trees; "
        f"trees outside dataset.languages: {counts.trees_dropped_language} ({in_language} messages); "
        f"messages dropped with their subtrees: {_counted(dropped)}; "
        f"messages skipped as orphans or loops: {_counted(unreachable)}; "
        f"paths dropped: {_counted(counts.paths_dropped)} (a conversation needs a prompter message answered "
        "by an assistant reply, roles alternating from a prompter root); allowed: data where at least one "
        "tree keeps such an exchange"
    )


def build_conversations(
    messages: pd.DataFrame,
    *,
    languages: Sequence[str] = (),
    paths: str = "top1",
    validation_fraction: float = 0.05,
    source_name: str | None = None,
) -> Conversations:
    """Turn oasst1-format messages into train/validation conversations.

    languages: keep trees whose root message has one of these ``lang`` codes (empty keeps all).
    paths: ``top1`` follows the best-ranked surviving child from each root to a leaf; ``all`` yields every
    root-to-leaf path. validation_fraction: share of trees held out when the data has no ``split`` column.
    source_name: the file name that error messages cite (default: the file read_messages read).
    Raises DataError for malformed input, for a language that no tree has, or when the filters leave no
    conversation at all. Orphans, parent loops and everything the filters drop are counted, not errors.
    """
    if isinstance(languages, str):
        raise TypeError(f"languages must be a sequence of codes, not the string {languages!r}")
    if paths not in PATHS_MODES:
        raise ValueError(f"paths {paths!r} is not allowed; allowed: {', '.join(PATHS_MODES)}")
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction {validation_fraction} must be >= 0 and < 1")

    parsed, src = _parse(messages, source_name)
    root_of, unreachable = _find_roots({m.message_id: m for m in parsed})
    counts = _Counts(
        dropped=dict.fromkeys(MESSAGE_DROP_REASONS, 0), paths_dropped=dict.fromkeys(PATH_DROP_REASONS, 0)
    )
    for reason in unreachable.values():
        counts.dropped[reason] += 1
    children = _children_map(parsed, root_of)
    tree_size: dict[str, int] = {}
    for root_id in root_of.values():
        tree_size[root_id] = tree_size.get(root_id, 0) + 1

    wanted = set(languages)
    roots = sorted((m for m in parsed if m.parent_id is None), key=lambda m: m.message_id)
    _check_languages(wanted, roots, src)
    rows: list[dict[str, Any]] = []
    tree_roots: dict[str, _Message] = {}
    for root in roots:
        if wanted and root.lang not in wanted:
            counts.trees_dropped_language += 1
            counts.dropped["language"] += tree_size[root.message_id]
            continue
        kept_children = _prune_tree(root, children, counts.dropped)
        if root.message_id not in kept_children:
            continue
        tree = _tree_rows(root, kept_children, paths, counts)
        if tree:
            tree_roots[tree[0]["message_tree_id"]] = root
            rows.extend(tree)

    if not rows:
        raise _nothing_left(src, wanted, paths, len(parsed), len(roots), counts)

    use_source = any(m.split is not None for m in parsed)
    assignment, fallback = _assign_splits(tree_roots, validation_fraction, use_source, src)
    split_rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for r in rows:
        split_rows[assignment[r["message_tree_id"]]].append(r)

    # No file paths or times in here: stats.json must be byte-identical wherever the workflow runs.
    stats: dict[str, Any] = {
        "paths": paths,
        "languages": sorted(wanted),
        "validation_fraction": validation_fraction,
        "trees": len(roots),
        "messages": len(parsed),
        "messages_kept": len(parsed) - sum(counts.dropped.values()),
        "dropped": counts.dropped,
        "trees_dropped": {"language": counts.trees_dropped_language},
        "paths_dropped": counts.paths_dropped,
        "paths_trimmed_prompter": counts.trimmed,
        "split_source": "source" if use_source else "hash",
        "split_fallback": fallback,
        "trees_by_split": {s: sum(1 for t in assignment.values() if t == s) for s in SPLITS},
        "conversations": {s: len(split_rows[s]) for s in SPLITS},
        "by_language": {},
        "turns_mean": {},
    }
    for s in SPLITS:
        stats["by_language"][s], stats["turns_mean"][s] = _split_stats(split_rows[s])
    return Conversations(
        train=_frame(split_rows["train"]), validation=_frame(split_rows["validation"]), stats=stats
    )


# ---- files --------------------------------------------------------------------------------------------


def _output_table(frame: pd.DataFrame) -> pa.Table:
    # Built from plain lists with a fixed schema: no pandas metadata (it records the pandas version and
    # index details), and an empty split still gets the right column types.
    return pa.Table.from_pydict({c: frame[c].tolist() for c in OUTPUT_COLUMNS}, schema=OUTPUT_SCHEMA)


def write_conversations(result: Conversations, out_dir: str | os.PathLike[str]) -> None:
    """Write train.parquet, validation.parquet and stats.json; the bytes depend only on ``result``.

    snaketune.io writes each file to a temp file beside it and renames it into place, with fixed Parquet
    writer options and sorted-key JSON (indent 2).
    """
    out = Path(out_dir)
    write_parquet(_output_table(result.train), out / "train.parquet")
    write_parquet(_output_table(result.validation), out / "validation.parquet")
    write_json(out / "stats.json", result.stats)


def _object_without_duplicate_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    record = dict(pairs)
    if len(record) < len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                # json.loads would keep the last value silently; which one the author meant is a guess.
                raise ValueError(f"key {key!r} appears twice in one object")
            seen.add(key)
    return record


def _read_jsonl(path: Path) -> pd.DataFrame:
    records: list[dict[str, Any]] = []
    lines: list[int] = []
    with path.open("rb") as fh:
        for line_no, raw in enumerate(fh, start=1):
            try:
                # utf-8-sig on the first line: editors on Windows often start a file with a BOM.
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                raise DataError(
                    f"{path}: line {line_no}: invalid UTF-8 at byte {e.start} of the line; allowed: UTF-8 text"
                ) from e
            if not line.strip():
                continue
            try:
                # Without the line end: an unclosed string would otherwise end in "invalid control character".
                record = json.loads(line.rstrip("\r\n"), object_pairs_hook=_object_without_duplicate_keys)
            except json.JSONDecodeError as e:
                raise DataError(
                    f"{path}: line {line_no}: malformed JSON at column {e.colno} ({e.msg}); "
                    "allowed: one JSON object per line"
                ) from e
            except ValueError as e:  # from the duplicate-key hook
                raise DataError(f"{path}: line {line_no}: {e}; allowed: each key once per message") from e
            if not isinstance(record, dict):
                raise DataError(
                    f"{path}: line {line_no}: expected a JSON object (one message), "
                    f"got {type(record).__name__}; allowed: one JSON object per line"
                )
            # A key left out would read as null: a missing parent_id would make a reply a root, a missing
            # text would drop it as empty. In a table the column is there or not; in JSONL ask every line.
            missing = [key for key in REQUIRED_COLUMNS if key not in record]
            if missing:
                raise DataError(
                    f"{path}: line {line_no}: missing required key(s) {', '.join(missing)}; "
                    f"required on every line: {', '.join(REQUIRED_COLUMNS)} (parent_id null for a root)"
                )
            records.append(record)
            lines.append(line_no)
    if not records:
        raise DataError(
            f"{path}: no messages (the file is empty or has only blank lines); allowed: one JSON object per line"
        )
    # dtype=object keeps each value as the JSON had it: pandas would otherwise turn 0 into 0.0 and null into
    # NaN in a column with gaps, and an error would then quote a value the file does not contain.
    frame = pd.DataFrame(records, dtype=object)
    frame.attrs[LINES_ATTR] = np.asarray(lines, dtype=np.int64)
    return frame


def read_messages(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read an oasst1-format message table from .parquet or .jsonl (one JSON object per line).

    The file name (and, for JSONL, each row's line) travel in ``DataFrame.attrs`` so that the checks of
    :func:`check_messages` and :func:`build_conversations` can name them.
    """
    p = Path(path)
    if p.suffix == ".jsonl":
        frame = _read_jsonl(p)
    elif p.suffix == ".parquet":
        try:
            # integer_object_nulls: an int column with gaps stays ints (pandas would make 7 into 7.0), so
            # errors quote the value the file holds.
            frame = pq.read_table(p).to_pandas(integer_object_nulls=True)
        except pa.ArrowException as e:
            raise DataError(f"{p}: not a readable Parquet file ({e}); allowed: a Parquet file") from e
    else:
        raise DataError(f"{p}: unsupported file type {p.suffix!r}; allowed: .parquet, .jsonl")
    frame.attrs[SOURCE_ATTR] = str(p)
    return frame
