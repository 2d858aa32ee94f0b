"""The common chat format (`dataset.format: chat`): one conversation per JSONL line or Parquet row, what TRL, Axolotl
and LLaMA-Factory read.

A record: `messages` (required), a list of {role, content} with roles `system`, `user`, `assistant` and `tool`;
optional `tools` (the functions its assistant turns may call: snaketune.data.tools has the form, assistant
`tool_calls` and `tool` turns included), `id` (a string or an integer, unique in the file: names the conversation
and decides its split), `split` (`train` or `validation`, on every record or on none) and `lang` (a language code,
for dataset.languages). Other fields, and other keys of a message, are not read.

Reading (the download stage, `read_chats`) refuses what cannot be a conversation: each error names the file, the
line (JSONL, 1-based) or row (Parquet, 0-based), the field (`messages[2].role`) and what is allowed. Cleaning (the
conversations stage, `clean_chats`) drops what is a conversation but not one to train on, each counted in stats.json
under the first reason that applies, in the order of DROP_REASONS: a legacy function-calling turn (roles function,
ipython), an empty user turn or an empty assistant turn that calls no tool, roles out of order (ORDER), no assistant
turn, a language outside dataset.languages, a conversation already seen. An empty system turn is removed and
trailing user turns or tool results cut (all counted): what remains still teaches. The split is the records' own,
else a hash of the id (a hash of the messages where a record has no id), as for oasst's trees.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.data import tools as tool_calling
from snaketune.data.cells import Cell, Source, bad_value, missing_key
from snaketune.data.forest import both_splits, sample, split_by_hash
from snaketune.data.jsonl import json_lines
from snaketune.data.messages import SPLITS, UNKNOWN_LANG, DataError

CHAT_ROLES = ("system", "user", "assistant", "tool")
LEGACY_TOOL_ROLES = ("function", "ipython")
"""OpenAI's deprecated function calling and Llama 3's code interpreter: read, and their conversations dropped
(`tool_use`); the common form's `tool` turns are trained on."""
ROLES_ALLOWED = (
    "system, user, assistant, tool (a conversation with function or ipython turns is dropped and counted)"
)
ORDER = (
    "an optional system turn first, then a user turn; a user turn answered by an assistant turn; an assistant turn "
    "that calls tools answered by tool turns, and tool turns by an assistant turn"
)
FIELDS = ("id", "split", "lang", "tools", "messages")
DROP_REASONS = (
    "tool_use",
    "empty_content",
    "roles_out_of_order",
    "no_assistant_turn",
    "language",
    "duplicate",
)
RAW_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("split", pa.string()),
        ("lang", pa.string()),
        ("tools", pa.string()),
        ("messages", pa.list_(tool_calling.MESSAGE)),
    ]
)
"""The download stage's messages.parquet for chat-format data: one checked conversation per row."""


def is_chat_table(path: str | Path) -> bool:
    """Whether a messages.parquet of the download stage holds chat-format conversations (else oasst messages)."""
    return pq.read_schema(path).names == RAW_SCHEMA.names


# ---- reading and checking (download) --------------------------------------------------------------------------


def parse_messages(
    value: Any, src: Source, row: int, key: str, tools: list[dict] | None = None
) -> list[dict[str, Any]]:
    """A record's messages list as [{role, content, tool_calls, tool_call_id}], every message checked, calls against
    the record's `tools` (content null stays null: the cleaning counts it as empty)."""
    at = Cell(src, row)
    if isinstance(value, np.ndarray):  # a list column that pandas holds
        value = value.tolist()
    if not isinstance(value, list):
        raise bad_value(at, key, value, "a list of {role, content} objects")
    out = []
    for i, message in enumerate(value):
        k = f"{key}[{i}]"
        if not isinstance(message, dict):
            raise bad_value(at, k, message, "an object with role and content")
        if "role" not in message:
            raise missing_key(at, k, "role", f"an object with role ({ROLES_ALLOWED}) and content")
        role = message["role"]
        if not isinstance(role, str) or role not in CHAT_ROLES + LEGACY_TOOL_ROLES:
            raise bad_value(at, f"{k}.role", role, ROLES_ALLOWED)
        # A tool result, or an assistant turn that only calls tools, may come without content.
        calls = message.get("tool_calls")
        if isinstance(calls, np.ndarray):
            calls = calls.tolist()
        tool_roles = ("tool", *LEGACY_TOOL_ROLES)
        if "content" not in message and role not in tool_roles and not calls:
            raise missing_key(at, k, "content", "an object with role and content (a string)")
        content = message.get("content")
        if content is not None and not isinstance(content, str):
            raise bad_value(
                at, f"{k}.content", content, "a string or null (a list of content parts is not read)"
            )
        if (
            calls and role != "assistant"
        ):  # a Parquet struct column gives every message the key, null or empty
            raise bad_value(at, f"{k}.tool_calls", calls, "null on a turn that is not the assistant's")
        call_id = message.get("tool_call_id") if role == "tool" else None
        if call_id is not None and not isinstance(call_id, str):
            raise bad_value(
                at, f"{k}.tool_call_id", call_id, "a string, the id of the call it answers, or null"
            )
        out.append(
            {
                "role": role,
                "content": content,
                "tool_calls": tool_calling.parse_tool_calls(calls, at, f"{k}.tool_calls", tools)
                if calls
                else None,
                "tool_call_id": call_id,
            }
        )
    tool_calling.check_call_ids(out, at, key)
    return out


