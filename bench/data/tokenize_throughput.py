"""Tokens/s of the tokenize stage with the real DeepSeek-LLM tokenizer on real oasst text, by thread count.

The corpus: every conversation (`paths: all`, every tree state) of the real oasst rows SNAKETUNE_BENCH_ROWS names
(bench/transport/real_rows.py: 100 English oasst1 trees, 520 oasst2 trees in 30+ languages), repeated under new
conversation ids until it holds about `--tokens` tokens: the length mix and languages of real oasst data, at
the scale of the full oasst1 (~21M tokens with `paths: all`) when asked. Each thread count runs the stage
function (`snaketune.data.tokenization.tokenize_conversations`, what the tokenize rule calls) in a fresh process,
as the rule does, and the outputs are compared byte for byte across thread counts.

    python -m bench tokenize [--tokens 5000000] [--threads 1,2]     (SNAKETUNE_BENCH_ROWS, SNAKETUNE_BENCH_TOKENIZER)

Prints a table: the process's wall time (Python start and imports included), the stage function's (tokenizer
load, reading, encoding, packing, writing the Arrow files), and tokens/s over the stage (tokens written, i.e.
after truncation to 2,048).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROWS = Path(os.environ.get("SNAKETUNE_BENCH_ROWS", REPO / ".realdata/oasst_real.hf_rows.jsonl"))
TOKENIZER = Path(os.environ.get("SNAKETUNE_BENCH_TOKENIZER", REPO / ".realdata"))


def build_corpus(out: Path, tokens: int) -> dict:
    sys.path.insert(0, str(REPO / "workflow"))
    import pandas as pd

    from snaketune.data.conversations import (
        OUTPUT_COLUMNS,
        Conversations,
        build_conversations,
        write_conversations,
    )
    from snaketune.data.readers import read_messages

    base = build_conversations(read_messages(ROWS), paths="all", tree_states=()).train
    # ~3.4 characters per token in this mix (measured once; the stage's stats give the exact count).
    chars = sum(len(m["content"]) for msgs in base["messages"] for m in msgs)
    copies = max(1, round(tokens / (chars / 3.4)))
    rows = []
    for k in range(copies):
        part = base.copy()
        part["conversation_id"] = part["conversation_id"] + f"-{k}"
        rows.append(part)
    train = pd.concat(rows, ignore_index=True)[list(OUTPUT_COLUMNS)]
    validation = base.head(20)[list(OUTPUT_COLUMNS)]
    write_conversations(Conversations(train, validation, {"bench": True}), out)
    return {"conversations": len(train), "copies": copies, "distinct": len(base)}


CHILD = r"""
import json, os, sys, time
sys.path.insert(0, {workflow!r})
t0 = time.perf_counter()
from snaketune.data.tokenization import tokenize_conversations
stats = tokenize_conversations({conv!r}, {tok!r}, {out!r}, max_length=2048, packing=True,
    assistant_only_loss=True, chat_template="deepseek", threads={threads})
print(json.dumps({{"wall": time.perf_counter() - t0, "stats": stats}}))
"""


def run(conv: Path, out: Path, threads: int) -> dict:
    code = CHILD.format(workflow=str(REPO / "workflow"), conv=str(conv), tok=str(TOKENIZER), out=str(out),
                        threads=threads)  # fmt: skip
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "true"}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=False)
    if proc.returncode:
        sys.exit(proc.stderr[-3000:])
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["process"] = time.perf_counter() - t0
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=5_000_000)
    parser.add_argument("--threads", default="1,2")
    args = parser.parse_args()
    if not (TOKENIZER / "tokenizer.json").is_file() or not ROWS.is_file():
        sys.exit(f"needs the real tokenizer ({TOKENIZER}: SNAKETUNE_BENCH_TOKENIZER) and oasst rows ({ROWS}: "
                 "SNAKETUNE_BENCH_ROWS); `python -m bench --help` says where they come from")  # fmt: skip
    sys.path.insert(0, str(REPO / "workflow"))
    from snaketune.io import sha256_tree

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        corpus = build_corpus(root / "conversations", args.tokens)
        print(f"corpus: {corpus['conversations']:,} conversations ({corpus['distinct']:,} distinct x "
              f"{corpus['copies']})")  # fmt: skip
        rows, hashes = [], {}
        for threads in (int(t) for t in args.threads.split(",")):
            out = root / f"tokenized-{threads}"
            r = run(root / "conversations", out, threads)
            tokens = sum(s["tokens"] for s in r["stats"]["splits"].values())
            hashes[threads] = sha256_tree(out)
            rows.append((threads, r["process"], r["wall"], tokens))
        print(f"{'threads':>7} {'process s':>10} {'stage s':>8} {'tokens':>12} {'tok/s (stage)':>14}")
        for threads, proc_s, wall, tokens in rows:
            print(f"{threads:>7} {proc_s:>10.2f} {wall:>8.2f} {tokens:>12,} {tokens / wall:>14,.0f}")
        same = len({json.dumps(h, sort_keys=True) for h in hashes.values()}) == 1
        print(f"outputs byte-identical across thread counts: {same}")
        if not same:
            sys.exit(1)


if __name__ == "__main__":
    main()
