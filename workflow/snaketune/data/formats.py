"""What a dataset file holds (config key `dataset.format`), told from its fields when the config loads.

- `oasst`: the OpenAssistant message schema (snaketune.data.readers): flat rows with message_id, parent_id, role and
  text, or LAION's nested trees (a tree's root message under `prompt`, with `replies`);
- `chat`: the common chat format (snaketune.data.chat_format): one conversation per line or row, `messages` = a list
  of {role, content}.

`auto` reads the first record of a JSONL file (or a Parquet file's schema) and names the format its fields show; a
record with the fields of both, or of neither, stops the workflow before any job, naming the file and the fields it
found. The builtin sample and hub datasets are oasst. `snaketune.data.format_config.resolve_format` puts the answer into the config (as snaketune.hub
pins revisions), so every stage, cache key and rerun sees the format the data is read as, not the word `auto`.
"""

from __future__ import annotations

from pathlib import Path

from snaketune.data.jsonl import DataError, is_tree_record, json_lines

CHAT_FIELD = "messages"
"""The field of a chat-format record (TRL's, Axolotl's and LLaMA-Factory's `messages`)."""
OASST_FIELDS = ("message_id", "parent_id", "role", "text")
"""snaketune.data.messages.REQUIRED_COLUMNS, kept here: this module runs when Snakemake builds the DAG, where pandas
(which messages imports) is not loaded (tests/test_keys.py)."""


def _first_fields(path: Path) -> tuple[str, set[str], bool]:
    """(where the fields were read, the field names, whether it is a LAION nested tree) of a file's first record."""
    if path.suffix == ".parquet":
        import pyarrow as pa  # only for a Parquet source: a tenth of a second at DAG time otherwise spent
        import pyarrow.parquet as pq

        try:
            return "its schema", set(pq.read_schema(path).names), False
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e}); allowed: a Parquet file") from e
    for line_no, record in json_lines(path, "one record"):
        tree = is_tree_record(record) and isinstance(record.get("prompt"), dict)
        return f"line {line_no}", set(map(str, record)), tree
    raise DataError(
        f"{path}: no records (the file is empty or has only blank lines); allowed: one JSON object per line"
    )


def detect_format(path: str | Path) -> str:
    """`oasst` or `chat` from the fields of the file's first record (JSONL) or its columns (Parquet); DataError naming
    the file and the fields when they show both or neither."""
    path = Path(path)
    where, names, tree = _first_fields(path)
    oasst_fields = sorted(names & set(OASST_FIELDS))
    oasst = tree or "message_id" in names or {"role", "text"} <= names
    chat = CHAT_FIELD in names
    found = ", ".join(sorted(names)) or "none"
    if oasst and chat:
        raise DataError(
            f"{path}: {where} has the chat format's `messages` and oasst's message fields "
            f"({', '.join(oasst_fields) or 'prompt with replies'}), so its format is ambiguous; allowed: set "
            "dataset.format to chat or oasst"
        )
    if oasst:
        return "oasst"
    if chat:
        return "chat"
    hint = ""
    if {"prompt", "chosen", "rejected"} <= names or {"chosen", "rejected"} <= names:
        hint = " (chosen and rejected make preference pairs: give this file as preference.source)"
    elif "conversations" in names:
        hint = " (ShareGPT's `conversations` of {from, value}: rename them to `messages` of {role, content})"
    raise DataError(
        f"{path}: cannot tell the format: {where} has the fields {found}, neither oasst's (message_id, parent_id, "
        "role, text; or a nested tree: prompt with replies) nor the chat format's (messages: a list of {role, "
        f"content}}){hint}; allowed: a file in one of them, dataset.format: oasst | chat"
    )
