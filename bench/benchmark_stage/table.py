"""The benchmark stage's figures from a finished run: per model and task the job's wall time (Snakemake's benchmark
TSV), the model's load time and the task's time (the result file), the score with its standard error and, for a
GGUF file, its difference from the bf16 model it came from on the same examples (95% interval). Markdown on stdout,
the same rows as JSON beside it with --json.

    python bench/benchmark_stage/table.py RUN_DIR [--json OUT.json]
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))

from snaketune.report.benchmark import change, load_results  # noqa: E402


def wall_s(run: Path, result: Path) -> float | None:
    """The job's wall time: benchmarks/ mirrors results/ (benchmarks/benchmark/<...>/<task>.tsv)."""
    tsv = run / "benchmarks" / result.relative_to(run / "results").with_suffix(".tsv")
    if not tsv.is_file():
        return None
    with open(tsv, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    return float(rows[-1]["s"]) if rows else None


def rows(run: Path) -> list[dict]:
    paths = sorted((run / "results/benchmark").rglob("*.json"))
    results = load_results(paths)
    by_path = dict(zip(results, paths, strict=True))
    out = []
    for (owner, label, task), r in results.items():
        key = next(iter(r["metrics"]))
        row = {
            "model": label if owner.startswith("base/") else f"{owner} {label}",
            "task": task,
            "metric": key,
            "n": r["n"],
            "job_wall_s": wall_s(run, by_path[(owner, label, task)]),
            "load_s": r["load_s"],
            "task_s": r["time_s"],
            "score": r["metrics"][key]["value"],
            "stderr": r["metrics"][key]["stderr"],
            "device": r["model"].get("device") or r["model"]["runtime"],
        }
        source = (owner, label.split("-")[0], task)
        if r["model"]["kind"] == "gguf" and source in results:
            row["vs_bf16"] = change(results[source], r, key)
        out.append(row)
    return out


def markdown(table: list[dict]) -> str:
    lines = [
        "| model | task | metric | n | job wall s | load s | task s | score ± se | − bf16 [95%] | device |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in table:
        d = r.get("vs_bf16")
        diff = f"{d['delta']:+.3f} [{d['ci95'][0]:+.3f}, {d['ci95'][1]:+.3f}] (n={d['n']})" if d else ""
        se = "" if r["stderr"] is None else f" ± {r['stderr']:.3f}"
        wall = "" if r["job_wall_s"] is None else f"{r['job_wall_s']:.1f}"
        lines.append(
            f"| {r['model']} | {r['task']} | {r['metric']} | {r['n']} | {wall} | {r['load_s']:.1f} | "
            f"{r['task_s']:.1f} | {r['score']:.3f}{se} | {diff} | {r['device']} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="the workflow's working directory after the run")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    table = rows(args.run)
    print(markdown(table))
    if args.json:
        args.json.write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
