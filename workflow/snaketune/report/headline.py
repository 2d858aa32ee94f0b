"""The report's first screen: did fine-tuning help? First any benchmark score the final models lost beyond
benchmark.max_drop; then for each experiment, its final model (DPO where the preference stage ran, else SFT) against
the models before it, base -> SFT -> DPO, on every headline figure with its 95% interval; the verdict in words,
computed from those figures (a change whose interval holds zero is called within the noise); and what the whole
run cost in time and GPU-hours."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Any

from snaketune.evaluation.intervals import wilson_interval
from snaketune.report.benchmark import drop_text, points
from snaketune.report.intervals import difference_interval, within_noise
from snaketune.report.render import MINUS, Block, Bullets, Heading, Para, Table, fmt, fmt_duration

if TYPE_CHECKING:
    from snaketune.report.inputs import Experiment

MODEL_NAMES = {"base": "base", "tuned": "SFT", "dpo": "DPO"}
"""The evaluate stage's model keys, as the report names them."""
REFERENCE_MODEL = {"sft": "tuned", "base": "base"}
"""preference.reference -> the evaluate stage's key of the model DPO's implicit reward is measured against."""


@dataclass
class Measure:
    """One headline figure of one experiment, for each model that has it."""

    key: str
    """Its name in summary.json: val_loss, exact_match, preference_accuracy, reward_accuracy."""
    label: str
    percent: bool
    """A share, shown in percent (its changes in percentage points); else a loss (changes absolute and relative)."""
    values: dict[str, float]
    """Evaluate's model key (base, tuned, dpo) -> value."""
    intervals: dict[str, list[float]] = field(default_factory=dict)
    """Model key -> 95% interval [lo, hi], where one is recorded or computable."""
    reference: str | None = None
    """The model the reward is measured against (reward accuracy only): it scores every pair 0 by construction."""


def final_model(exp: Experiment) -> str:
    """The evaluate stage's key of the experiment's final model: dpo where the preference stage ran, else tuned."""
    return "dpo" if exp.dpo is not None and "dpo" in exp.eval["validation"] else "tuned"


def measures(exp: Experiment) -> list[Measure]:
    """Validation loss; exact match on the builtin questions (builtin data only); held-out preference and
    reward accuracy (where the preference stage ran and there are held-out pairs)."""
    val = exp.eval["validation"]
    models = [m for m in MODEL_NAMES if m in val]
    out = [
        Measure(
            "val_loss",
            f"validation loss ({fmt(val.get('loss_tokens'))} tokens; lower is better)",
            False,
            {m: val[m]["loss"] for m in models},
            # The evaluate stage writes no interval for the loss yet (its `<figure>_ci95` convention names this
            # one); without it the verdict on the loss says so instead of judging the noise.
            {m: val[m]["loss_ci95"] for m in models if val[m].get("loss_ci95")},
        )
    ]
    em = exp.eval.get("exact_match")
    if em:
        scored = [m for m in models if m in em]
        out.append(
            Measure(
                "exact_match",
                f"exact match ({em['n']} builtin questions)",
                True,
                {m: em[m]["accuracy"] for m in scored},
                {
                    m: em[m].get("accuracy_ci95") or wilson_interval(em[m]["correct"], em[m]["n"])
                    for m in scored
                },
            )
        )
    pref = exp.eval.get("preference") or {}
    scored = [m for m in models if (pref.get(m) or {}).get("pairs")]
    if exp.dpo is not None and scored:
        pairs = pref[scored[0]]["pairs"]
        out.append(
            Measure(
                "preference_accuracy",
                f"held-out preference accuracy ({fmt(pairs)} pair{'s' if pairs != 1 else ''})",
                True,
                {m: pref[m]["accuracy"] for m in scored},
                {m: pref[m]["accuracy_ci95"] for m in scored if pref[m].get("accuracy_ci95")},
            )
        )
        reference = REFERENCE_MODEL.get(exp.dpo["summary"].get("reference", "sft"))
        out.append(
            Measure(
                "reward_accuracy",
                f"held-out reward accuracy (implicit reward against {MODEL_NAMES.get(reference, '?')})",
                True,
                {m: pref[m]["reward_accuracy"] for m in scored},
                {m: pref[m]["reward_accuracy_ci95"] for m in scored if pref[m].get("reward_accuracy_ci95")},
                reference=reference,
            )
        )
    return out


