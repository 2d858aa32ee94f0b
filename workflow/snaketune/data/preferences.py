"""Stage 2b, preferences: the rankings oasst already has -> preference pairs (train / validation) with stats.

Every oasst tree ranks the assistant replies to each prompt (rank 0 = best among siblings). From the same
message trees and the same cleaning rules as the conversations stage (snaketune.data.forest: deleted, failed
review, empty text and their subtrees dropped; language and tree-state filters on the root), for every
prompter message whose path from the root survives and alternates (prompter, assistant, ...), its surviving
assistant replies that carry a rank form a group; a group needs two distinct ranks. Pairs are
``(conversation so far, chosen, rejected)``:

- ``best_vs_rest``: each reply of the best rank against each reply of a worse rank;
- ``all``: every ordered pair of replies with different ranks, the better one chosen.

Ties are never a pair. The split is the conversations stage's: a pair belongs to its tree's split, read from
the conversations files, so no tree is in training as a conversation and in validation as a pair. stats.json
counts groups, pairs and every drop by reason. Both input forms (flat rows, nested trees) give the same pairs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq

from snaketune.data import forest, tools
from snaketune.data.forest import DEFAULT_TREE_STATES
from snaketune.data.messages import ROLES, SPLITS, DataError, Message, tree_id
from snaketune.io import write_json, write_parquet

PAIR_MODES = ("best_vs_rest", "all")
GROUP_DROP_REASONS = (
    "fewer_than_two_replies",
    "fewer_than_two_ranked",
    "ranks_tied",
    "non_alternating",
    "no_split",
)
"""Why a prompter message with assistant replies gives no pair (every one counted in stats.json)."""

OUTPUT_SCHEMA = pa.schema(
    [
        ("pair_id", pa.string()),
        ("message_tree_id", pa.string()),
        ("lang", pa.string()),
        ("tools", pa.string()),  # a pairs file's tools as JSON (snaketune.data.tools); null for oasst
        ("prompt", pa.list_(tools.MESSAGE)),
        ("chosen", pa.string()),
        ("chosen_tool_calls", pa.list_(tools.CALL)),  # the calls a reply makes (a pairs file's), else null
        ("rejected", pa.string()),
        ("rejected_tool_calls", pa.list_(tools.CALL)),
        ("chosen_rank", pa.float64()),
        ("rejected_rank", pa.float64()),
    ]
)
OUTPUT_COLUMNS = tuple(OUTPUT_SCHEMA.names)


@dataclass(frozen=True)
class Preferences:
    train: pd.DataFrame
    validation: pd.DataFrame
    stats: dict[str, Any]


def _pairs_of(replies: list[Message], mode: str) -> list[tuple[Message, Message]]:
    """(chosen, rejected) of one group of ranked replies, sorted best first; ties never pair."""
    pairs = []
    best = replies[0].rank
    for i, better in enumerate(replies):
        if mode == "best_vs_rest" and better.rank != best:
            break
        pairs += [(better, worse) for worse in replies[i + 1 :] if worse.rank > better.rank]  # type: ignore[operator]
    return pairs


def read_split_of_trees(conversations_dir: str | Path) -> dict[str, str]:
    """message_tree_id -> split, from the conversations stage's train.parquet and validation.parquet."""
    out: dict[str, str] = {}
    for split in SPLITS:
        path = Path(conversations_dir) / f"{split}.parquet"
        try:
            ids = pq.read_table(path, columns=["message_tree_id"]).column(0).to_pylist()
        except Exception as e:
            raise ValueError(f"{path}: not a conversations file the conversations stage wrote ({e})") from e
        out.update(dict.fromkeys(ids, split))
    return out


