"""The report's preference-tuning section and plot: where the pairs came from (and what was dropped), how DPO
trained, and what it changed: preference accuracy and margins, and the SFT validation loss, for the base, SFT
and DPO models side by side."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from snaketune.report.plots import COLORS, SIZE, STYLE, mark_empty, save_png, series
from snaketune.report.render import Block, Columns, Figure, Heading, Para, Table, fmt, fmt_duration, fmt_pct

if TYPE_CHECKING:
    from snaketune.report.inputs import Experiment

MODEL_NAMES = {"base": "base", "tuned": "SFT", "dpo": "DPO"}


def _acc(x: float | None) -> str:
    return fmt_pct(100.0 * x) if x is not None else "–"


def preference_summary(exp: Experiment) -> dict | None:
    """The headline figures of the preference stage (summary.json), None when it did not run."""
    if exp.dpo is None:
        return None
    pref = exp.eval.get("preference") or {}
    val = exp.eval["validation"]
    s = exp.dpo["summary"]
    return {
        "loss": s.get("objective"),
        "beta": s.get("beta"),
        "pairs": exp.dpo["pairs_stats"]["splits"]["train"]["pairs"],
        "validation_pairs": exp.dpo["pairs_stats"]["splits"]["validation"]["pairs"],
        "steps": s.get("steps"),
        "final_loss": s.get("final_train_loss"),
        "final_val_reward_accuracy": s.get("final_val_reward_accuracy"),
        "tokens_per_s_per_gpu": s.get("tokens_per_s_per_gpu"),
        "peak_memory_gib_per_rank": s.get("peak_memory_gib_per_rank"),
        "wall_time_s": s.get("wall_time_s"),
        "preference_accuracy": {w: (pref.get(w) or {}).get("accuracy") for w in MODEL_NAMES},
        "reward_accuracy": {w: (pref.get(w) or {}).get("reward_accuracy") for w in MODEL_NAMES},
        "logprob_margin": {w: (pref.get(w) or {}).get("logprob_margin") for w in MODEL_NAMES},
        "sft_val_loss": {w: (val.get(w) or {}).get("loss") for w in MODEL_NAMES},
        "dpo_val_loss_change_pct": val.get("dpo_loss_change_pct"),
    }


def preference_plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Preference loss and reward accuracy per step (validation dashed), every experiment that ran the stage."""
    import matplotlib.pyplot as plt

    with plt.rc_context(STYLE):
        fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=SIZE)
        if not runs:
            mark_empty(ax_loss, "no preference stage (preference.enabled: false)")
            mark_empty(ax_acc, "")
        for i, (name, rows) in enumerate(runs.items()):
            color = COLORS[i % len(COLORS)]
            ax_loss.plot(*series(rows, "step", "dpo/loss"), color=color, lw=1.6, label=f"{name}: train")
            ax_loss.plot(
                *series(rows, "step", "val/dpo_loss"), "--o", color=color, ms=4, label=f"{name}: validation"
            )
            ax_acc.plot(*series(rows, "step", "dpo/reward_accuracy"), color=color, lw=1.6)
            ax_acc.plot(*series(rows, "step", "val/reward_accuracy"), "--o", color=color, ms=4)
        ax_loss.set_title("Preference loss")
        ax_loss.set_ylabel("loss per pair")
        ax_acc.set_title("Reward accuracy")
        ax_acc.set_ylabel("share of pairs ranked right")
        ax_acc.set_ylim(-0.02, 1.02)
        for ax in (ax_loss, ax_acc):
            ax.set_xlabel("optimizer step")
        if runs:
            ax_loss.legend()
        save_png(fig, path)


def preference_section(experiments: list[Experiment], plot: Path) -> list[Block]:
    runs = [exp for exp in experiments if exp.dpo is not None]
    if not runs:
        return []
    blocks: list[Block] = [
        Heading(2, "Preference tuning"),
        Para(
            "Pairs come from oasst's ranks (for each prompt, replies of a better rank are chosen over worse "
            "siblings, ties never pair, after the conversations stage's cleaning and with its train/validation "
            "split) or from a pairs file (preference.source: prompt, chosen, rejected). The reference model's log-probabilities are computed once and cached; DPO trains the SFT "
            "model against them. Preference accuracy: share of held-out pairs where a model gives the chosen "
            "reply the higher summed log-probability. Reward accuracy: share where the implicit reward "
            "beta × (log π − log π_ref) of the chosen reply is larger (the reference itself scores 0 on every "
            "pair, so it ranks none).",
            muted=True,
        ),
    ]
    for exp in runs:
        if len(experiments) > 1:
            blocks.append(Heading(3, f"Experiment {exp.name}"))
        blocks += [_pairs_columns(exp.dpo), _run_line(exp.dpo), *_held_out_blocks(exp.eval)]
    blocks.append(Figure(plot, "Preference loss and reward accuracy per step (validation pairs dashed)."))
    return blocks