def message_hash(messages: Sequence[dict], tools: str | None = None) -> str:
    """16 hex digits of sha256 over the messages (and tools): a record's id when it has none (stable across
    machines; a conversation without tool parts hashes as it did before they were read)."""
    return hashlib.sha256(conversation_key(messages, tools).encode("utf-8")).hexdigest()[:16]


def conversation_key(messages: Sequence[dict], tools: str | None = None) -> str:
    """A conversation as one string: what duplicates share."""
    if not tool_calling.has_tool_parts(messages, tools):
        return json.dumps([[m["role"], m["content"]] for m in messages], ensure_ascii=False)
    turns = [[m["role"], m["content"], m.get("tool_calls"), m.get("tool_call_id")] for m in messages]
    return json.dumps([turns, tools], ensure_ascii=False)


def parse_split(value: Any, src: Source, row: int) -> str | None:
    if value is None:
        return None
    if not isinstance(value, str) or value not in SPLITS:
        raise bad_value(Cell(src, row), "split", value, ", ".join(SPLITS) + " or null")
    return value


def _parse_record(record: dict, src: Source, row: int) -> dict[str, Any]:
    at = Cell(src, row)
    tools = tool_calling.parse_tools(record.get("tools"), at)
    messages = parse_messages(record["messages"], src, row, "messages", tools)
    raw_id = record.get("id")
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or raw_id == ""):
        raise bad_value(at, "id", raw_id, "a non-empty string or an integer, unique in the file (or null)")
    lang = record.get("lang")
    if lang is not None and not isinstance(lang, str):
        raise bad_value(at, "lang", lang, "a language code string (e.g. en, pt-BR) or null")
    return {
        "id": None if raw_id is None else str(raw_id),
        "split": parse_split(record.get("split"), src, row),
        "lang": lang,
        "tools": None if tools is None else json.dumps(tools, ensure_ascii=False),
        "messages": messages,
    }


