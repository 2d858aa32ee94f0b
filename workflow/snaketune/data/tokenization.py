"""Stage 4, tokenize: conversations to training sequences: assistant-only labels, truncation and packing.

Each conversation is rendered with the chat template and encoded once (snaketune.data.chat, batched); a token is
trained on (label = its id) when its first character lies in an assistant turn's span: the reply text and
its end-of-turn token, never the ``Assistant:`` prompt or anything the user wrote. Labels are not shifted:
the causal LM's loss shifts them itself. Packing concatenates whole conversations into blocks of at most ``max_length`` tokens
with position ids restarting at 0 per conversation. The model must keep a block's conversations apart:
call it with position_ids, no attention_mask and ``use_cache=False`` (transformers then derives the
block-diagonal mask itself), or pass ``snaketune.model.batching.packed_attention_mask(position_ids)`` as training does.
"""

from __future__ import annotations

import bisect
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
from tqdm import tqdm

from snaketune.data.chat import (
    IGNORE_INDEX,
    Message,
    TemplateError,
    assistant_spans,
    chat_template_text,
    check_chat_template,
    encode_conversation,
    encode_conversations,
    load_tokenizer,
    turn_check,
)
from snaketune.data.template_check import TurnCheck
from snaketune.data.tokenizer import read_conversations_file
from snaketune.io import atomic_dir, sha256_file, sha256_text

__all__ = [
    "IGNORE_INDEX",
    "TemplateError",
    "assistant_spans",
    "check_chat_template",
    "encode_conversation",
    "load_tokenizer",
    "pack",
    "tokenize_conversation",
    "tokenize_conversations",
    "truncate",
]

SPLITS = ("train", "validation")
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
)
"""Files of a tokenizer directory whose hashes go into stats.json (those present)."""
COLUMNS = ("input_ids", "labels", "position_ids")

Example = dict[str, Any]


def truncate(input_ids: list[int], labels: list[int], max_length: int) -> Example | None:
    """The first max_length tokens as an example, or None when none of their labels is trained on."""
    if all(label == IGNORE_INDEX for label in labels[:max_length]):
        return None
    return {
        "input_ids": input_ids[:max_length],
        "labels": labels[:max_length],
        "truncated": len(input_ids) > max_length,
    }


def tokenize_conversation(
    tokenizer, messages: Sequence[Message], *, max_length: int, assistant_only_loss: bool
) -> Example | None:
    """{"input_ids", "labels", "truncated"} of one conversation cut to max_length; None when no label survives.

    Labels are the token ids on assistant replies and their end-of-turn tokens (every token but the first
    when not assistant_only_loss) and IGNORE_INDEX elsewhere; they are not shifted.
    """
    input_ids, labels = encode_conversation(tokenizer, messages, assistant_only_loss=assistant_only_loss)
    return truncate(input_ids, labels, max_length)


def with_position_ids(example: Example) -> Example:
    """One conversation as a row: ids, labels and positions 0..n-1."""
    n = len(example["input_ids"])
    return {"input_ids": example["input_ids"], "labels": example["labels"], "position_ids": list(range(n))}


def pack(examples: Sequence[Example], max_length: int) -> list[Example]:
    """Best-fit-decreasing packing of whole examples into blocks of <= max_length tokens.

    Longest first, each example goes into the open block it fills best (the least room left that still
    holds it), else into a new block: a few percent of padding where next-fit in input order wastes a
    fifth on oasst1-like lengths (bench/RESULTS.md), because a conversation near max_length closes a
    half-empty block. Deterministic (ties by input order); inside a block the examples keep their input
    order, a conversation is never split, and position ids restart at 0 at each conversation. Training
    shuffles the blocks (snaketune.model.batching), so the length-sorted block order does not reach the model.
    """
    for example in examples:
        if len(example["input_ids"]) > max_length:
            raise ValueError(
                f"an example of {len(example['input_ids'])} tokens is longer than max_length {max_length}; "
                "truncate first"
            )
    order = sorted(range(len(examples)), key=lambda i: (-len(examples[i]["input_ids"]), i))
    members: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (tokens left, block index), sorted: bisect finds the best fit
    for i in order:
        n = len(examples[i]["input_ids"])
        at = bisect.bisect_left(room, (n, -1))
        if at < len(room):
            left, block = room.pop(at)
            members[block].append(i)
        else:
            left, block = max_length, len(members)
            members.append([i])
        if left - n > 0:
            bisect.insort(room, (left - n, block))
    blocks: list[Example] = []
    for ids in sorted(members, key=min):
        block: Example = {column: [] for column in COLUMNS}
        for i in sorted(ids):
            row = with_position_ids(examples[i])
            for column in COLUMNS:
                block[column].extend(row[column])
        blocks.append(block)
    return blocks


