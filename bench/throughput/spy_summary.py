"""Where a training rank's host time goes, from py-spy's collapsed stacks (`python -m bench host_profile` writes them):

    python3 bench/throughput/spy_summary.py spy_raw.txt.gz [--top 40] [--within Trainer.train]

For the rank process (the one running snaketune.train.trainer), each thread's samples and, per thread, the frames
that appear in most of them (inclusive: a frame counts once per sample, wherever it sits in the stack) and the
innermost frames (self). The main thread runs the forward; the autograd engine's device thread runs the backward,
the checkpointed layers' recomputation and the post-accumulate-grad hooks (the step in backward's updates).
py-spy drops idle samples, so a thread blocked on the GPU or on the other thread does not count. `--within` keeps
the main thread's samples under that frame only (the training loop, not the imports, model build or save).
"""

from __future__ import annotations

import argparse
import collections
import gzip
from pathlib import Path

RANK = "snaketune.train.trainer"


def frame_name(frame: str) -> str:
    """`func (path/file.py:line)` -> `func@file.py`; native frames keep their library."""
    if " (" not in frame:
        return frame
    func, where = frame.split(" (", 1)
    return f"{func}@{where.split(':')[0].rsplit('/', 1)[-1].rstrip(')')}"


def read(path: Path) -> list[tuple[list[str], int]]:
    opener = gzip.open if path.suffix == ".gz" else open
    rows = []
    with opener(path, "rt") as f:
        for line in f:
            stack, count = line.rstrip("\n").rsplit(" ", 1)
            rows.append((stack.split(";"), int(count)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("raw", type=Path)
    parser.add_argument("--top", type=int, default=40)
    parser.add_argument("--within", default="Trainer.train@trainer.py")
    args = parser.parse_args()
    threads: dict[str, tuple[collections.Counter, collections.Counter, list[int]]] = {}
    for frames, count in read(args.raw):
        processes = [i for i, f in enumerate(frames) if f.startswith("process ")]
        if not processes or RANK not in frames[processes[-1]]:
            continue
        rest = frames[processes[-1] + 1 :]
        if not rest or not rest[0].startswith("thread "):
            continue
        inclusive, own, total = threads.setdefault(
            rest[0], (collections.Counter(), collections.Counter(), [0])
        )
        names = [frame_name(f) for f in rest[1:]]
        if "MainThread" in rest[0] and args.within:
            if args.within not in names:
                continue
            names = names[names.index(args.within) :]
        for name in set(names):
            inclusive[name] += count
        if names:
            own[names[-1]] += count
        total[0] += count
    for thread, (inclusive, own, total) in sorted(threads.items(), key=lambda kv: -kv[1][2][0]):
        print(
            f"\n## {thread}: {total[0]} samples\n\n| samples | share | frame (inclusive) |\n|---:|---:|---|"
        )
        for name, n in inclusive.most_common(args.top):
            print(f"| {n} | {n / total[0]:.0%} | `{name[:140]}` |")
        print("\n| samples | frame (innermost) |\n|---:|---|")
        for name, n in own.most_common(args.top // 2):
            print(f"| {n} | `{name[:140]}` |")


if __name__ == "__main__":
    main()