def _records(path: Path) -> tuple[list[dict], Source, list[str]]:
    """The file's records (JSONL lines or Parquet rows), where they came from, and the fields the file has."""
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        records, lines, fields = [], [], set()
        for line_no, record in json_lines(path, "one conversation"):
            if "messages" not in record:
                raise DataError(
                    f"{path}: line {line_no}: missing required key 'messages' (the line has "
                    f"{', '.join(map(str, record)) or 'no keys'}); required on every line: messages (a list of "
                    "{role, content}); optional: id, split, lang, tools"
                )
            records.append(record)
            lines.append(line_no)
            fields.update(map(str, record))
        if not records:
            raise DataError(f"{path}: no conversations (the file is empty or has only blank lines)")
        return records, Source(str(path), np.asarray(lines, dtype=np.int64)), sorted(fields)
    try:
        table = pq.read_table(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({e}); allowed: a Parquet file") from e
    if "messages" not in table.column_names:
        raise DataError(
            f"{path}: missing required column messages (the file has {', '.join(table.column_names)}); required: "
            "messages (a list of {role, content}); optional: id, split, lang, tools"
        )
    if table.num_rows == 0:
        raise DataError(f"{path}: no conversations (the table is empty)")
    read = table.select([c for c in FIELDS if c in table.column_names])
    return read.to_pylist(), Source(str(path)), sorted(table.column_names)


def check_chats(records: list[dict], src: Source) -> list[dict[str, Any]]:
    """Every record checked and normalized ({id, split, lang, messages}); ids unique, splits on all or none."""
    rows = [_parse_record(record, src, i) for i, record in enumerate(records)]
    first: dict[str, int] = {}
    for i, row in enumerate(rows):
        if row["id"] is None:
            continue
        if row["id"] in first:
            raise DataError(
                f"{src.where('id', i)}: duplicate id {row['id']!r} (first in {src.at(first[row['id']])}); "
                "allowed: ids unique in the file (or no id: the messages' hash names the conversation)"
            )
        first[row["id"]] = i
    with_split = [i for i, row in enumerate(rows) if row["split"] is not None]
    if with_split and len(with_split) < len(rows):
        i = next(i for i, row in enumerate(rows) if row["split"] is None)
        raise DataError(
            f"{src.where('split', i)}: no split while {src.at(with_split[0])} has one; allowed: "
            f"{', '.join(SPLITS)} on every record, or on none (then a hash of the id splits them)"
        )
    for row in rows:
        if row["id"] is None:
            row["id"] = message_hash(row["messages"], row["tools"])
    return rows


def read_chats(path: str | Path) -> tuple[pa.Table, dict[str, Any]]:
    """A chat-format file (.jsonl, .jsonl.gz, .parquet), checked, as the download stage's table (RAW_SCHEMA), and
    what source.json records of it."""
    path = Path(path)
    records, src, fields = _records(path)
    rows = check_chats(records, src)
    record = {
        "conversations": len(rows),
        "messages": sum(len(r["messages"]) for r in rows),
        "columns": fields,
        "splits": sorted({r["split"] for r in rows if r["split"] is not None}),
    }
    return pa.Table.from_pylist(rows, schema=RAW_SCHEMA), record


# ---- cleaning (conversations) ---------------------------------------------------------------------------------


def _next_roles(message: dict) -> tuple[str, ...]:
    """The roles that may follow a turn (ORDER)."""
    if message["role"] == "assistant":
        return ("tool",) if message.get("tool_calls") else ("user",)
    return {"system": ("user",), "user": ("assistant",), "tool": ("tool", "assistant")}[message["role"]]


def roles_in_order(messages: Sequence[dict]) -> bool:
    """An optional system turn first, then ORDER: user and assistant alternating from a user turn, an assistant turn
    that calls tools followed by their results and those by an assistant turn."""
    body = messages[1:] if messages and messages[0]["role"] == "system" else messages
    allowed: tuple[str, ...] = ("user",)
    for m in body:
        if m["role"] not in allowed:
            return False
        allowed = _next_roles(m)
    return True


def is_empty(content: str | None) -> bool:
    return content is None or not content.strip()


REPAIRS = ("empty_system_turns_removed", "trailing_user_turns_cut", "trailing_tool_results_cut")


def clean_conversation(messages: list[dict]) -> tuple[list[dict] | None, str | None, dict[str, int]]:
    """The conversation to train on, or None and the first drop reason; with the repairs made (an empty system
    turn removed, a trailing user turn or trailing tool results cut)."""
    repairs = dict.fromkeys(REPAIRS, 0)
    if any(m["role"] in LEGACY_TOOL_ROLES for m in messages):
        return None, "tool_use", repairs
    kept = []
    for m in messages:
        # A tool may return nothing, and an assistant turn may only call tools.
        if is_empty(m["content"]) and m["role"] != "tool" and not m.get("tool_calls"):
            if m["role"] != "system":
                return None, "empty_content", repairs
            repairs["empty_system_turns_removed"] += 1  # an empty instruction instructs nothing
            continue
        kept.append(m)
    if not roles_in_order(kept):
        return None, "roles_out_of_order", repairs
    if kept and kept[-1]["role"] == "user":
        kept = kept[:-1]  # an unanswered question teaches nothing; the exchanges before it still do
        repairs["trailing_user_turns_cut"] += 1
    while kept and kept[-1]["role"] == "tool":  # results nobody answers: the calls before them still teach
        kept = kept[:-1]
        repairs["trailing_tool_results_cut"] += 1
    if not any(m["role"] == "assistant" for m in kept):
        return None, "no_assistant_turn", repairs
    return kept, None, repairs


def _check_languages(wanted: set[str], rows: list[dict], source: str) -> None:
    have: dict[str, int] = {}
    for row in rows:
        lang = row["lang"] or UNKNOWN_LANG
        have[lang] = have.get(lang, 0) + 1
    absent = sorted(wanted - have.keys())
    if absent:
        listing = ", ".join(f"{k} ({n})" for k, n in sorted(have.items(), key=lambda x: (-x[1], x[0])))
        raise DataError(
            f"config key 'dataset.languages': {', '.join(map(repr, absent))} in no conversation of {source} (the "
            f"filter reads each record's lang; without one: {UNKNOWN_LANG}); allowed: the languages the data has: "
            f"{listing}"
        )


def _assign_splits(
    rows: list[dict], kept: list[dict], validation_fraction: float
) -> tuple[dict[str, str], dict[str, str] | None]:
    """Each kept conversation's split: the source's own where it has one, else by hash; the fallback move made."""
    if not any(row["split"] is not None for row in rows):
        return split_by_hash([r["message_tree_id"] for r in kept], validation_fraction)
    split_of: dict[str, str] = {}
    for row in rows:
        split_of.setdefault(row["id"], row["split"])  # a repeat without an id shares the first one's hash
    assignment = {r["message_tree_id"]: split_of[r["message_tree_id"]] for r in kept}
    return assignment, both_splits(assignment)


def clean_chats(
    rows: list[dict],
    *,
    languages: Sequence[str],
    validation_fraction: float,
    source: str,
    max_trees: int | None = None,
) -> tuple[dict[str, list[dict]], dict[str, Any]]:
    """The conversations of each split (conversations stage rows) and the counts for stats.json; `max_trees`: at
    most this many conversations (forest.sample)."""
    wanted = set(languages)
    _check_languages(wanted, rows, source)
    dropped = dict.fromkeys(DROP_REASONS, 0)
    repairs = dict.fromkeys(REPAIRS, 0)
    kept: list[dict] = []
    seen: set[str] = set()
    for row in rows:
        messages, reason, fixed = clean_conversation(row["messages"])
        lang = row["lang"] or UNKNOWN_LANG
        if reason is None and wanted and lang not in wanted:
            reason = "language"
        if reason is None:
            content = conversation_key(messages, row["tools"])
            reason = "duplicate" if content in seen else None
            seen.add(content)
        if reason is not None:
            dropped[reason] += 1
            continue
        for k, v in fixed.items():  # of the conversations kept
            repairs[k] += v
        kept.append(
            {
                "conversation_id": row["id"],
                "message_tree_id": row["id"],
                "lang": lang,
                "tools": row["tools"],
                "messages": messages,
            }
        )
    if not kept:
        raise DataError(
            f"{source}: no conversation is left to train on: {len(rows)} read, dropped: "
            f"{', '.join(f'{k} {v}' for k, v in dropped.items() if v) or 'none'}; allowed: conversations where a "
            f"user turn is answered by an assistant turn, roles in order ({ORDER}), no empty user or assistant turn"
        )
    sampled = sample((r["message_tree_id"] for r in kept), max_trees)
    sampled_out = len(kept) - len(sampled)
    kept = [r for r in kept if r["message_tree_id"] in sampled]
    assignment, fallback = _assign_splits(rows, kept, validation_fraction)
    by_split: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for r in kept:
        by_split[assignment[r["message_tree_id"]]].append(r)
    stats = {
        "format": "chat",
        "languages": sorted(wanted),
        "validation_fraction": validation_fraction,
        "max_trees": max_trees,
        "trees_sampled_out": sampled_out,
        "rows": len(rows),
        "rows_kept": len(kept),
        "messages": sum(len(row["messages"]) for row in rows),
        "messages_kept": sum(len(r["messages"]) for r in kept),
        "dropped": dropped,
        **repairs,
        "with_system_turn": {
            s: sum(r["messages"][0]["role"] == "system" for r in by_split[s]) for s in SPLITS
        },
        "with_tool_calls": {
            s: sum(any(m["tool_calls"] for m in r["messages"]) for r in by_split[s]) for s in SPLITS
        },
        "split_source": "source" if any(row["split"] is not None for row in rows) else "hash",
        "split_fallback": fallback,
        "conversations": {s: len(by_split[s]) for s in SPLITS},
    }
    return by_split, stats


def read_chat_table(path: str | Path) -> list[dict]:
    """The download stage's chat table (RAW_SCHEMA) as rows."""
    return pq.read_table(path).to_pylist()