def tokenizer_hashes(tokenizer_dir: str | Path) -> dict[str, str]:
    """sha256 of the tokenizer files that decide tokenization, for those the directory has."""
    directory = Path(tokenizer_dir)
    return {name: sha256_file(directory / name) for name in TOKENIZER_FILES if (directory / name).is_file()}


def _features():
    from datasets import Features, Sequence, Value

    # int32 halves the files against int64 and holds any vocabulary; the collator widens to int64.
    return Features({column: Sequence(Value("int32")) for column in COLUMNS})


def save_rows(rows: list[Example], path: Path, *, split: str, fingerprint: str) -> None:
    """Write rows as a datasets.Dataset directory whose bytes depend only on the rows and the fingerprint.

    datasets stores ``_fingerprint`` in state.json. It is passed in (a hash of the inputs and settings)
    rather than left to datasets, which hashes an in-memory table today but falls back to random
    fingerprints whenever it cannot hash something, and random bytes in state.json break reproducibility.
    """
    from datasets import Dataset, DatasetInfo, NamedSplit

    features = _features()
    table = pa.table(
        {column: [row[column] for row in rows] for column in COLUMNS}, schema=features.arrow_schema
    )
    dataset = Dataset(
        table, info=DatasetInfo(features=features), split=NamedSplit(split), fingerprint=fingerprint
    )
    dataset.save_to_disk(str(path))


def _split_stats(
    lengths: list[int], kept: list[Example], blocks: list[Example], max_length: int, loss_tokens: int
) -> dict[str, Any]:
    """Counts for stats.json; ``lengths`` are untruncated token counts of every conversation read."""
    n_conversations = len(lengths)
    tokens = sum(len(example["input_ids"]) for example in kept)
    truncated = sum(example["truncated"] for example in kept)
    return {
        "conversations": n_conversations,
        "dropped_no_loss_tokens": n_conversations - len(kept),
        "truncated": truncated,
        "truncated_pct": round(100.0 * truncated / max(n_conversations, 1), 3),
        "tokens": tokens,
        # labels[0] is never a target (see snaketune.data.chat), so this is what the loss averages over.
        "loss_tokens": loss_tokens,
        # What padding each kept conversation to max_length would waste, and what packing leaves unused.
        "pad_fraction_unpadded_to_max": round(1.0 - tokens / max(len(kept) * max_length, 1), 6),
        "packed_blocks": len(blocks),
        "pad_fraction_packed": round(1.0 - tokens / max(len(blocks) * max_length, 1), 6),
        "mean_conversation_tokens": round(sum(lengths) / max(len(lengths), 1), 3),
        "max_conversation_tokens": max(lengths, default=0),
    }


def tokenize_split(
    tokenizer,
    parquet_path: Path,
    *,
    max_length: int,
    assistant_only_loss: bool,
    desc: str,
    check: TurnCheck | None = None,
) -> tuple[list[int], list[Example], tuple[int, str] | None, int]:
    """Untruncated lengths of all conversations of one file, the examples that keep a loss token, the
    fewest tokens any conversation needs to keep one (with its conversation_id; None when none has one),
    and the loss tokens of the kept examples. Every row passes the template's checks (`check` counts them).
    """
    columns = read_conversations_file(
        parquet_path, ["conversation_id", "messages", "tools"], optional=("tools",)
    )
    ids_by_row = columns["conversation_id"]
    lengths: list[int] = []
    kept: list[Example] = []
    shortest: tuple[int, str] | None = None
    loss_tokens = 0
    encoded = encode_conversations(
        tokenizer,
        columns["messages"],
        assistant_only_loss=assistant_only_loss,
        tools=columns["tools"],
        check=check,
    )
    progress = tqdm(encoded, total=len(ids_by_row), desc=desc, unit="conv", file=sys.stderr, mininterval=2.0)
    try:
        for row, (input_ids, labels) in enumerate(progress):
            lengths.append(len(input_ids))
            trained = np.flatnonzero(labels != IGNORE_INDEX)
            if not len(trained):
                continue
            # max_length must reach the first trained token (in the first assistant reply) for it to count.
            if shortest is None or trained[0] + 1 < shortest[0]:
                shortest = (int(trained[0]) + 1, ids_by_row[row])
            if trained[0] >= max_length:
                continue
            loss_tokens += int(np.count_nonzero(trained < max_length))
            kept.append(
                {
                    "input_ids": input_ids[:max_length].tolist(),
                    "labels": labels[:max_length].tolist(),
                    "truncated": len(input_ids) > max_length,
                }
            )
    except TemplateError as e:
        index = str(e).removeprefix("conversation index ").split(":", 1)[0]
        where = f"conversation {ids_by_row[int(index)]!r}" if index.isdigit() else "a conversation"
        raise TemplateError(f"{parquet_path}: {where}: {str(e).split(': ', 1)[-1]}") from e
    return lengths, kept, shortest, loss_tokens


