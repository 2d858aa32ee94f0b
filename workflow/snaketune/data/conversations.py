"""Stage 2, conversations: oasst-format message trees -> chat conversations (train / validation) with stats.

Chat-format data (one conversation per record: snaketune.data.chat_format) is cleaned there and framed here, into the
same files; `conversations_of_file` picks the way by what the download stage wrote.

The messages are read and checked by snaketune.data.messages and cleaned by snaketune.data.forest (deleted, failed
review, empty text and their subtrees dropped; language and tree-state filters on the root; splits by tree).
This module turns the surviving trees into root-to-leaf conversations: ``top1`` follows, from the root, the
best-ranked surviving child to a leaf; ``all`` takes every root-to-leaf path. A trailing prompter message
is cut; a conversation needs a user->assistant exchange and alternating roles.

Every decision is deterministic (sorted iteration, hash-based split, fixed Parquet options), so the same
input always gives byte-identical outputs and Snakemake reruns change nothing downstream.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa

from snaketune.data import chat_format, forest, tools
from snaketune.data.cells import Source
from snaketune.data.forest import DEFAULT_TREE_STATES, MESSAGE_DROP_REASONS, split_hash
from snaketune.data.messages import (
    REQUIRED_COLUMNS,
    ROLES,
    SPLITS,
    DataError,
    Message,
    check_messages,
    tree_id,
    where,
)
from snaketune.data.readers import read_messages
from snaketune.io import write_json, write_parquet

__all__ = [
    "DEFAULT_TREE_STATES",
    "MESSAGE_DROP_REASONS",
    "OUTPUT_COLUMNS",
    "REQUIRED_COLUMNS",
    "Conversations",
    "DataError",
    "build_conversations",
    "check_messages",
    "conversations_of_file",
    "read_messages",
    "split_hash",
    "where",
    "write_conversations",
]

PATHS_MODES = ("top1", "all")
PATH_DROP_REASONS = ("non_alternating", "no_exchange", "duplicate")

OUTPUT_SCHEMA = pa.schema(
    [
        ("conversation_id", pa.string()),
        ("message_tree_id", pa.string()),
        ("lang", pa.string()),
        (
            "tools",
            pa.string(),
        ),  # the functions a chat-format conversation may call, as JSON (snaketune.data.tools)
        ("messages", pa.list_(tools.MESSAGE)),
    ]
)
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)


@dataclass(frozen=True)
class Conversations:
    """The result of :func:`build_conversations`."""

    train: pd.DataFrame
    """Columns conversation_id, message_tree_id, lang, tools, messages; sorted by tree id, then conversation id."""
    validation: pd.DataFrame
    """Same columns as ``train``; trees here never appear in ``train``."""
    stats: dict[str, Any]
    """JSON-able counts: what was dropped and why, conversations per split and language."""


# ---- paths --------------------------------------------------------------------------------------------


def _top1_path(root: Message, kept_children: dict[str, list[Message]]) -> Iterator[list[Message]]:
    path = [root]
    while kept_children[path[-1].message_id]:
        path.append(kept_children[path[-1].message_id][0])  # children are sorted best first
    yield path


def _all_paths(root: Message, kept_children: dict[str, list[Message]]) -> Iterator[list[Message]]:
    stack: list[list[Message]] = [[root]]
    while stack:
        path = stack.pop()
        kids = kept_children[path[-1].message_id]
        if not kids:
            yield path
        stack.extend(path + [child] for child in reversed(kids))


def _to_conversation(path: list[Message]) -> tuple[list[Message] | None, str | None]:
    """The path as a trainable conversation, or None and the reason it is not one."""
    for i, message in enumerate(path):
        if message.role != ("prompter" if i % 2 == 0 else "assistant"):
            return None, "non_alternating"
    if path[-1].role == "prompter":
        path = path[:-1]  # an unanswered question teaches nothing; the exchanges before it still do
    if len(path) < 2:
        return None, "no_exchange"
    return path, None


# ---- build --------------------------------------------------------------------------------------------


@dataclass
class _Counts:
    """Paths dropped and trimmed, filled in as the trees are walked."""

    paths_dropped: dict[str, int]
    trimmed: int = 0


def _tree_rows(
    root: Message, kept_children: dict[str, list[Message]], paths: str, counts: _Counts
) -> list[dict[str, Any]]:
    """The output rows of one pruned tree."""
    tid = tree_id(root)
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
                "message_tree_id": tid,
                "lang": root.lang,
                "tools": None,
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


def _nothing_left(
    src: Source, wanted: set[str], paths: str, cleaned: forest.Forest, counts: _Counts
) -> DataError:
    dropped = dict(cleaned.dropped)
    unreachable = {k: dropped.pop(k) for k in ("orphan", "loop")}
    in_language = dropped.pop("language")
    in_state = dropped.pop("tree_state")
    return DataError(
        f"{src.name}: the filters left no conversations (dataset.languages: {sorted(wanted) or 'all'}, "
        f"dataset.paths: {paths!r}): {cleaned.messages} messages in {len(cleaned.roots)} trees; "
        f"trees outside dataset.languages: {cleaned.trees_dropped['language']} ({in_language} messages); "
        + (
            f"trees outside dataset.tree_states: {cleaned.trees_dropped['tree_state']} ({in_state} messages); "
            if in_state
            else ""
        )
        + f"messages dropped with their subtrees: {_counted(dropped)}; "
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
    tree_states: Sequence[str] = DEFAULT_TREE_STATES,
    max_trees: int | None = None,
    source_name: str | None = None,
) -> Conversations:
    """Turn oasst-format messages into train/validation conversations.

    languages: keep trees whose root message has one of these ``lang`` codes (empty keeps all).
    paths: ``top1`` follows the best-ranked surviving child from each root to a leaf; ``all`` yields every
    root-to-leaf path. validation_fraction: share of trees held out when the data has no ``split`` column.
    tree_states: keep trees whose root has one of these ``tree_state`` values (or none; empty keeps all).
    max_trees: at most this many of the trees that give a conversation (`forest.sample`); None keeps all.
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

    cleaned = forest.clean(messages, languages=languages, tree_states=tree_states, source_name=source_name)
    counts = _Counts(paths_dropped=dict.fromkeys(PATH_DROP_REASONS, 0))
    rows: list[dict[str, Any]] = []
    tree_roots: dict[str, Message] = {}
    for root, kept_children in cleaned.trees:
        tree = _tree_rows(root, kept_children, paths, counts)
        if tree:
            tree_roots[tree[0]["message_tree_id"]] = root
            rows.extend(tree)
    wanted = set(languages)
    if not rows:
        raise _nothing_left(cleaned.src, wanted, paths, cleaned, counts)
    kept = forest.sample(tree_roots, max_trees)
    sampled_out = len(tree_roots) - len(kept)
    tree_roots = {t: root for t, root in tree_roots.items() if t in kept}
    rows = [r for r in rows if r["message_tree_id"] in kept]

    assignment, fallback = forest.assign_splits(
        tree_roots, validation_fraction, cleaned.use_source_split, cleaned.src
    )
    split_rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for r in rows:
        split_rows[assignment[r["message_tree_id"]]].append(r)

    # No file paths or times in here: stats.json must be byte-identical wherever the workflow runs.
    stats: dict[str, Any] = {
        "paths": paths,
        "languages": sorted(wanted),
        "tree_states": sorted(tree_states),
        "validation_fraction": validation_fraction,
        "max_trees": max_trees,
        "trees_sampled_out": sampled_out,
        "trees": len(cleaned.roots),
        "messages": cleaned.messages,
        "messages_kept": cleaned.messages_kept,
        "dropped": cleaned.dropped,
        "trees_dropped": cleaned.trees_dropped,
        "paths_dropped": counts.paths_dropped,
        "paths_trimmed_prompter": counts.trimmed,
        "split_source": "source" if cleaned.use_source_split else "hash",
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


def conversations_of_file(
    path: str | os.PathLike[str],
    *,
    languages: Sequence[str] = (),
    paths: str = "top1",
    validation_fraction: float = 0.05,
    tree_states: Sequence[str] = DEFAULT_TREE_STATES,
    max_trees: int | None = None,
) -> Conversations:
    """The conversations of the download stage's messages.parquet: oasst messages (`build_conversations`) or
    chat-format conversations (snaketune.data.chat_format; paths and tree_states are oasst's and not read)."""
    if not chat_format.is_chat_table(path):
        return build_conversations(
            read_messages(path),
            languages=languages,
            paths=paths,
            validation_fraction=validation_fraction,
            tree_states=tree_states,
            max_trees=max_trees,
            source_name=str(path),
        )
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation_fraction {validation_fraction} must be >= 0 and < 1")
    by_split, stats = chat_format.clean_chats(
        chat_format.read_chat_table(path),
        languages=languages,
        validation_fraction=validation_fraction,
        max_trees=max_trees,
        source=str(path),
    )
    stats["by_language"], stats["turns_mean"] = {}, {}
    for s in SPLITS:
        stats["by_language"][s], stats["turns_mean"][s] = _split_stats(by_split[s])
    return Conversations(
        train=_frame(by_split["train"]), validation=_frame(by_split["validation"]), stats=stats
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