def build_preferences(
    messages: pd.DataFrame,
    split_of_tree: dict[str, str],
    *,
    pairs: str = "best_vs_rest",
    languages: Sequence[str] = (),
    tree_states: Sequence[str] = DEFAULT_TREE_STATES,
    source_name: str | None = None,
) -> Preferences:
    """Preference pairs of the messages' ranked sibling replies (module docstring)."""
    if pairs not in PAIR_MODES:
        raise ValueError(f"config key 'preference.pairs': {pairs!r}; allowed: {', '.join(PAIR_MODES)}")
    cleaned = forest.clean(messages, languages=languages, tree_states=tree_states, source_name=source_name)
    drops = dict.fromkeys(GROUP_DROP_REASONS, 0)
    groups = unranked_replies = ties = 0
    rows: dict[str, list[dict[str, Any]]] = {s: [] for s in SPLITS}
    for root, kept in cleaned.trees:
        tid = tree_id(root)
        for path, replies in _prompts_with_replies(root, kept):
            groups += 1
            ranked = [c for c in replies if c.rank is not None]  # kept children are sorted best first
            unranked_replies += len(replies) - len(ranked)
            reason = _drop_reason(path, replies, ranked, in_a_split=tid in split_of_tree)
            if reason is not None:
                drops[reason] += 1
                continue
            ties += sum(1 for i, a in enumerate(ranked) for b in ranked[i + 1 :] if a.rank == b.rank)
            prompt = [{"role": ROLES[m.role], "content": m.text} for m in path]
            for chosen, rejected in _pairs_of(ranked, pairs):
                rows[split_of_tree[tid]].append(
                    {
                        "pair_id": f"{chosen.message_id}>{rejected.message_id}",
                        "message_tree_id": tid,
                        "lang": root.lang,
                        "prompt": prompt,
                        "chosen": chosen.text,
                        "rejected": rejected.text,
                        "chosen_rank": chosen.rank,
                        "rejected_rank": rejected.rank,
                    }
                )
    if not any(rows.values()):
        raise DataError(
            f"{cleaned.src.name}: no preference pairs (preference.pairs: {pairs!r}): {groups} prompts with "
            f"assistant replies, dropped: {', '.join(f'{k} {v}' for k, v in drops.items() if v) or 'none'}; "
            "allowed: data where some prompt has two replies of different rank (oasst's rank field), a pairs "
            "file as preference.source, or preference.enabled: false"
        )
    frames = {s: frame_pairs(rows[s]) for s in SPLITS}
    stats: dict[str, Any] = {
        "pairs_mode": pairs,
        "languages": sorted(languages),
        "tree_states": sorted(tree_states),
        "trees": len(cleaned.roots),
        "messages": cleaned.messages,
        "messages_kept": cleaned.messages_kept,
        "dropped": cleaned.dropped,
        "trees_dropped": cleaned.trees_dropped,
        "groups": groups,
        "groups_with_pairs": groups - sum(drops.values()),
        "groups_dropped": drops,
        "unranked_replies": unranked_replies,
        "tied_reply_pairs_skipped": ties,
        "pairs": {s: len(frames[s]) for s in SPLITS},
        "pairs_by_language": {s: frames[s]["lang"].value_counts().sort_index().to_dict() for s in SPLITS},
        "trees_with_pairs": {s: int(frames[s]["message_tree_id"].nunique()) for s in SPLITS},
    }
    return Preferences(frames["train"], frames["validation"], stats)


def _prompts_with_replies(root: Message, kept: dict) -> Iterator[tuple[list[Message], list[Message]]]:
    """Depth-first over a tree's prompter messages that have assistant replies: (the path that leads to the
    message, the message itself last; its assistant replies, best first)."""
    stack: list[list[Message]] = [[root]]
    while stack:
        path = stack.pop()
        node = path[-1]
        children = kept[node.message_id]
        stack.extend(path + [c] for c in reversed(children))
        if node.role == "prompter" and any(c.role == "assistant" for c in children):
            yield path, [c for c in children if c.role == "assistant"]


def _drop_reason(
    path: list[Message], replies: list[Message], ranked: list[Message], *, in_a_split: bool
) -> str | None:
    """Why a prompt's replies give no pair (one of GROUP_DROP_REASONS), or None."""
    if not all(m.role == ("prompter" if i % 2 == 0 else "assistant") for i, m in enumerate(path)):
        return "non_alternating"
    if len(replies) < 2:
        return "fewer_than_two_replies"
    if len(ranked) < 2:
        return "fewer_than_two_ranked"
    if len({c.rank for c in ranked}) < 2:
        return "ranks_tied"
    if not in_a_split:
        return "no_split"  # the tree gave no conversation (the conversations stage says why)
    return None


def frame_pairs(rows: list[dict[str, Any]]) -> pd.DataFrame:
    rows = sorted(rows, key=lambda r: (r["message_tree_id"], r["pair_id"]))
    # oasst's pairs have no tool columns: null there.
    return pd.DataFrame({c: pd.Series([r.get(c) for r in rows], dtype=object) for c in OUTPUT_COLUMNS})


def write_preferences(result: Preferences, out_dir: str | os.PathLike[str]) -> None:
    """train.parquet, validation.parquet and stats.json; the bytes depend only on `result`."""
    out = Path(out_dir)
    for split in SPLITS:
        frame = getattr(result, split)
        table = pa.Table.from_pydict({c: frame[c].tolist() for c in OUTPUT_COLUMNS}, schema=OUTPUT_SCHEMA)
        write_parquet(table, out / f"{split}.parquet")
    write_json(out / "stats.json", result.stats)
