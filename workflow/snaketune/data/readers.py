"""Stage 2a, the message files: read oasst-format messages in either official form into one table.

Two forms exist, both in oasst1 and oasst2 (and in LAION's exports):
- flat rows, one message per row: what `load_dataset("OpenAssistant/oasst1")` gives, or a
  `*.messages.jsonl[.gz]` export; read from `.jsonl`, `.jsonl.gz` or `.parquet`;
- nested trees, one tree per line: LAION's `*.trees.jsonl[.gz]` exports, `{"message_tree_id", "tree_state",
  "prompt": {message..., "replies": [message..., "replies": [...]]}}`; recognised by the first line's
  `prompt` key, whatever the file is called, and flattened to the same rows (a reply's parent_id is the
  message it sits under; a tree's message_tree_id and tree_state reach every message of it).

A malformed line, a key twice in one object or invalid UTF-8 is refused with the file, the line and what is
allowed; the table remembers the file and each row's line (snaketune.data.messages names them in its errors).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.data.jsonl import DataError, is_tree_record, json_lines
from snaketune.data.messages import (
    CHAT_HINT,
    LINES_ATTR,
    OPTIONAL_COLUMNS,
    REQUIRED_COLUMNS,
    SOURCE_ATTR,
    SUFFIXES,
)

TREE_KEYS = ("message_tree_id", "tree_state")
"""Keys of a nested tree line that every message of the tree inherits (unless it has its own)."""


def _flatten_tree(path: Path, line_no: int, tree: dict) -> list[dict[str, Any]]:
    """The messages of one nested tree as flat rows, parents before children; parent_id from the nesting."""
    if not isinstance(tree.get("prompt"), dict):
        raise DataError(
            f"{path}: line {line_no}, key 'prompt': {tree.get('prompt')!r} is not allowed; allowed: the tree's "
            "root message as a JSON object (LAION's nested export: prompt with replies)"
        )
    inherited = {k: tree[k] for k in TREE_KEYS if k in tree}
    rows: list[dict[str, Any]] = []
    stack: list[tuple[dict, str | None, str]] = [(tree["prompt"], None, "prompt")]
    while stack:
        message, parent_id, where_ = stack.pop()
        missing = [k for k in REQUIRED_COLUMNS if k != "parent_id" and k not in message]
        if missing:
            raise DataError(
                f"{path}: line {line_no}, {where_}: missing required key(s) {', '.join(missing)}; required in "
                f"every message of a tree: {', '.join(k for k in REQUIRED_COLUMNS if k != 'parent_id')}"
            )
        if message.get("parent_id", parent_id) != parent_id:
            raise DataError(
                f"{path}: line {line_no}, {where_} (message_id {message['message_id']!r}), key 'parent_id': "
                f"{message['parent_id']!r} is not allowed; allowed: the message it is a reply of "
                f"({parent_id!r})" + (" or null for the root" if parent_id is None else "")
            )
        replies = message.get("replies") or []
        if not isinstance(replies, list) or not all(isinstance(r, dict) for r in replies):
            raise DataError(
                f"{path}: line {line_no}, {where_} (message_id {message['message_id']!r}), key 'replies': "
                "allowed: a list of message objects"
            )
        row = {k: v for k, v in message.items() if k != "replies"}
        for key, value in inherited.items():
            if row.get(key) is None:  # LAION's messages often carry these keys as null
                row[key] = value
        row["parent_id"] = parent_id
        rows.append(row)
        for i in reversed(range(len(replies))):
            stack.append((replies[i], message["message_id"], f"{where_}.replies[{i}]"))
    return rows


def _what_is_read(rows: list[dict[str, Any]]) -> tuple:
    """The fields of a tree's messages that the stages read (two copies of a tree agree on these or differ)."""
    keys = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
    return tuple(json.dumps([row.get(k) for k in keys], sort_keys=True, default=str) for row in rows)


