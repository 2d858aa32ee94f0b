"""Stage 2a, the message tables: the checks every oasst-format message passes, whatever file it came from.

``parent_id`` links a reply to the message it answers and is null for a tree's root. `parse` turns a table of
messages (snaketune.data.readers reads either official form into one) into typed `Message`s, checking every
cell: each error names the file, the line (JSONL) or row (Parquet), the key and what is allowed. The stages that
build conversations and preference pairs (snaketune.data.conversations, snaketune.data.preferences) work on the
typed messages.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import numpy as np
import pandas as pd

from snaketune.data.cells import Cell, Source, bad_value, is_null
from snaketune.data.jsonl import DataError

REQUIRED_COLUMNS = ("message_id", "parent_id", "role", "text")
OPTIONAL_COLUMNS = (
    "lang",
    "created_date",
    "rank",
    "deleted",
    "review_result",
    "message_tree_id",
    "tree_state",
    "split",
)
ROLES = {"prompter": "user", "assistant": "assistant"}
SPLITS = ("train", "validation")
UNKNOWN_LANG = "unknown"
SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
"""File types a local dataset.source may have."""


CHAT_HINT = (
    "; it has `messages`, the chat format's field: dataset.format: chat (or auto) reads it, from a local file"
)


@dataclass(frozen=True, slots=True)
class Message:
    """One checked message (row = 0-based position in the table)."""

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
    tree_state: str | None
    split: str | None


# ---- input checks -------------------------------------------------------------------------------------


SOURCE_ATTR = "snaketune_source"
"""``DataFrame.attrs`` key under which :func:`read_messages` keeps the file name (the default source_name)."""
LINES_ATTR = "snaketune_source_lines"
"""``DataFrame.attrs`` key under which :func:`read_messages` keeps the 1-based line of each JSONL row, so
that errors found later (in :func:`check_messages`) name the line of the text file, not a row number."""


def _source(messages: pd.DataFrame, source_name: str) -> Source:
    lines = messages.attrs.get(LINES_ATTR)
    # Only trust the line numbers when the table is still the one read_messages made.
    ok = isinstance(lines, np.ndarray) and len(lines) == len(messages)
    return Source(source_name, lines if ok else None)


def where(messages: pd.DataFrame, source_name: str, column: str, row: int) -> str:
    """How an error names a cell of the table (snaketune.data.cells.Source.where)."""
    return _source(messages, source_name).where(column, row)


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
            + (CHAT_HINT if "messages" in messages.columns else "")
        )
    duplicated = messages.columns[messages.columns.duplicated()].tolist()
    if duplicated:
        raise DataError(f"{source_name}: column(s) {', '.join(map(str, duplicated))} appear more than once")


def _as_str(value: Any, nullable: bool, at: Cell, column: str) -> str | None:
    if is_null(value):
        if nullable:
            return None
        raise bad_value(at, column, value, "a non-null string")
    if not isinstance(value, str):
        raise bad_value(at, column, value, "a string" + (" or null" if nullable else ""))
    return value


def _as_bool(value: Any, default: bool, at: Cell, column: str) -> bool:
    if is_null(value):
        return default
    # Strict on purpose: a 0/1 or "false" column means the export is not what we think it is.
    if not isinstance(value, (bool, np.bool_)):
        raise bad_value(at, column, value, "true, false or null")
    return bool(value)


def _as_rank(value: Any, at: Cell) -> float | None:
    if is_null(value):
        return None  # unranked; oasst1 parquet stores this as NaN in a float column (JSON NaN reads the same)
    # Infinity would sort before (or after) every real rank: refused rather than silently best or worst.
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real) or math.isinf(value):
        raise bad_value(at, "rank", value, "a finite number or null")
    return float(value)


_DATE_ALLOWED = "an ISO 8601 date string (e.g. 2023-02-05T14:23:50.983374+00:00), a timestamp or null"


def _as_date(value: Any, at: Cell) -> str:
    """The date as UTC, ISO 8601 with microseconds (2023-02-05T14:23:50.983374+00:00; a date without an offset is
    taken as UTC), so that comparing two of these strings compares the instants: dates order siblings (rank ties),
    and exports mix offsets and forms ("...Z", "+05:00", whole seconds). Null: ""."""
    if is_null(value):
        return ""
    if isinstance(value, str):
        # A string that is no date would order siblings by its letters.
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            raise bad_value(at, "created_date", value, _DATE_ALLOWED) from None
    elif isinstance(value, datetime):  # pd.Timestamp is one (nanoseconds dropped)
        parsed = value.to_pydatetime(warn=False) if hasattr(value, "to_pydatetime") else value
    else:
        raise bad_value(at, "created_date", value, _DATE_ALLOWED)
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=UTC)
    return parsed.astimezone(UTC).isoformat(timespec="microseconds")


def _parse_row(cols: dict[str, list[Any]], row: int, src: Source, has_split: bool) -> Message:
    """One row, type-checked, with the defaults of absent optional columns filled in."""
    message_id = _as_str(cols["message_id"][row], False, Cell(src, row), "message_id")
    at = Cell(src, row, message_id)
    role = cols["role"][row]
    if not isinstance(role, str) or role not in ROLES:
        raise bad_value(at, "role", role, ", ".join(ROLES))
    split = _as_str(cols["split"][row], True, at, "split") if has_split else None
    if split is not None and split not in SPLITS:
        raise bad_value(at, "split", split, ", ".join(SPLITS) + " or null")
    return Message(
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
        tree_state=_as_str(cols["tree_state"][row], True, at, "tree_state"),
        split=split,
    )


def _parse_messages(messages: pd.DataFrame, src: Source) -> list[Message]:
    """Check every cell once and return typed messages (row = 0-based position in the table)."""
    _check_columns(messages, src.name)
    has_split = "split" in messages.columns and bool(messages["split"].notna().any())
    cols = {name: _column(messages, name) for name in REQUIRED_COLUMNS + OPTIONAL_COLUMNS}
    out: list[Message] = []
    first_row: dict[str, int] = {}
    for row in range(len(messages)):
        message = _parse_row(cols, row, src, has_split)
        if message.message_id in first_row:
            raise DataError(
                f"{src.where('message_id', row)}: duplicate message_id {message.message_id!r} "
                f"(first seen in {src.at(first_row[message.message_id])}); message ids must be unique"
            )
        first_row[message.message_id] = row
        out.append(message)
    return out


def tree_id(root: Message) -> str:
    return root.message_tree_id or root.message_id  # oasst1: the tree id is the root's message id


def _check_tree_ids(parsed: list[Message], src: Source) -> None:
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
                f"{src.where('message_tree_id', m.row, m.message_id)}: {m.message_tree_id!r} differs from "
                f"the tree of its parent {parent.message_id!r} ({src.at(parent.row)}: "
                f"{parent.message_tree_id!r}); allowed: the parent's message_tree_id"
            )
    first_root: dict[str, Message] = {}
    for m in parsed:
        if m.parent_id is not None:
            continue
        tid = tree_id(m)
        other = first_root.setdefault(tid, m)
        if other is not m:
            raise DataError(
                f"{src.where('message_tree_id', m.row, m.message_id)}: tree {tid!r} has a second root "
                f"(parent_id null); its first root is {other.message_id!r} ({src.at(other.row)}); "
                "allowed: one root per message_tree_id"
            )


def parse(messages: pd.DataFrame, source_name: str | None) -> tuple[list[Message], Source]:
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
    parse(messages, source_name)
