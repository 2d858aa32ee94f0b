"""The tables of bench/RESULTS.md's section on the real model (issue #24), from what bench/real_model/run.sh
brought back (its $OUT, copied to bench/log/<date>_h200_real_model/ with the tarballs unpacked):

    python -m bench real_model_table bench/log/2026-12-03_h200_real_model

Reads selection.json (the sweep), final/ and seeds/ (the workflow's runs: results/eval/<exp>/metrics.json,
results/train|dpo/<exp>/summary.json, benchmarks/), trl_*/ (TRL's trl.json and metrics.json).
"""

from __future__ import annotations

import csv
import json
import statistics
import sys
from pathlib import Path

SFT_RULES = {"tokenize": "tokenized", "train": "train"}
"""The workflow's rules on the way to the SFT model and their benchmarks/ folders (the model's import, the data's
download and conversations are TRL's input too and left out on both sides; the plan rules keep no benchmark file
and take about a second)."""
DPO_RULES = {
    "preferences": "preferences",
    "tokenize_pairs": "tokenized_pairs",
    "reference": "reference",
    "dpo": "dpo",
}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def ci(pref: dict, key: str) -> str:
    lo, hi = pref[f"{key}_ci95"]
    return f"{pref[key]:.3f} [{lo:.3f}, {hi:.3f}]"


def quality(metrics: dict) -> dict:
    v, p = metrics["validation"], metrics["preference"]
    return {
        "base": v["base"]["loss"],
        "sft": v["tuned"]["loss"],
        "dpo": v["dpo"]["loss"],
        "reward": p["dpo"]["reward_accuracy"],
        "reward_txt": ci(p["dpo"], "reward_accuracy"),
        "margin_txt": ci(p["dpo"], "reward_margin"),
        "acc": {w: p[w]["accuracy"] for w in ("base", "tuned", "dpo")},
        "acc_tok": {w: p[w]["accuracy_per_token"] for w in ("base", "tuned", "dpo")},
    }


def bench_seconds(run: Path, rules: dict[str, str], experiment: str) -> dict[str, float]:
    """Wall seconds per rule from Snakemake's benchmark files: benchmarks/<folder>/<experiment>.tsv for the rules
    of one experiment, the folder's only file for the shared ones."""
    out = {}
    for rule, folder in rules.items():
        files = sorted((run / "benchmarks" / folder).glob("*.tsv"))
        mine = [p for p in files if p.stem == experiment] or (files if len(files) == 1 else [])
        if mine:
            with mine[0].open() as f:
                out[rule] = float(next(csv.DictReader(f, delimiter="\t"))["s"])
    return out


def spread(values: list[float]) -> str:
    return f"{statistics.mean(values):.4f} (range {min(values):.4f}-{max(values):.4f}, sd {statistics.stdev(values):.4f})"


def main(root: Path) -> None:
    sel = load(root / "selection.json")
    print(f"Sweep (seed 1234; chosen SFT {sel['sft_lr']:.0e}, DPO {sel['dpo_lr']:.0e}):\n")
    print("| experiment | SFT lr | DPO lr | held-out loss base / SFT / DPO | DPO reward accuracy [95%] |")
    print("|---|---:|---:|---|---|")
    for r in sorted(sel["records"], key=lambda r: (r["sft_lr"], r["dpo_lr"])):
        lo, hi = r["reward_accuracy_ci95"]
        print(f"| {r['experiment']} | {r['sft_lr']:.0e} | {r['dpo_lr']:.0e} | {r['base_loss']:.4f} / {r['sft_loss']:.4f} / "
              f"{r['dpo_loss']:.4f} | {r['reward_accuracy']:.3f} [{lo:.3f}, {hi:.3f}] |")  # fmt: skip

    runs = {"workflow": [], "trl": []}
    for exp, d in (("default", root / "final"), ("seed1", root / "seeds"), ("seed2", root / "seeds")):
        m = d / f"results/eval/{exp}/metrics.json"
        if m.is_file():
            runs["workflow"].append((exp, quality(load(m))))
    fast = root / "trl_packed/metrics.json"
    mode = "packed" if fast.is_file() else "padded"
    for name in (f"trl_{mode}", "trl_seed1", "trl_seed2"):
        m = root / name / "metrics.json"
        if m.is_file():
            runs["trl"].append((name, quality(load(m))))
    print(f"\nSeeds (workflow: 1234, 1, 2; TRL in its faster mode, {mode}):\n")
    print("| run | held-out loss SFT | DPO | DPO reward accuracy [95%] | reward margin [95%] | "
          "preference accuracy summed / per token (base, SFT, DPO) |")  # fmt: skip
    print("|---|---:|---:|---|---|---|")
    for side, rows in runs.items():
        for name, q in rows:
            acc = ", ".join(f"{q['acc'][w]:.3f} / {q['acc_tok'][w]:.3f}" for w in ("base", "tuned", "dpo"))
            print(
                f"| {side} {name} | {q['sft']:.4f} | {q['dpo']:.4f} | {q['reward_txt']} | {q['margin_txt']} | {acc} |"
            )
    for side, rows in runs.items():
        if len(rows) > 1:
            print(f"\n{side}: SFT held-out loss {spread([q['sft'] for _, q in rows])}; "
                  f"DPO reward accuracy {spread([q['reward'] for _, q in rows])}")  # fmt: skip
    if runs["workflow"]:
        print(f"base model held-out loss: {runs['workflow'][0][1]['base']:.4f}")

    final = root / "final"
    sft_s = bench_seconds(final, SFT_RULES, "default")
    dpo_s = bench_seconds(final, DPO_RULES, "default")
    print("\nWall time per stage, seed 1234, alone on the GPU (s):\n")
    print(f"workflow SFT {sum(sft_s.values()):.1f} ({sft_s}); DPO {sum(dpo_s.values()):.1f} ({dpo_s})")
    for name in ("trl_padded", "trl_packed"):
        p = root / name / "trl.json"
        if p.is_file():
            t = load(p)
            sft, dpo = t["sft"], t["dpo"]
            steps = sft["step_times"][2:]
            print(f"{name}: imports {t['import_s']:.1f}, SFT {sft['wall_s']:.1f} ({sft['status']}), "
                  f"DPO {dpo['wall_s']:.1f} ({dpo['status']}), SFT step {statistics.median(steps) if steps else 0:.3f} s, "
                  f"SFT rows/step {sft.get('rows_per_step')}")  # fmt: skip
    for stage in ("train", "dpo"):
        p = final / f"results/{stage}/default/summary.json"
        if p.is_file():
            s = load(p)
            keep = ("tokens_per_s_per_gpu", "mfu", "device_memory_per_rank", "steps", "final_train_loss")
            print(stage, json.dumps({k: s.get(k) for k in keep}))


if __name__ == "__main__":
    main(Path(sys.argv[1]))
