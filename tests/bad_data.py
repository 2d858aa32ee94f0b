"""The rows and stage runners the bad-input catalogs share (tests/test_bad_sources.py: the download stage;
tests/test_bad_inputs.py: the conversations, tokenizer and tokenize stages): a good oasst1-format sample, its
writers as JSONL and Parquet, and `fails_and_keeps`, which runs a stage that must fail and checks that it lost
nothing: the previous good outputs stay byte for byte as they were and no temporary file is left beside them."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from snaketune.data import download
from snaketune.data.conversations import build_conversations, read_messages, write_conversations
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
