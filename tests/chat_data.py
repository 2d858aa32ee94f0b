"""Conversations for the tokenization and packing tests: random words (a few non-ASCII), one to three
exchanges each, in the conversations stage's parquet schema (their fixtures, conv_dir, tok_dir and tok, are in
conftest.py)."""

from __future__ import annotations

import random
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

SYLLABLES = ["ka", "lo", "mi", "ne", "ru", "sa", "to", "vi", "ze", "qu", "th", "er", "an", "in", "on", "ch"]
WORDS = ["".join(random.Random(i).choice(SYLLABLES) for _ in range(1 + i % 4)) for i in range(300)] + [
    "¿qué",
    "日本語",
    "ok,",
    "why?",
]


def sentence(rng: random.Random, low: int = 3, high: int = 12) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))


def conversation(rng: random.Random, exchanges: int, prompt_words: tuple[int, int] = (3, 12)) -> list[dict]:
    return [
        message
        for _ in range(exchanges)
        for message in (
            {"role": "user", "content": sentence(rng, *prompt_words)},
            {"role": "assistant", "content": sentence(rng)},
        )
    ]


def write_conversations(path: Path, conversations: list[list[dict]]) -> Path:
    """A conversations parquet file in the schema the conversations stage writes."""
    n = len(conversations)
    table = pa.table(
        {
            "conversation_id": [f"c{i}" for i in range(n)],
            "message_tree_id": [f"t{i}" for i in range(n)],
            "lang": ["en"] * n,
            "messages": conversations,
        }
    )
    pq.write_table(table, path)
    return path