def _read_jsonl(path: Path) -> pd.DataFrame:
    """Flat message rows or nested trees (decided by the first line), as one row per message."""
    records: list[dict[str, Any]] = []
    lines: list[int] = []
    trees: bool | None = None
    seen_trees: dict[str, tuple[int, tuple]] = {}
    repeated = 0
    for line_no, record in json_lines(path):
        if trees is None:
            trees = is_tree_record(record)
        if trees:
            if not is_tree_record(record):
                raise DataError(
                    f"{path}: line {line_no}: a message row in a file of nested trees (line "
                    f"{min(seen_trees.values(), default=(line_no, ''))[0]} is a tree); allowed: one form per file"
                )
            rows = _flatten_tree(path, line_no, record)
            tree_id = str(record.get("message_tree_id") or rows[0]["message_id"])
            read = _what_is_read(rows)
            if tree_id in seen_trees:
                first_line, first_read = seen_trees[tree_id]
                if read == first_read:
                    # LAION's exports repeat some trees, at times with extra annotations that nothing here
                    # reads: the first copy is the tree.
                    repeated += 1
                    continue
                raise DataError(
                    f"{path}: line {line_no}: tree {tree_id!r} appears again with other messages (first on line "
                    f"{first_line}); allowed: each message_tree_id once (repeats that agree on "
                    f"{', '.join(REQUIRED_COLUMNS + OPTIONAL_COLUMNS[:-1])} are skipped)"
                )
            seen_trees[tree_id] = (line_no, read)
            records.extend(rows)
            lines.extend([line_no] * len(rows))
            continue
        if is_tree_record(record):
            raise DataError(
                f"{path}: line {line_no}: a nested tree in a file of message rows (line {lines[0]} is a "
                "message); allowed: one form per file"
            )
        # A key left out would read as null: a missing parent_id would make a reply a root, a missing
        # text would drop it as empty. In a table the column is there or not; in JSONL ask every line.
        missing = [key for key in REQUIRED_COLUMNS if key not in record]
        if missing:
            raise DataError(
                f"{path}: line {line_no}: missing required key(s) {', '.join(missing)}; "
                f"required on every line: {', '.join(REQUIRED_COLUMNS)} (parent_id null for a root); or one "
                "nested tree per line (LAION's *.trees.jsonl: message_tree_id, prompt with replies)"
                + (CHAT_HINT if "messages" in record else "")
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
    frame.attrs[FORM_ATTR] = "trees" if trees else "rows"
    frame.attrs[REPEATED_ATTR] = repeated
    return frame


FORM_ATTR = "snaketune_form"
"""``DataFrame.attrs`` key: ``rows`` (flat messages) or ``trees`` (nested export) for a JSONL source."""


REPEATED_ATTR = "snaketune_repeated_trees"
"""``DataFrame.attrs`` key: tree lines skipped because they repeat an earlier line exactly."""


def read_messages(path: str | os.PathLike[str]) -> pd.DataFrame:
    """Read oasst-format messages from .parquet, .jsonl or .jsonl.gz, flat rows or nested trees.

    The file name (and, for JSONL, each row's line) travel in ``DataFrame.attrs`` so that the checks of
    :func:`check_messages` and the stages after it can name them.
    """
    p = Path(path)
    if p.name.endswith((".jsonl", ".jsonl.gz")):
        frame = _read_jsonl(p)
    elif p.suffix == ".parquet":
        try:
            # integer_object_nulls: an int column with gaps stays ints (pandas would make 7 into 7.0), so
            # errors quote the value the file holds.
            frame = pq.read_table(p).to_pandas(integer_object_nulls=True)
        except pa.ArrowException as e:
            raise DataError(f"{p}: not a readable Parquet file ({e}); allowed: a Parquet file") from e
        frame.attrs[FORM_ATTR] = "rows"
    else:
        raise DataError(f"{p}: unsupported file type {p.suffix!r}; allowed: {', '.join(SUFFIXES)}")
    frame.attrs[SOURCE_ATTR] = str(p)
    return frame