def training_mode(e: dict) -> str:
    """How an experiment trained (its summary.json entry): full fine-tuning, LoRA or QLoRA, quantized Adam states
    and the in-backward step where used."""
    mode = "full fine-tuning"
    if e["lora"]:
        mode = "QLoRA, 4-bit NF4 base" if e.get("lora_quantize", "none") != "none" else "LoRA"
    if e.get("optimizer_states") in ("8bit", "4bit"):
        mode += f", {e['optimizer_states'][0]}-bit Adam states"
    if e.get("optimizer_step") == "in_backward":
        mode += ", step in backward"
    if e.get("fp8", "none") != "none":
        mode += f", FP8 matmuls ({e['fp8']})"
    return mode


# ---- numbers and words ---------------------------------------------------------------------------


def value_text(m: Measure, x: float) -> str:
    return f"{100 * x:.1f}%" if m.percent else fmt(x)


def interval_text(m: Measure, ci: list[float] | None) -> str:
    """`[lo, hi]` in the figure's unit (percent for shares, without the sign: the value beside it has it)."""
    if not ci:
        return ""
    lo, hi = (100 * c if m.percent else c for c in ci)
    text = f"[{lo:.1f}, {hi:.1f}]" if m.percent else f"[{fmt(lo)}, {fmt(hi)}]"
    return text.replace("-", MINUS)


def cell_text(m: Measure, model: str, final: str) -> str:
    if model == m.reference:
        return "– (reference)"
    if model not in m.values:
        return "–"
    value = value_text(m, m.values[model])
    if model == final:
        value = f"**{value}**"
    interval = interval_text(m, m.intervals.get(model))
    return f"{value} {interval}" if interval else value


def _signed(x: float, digits: int) -> str:
    return f"{x:+.{digits}f}".replace("-", MINUS)


def change_text(m: Measure, a: str, b: str) -> str:
    """The change from model a to model b: in points for a share, absolute and relative for a loss; with its
    95% interval and whether that holds zero ("within the noise") when both models' intervals are known."""
    va, vb = m.values[a], m.values[b]
    scale, digits = (100.0, 1) if m.percent else (1.0, 3)
    text = f"{_signed(scale * (vb - va), digits)}{' points' if m.percent else ''}"
    if a not in m.intervals or b not in m.intervals:
        return text + ("" if m.percent or not va else f" ({_signed(100 * (vb - va) / va, 1)}%)")
    _, lo, hi = diff = difference_interval(va, m.intervals[a], vb, m.intervals[b])
    text += f" [{_signed(scale * lo, digits)}, {_signed(scale * hi, digits)}]"
    if not m.percent and va:
        text += f" ({_signed(100 * (vb - va) / va, 1)}%)"
    return text + (", within the noise" if within_noise(diff) else ", beyond the noise")


