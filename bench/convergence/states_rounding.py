"""Losses of the step-in-backward experiments against a reference run (issue #26; fp32_states unless
$REFERENCE names another experiment, such as fp32_adam): each experiment's training loss over quarters of the steps
(the ratio of the quarter's summed losses; the experiments train on the same batches in the same order) and its
validation losses, as a markdown table.

    [REFERENCE=fp32_adam] python3 bench/convergence/states_rounding.py DIR/wf_*/results/train/*/metrics.csv

(converge.sh, cpu_tiny.sh and cpu_real.sh print it at their end.)
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path


def _series(path: Path) -> tuple[dict[int, float], dict[int, float]]:
    train, val = {}, {}
    for row in csv.DictReader(path.open()):
        step = int(row["step"])
        if row.get("train/loss"):
            train[step] = float(row["train/loss"])
        if row.get("val/loss"):
            val[step] = float(row["val/loss"])
    return train, val


def main(paths: list[str]) -> None:
    runs = {Path(p).parent.name: _series(Path(p)) for p in paths}
    ref = os.environ.get("REFERENCE", "fp32_states")
    if ref not in runs:
        sys.exit(f"no {ref} among {sorted(runs)} (set REFERENCE to one of them)")
    ref_train, ref_val = runs.pop(ref)
    steps = sorted(ref_train)
    cuts = [round(i * len(steps) / 4) for i in range(5)]
    windows = [steps[cuts[i] : cuts[i + 1]] for i in range(4)]
    names = [f"{w[0]}-{w[-1]}" for w in windows]
    print(f"{ref}: train loss {' / '.join(f'{sum(ref_train[s] for s in w) / len(w):.4f}' for w in windows)} "
          f"(steps {' / '.join(names)}); validation {' / '.join(f'{v:.4f}' for v in ref_val.values())} "
          f"(steps {' / '.join(map(str, ref_val))})")  # fmt: skip
    print()
    print(f"| experiment | train loss vs {ref}, steps {' / '.join(names)} | validation vs {ref} |")
    print("|---|---|---|")
    for name, (train, val) in sorted(runs.items()):
        sums = [sum(train[s] for s in w) / sum(ref_train[s] for s in w) - 1 for w in windows]
        vals = [val[s] / ref_val[s] - 1 for s in ref_val if s in val]
        print(
            f"| {name} | {' / '.join(f'{x:+.1%}' for x in sums)} | {' / '.join(f'{x:+.1%}' for x in vals)} |"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