def _no_rows_error(parquet_path: Path, lengths: list[int], shortest, max_length: int) -> ValueError:
    if shortest is None:
        return ValueError(
            f"{parquet_path}: none of its {len(lengths)} conversations has a token to train on (no assistant "
            "reply renders to a token); allowed: conversations with a non-empty assistant reply"
        )
    need, conversation_id = shortest
    return ValueError(
        f"{parquet_path}: tokenize.max_length {max_length} keeps none of its {len(lengths)} "
        f"conversation{'s' * (len(lengths) != 1)} (no loss token survives truncation); the shortest first "
        f"user->assistant exchange needs {need} tokens (conversation {conversation_id!r}); "
        f"allowed: tokenize.max_length >= {need}"
    )


def tokenize_conversations(
    conv_dir: str | Path,
    tokenizer_dir: str | Path,
    out_dir: str | Path,
    *,
    max_length: int,
    packing: bool,
    assistant_only_loss: bool,
    chat_template: str,
    threads: int = 1,
) -> dict[str, Any]:
    """Tokenize conversations/{train,validation}.parquet into out_dir/{train,validation} datasets + stats.json.

    Every row has input_ids, labels and position_ids (packed blocks or single conversations). The output
    directory appears atomically (built beside it, then renamed over any old one) and its bytes depend only
    on the inputs and settings. stats.json (also returned) holds, per split: conversations read,
    dropped_no_loss_tokens, truncated (count and truncated_pct), sequences (rows written), tokens,
    loss_tokens, packed_blocks, pad_fraction_unpadded_to_max = 1 - tokens / (kept conversations x
    max_length), pad_fraction_packed = 1 - tokens / (packed_blocks x max_length) (reported with packing
    off too), mean/max untruncated conversation tokens; and the sha256 of the conversation files, the
    tokenizer files and the chat template, the settings and library versions; and `template_check`, what every row
    was checked for (snaketune.data.template_check): the end-of-turn token, the generation prompt, the turns.
    """
    # The Rust tokenizer's thread pool starts at its first batch and reads this then; the output does not
    # depend on it (bench/tokenize_throughput.py compares the bytes across thread counts).
    os.environ.setdefault("RAYON_NUM_THREADS", str(max(1, threads)))
    import datasets
    import tokenizers
    import transformers

    conv_dir, out_dir = Path(conv_dir), Path(out_dir)
    tokenizer = load_tokenizer(tokenizer_dir, chat_template)
    check_chat_template(tokenizer)
    settings = {
        "max_length": max_length,
        "packing": packing,
        "assistant_only_loss": assistant_only_loss,
        "chat_template": chat_template,
    }
    stats: dict[str, Any] = {
        "settings": settings,
        "conversation_files_sha256": {s: sha256_file(conv_dir / f"{s}.parquet") for s in SPLITS},
        "tokenizer_files_sha256": tokenizer_hashes(tokenizer_dir),
        "chat_template_sha256": sha256_text(chat_template_text(tokenizer)),
        "versions": {
            "datasets": datasets.__version__,
            "tokenizers": tokenizers.__version__,
            "transformers": transformers.__version__,
        },
        "splits": {},
    }
    check = turn_check(tokenizer)
    with atomic_dir(out_dir) as tmp:
        for split in SPLITS:
            lengths, kept, shortest, loss_tokens = tokenize_split(
                tokenizer,
                conv_dir / f"{split}.parquet",
                max_length=max_length,
                assistant_only_loss=assistant_only_loss,
                desc=f"tokenize {split}",
                check=check,
            )
            # Packed anyway so stats can say what packing saves when it is off.
            blocks = pack(kept, max_length)
            rows = blocks if packing else [with_position_ids(example) for example in kept]
            split_stats = _split_stats(lengths, kept, blocks, max_length, loss_tokens)
            split_stats["sequences"] = len(rows)
            if not rows:
                raise _no_rows_error(conv_dir / f"{split}.parquet", lengths, shortest, max_length)
            identity = {"split": split, **{k: stats[k] for k in stats if k not in ("splits", "versions")}}
            fingerprint = sha256_text(json.dumps(identity, sort_keys=True))[:16]
            save_rows(rows, tmp / split, split=split, fingerprint=fingerprint)
            stats["splits"][split] = split_stats
        stats["template_check"] = check.as_json()
        (tmp / "stats.json").write_text(json.dumps(stats, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return stats