def change_sentence(m: Measure, final: str) -> str:
    """What fine-tuning did to figure m: from the base model to the final one (for preference accuracy, whose
    question is DPO's: from SFT), and for a DPO experiment DPO's own part, from SFT."""
    label = m.label.split(" (")[0]
    start = "tuned" if m.key == "preference_accuracy" or "base" not in m.values else "base"
    actor = "DPO" if start == "tuned" else ("SFT then DPO" if final == "dpo" else "SFT")
    va, vb = m.values[start], m.values[final]
    if va == vb:
        text = f"{actor} left {label} unchanged at {value_text(m, vb)} ({MODEL_NAMES[start]} and {MODEL_NAMES[final]})"
    else:
        interval = interval_text(m, m.intervals.get(final))
        text = (
            f"{actor} {'raised' if vb > va else 'lowered'} {label} from {value_text(m, va)} ({MODEL_NAMES[start]}) to "
            f"**{value_text(m, vb)}**{' ' + interval if interval else ''} ({MODEL_NAMES[final]}): "
            f"{change_text(m, start, final)}"
        )
    if start == "base" and final == "dpo" and "tuned" in m.values:
        text += (
            f"; DPO's part, from {value_text(m, m.values['tuned'])} (SFT): {change_text(m, 'tuned', 'dpo')}"
        )
    if start not in m.intervals or final not in m.intervals:
        text += ". No interval is recorded for it, so no noise verdict"
    return text + "."


def reward_sentence(m: Measure, model: str) -> str:
    """Reward accuracy against a coin toss: the reference model ranks no pair (its reward is 0), so the
    comparison that means something is with a random reward, which ranks half the pairs right."""
    value, ci = m.values[model], m.intervals.get(model)
    text = (
        f"{MODEL_NAMES[model]}'s implicit reward ranks **{value_text(m, value)}**"
        f"{' ' + interval_text(m, ci) if ci else ''} of the held-out pairs right"
    )
    if not ci:
        return text + " (no interval recorded)."
    if ci[0] > 0.5:
        return text + ", beyond a coin toss's 50%."
    if ci[1] < 0.5:
        return text + ", below a coin toss's 50%."
    return text + ", within the noise of a coin toss's 50%."


def verdicts(exp: Experiment, figures: list[Measure]) -> list[str]:
    """One sentence per headline figure: what the final model gained over the models before it."""
    final = final_model(exp)
    out = []
    for m in figures:
        if final not in m.values or final == m.reference:
            continue
        if m.key == "reward_accuracy":
            out.append(reward_sentence(m, final))
        elif len(m.values) > 1:
            out.append(change_sentence(m, final))
    return out


# ---- time and cost -------------------------------------------------------------------------------


def _seconds(stamp: str) -> float:
    return datetime.fromisoformat(stamp).timestamp()


def busy_seconds(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end] spans: the time while at least one job ran. Unlike last end minus
    first start it holds no idle gap, e.g. days between a run and a rerun of its report."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def run_cost(jobs: list[dict], benchmarks: list[dict]) -> dict[str, Any]:
    """Wall time and GPU-hours of the jobs behind the report (the manifest's, inputs.manifest_jobs). A job's
    record times the stage's own work; its benchmark, where it has one, the whole job (Python start-up and
    imports included), so a job spans its benchmark's wall time up to its end. GPU-hours sum each job's span
    times the GPUs it held. Without a manifest: the benchmarks' wall times summed, GPU time unknown."""
    if not jobs:
        return {
            "wall_time_s": sum(b["wall_s"] or 0 for b in benchmarks),
            "wall_time_basis": "benchmarks",
            "jobs": len(benchmarks),
            "gpu_hours": None,
            "gpu_hours_by_rule": {},
            "gpu_devices": [],
        }
    whole = {b["job"]: b["wall_s"] or 0.0 for b in benchmarks}
    spans, by_rule = [], {}
    for j in jobs:
        wall = max(j["wall_s"], whole.get(j.get("benchmark"), 0.0))
        end = _seconds(j["end"]) if j.get("end") else _seconds(j["start"]) + j["wall_s"]
        spans.append((end - wall, end))
        if j["gpus_held"]:
            by_rule[j["rule"]] = by_rule.get(j["rule"], 0.0) + wall * j["gpus_held"] / 3600
    return {
        "wall_time_s": busy_seconds(spans),
        "wall_time_basis": "jobs",
        "jobs": len(jobs),
        "gpu_hours": sum(by_rule.values()),
        "gpu_hours_by_rule": dict(sorted(by_rule.items(), key=lambda item: -item[1])),
        "gpu_devices": sorted({g for j in jobs if j["gpus_held"] for g in j["gpus"]}),
    }


