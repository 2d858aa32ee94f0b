"""A documented conversation-length mix in the oasst1 message schema, for throughput benchmarks.

The builtin sample (snaketune.data.builtin) has short exact-answer conversations (~30 tokens), which would make
padding look far cheaper or far costlier than on real data. This mix has oasst1's shape instead: threads of 1-3
user/assistant exchanges (60% / 30% / 10%), user turns of log-normal length (median 25 words, sigma 0.9) and
assistant replies of log-normal length (median 110 words, sigma 0.8), each capped at 600 words. Words come from
a fixed lexicon of 3,000 pseudo-words with Zipf frequencies, so a byte-level BPE learns a realistic number of
tokens per word. bench/throughput/train_throughput.py reports the token statistics of the mix as the tokenizer sees it
(mean, median, 90th percentile, share longer than the 512-token block) next to its figures.

    python3 bench/throughput/length_mix.py OUT.jsonl [--trees 1200] [--seed 0]

Deterministic: everything derives from random.Random(seed).
"""

from __future__ import annotations

import argparse
import json
import math
import random
from pathlib import Path

EXCHANGES = {1: 0.6, 2: 0.3, 3: 0.1}
USER_WORDS = (15, 0.9)  # median, sigma of the log-normal
ASSISTANT_WORDS = (60, 0.8)
MAX_WORDS = 600
LEXICON = 3000
SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in ("a", "e", "i", "o", "u", "ai", "ou")]


def _lexicon(rng: random.Random) -> list[str]:
    words: set[str] = set()
    while len(words) < LEXICON:
        words.add("".join(rng.choice(SYLLABLES) for _ in range(rng.choice((1, 2, 2, 3, 3, 4)))))
    return sorted(words)


def _words(rng: random.Random, lexicon: list[str], weights: list[float], median: int, sigma: float) -> str:
    n = min(MAX_WORDS, max(1, round(math.exp(rng.gauss(math.log(median), sigma)))))
    picked = rng.choices(lexicon, weights=weights, k=n)
    sentences, i = [], 0
    while i < n:
        k = rng.randint(6, 18)
        sentences.append(" ".join(picked[i : i + k]).capitalize() + rng.choice((".", ".", ".", "?", "!")))
        i += k
    return " ".join(sentences)


def generate(trees: int = 1200, seed: int = 0) -> list[dict]:
    """Rows of the oasst1 message table: one linear thread per tree, every oasst1 field present."""
    rng = random.Random(seed)
    lexicon = _lexicon(rng)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]  # Zipf
    rows = []
    for t in range(trees):
        tree_id = f"mix-{seed}-{t:06d}"
        parent = None
        exchanges = rng.choices(list(EXCHANGES), weights=list(EXCHANGES.values()))[0]
        for turn in range(2 * exchanges):
            role = "prompter" if turn % 2 == 0 else "assistant"
            median, sigma = USER_WORDS if role == "prompter" else ASSISTANT_WORDS
            message_id = f"{tree_id}-{turn}"
            rows.append(
                {
                    "message_id": message_id,
                    "parent_id": parent,
                    "user_id": f"user-{rng.randrange(500):03d}",
                    "created_date": f"2023-03-{1 + t % 28:02d}T{turn % 24:02d}:00:00+00:00",
                    "text": _words(rng, lexicon, weights, median, sigma),
                    "role": role,
                    "lang": "en",
                    "review_count": 3,
                    "review_result": True,
                    "deleted": False,
                    "rank": 0 if role == "assistant" else None,
                    "synthetic": False,
                    "model_name": None,
                    "detoxify": None,
                    "message_tree_id": tree_id,
                    "tree_state": "ready_for_export",
                    "emojis": None,
                    "labels": None,
                }
            )
            parent = message_id
    return rows


def write_jsonl(path: str | Path, trees: int = 1200, seed: int = 0) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for row in generate(trees, seed):
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out")
    parser.add_argument("--trees", type=int, default=1200)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(write_jsonl(args.out, args.trees, args.seed))
