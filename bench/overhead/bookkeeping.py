"""Bookkeeping speed: how long Snakemake takes to decide that there is nothing to do.

On a completed run of the default workflow (config/config.yaml), times

- `snakemake --version`: Snakemake's own start-up (imports, plugin discovery), the floor of any command,
- `snakemake -n`: a dry run of the full default workflow (target: under 2 s),
- `snakemake --cores all --resources gpu=3`: a no-op rerun (target: under 3 s),

each --repeat times (median, min, max of the wall time, and the median CPU time, user + sys, which other
load on the machine inflates less), and prints a Markdown table.

The run lives in --workdir, a copy of the repository's workflow (Snakefile, workflow/, config/, envs/) taken
afresh on every call, so the repository's own results/ are never touched; the first call (or one after a
source change) completes the run first, ~4 min on 2 CPU cores. --no-sync measures --workdir as it is.
--profile also profiles one dry run and prints where its time goes.

    python -m bench bookkeeping [--workdir /tmp/snaketune-bookkeeping] [--repeat 5]
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
WORKFLOW_FILES = ("Snakefile", "workflow", "config", "envs")
NOTHING_TO_DO = "Nothing to be done"
COMMANDS = {
    "snakemake --version (start-up floor)": (["--version"], None),
    "snakemake -n (dry run)": (["-n"], 2.0),
    "snakemake --cores all --resources gpu=3 (no-op rerun)": (
        ["--cores", "all", "--resources", "gpu=3"],
        3.0,
    ),
}


def snakemake_bin() -> str:
    local = Path(sys.executable).parent / "snakemake"
    return str(local) if local.exists() else shutil.which("snakemake") or "snakemake"


def env() -> dict[str, str]:
    # CPU ranks for the run; no GPU is needed to measure bookkeeping.
    return {**os.environ, "CUDA_VISIBLE_DEVICES": os.environ.get("CUDA_VISIBLE_DEVICES", "")}


def sync(workdir: Path) -> None:
    """Replace the workflow sources in workdir by the repository's; results/ and .snakemake/ stay."""
    workdir.mkdir(parents=True, exist_ok=True)
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info")
    for name in WORKFLOW_FILES:
        dst = workdir / name
        if dst.is_dir():
            shutil.rmtree(dst)
        elif dst.exists():
            dst.unlink()
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dst, ignore=ignore)
        else:
            shutil.copy2(src, dst)


def run(workdir: Path, args: list[str], *, check: bool = True) -> tuple[float, float, str]:
    """(wall s, CPU s of the command and its children, output)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    proc = subprocess.run(
        [snakemake_bin(), *args], cwd=workdir, env=env(), capture_output=True, text=True, check=False
    )
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    if check and proc.returncode != 0:
        sys.exit(f"snakemake {' '.join(args)} failed:\n{(proc.stdout + proc.stderr)[-4000:]}")
    return wall, cpu, proc.stdout + proc.stderr


def complete(workdir: Path) -> None:
    """Run the default workflow until a dry run has nothing to do."""
    _, _, out = run(workdir, ["-n"])
    if NOTHING_TO_DO in out:
        return
    print("completing the default run in", workdir, "(a few minutes) ...", flush=True)
    t0 = time.perf_counter()
    run(workdir, ["--cores", "all", "--resources", "gpu=3"])
    print(f"  done in {time.perf_counter() - t0:.0f} s", flush=True)
    _, _, out = run(workdir, ["-n"])
    if NOTHING_TO_DO not in out:
        sys.exit(f"the completed run still has work to do:\n{out[-4000:]}")


def profile(workdir: Path, top: int) -> None:
    """cProfile one dry run in this process (Snakemake's CLI entry point) and print the costliest calls."""
    from snakemake.cli import main

    prof = cProfile.Profile()
    cwd = os.getcwd()
    os.chdir(workdir)
    argv = sys.argv
    sys.argv = ["snakemake", "-n", "--quiet"]
    try:
        prof.enable()
        with contextlib.suppress(SystemExit):  # the CLI exits when it is done
            main()
        prof.disable()
    finally:
        sys.argv = argv
        os.chdir(cwd)
    stats = pstats.Stats(prof)
    stats.sort_stats("cumulative").print_stats(top)
    print("The workflow's own files:")
    stats.print_stats(str(workdir), top)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/snaketune-bookkeeping"))
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--no-sync", action="store_true", help="measure --workdir as it is")
    parser.add_argument("--profile", action="store_true", help="also profile one dry run")
    args = parser.parse_args()
    workdir = args.workdir.resolve()
    if not args.no_sync:
        sync(workdir)
    complete(workdir)

    load_before = os.getloadavg()[0]
    rows = []
    for label, (cmd, target) in COMMANDS.items():
        run(workdir, cmd)  # warm the file cache and Python's bytecode cache first
        walls, cpus = [], []
        for _ in range(args.repeat):
            wall, cpu, out = run(workdir, cmd)
            if cmd != ["--version"] and NOTHING_TO_DO not in out:
                sys.exit(f"snakemake {' '.join(cmd)} found work to do:\n{out[-3000:]}")
            walls.append(wall)
            cpus.append(cpu)
        rows.append((label, walls, cpus, target))
    load_after = os.getloadavg()[0]

    print(
        f"\nworkdir {workdir}; {os.cpu_count()} CPUs; load average {load_before:.2f} before, {load_after:.2f} after"
    )
    print(f"{args.repeat} runs each, after one warm-up run\n")
    print("| command | wall median (s) | wall min-max (s) | CPU median (s) | target |")
    print("|---|---:|---:|---:|---|")
    for label, walls, cpus, target in rows:
        verdict = ""
        if target is not None:
            verdict = f"< {target:g} s: {'met' if statistics.median(walls) < target else 'NOT met'}"
        print(
            f"| `{label}` | {statistics.median(walls):.2f} | {min(walls):.2f}-{max(walls):.2f} | "
            f"{statistics.median(cpus):.2f} | {verdict} |"
        )
    if args.profile:
        print()
        profile(workdir, 25)


if __name__ == "__main__":
    main()
