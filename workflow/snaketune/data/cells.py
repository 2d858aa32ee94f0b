"""Where a value of a local dataset file sits, and how an error names it: the one form every reader of such a file
(oasst messages: snaketune.data.messages and .forest; chat-format conversations and preference pairs:
.chat_format, .pair_format; their tools and tool calls: .tools) gives a bad value,

    ``file: line N (message_id 'x'), key 'k': <value> (<type>) is not allowed; allowed: ...``  (JSONL)
    ``file: column 'k', row N (message_id 'x'): ...``                                           (Parquet)

so that a user finds the cell, and what would be accepted there, from the message alone.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import pandas as pd

from snaketune.data.jsonl import DataError


@dataclass(frozen=True)
class Source:
    """Where the rows came from: a file name and, for a text file, the 1-based line of each (0-based) row."""

    name: str
    lines: np.ndarray | None = None

    def at(self, row: int) -> str:
        """``line N`` of a text file, else ``row N``."""
        return f"line {self.lines[row]}" if self.lines is not None else f"row {row}"

    def where(self, column: str, row: int, record_id: Any = None) -> str:
        """How an error names a cell: ``file: line N (message_id 'x'), key 'k'`` for JSONL, ``file: column 'k',
        row N (message_id 'x')`` else; the id only where it has been read."""
        who = "" if record_id is None else f" (message_id {record_id!r})"
        if self.lines is not None:
            return f"{self.name}: {self.at(row)}{who}, key {column!r}"
        return f"{self.name}: column {column!r}, {self.at(row)}{who}"


class Cell(NamedTuple):
    """A record of a source: its row and, once read, its id (which the error names beside the row)."""

    source: Source
    row: int
    record_id: Any = None


def is_null(value: Any) -> bool:
    """None, pandas' NA and NaT, or a float NaN: how a missing cell reads, by dtype and pandas version."""
    # pd.isna is not used on purpose: on a list (a wrong-typed cell) it returns an array, not a bool.
    return (
        value is None or value is pd.NA or value is pd.NaT or (isinstance(value, float) and math.isnan(value))
    )


def bad_value(cell: Cell, column: str, value: Any, allowed: str) -> DataError:
    """The error for `value` in `column` of `cell`: where it is, the value and its type, what is allowed."""
    # One word for every kind of null: pandas shows a missing string as None, NaN or <NA> by dtype and version.
    shown = "null" if is_null(value) else f"{value!r} ({type(value).__name__})"
    where = cell.source.where(column, cell.row, cell.record_id)
    return DataError(f"{where}: {shown} is not allowed; allowed: {allowed}")


def missing_key(cell: Cell, column: str, name: str, allowed: str) -> DataError:
    """The error for a record (or a part of one, `column`) without its key `name`."""
    return DataError(f"{cell.source.where(column, cell.row)}: missing key {name!r}; allowed: {allowed}")
