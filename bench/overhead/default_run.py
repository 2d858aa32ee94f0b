"""The embedded default (config/config.yaml: the tiny model, three CPU ranks, SFT, DPO, evaluation, two GGUF
exports, the report) from scratch, as `make run` runs it: the wall time of the whole run and of each stage
(Snakemake's benchmark files), and the figures the README quotes from it (the held-out preference accuracy and
validation loss after SFT and after DPO).

    python -m bench default_run [--workdir /tmp/snaketune-default-run] [--cores all]

The run lives in --workdir, a fresh copy of the repository's workflow (bookkeeping.sync), so the repository's own
results/ are never touched; CPU ranks, the GPUs hidden (the default is the CPU run). Time it on a quiet machine:
the ranks and the export share the cores.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

from bookkeeping import env, snakemake_bin, sync


def stage_times(workdir: Path) -> dict[str, float]:
    """Wall seconds per rule, from benchmarks/<rule>[/<wildcards>].tsv (the first column, `s`)."""
    times = {}
    for tsv in sorted((workdir / "benchmarks").rglob("*.tsv")):
        lines = tsv.read_text().splitlines()
        if len(lines) >= 2:
            times[str(tsv.relative_to(workdir / "benchmarks").with_suffix(""))] = float(
                lines[-1].split("\t")[0]
            )
    return times


def quality(workdir: Path) -> dict[str, float]:
    metrics = json.loads((workdir / "results/eval/default/metrics.json").read_text())
    out = {f"validation loss, {m}": metrics["validation"][m]["loss"] for m in ("tuned", "dpo")}
    for m in ("tuned", "dpo"):
        out[f"held-out preference accuracy, {m}"] = metrics["preference"][m]["accuracy"]
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/snaketune-default-run"))
    parser.add_argument("--cores", default="all")
    args = parser.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    sync(args.workdir)
    t0 = time.perf_counter()
    cmd = [snakemake_bin(), "--cores", args.cores, "--resources", "gpu=3"]
    proc = subprocess.run(cmd, cwd=args.workdir, env=env(), capture_output=True, text=True, check=False)
    wall = time.perf_counter() - t0
    if proc.returncode:
        print(proc.stdout[-3000:] + proc.stderr[-3000:])
        return proc.returncode
    print(f"the whole run: {wall:.0f} s ({int(wall // 60)} min {wall % 60:.0f} s), {' '.join(cmd)}")
    for rule, s in stage_times(args.workdir).items():
        print(f"  {rule:<40} {s:8.1f} s")
    for name, value in quality(args.workdir).items():
        print(f"{name}: {value:.4f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
