"""The report's benchmark section: the benchmark stage's lm-evaluation-harness scores (snaketune.benchmark.run).

- Forgetting, per experiment and task: base -> SFT -> DPO -> the final model's GGUF files, each score with its
  standard error, and each fine-tuned model's change against the base with a 95% interval, marked where the model
  is worse than the base beyond the noise (the interval lies wholly on the worse side).
- The deployed files, per exported model and task: each GGUF file's score beside its transformers model's, the
  difference and its 95% interval.

Changes pair the two models' scores on the same examples (both ran the same task spec: the same examples in the same
order): the mean of the per-example differences, ± 1.96 of its standard error. Where a task has no per-example
scores (a group of tasks), the standard errors combine as if the two were independent (wider).

A drop beyond benchmark.max_drop (`drops`: the first screen says so first, and rule benchmark_gate fails the run on
it under benchmark.fail_on_drop) is a change against the base whose whole 95% interval lies below -max_drop
percentage points: a loss larger than max_drop that the noise of this many examples does not explain (an interval
that reaches above -max_drop may be a smaller loss, or none). Judged are the changes that matter to a user: those
of each experiment's final scored model (DPO where the benchmark scored it, else SFT: the SFT model of a DPO
experiment is a step on the way, and what it lost and DPO kept shows in DPO) and of its GGUF files (what is
deployed), on the metrics that are shares where higher is better (acc, acc_norm, exact_match, ifeval's
accuracies), whose changes are percentage points; other metrics (perplexities, BLEU) are shown, not judged.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from snaketune.evaluation.intervals import Z95
from snaketune.report.render import MINUS, Block, Heading, Para, Table, fmt

NAMES = {"base": "base", "sft": "SFT", "dpo": "DPO"}


def load_results(paths: list[Path]) -> dict[tuple[str, str, str], dict]:
    """(owner, model label, task) -> result; owner is the experiment, or `base/<key>` for a base model."""
    out = {}
    for path in paths:
        r = json.loads(Path(path).read_text())
        owner = r["model"]["experiment"] if r["model"]["kind"] != "base" else f"base/{Path(path).parent.name}"
        out[(owner, r["model"]["label"], r["task"])] = r
    return out


def _per_example(result: dict, metric: str, filt: str) -> dict[int, float]:
    return {
        s["doc_id"]: s[metric]
        for s in result["samples"]
        if s.get("filter") == filt and s.get(metric) is not None
    }


def change(before: dict, after: dict, key: str) -> dict | None:
    """after - before on metric `key` ("acc,none"): the difference, its 95% interval, n paired, and `worse`: the
    interval lies wholly on the side the metric calls worse."""
    a, b = before["metrics"].get(key), after["metrics"].get(key)
    if a is None or b is None:
        return None
    x, y = _per_example(before, a["metric"], a["filter"]), _per_example(after, b["metric"], b["filter"])
    docs = sorted(set(x) & set(y))
    if len(docs) >= 2:
        d = [y[i] - x[i] for i in docs]
        mean = sum(d) / len(d)
        sd = math.sqrt(sum((v - mean) ** 2 for v in d) / (len(d) - 1))
        half, paired = Z95 * sd / math.sqrt(len(d)), True
    else:
        mean, paired = b["value"] - a["value"], False
        half = Z95 * math.hypot(a["stderr"] or 0.0, b["stderr"] or 0.0)
    low, high = mean - half, mean + half
    higher = a.get("higher_is_better")
    worse = None if higher is None else (high < 0 if higher else low > 0)
    # A share where higher is better: its change, in percentage points, is what benchmark.max_drop limits.
    share = higher is True and all(0 <= m["value"] <= 1 for m in (a, b))
    return {
        "delta": mean,
        "ci95": [low, high],
        "n": len(docs),
        "paired": paired,
        "worse": worse,
        "share": share,
    }


def beyond_max_drop(c: dict | None, max_drop: float) -> bool:
    """Whether a change is a drop beyond benchmark.max_drop: a share's, whose whole 95% interval lies below
    -max_drop percentage points (with max_drop 0, exactly `worse`)."""
    return bool(c and c["share"] and c["ci95"][1] < -max_drop / 100)


def _chain(exp: str, results: dict, bases: dict[str, str]) -> list[tuple[str, str]]:
    """(owner, label) of the experiment's models in order: base, SFT, DPO, then the last one's GGUF files."""
    labels = {label for owner, label, _ in results if owner == exp}
    chain = [(f"base/{bases[exp]}", "base")] if exp in bases else []
    chain += [(exp, m) for m in ("sft", "dpo") if m in labels]
    last = _last(labels)
    chain += [(exp, label) for label in sorted(labels) if label.startswith(f"{last}-")]
    return chain


def _last(labels) -> str:
    """The experiment's final scored model: dpo where the benchmark scored it, else sft."""
    return "dpo" if "dpo" in labels else "sft"