def _pairs_columns(d: dict) -> Columns:
    """The pairs per split and what was dropped making them."""
    p, tok = d["preference_stats"], d["pairs_stats"]["splits"]
    drops = [[f"group: {k.replace('_', ' ')}", fmt(v)] for k, v in p["groups_dropped"].items() if v]
    drops += [[f"message: {k.replace('_', ' ')}", fmt(v)] for k, v in p["dropped"].items() if v]
    if p.get("unranked_replies"):
        drops.append(["reply without a rank", fmt(p["unranked_replies"])])

    def cut(split: str) -> str:
        return f"{tok[split]['sides_cut_in_prompt']} / {tok[split]['sides_cut_in_reply']}"

    trees = p["trees_with_pairs"]
    rows = [
        ["pairs", fmt(p["pairs"]["train"]), fmt(p["pairs"]["validation"])],
        ["trees with pairs", fmt(trees["train"]), fmt(trees["validation"])],
        ["tokens", fmt(tok["train"]["tokens"]), fmt(tok["validation"]["tokens"])],
        ["sides cut (prompt / reply)", cut("train"), cut("validation")],
    ]
    return Columns(
        [
            Table(["pairs", "train", "validation"], rows),
            Table(
                [f"dropped ({fmt(p['groups'])} prompts with replies, `{p['pairs_mode']}`)", "count"],
                drops or [["nothing", "0"]],
            ),
        ]
    )


def _run_line(d: dict) -> Para:
    """How the preference stage ran: objective, steps, ranks, speed, memory, time."""
    s = d["summary"]
    mem = [m for m in s.get("peak_memory_gib_per_rank") or [] if m is not None]
    return Para(
        f"{s.get('objective', 'dpo').upper()} with beta {fmt(s.get('beta'))}: {fmt(s.get('steps'))} steps of "
        f"{s.get('global_batch_size')} pairs on {s.get('world_size')} × {s.get('device')} (ZeRO-"
        f"{s.get('zero_stage')}, {'LoRA' if s.get('lora') else 'full'}), {fmt(s.get('tokens_per_s_per_gpu'))} "
        f"tokens/s per rank, peak {fmt(max(mem) if mem else None, 3)} GiB, "
        f"{fmt_duration(s.get('wall_time_s'))}; reference log-probabilities from "
        f"`{d['reference'].get('reference')}` ({fmt_duration(d['reference'].get('time_s'))})."
    )


def _held_out_blocks(ev: dict) -> list[Block]:
    """Each model on the held-out pairs: preference and reward accuracy and margins."""
    pref, val = ev.get("preference") or {}, ev["validation"]
    models = [w for w in MODEL_NAMES if w in pref]
    if not any(pref[w].get("pairs") for w in models):
        # An empty validation split (a small dataset, or a filter that leaves no held-out tree with pairs).
        return [Para("No held-out pairs: the preference metrics were not measured.")]
    rows = [
        ["preference accuracy", *[_acc(pref[w]["accuracy"]) for w in models]],
        ["mean log-probability margin", *[fmt(pref[w]["logprob_margin"]) for w in models]],
        ["reward accuracy (vs reference)", *[_acc(pref[w]["reward_accuracy"]) for w in models]],
        ["mean reward margin", *[fmt(pref[w]["reward_margin"]) for w in models]],
        ["SFT validation loss", *[fmt(val[w]["loss"]) for w in models]],
    ]
    blocks: list[Block] = [
        Table(["held-out pairs: " + fmt(pref[models[0]]["pairs"]), *[MODEL_NAMES[w] for w in models]], rows)
    ]
    change = val.get("dpo_loss_change_pct")
    if change is not None:
        blocks.append(
            Para(
                f"DPO moved the SFT validation loss by {fmt_pct(change, signed=True)} and the preference "
                f"accuracy from {_acc(pref['tuned']['accuracy'])} (SFT) to **{_acc(pref['dpo']['accuracy'])}**."
            )
        )
    return blocks