def cost_sentence(cost: dict[str, Any]) -> str:
    if cost["wall_time_basis"] == "benchmarks":
        return (
            f"**Time**: {fmt_duration(cost['wall_time_s'])}, the {cost['jobs']} benchmarked jobs' wall times summed "
            "(no provenance manifest, so GPU time is unknown)."
        )
    text = (
        f"**Time and cost**: {fmt_duration(cost['wall_time_s'])} of wall time for the {cost['jobs']} jobs behind "
        "these results (while any of them ran); "
    )
    if not cost["gpu_hours_by_rule"]:
        return text + "**CPU run**: no job held a GPU."
    parts = ", ".join(f"{rule} {fmt(h, 2)}" for rule, h in cost["gpu_hours_by_rule"].items())
    return text + f"**{fmt(cost['gpu_hours'], 3)} GPU-hours** ({parts}) on {', '.join(cost['gpu_devices'])}."


# ---- the section ---------------------------------------------------------------------------------


def headline_summary(exp: Experiment) -> dict[str, Any]:
    """summary.json's view of the first screen: the final model and each headline figure per model."""
    return {
        m.key: {
            "label": m.label,
            "values": m.values,
            "ci95": m.intervals,
            **({"reference": m.reference} if m.reference else {}),
        }
        for m in measures(exp)
    }


def describe(exp: Experiment, e: dict) -> str:
    steps = f"{fmt(e['steps'])} SFT steps"
    if exp.dpo is not None:
        steps += f" then {fmt(exp.dpo['summary'].get('steps'))} {exp.dpo['summary'].get('objective', 'dpo').upper()} steps"
    return (
        f"**{exp.name}**: `{e['model']}` ({fmt(e['parameters'])} parameters, {training_mode(e)}), {steps} on "
        f"{e['world_size']} × {e['device'] or '?'}; the final model is the **{MODEL_NAMES[final_model(exp)]}** model."
    )


def drop_blocks(bench: dict | None) -> list[Block]:
    """The drops beyond benchmark.max_drop (snaketune.report.benchmark), first on the screen: a model that lost
    what it knew answers "did it help?" before any gain does."""
    if not bench or not bench.get("drops"):
        return []
    limit = points(bench["max_drop"])
    outcome = (
        "**The run fails on it** (`benchmark.fail_on_drop`)."
        if bench.get("fail_on_drop")
        else "`benchmark.fail_on_drop: true` fails the run on it."
    )
    return [
        Para(
            f"**Forgetting beyond `benchmark.max_drop` ({limit} points)**: a final model (or a GGUF file of it) lost "
            f"more than {limit} points of a benchmark score against the base model on the same examples, beyond the "
            f"noise (the whole 95% interval below {MINUS}{limit}). {outcome}"
        ),
        Bullets([drop_text(d) for d in bench["drops"]]),
    ]


def headline_section(experiments: list[Experiment], summary: dict, reproduce: list[Block]) -> list[Block]:
    blocks: list[Block] = [
        Heading(2, "Did it help?", anchor="summary"),
        *drop_blocks(summary.get("benchmark")),
    ]
    for exp in experiments:
        final, figures = final_model(exp), measures(exp)
        models = [m for m in MODEL_NAMES if any(m in f.values for f in figures)]
        blocks += [
            Para(describe(exp, summary["experiments"][exp.name])),
            Table(
                [
                    "95% intervals in brackets",
                    *[MODEL_NAMES[m] + (" (final)" if m == final else "") for m in models],
                ],
                [[f.label, *[cell_text(f, m, final) for m in models]] for f in figures],
            ),
            Bullets(verdicts(exp, figures)),
        ]
    return [*blocks, Para(cost_sentence(summary["run"])), *reproduce]