def benchmark_summary(paths: list[Path], bases: dict[str, str], max_drop: float) -> dict:
    """What the section shows, for summary.json: per experiment, task and metric each model's score and its change
    against the base (the final model's and its files' marked `beyond_max_drop`, true or false); per GGUF file and
    task, the difference against its transformers model; `drops`, the changes beyond max_drop."""
    results = load_results(paths)
    tasks = list(dict.fromkeys(task for _, _, task in results))
    experiments = sorted({owner for owner, _, _ in results if not owner.startswith("base/")} | set(bases))
    out: dict = {"experiments": {}, "deployed": []}
    for exp in experiments:
        chain = _chain(exp, results, bases)
        per_task = {}
        for task in tasks:
            got = {
                label: results[(owner, label, task)]
                for owner, label in chain
                if (owner, label, task) in results
            }
            if not got:
                continue
            first = next(iter(got.values()))
            per_task[task] = {
                "n": first["n"],
                "n_shot": first["spec"]["num_fewshot"],
                "metrics": {
                    key: {
                        "scores": {lab: _score(r, key) for lab, r in got.items()},
                        "change_vs_base": {
                            lab: change(got["base"], r, key)
                            for lab, r in got.items()
                            if lab != "base" and "base" in got
                        },
                    }
                    for key in first["metrics"]
                },
            }
        out["experiments"][exp] = per_task
    out["max_drop"] = max_drop
    out["drops"] = _judge(out["experiments"], max_drop)
    for (owner, label, task), r in results.items():
        if r["model"]["kind"] == "gguf" and (owner, label.split("-")[0], task) in results:
            model = results[(owner, label.split("-")[0], task)]
            out["deployed"].append(
                {
                    "experiment": owner,
                    "model": label.split("-")[0],
                    "file": label,
                    "task": task,
                    "metrics": {
                        key: {
                            "transformers": _score(model, key),
                            "gguf": _score(r, key),
                            "difference": change(model, r, key),
                        }
                        for key in r["metrics"]
                    },
                }
            )
    return out


def _judge(experiments: dict, max_drop: float) -> list[dict]:
    """Mark each change of a final model (and its files) against the base `beyond_max_drop`; return those that are:
    experiment, model label, task, metric key, n and the change with its interval (the metric's units)."""
    drops = []
    for exp, per_task in experiments.items():
        labels = {lab for t in per_task.values() for m in t["metrics"].values() for lab in m["scores"]}
        last = _last(labels)
        for task, t in per_task.items():
            for key, m in t["metrics"].items():
                for lab, c in m["change_vs_base"].items():
                    if c is None or (lab != last and not lab.startswith(f"{last}-")):
                        continue
                    c["beyond_max_drop"] = beyond_max_drop(c, max_drop)
                    if c["beyond_max_drop"]:
                        drops.append(
                            {"experiment": exp, "model": lab, "task": task, "metric": key, "n": t["n"]}
                            | {k: c[k] for k in ("delta", "ci95")}
                        )
    return drops


def points(x: float) -> str:
    """benchmark.max_drop as written: 2, 0.5."""
    return f"{x:g}"


def drop_text(d: dict) -> str:
    """One drop in words: `default DPO q4_k_m: builtin_choice acc −25.0 points [−38.4, −11.6] (40 examples)`."""
    delta, low, high = (f"{100 * x:+.1f}".replace("-", MINUS) for x in (d["delta"], *d["ci95"]))
    return (
        f"{d['experiment']} {_name(d['model'])}: {d['task']} {_metric_name(d['metric'])} {delta} points "
        f"[{low}, {high}] ({fmt(d['n'])} examples)"
    )


def _score(result: dict, key: str) -> dict | None:
    m = result["metrics"].get(key)
    return None if m is None else {"value": m["value"], "stderr": m["stderr"]}


