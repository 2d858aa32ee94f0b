"""Stage 4b, tokenize pairs: preference pairs -> cached Arrow rows, one row per pair: ``chosen`` then
``rejected``, each the conversation so far plus one reply in the chat template of the SFT stage, position ids
restarting at 0 for the second, labels only on the reply (its text and end-of-turn token).

Each side holds at most ``preference.max_length`` tokens. A longer side keeps the reply's start: the oldest
part of the conversation goes first (bos and the latest turns stay), down to half the budget; past that the
reply's end is cut. The rows have the tokenized SFT cache's layout (snaketune.model.batching.TokenizedSplit reads
them), so collation, varlen attention and the memory plan treat a pair as a packed row of two sequences.
The cache key (snaketune.keys.pairs_key) covers everything that changes the tokens.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from snaketune.data.chat import (
    IGNORE_INDEX,
    chat_template_text,
    check_chat_template,
    encode_conversations,
    load_tokenizer,
    turn_check,
)
from snaketune.data.tokenization import SPLITS, save_rows, tokenizer_hashes
from snaketune.io import atomic_dir, sha256_file, sha256_text

PAIR_COLUMNS = ("tools", "prompt", "chosen", "chosen_tool_calls", "rejected", "rejected_tool_calls")
"""What a side is made of (the tool columns are a pairs file's: snaketune.data.preferences.OUTPUT_SCHEMA)."""


def fit(ids: np.ndarray, labels: np.ndarray, max_length: int) -> tuple[np.ndarray, np.ndarray, str | None]:
    """One side cut to max_length, keeping the reply's start; returns what was cut (None, prompt, reply)."""
    if len(ids) <= max_length:
        return ids, labels, None
    start = int(np.flatnonzero(labels != IGNORE_INDEX)[0])  # the reply's first trained token
    reply = len(ids) - start
    keep_prompt = min(start, max(max_length - reply, max_length // 2))
    keep_reply = max_length - keep_prompt
    # bos (position 0) and the last keep_prompt - 1 tokens of the conversation so far
    idx = np.concatenate(
        [[0], np.arange(start - keep_prompt + 1, start), np.arange(start, start + keep_reply)]
    )
    cut = "prompt" if keep_reply >= reply else "reply"
    return ids[idx], labels[idx], cut


def _sides(path: Path) -> tuple[list[list[dict]], list]:
    """Each pair's conversation with its chosen reply, then each with its rejected one, and their tools."""
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    column = {c: table.column(c).to_pylist() for c in PAIR_COLUMNS if c in table.column_names}
    nothing = [None] * table.num_rows
    sides = [
        [*prompt, {"role": "assistant", "content": reply, "tool_calls": calls}]
        for side in ("chosen", "rejected")
        for prompt, reply, calls in zip(
            column["prompt"], column[side], column.get(f"{side}_tool_calls", nothing), strict=True
        )
    ]
    return sides, 2 * column.get("tools", nothing)


def tokenize_pairs(
    pairs_dir: str | Path,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    max_length: int,
    chat_template: str,
    threads: int = 1,
) -> dict[str, Any]:
    """preferences/{train,validation}.parquet -> out_dir/{train,validation} (Arrow) + stats.json."""

    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
    pairs_dir, out_dir = Path(pairs_dir), Path(out_dir)
    tokenizer = load_tokenizer(tokenizer_dir, chat_template)
    check_chat_template(tokenizer)
    settings = {"max_length": max_length, "chat_template": chat_template}
    check = turn_check(tokenizer)
    stats: dict[str, Any] = {
        "settings": settings,
        "pair_files_sha256": {s: sha256_file(pairs_dir / f"{s}.parquet") for s in SPLITS},
        "tokenizer_files_sha256": tokenizer_hashes(tokenizer_dir),
        "chat_template_sha256": sha256_text(chat_template_text(tokenizer)),
        "splits": {},
    }
    with atomic_dir(out_dir) as tmp:
        for split in SPLITS:
            sides, tools = _sides(pairs_dir / f"{split}.parquet")
            encoded = list(
                encode_conversations(
                    tokenizer,
                    sides,
                    assistant_only_loss=True,
                    last_turn_only=True,
                    tools=tools,
                    check=check,
                )
            )
            n = len(sides) // 2
            rows, cuts = [], {"prompt": 0, "reply": 0}
            lengths = []
            for i in range(n):
                row: dict[str, list] = {"input_ids": [], "labels": [], "position_ids": []}
                for ids, labels in (encoded[i], encoded[n + i]):
                    lengths.append(len(ids))
                    ids, labels, cut = fit(ids, labels, max_length)
                    if cut:
                        cuts[cut] += 1
                    row["input_ids"] += ids.tolist()
                    row["labels"] += labels.tolist()
                    row["position_ids"] += list(range(len(ids)))
                rows.append(row)
            identity = {"split": split, **{k: stats[k] for k in stats if k != "splits"}}
            save_rows(
                rows,
                tmp / split,
                split=split,
                fingerprint=sha256_text(json.dumps(identity, sort_keys=True))[:16],
            )
            stats["splits"][split] = {
                "pairs": n,
                "sides_cut_in_prompt": cuts["prompt"],
                "sides_cut_in_reply": cuts["reply"],
                "tokens": sum(len(r["input_ids"]) for r in rows),
                "reply_tokens": sum(
                    int(np.count_nonzero(np.asarray(r["labels"]) != IGNORE_INDEX)) for r in rows
                ),
                "mean_side_tokens": round(float(np.mean(lengths)) if lengths else 0.0, 3),
                "max_side_tokens": int(max(lengths, default=0)),
            }
        stats["template_check"] = check.as_json()
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stats
