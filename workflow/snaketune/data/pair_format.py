"""Stage 2b from a file (`preference.source`): preference pairs as TRL's DPOTrainer, Axolotl and LLaMA-Factory read
them -> the preference stage's pairs (train / validation) with stats.

A record (one per JSONL line or Parquet row): `chosen` and `rejected` (required), the better and the worse reply, each
a string or a messages list whose last turn is the assistant's reply (earlier turns, where given, must be the
prompt's); `prompt`, a string (one user turn) or a messages list ending in a user turn or in tool results (an
optional system turn first). Without a prompt, chosen and rejected must be messages lists that share every turn before
the reply (TRL's implicit prompt). Optional: `tools` (the functions the prompt's and the replies' calls may name, as
for conversations: snaketune.data.tools), `id` (unique), `split` (`train` | `validation`, on every record or none),
`lang`. A reply may call tools (its `tool_calls`): a pair then teaches which call to make.

Errors name the file, the line (JSONL, 1-based) or row (Parquet, 0-based), the field and what is allowed. A pair that
cannot teach a preference is dropped and counted under the first reason that applies (DROP_REASONS): a tool turn,
an empty turn or reply (one that calls tools may have no text), prompt roles out of order, chosen identical to
rejected, a pair already seen; an empty system turn is removed. The split is the records' own, else a hash of the prompt, so the pairs of one prompt stay together.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.data import tools as tool_calling
from snaketune.data.cells import Cell, Source, bad_value
from snaketune.data.chat_format import (
    LEGACY_TOOL_ROLES,
    clean_conversation,
    conversation_key,
    is_empty,
    message_hash,
    parse_messages,
    parse_split,
)
from snaketune.data.forest import both_splits, split_by_hash
from snaketune.data.jsonl import json_lines
from snaketune.data.messages import SPLITS, UNKNOWN_LANG, DataError
from snaketune.data.preferences import Preferences, frame_pairs

DROP_REASONS = ("tool_use", "empty_content", "roles_out_of_order", "identical", "duplicate")
FIELDS = ("id", "split", "lang", "tools", "prompt", "chosen", "rejected")
_REQUIRED = (
    "required: chosen and rejected (a string, or a messages list ending in the assistant's reply) and prompt (a "
    "string, or a messages list ending in a user turn or tool results; optional where chosen and rejected are "
    "messages lists that share the turns before the reply); optional: id, split, lang, tools"
)

Turns = list[dict[str, Any]]


def _user(content: str) -> dict[str, Any]:
    return {"role": "user", "content": content, "tool_calls": None, "tool_call_id": None}


def _reply(value: Any, src: Source, row: int, key: str, tools) -> tuple[Turns | None, dict]:
    """(the turns before the reply, or None for a string; the reply: {content, tool_calls}) of chosen or rejected."""
    if isinstance(value, str):
        return None, {"content": value, "tool_calls": None}
    if not isinstance(value, list | np.ndarray) or len(value) == 0:
        raise bad_value(
            Cell(src, row), key, value, "a string, or a messages list ending in the assistant's reply"
        )
    turns = parse_messages(value, src, row, key, tools)
    if turns[-1]["role"] != "assistant":
        raise bad_value(
            Cell(src, row),
            f"{key}[{len(turns) - 1}].role",
            turns[-1]["role"],
            "assistant (the reply is the last turn)",
        )
    return turns[:-1], {"content": turns[-1]["content"], "tool_calls": turns[-1]["tool_calls"]}


def _prompt(value: Any, src: Source, row: int, tools) -> Turns:
    if isinstance(value, str):
        return [_user(value)]
    if not isinstance(value, list | np.ndarray) or len(value) == 0:
        raise bad_value(Cell(src, row), "prompt", value, "a string, or a messages list ending in a user turn")
    turns = parse_messages(value, src, row, "prompt", tools)
    if turns[-1]["role"] not in ("user", "tool"):
        raise bad_value(
            Cell(src, row),
            f"prompt[{len(turns) - 1}].role",
            turns[-1]["role"],
            "user or tool (the prompt ends with the turn the replies answer)",
        )
    return turns


def _parse_pair(record: dict, src: Source, row: int) -> dict[str, Any]:
    for key in ("chosen", "rejected"):
        if record.get(key) is None:
            what = "missing required key" if key not in record else "null in required key"
            raise DataError(f"{src.name}: {src.at(row)}: {what} {key!r}; {_REQUIRED}")
    tools = tool_calling.parse_tools(record.get("tools"), Cell(src, row))
    chosen_before, chosen = _reply(record["chosen"], src, row, "chosen", tools)
    rejected_before, rejected = _reply(record["rejected"], src, row, "rejected", tools)
    if record.get("prompt") is not None:
        prompt = _prompt(record["prompt"], src, row, tools)
        for before, key in ((chosen_before, "chosen"), (rejected_before, "rejected")):
            if before and before != prompt:
                raise DataError(
                    f"{src.where(key, row)}: its turns before the reply differ from the prompt's; allowed: the reply "
                    "alone, or the prompt's turns followed by the reply"
                )
    elif chosen_before and chosen_before == rejected_before:
        prompt = chosen_before
    else:
        why = (
            "differ"
            if chosen_before and rejected_before
            else "are not messages lists with turns before the reply"
        )
        raise DataError(
            f"{src.name}: {src.at(row)}: no prompt, and chosen and rejected {why}; {_REQUIRED}"
            + ("" if "prompt" in record else " (the record has no key 'prompt')")
        )
    raw_id = record.get("id")
    if raw_id is not None and (isinstance(raw_id, bool) or not isinstance(raw_id, str | int) or raw_id == ""):
        raise bad_value(
            Cell(src, row), "id", raw_id, "a non-empty string or an integer, unique in the file (or null)"
        )
    lang = record.get("lang")
    if lang is not None and not isinstance(lang, str):
        raise bad_value(Cell(src, row), "lang", lang, "a language code string (e.g. en, pt-BR) or null")
    return {
        "id": None if raw_id is None else str(raw_id),
        "split": parse_split(record.get("split"), src, row),
        "lang": lang or UNKNOWN_LANG,
        "tools": None if tools is None else json.dumps(tools, ensure_ascii=False),
        "prompt": prompt,
        "chosen": chosen["content"],
        "chosen_tool_calls": chosen["tool_calls"],
        "rejected": rejected["content"],
        "rejected_tool_calls": rejected["tool_calls"],
    }


def _records(path: Path) -> tuple[list[dict], Source]:
    if path.name.endswith((".jsonl", ".jsonl.gz")):
        lines, records = [], []
        for line_no, record in json_lines(path, "one pair"):
            lines.append(line_no)
            records.append(record)
        src = Source(str(path), np.asarray(lines, dtype=np.int64))
    elif path.suffix == ".parquet":
        try:
            table = pq.read_table(path)
        except (pa.ArrowException, OSError) as e:
            raise DataError(f"{path}: not a readable Parquet file ({e}); allowed: a Parquet file") from e
        records, src = (
            table.select([c for c in FIELDS if c in table.column_names]).to_pylist(),
            Source(str(path)),
        )
    else:
        raise DataError(f"{path}: unsupported file type; allowed: .jsonl, .jsonl.gz, .parquet")
    if not records:
        raise DataError(f"{path}: no pairs (the file is empty); allowed: one pair per line or row")
    return records, src


def read_pairs(path: str | Path) -> list[dict[str, Any]]:
    """Every record of a pairs file, checked: {id, split, lang, prompt, chosen, rejected}; ids unique, a split on
    every record or on none."""
    records, src = _records(Path(path))
    rows = [_parse_pair(record, src, i) for i, record in enumerate(records)]
    first: dict[str, int] = {}
    for i, row in enumerate(rows):
        if row["id"] is not None and first.setdefault(row["id"], i) != i:
            raise DataError(
                f"{src.where('id', i)}: duplicate id {row['id']!r} (first in {src.at(first[row['id']])}); allowed: "
                "ids unique in the file (or none)"
            )
    with_split = [i for i, row in enumerate(rows) if row["split"] is not None]
    if with_split and len(with_split) < len(rows):
        i = next(i for i, row in enumerate(rows) if row["split"] is None)
        raise DataError(
            f"{src.where('split', i)}: no split while {src.at(with_split[0])} has one; allowed: "
            f"{', '.join(SPLITS)} on every record, or on none (then a hash of the prompt splits them)"
        )
    return rows


def _reply_turn(row: dict, side: str) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": row[side],
        "tool_calls": row[f"{side}_tool_calls"],
        "tool_call_id": None,
    }


def _clean(row: dict) -> tuple[dict | None, str | None, int]:
    """The pair to train on (the prompt cleaned as a conversation is), or None and the drop reason; the empty system
    turns removed."""
    turns = [*row["prompt"], _reply_turn(row, "chosen")]
    if any(m["role"] in LEGACY_TOOL_ROLES for m in turns):
        return None, "tool_use", 0
    replies = [_reply_turn(row, side) for side in ("chosen", "rejected")]
    if any(is_empty(r["content"]) and not r["tool_calls"] for r in replies):
        return None, "empty_content", 0
    kept, reason, repairs = clean_conversation(turns)  # its last turn is the (non-empty) reply: none is cut
    if kept is None:
        return None, reason, repairs["empty_system_turns_removed"]
    if replies[0] == replies[1]:
        return None, "identical", repairs["empty_system_turns_removed"]
    return {**row, "prompt": kept[:-1]}, None, repairs["empty_system_turns_removed"]


def _pair_key(pair: dict) -> str:
    """What duplicates share: the prompt (with its tools) and both replies (with their calls)."""
    replies = [pair["chosen"], pair["rejected"]]
    if pair["chosen_tool_calls"] or pair["rejected_tool_calls"]:
        replies += [pair["chosen_tool_calls"], pair["rejected_tool_calls"]]
    return json.dumps([conversation_key(pair["prompt"], pair["tools"]), *replies], ensure_ascii=False)


def build_pair_preferences(path: str | Path, *, validation_fraction: float) -> Preferences:
    """The pairs of a pairs file, split and counted (module docstring); DataError for malformed records and when no
    pair is left."""
    rows = read_pairs(path)
    dropped = dict.fromkeys(DROP_REASONS, 0)
    removed = 0
    kept: list[dict] = []
    seen: set[str] = set()
    for row in rows:
        pair, reason, n = _clean(row)
        if pair is not None:
            key = _pair_key(pair)
            reason = "duplicate" if key in seen else None
            seen.add(key)
        if reason is not None:
            dropped[reason] += 1
            continue
        removed += n  # of the pairs kept
        prompt_id = message_hash(pair["prompt"], pair["tools"])
        replies = f"{pair['chosen']}\0{pair['rejected']}"
        if pair["chosen_tool_calls"] or pair["rejected_tool_calls"]:  # a pair without calls keeps its old id
            replies += "\0" + json.dumps(
                [pair["chosen_tool_calls"], pair["rejected_tool_calls"]], ensure_ascii=False
            )
        digest = hashlib.sha256(f"{prompt_id}\0{replies}".encode()).hexdigest()[:16]
        pair_id = pair["id"] if pair["id"] is not None else digest
        kept.append({**pair, "pair_id": pair_id, "message_tree_id": prompt_id})
    if not kept:
        raise DataError(
            f"{path}: no pair is left to train on: {len(rows)} read, dropped: "
            f"{', '.join(f'{k} {v}' for k, v in dropped.items() if v) or 'none'}; allowed: pairs with a non-empty "
            "prompt ending in a user turn and two different, non-empty replies"
        )
    return _split(kept, rows, dropped, removed, validation_fraction)


def _split(
    kept: list[dict], rows: list[dict], dropped: dict[str, int], removed: int, validation_fraction: float
) -> Preferences:
    use_source = kept[0]["split"] is not None
    if use_source:  # the records' own split, pair by pair
        assignment = {p["pair_id"]: p["split"] for p in kept}
        fallback = both_splits(assignment)
        split_of = {p["pair_id"]: assignment[p["pair_id"]] for p in kept}
    else:  # a hash of the prompt: the pairs of one prompt stay in one split
        assignment, fallback = split_by_hash({p["message_tree_id"] for p in kept}, validation_fraction)
        split_of = {p["pair_id"]: assignment[p["message_tree_id"]] for p in kept}
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    for p in kept:
        out[split_of[p["pair_id"]]].append(
            {
                "pair_id": p["pair_id"],
                "message_tree_id": p["message_tree_id"],
                "lang": p["lang"],
                "tools": p["tools"],
                "prompt": p["prompt"],
                "chosen": p["chosen"],
                "chosen_tool_calls": p["chosen_tool_calls"],
                "rejected": p["rejected"],
                "rejected_tool_calls": p["rejected_tool_calls"],
                "chosen_rank": None,
                "rejected_rank": None,
            }
        )
    frames = {s: frame_pairs(out[s]) for s in SPLITS}
    stats: dict[str, Any] = {
        "source": "file",
        "pairs_mode": "file",
        "validation_fraction": validation_fraction,
        "rows": len(rows),
        "rows_kept": len(kept),
        "dropped": dropped,
        "empty_system_turns_removed": removed,
        "with_system_turn": {s: sum(r["prompt"][0]["role"] == "system" for r in out[s]) for s in SPLITS},
        "with_tool_calls": {
            s: sum(bool(r["tools"]) or any(m["tool_calls"] for m in r["prompt"]) for r in out[s])
            for s in SPLITS
        },
        "split_source": "source" if use_source else "hash",
        "split_fallback": fallback,
        "pairs": {s: len(frames[s]) for s in SPLITS},
        "pairs_by_language": {s: frames[s]["lang"].value_counts().sort_index().to_dict() for s in SPLITS},
        # The keys the report reads for both sources: a file has no groups of ranked replies (`groups` counts its
        # records) and no trees (`trees_with_pairs` counts the distinct prompts).
        "groups": len(rows),
        "groups_dropped": {},
        "trees_with_pairs": {s: int(frames[s]["message_tree_id"].nunique()) for s in SPLITS},
    }
    return Preferences(frames["train"], frames["validation"], stats)
