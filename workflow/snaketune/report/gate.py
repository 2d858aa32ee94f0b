"""The benchmark gate (rule benchmark_gate, a target of rule all only under benchmark.fail_on_drop): once the report
is written, it reads the report's summary.json and fails the run when the report flags a drop beyond
benchmark.max_drop (snaketune.report.benchmark), naming each one: experiment, model, task, metric, the change and
its 95% interval.

A rule after the report rather than the report failing: Snakemake deletes a failed job's outputs, and the user needs
the report to see why the run failed. Passing, the gate writes gate.json (the max_drop and every change it judged),
an output like any other: a passed check is not repeated while the report stands. A failed one leaves none, so
every later run repeats it (a second's work) and fails again until the drop is gone, max_drop allows it or
fail_on_drop is off.
"""

from __future__ import annotations

import json
from pathlib import Path

from snaketune.io import write_json
from snaketune.report.benchmark import drop_text, points


class DropBeyondMaxDrop(Exception):
    """The report flags a benchmark score the final model lost beyond benchmark.max_drop."""


class NothingJudged(Exception):
    """fail_on_drop asks for a check that no benchmark score can answer."""


def judged(bench: dict) -> list[dict]:
    """Every change the report judged against max_drop (those with `beyond_max_drop`): experiment, model label,
    task, metric, the change and its interval, whether it is beyond."""
    out = []
    for exp, per_task in bench.get("experiments", {}).items():
        for task, t in per_task.items():
            for key, m in t["metrics"].items():
                out += [
                    {"experiment": exp, "model": lab, "task": task, "metric": key, "n": t["n"]}
                    | {k: c[k] for k in ("delta", "ci95", "beyond_max_drop")}
                    for lab, c in m["change_vs_base"].items()
                    if c is not None and "beyond_max_drop" in c
                ]
    return out


def check_drops(summary_path: str | Path, out_path: str | Path) -> dict:
    """Raise DropBeyondMaxDrop naming every drop of the report's summary.json; NothingJudged where the report
    judged no change (no base scores, or no metric that is a share); else write and return gate.json's content."""
    report = Path(summary_path).parent / "index.html"
    bench = json.loads(Path(summary_path).read_text(encoding="utf-8")).get("benchmark") or {}
    drops = bench.get("drops") or []
    if drops:
        limit, many = points(bench["max_drop"]), len(drops) > 1
        raise DropBeyondMaxDrop(
            f"{len(drops)} benchmark score{'s' if many else ''} of the final model{'s' if many else ''} "
            f"fell more than benchmark.max_drop ({limit} points) below the base model's, beyond the noise (the "
            f"whole 95% interval below -{limit}): {'; '.join(drop_text(d) for d in drops)}. The report ({report}) "
            "shows every score; benchmark.fail_on_drop: false lets the run end without failing"
        )
    checked = judged(bench)
    if not checked:
        raise NothingJudged(
            f"benchmark.fail_on_drop is true, but the report ({report}) judged no benchmark score against the base "
            "model: no task has a metric that is a share where higher is better (acc, acc_norm, exact_match, ...) "
            "scored for both the base and the final model. Name such a task in benchmark.tasks, or set "
            "benchmark.fail_on_drop: false"
        )
    result = {"max_drop": bench["max_drop"], "judged": checked, "drops": []}
    write_json(out_path, result)
    return result