# ---- rendering ---------------------------------------------------------------------------------------


def _name(label: str) -> str:
    """base, SFT, DPO, `DPO q4_k_m` (a GGUF file of the DPO model)."""
    model, _, quant = label.partition("-")
    return f"{NAMES.get(model, model)} {quant}".strip()


def _metric_name(key: str) -> str:
    metric, filt = key.split(",", 1)
    return metric if filt == "none" else f"{metric} ({filt})"


def _cell(score: dict | None) -> str:
    if score is None:
        return "—"
    return fmt(score["value"], 3) + ("" if score["stderr"] is None else f" ± {fmt(score['stderr'], 2)}")


def _delta(c: dict | None) -> str:
    if c is None:
        return "—"
    low, high = c["ci95"]
    text = f"{'+' if c['delta'] >= 0 else ''}{fmt(c['delta'], 3)} [{fmt(low, 2)}, {fmt(high, 2)}]"
    return text.replace("-", MINUS) + (" worse" if c["worse"] else "")


def _forgetting_table(per_task: dict) -> Table:
    """One experiment's tasks and metrics: each model's score, each change against the base, which are worse."""
    labels = list(
        dict.fromkeys(lab for t in per_task.values() for m in t["metrics"].values() for lab in m["scores"])
    )
    changed = [lab for lab in labels if lab != "base"]
    rows = []
    for task, t in per_task.items():
        for key, m in t["metrics"].items():
            worse = [
                _name(lab) + (" (beyond max_drop)" if c.get("beyond_max_drop") else "")
                for lab, c in m["change_vs_base"].items()
                if c and c["worse"]
            ]
            rows.append(
                [
                    task,
                    _metric_name(key),
                    fmt(t["n"]),
                    *(_cell(m["scores"].get(lab)) for lab in labels),
                    *(_delta(m["change_vs_base"].get(lab)) for lab in changed),
                    ", ".join(worse) or "—",
                ]
            )
    header = [
        "task",
        "metric",
        "n",
        *(_name(lab) for lab in labels),
        *(f"{_name(lab)} − base" for lab in changed),
        "worse than base",
    ]
    return Table(header, rows, numeric=[False, False, *[True] * (len(header) - 3), False])


def benchmark_section(summary: dict | None) -> list[Block]:
    if not summary or not any(summary["experiments"].values()):
        return []
    blocks: list[Block] = [
        Heading(2, "Benchmarks (lm-evaluation-harness)"),
        Para(
            "Each model on the benchmark tasks with EleutherAI's lm-evaluation-harness, prompts rendered with the "
            "chat template (few-shot examples as earlier turns). Scores ± their standard error; changes against the "
            "base model, and the GGUF files against the model they came from, are means of per-example differences "
            "with their 95% interval; “worse” marks an interval wholly below zero (above, for a metric where lower "
            "is better): lost beyond the noise of this many examples; “beyond max_drop” an interval of the final "
            f"model or its files wholly below −{points(summary['max_drop'])} points (benchmark.max_drop).",
            muted=True,
        ),
    ]
    if summary.get("tasks_reason"):
        blocks.append(Para(f"Why these tasks: {summary['tasks_reason']}."))
    for exp, per_task in summary["experiments"].items():
        if per_task:
            blocks += [Heading(3, f"{exp}: forgetting"), _forgetting_table(per_task)]
    if summary["deployed"]:
        rows = []
        for d in summary["deployed"]:
            for key, m in d["metrics"].items():
                rows.append(
                    [
                        f"{d['experiment']} {NAMES.get(d['model'], d['model'])}",
                        d["task"],
                        _metric_name(key),
                        _cell(m["transformers"]),
                        d["file"].split("-", 1)[1],
                        _cell(m["gguf"]),
                        _delta(m["difference"]),
                    ]
                )
        blocks += [
            Heading(3, "The deployed files"),
            Para(
                "Each exported GGUF file run by llama.cpp (llama-cpp-python, in the job's process) and scored by the "
                "harness, beside the transformers model it was exported from, on the same examples.",
                muted=True,
            ),
            Table(
                ["model", "task", "metric", "transformers", "GGUF", "GGUF score", "GGUF − transformers"],
                rows,
                numeric=[False, False, False, True, False, True, True],
            ),
        ]
    return blocks
