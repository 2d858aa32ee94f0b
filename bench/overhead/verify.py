"""Verify speed: how fast `snakemake --cores all verify` (snaketune.verify) hashes outputs against their records.

Writes --gib GiB as --files files of one output directory under --dir, describes the directory as a job's
provenance record does, then times the full check (`snaketune.verify.compare(full=True)`: every file hashed, sha256,
--threads files at a time) --repeat times and prints a Markdown table (seconds, GB/s). The files are sparse by
default (all zeros, no disk blocks: the hash's own speed, what one core does per file); --random writes random bytes
(then the disk's speed counts too, and the page cache may hold them). The files are deleted at the end.

    python -m bench verify [--gib 14] [--files 1] [--threads 1] [--repeat 3] [--random] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))

from snaketune import verify  # noqa: E402

CHUNK = 64 << 20


def make(directory: Path, gib: float, files: int, random: bool) -> None:
    size = int(gib * 2**30) // files
    for i in range(files):
        path = directory / f"model-{i:05d}-of-{files:05d}.safetensors"
        with open(path, "wb") as f:
            if random:
                left = size
                while left:
                    n = min(CHUNK, left)
                    f.write(os.urandom(n))
                    left -= n
            else:
                f.truncate(size)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gib", type=float, default=14.0)
    ap.add_argument("--files", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--random", action="store_true")
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    args = ap.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="snaketune-verify-", dir=args.dir))
    try:
        out = root / "model"
        out.mkdir()
        make(out, args.gib, args.files, args.random)
        t0 = time.perf_counter()
        entry = verify.describe(out)  # what the job's record holds (one sequential pass)
        record_s = time.perf_counter() - t0
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            assert verify.compare(out, entry, full=True, threads=args.threads) == []
            times.append(time.perf_counter() - t0)
        size = entry["bytes"]
        best, median = min(times), statistics.median(times)
        kind = "random" if args.random else "sparse"
        print(f"{platform.node()}: {os.cpu_count()} CPUs, Python {platform.python_version()}")
        print(
            "| bytes | files | content | threads | record (s) | verify median (s) | min (s) | GB/s (median) |"
        )
        print("|---|---|---|---|---|---|---|---|")
        print(
            f"| {size / 1e9:.2f} GB | {args.files} | {kind} | {args.threads} | {record_s:.2f} | {median:.2f} | "
            f"{best:.2f} | {size / 1e9 / median:.2f} |"
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
