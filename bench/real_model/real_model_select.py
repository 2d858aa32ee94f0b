"""Pick the learning rates of config/examples/smollm2-135m-real.yaml from the sweep of bench/real_model/run.sh
(phase `sweep`, experiments of bench/real_model/configs/real_model_sweep.yaml) and write them into the example.

The rule, decided before the sweep ran (issue #24):
- SFT: the rate with the lowest held-out validation loss of the SFT model (`validation.tuned.loss` of the evaluate
  stage), averaged over the experiments that share it (their SFT runs are the same run: same rate, same seed).
- DPO: among the DPO rates swept over the chosen SFT rate (or, where none were, over the nearest swept SFT rate),
  the one with the highest held-out reward accuracy (`preference.dpo.reward_accuracy`), among those that do not
  raise the held-out validation loss by more than MAX_LOSS_RISE_PCT over the SFT model (a DPO that buys
  preferences by unlearning the replies is not what the example should ship); ties go to the lower loss.

    python3 bench/real_model/real_model_select.py --example config/examples/smollm2-135m-real.yaml --out sel.json DIR...

DIR: workflow run directories of the sweep (results/eval/<experiment>/metrics.json in each).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from pathlib import Path

import yaml

MAX_LOSS_RISE_PCT = 2.0
NAME = re.compile(r"^s(?P<sft>[0-9.e+-]+?)(?:_d(?P<dpo>[0-9.e+-]+))?$")


def records(dirs: list[Path], default_dpo: float) -> list[dict]:
    out = []
    for d in dirs:
        for path in sorted(d.glob("results/eval/*/metrics.json")):
            m = NAME.match(path.parent.name)
            if not m:
                continue
            metrics = json.loads(path.read_text())
            v, pref = metrics["validation"], (metrics.get("preference") or {}).get("dpo") or {}
            out.append(
                {
                    "experiment": path.parent.name,
                    "sft_lr": float(m["sft"]),
                    "dpo_lr": float(m["dpo"]) if m["dpo"] else default_dpo,
                    "base_loss": v["base"]["loss"],
                    "sft_loss": v["tuned"]["loss"],
                    "dpo_loss": v.get("dpo", {}).get("loss"),
                    "dpo_loss_change_pct": v.get("dpo_loss_change_pct"),
                    "reward_accuracy": pref.get("reward_accuracy"),
                    "reward_accuracy_ci95": pref.get("reward_accuracy_ci95"),
                    "reward_margin": pref.get("reward_margin"),
                }
            )
    return out


def choose(recs: list[dict]) -> tuple[float, float]:
    if not recs:
        raise SystemExit("no sweep results (results/eval/s*/metrics.json) in the given directories")
    by_sft: dict[float, list[float]] = {}
    for r in recs:
        by_sft.setdefault(r["sft_lr"], []).append(r["sft_loss"])
    sft = min(by_sft, key=lambda lr: sum(by_sft[lr]) / len(by_sft[lr]))
    swept = {r["sft_lr"] for r in recs if sum(q["sft_lr"] == r["sft_lr"] for q in recs) > 1}
    anchor = sft if sft in swept else min(swept or {sft}, key=lambda lr: abs(math.log(lr / sft)))
    pool = [r for r in recs if r["sft_lr"] == anchor and r["reward_accuracy"] is not None]
    kept = [r for r in pool if (r["dpo_loss_change_pct"] or 0.0) <= MAX_LOSS_RISE_PCT] or pool
    best = max(kept, key=lambda r: (r["reward_accuracy"], -(r["dpo_loss"] or 0.0)))
    return sft, best["dpo_lr"]


def rewrite(example: Path, sft: float, dpo: float) -> None:
    """Replace the numbers of the two `learning_rate:` lines (train, then preference.train), comments kept."""
    lines = example.read_text().splitlines(keepends=True)
    hits = [i for i, line in enumerate(lines) if re.match(r"^\s+learning_rate:\s", line)]
    if len(hits) != 2:
        raise SystemExit(
            f"{example}: expected two learning_rate lines (train, preference.train), found {len(hits)}"
        )
    for i, value in zip(hits, (sft, dpo), strict=True):
        lines[i] = re.sub(
            r"(learning_rate:\s*)\S+",
            lambda m, v=value: m[1] + f"{v:.1e}".replace("e-0", "e-"),
            lines[i],
            count=1,
        )
    example.write_text("".join(lines))
    cfg = yaml.safe_load(example.read_text())
    assert math.isclose(cfg["train"]["learning_rate"], sft) and math.isclose(
        cfg["preference"]["train"]["learning_rate"], dpo
    ), "rewrite did not land where the YAML reads it"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("dirs", type=Path, nargs="+")
    parser.add_argument("--example", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    default_dpo = float(yaml.safe_load(args.example.read_text())["preference"]["train"]["learning_rate"])
    recs = records(args.dirs, default_dpo)
    sft, dpo = choose(recs)
    rewrite(args.example, sft, dpo)
    args.out.write_text(json.dumps({"sft_lr": sft, "dpo_lr": dpo, "records": recs}, indent=2))
    for r in sorted(recs, key=lambda r: (r["sft_lr"], r["dpo_lr"])):
        print(json.dumps(r))
    print(f"chosen: SFT learning rate {sft:.1e}, DPO learning rate {dpo:.1e}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
