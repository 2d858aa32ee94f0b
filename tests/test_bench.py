"""The GPU benchmark of issue #7 still runs: bench/throughput/train_throughput.py --tiny on CPU ranks (builtin-tiny, fp32),
the seed recipe (HF Trainer + DeepSpeed ZeRO-2), the train rule through Snakemake and the TRL peer (SFTTrainer),
one timed step each.
Its figures mean nothing on CPU; what is checked is that both sides run on the same data and the table is
written (bench/RESULTS.md has the H200 figures)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_train_throughput_runs_both_sides_on_cpu(tmp_path):
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(REPO / "bench/throughput/train_throughput.py"),
        "--tiny",
        "--only",
        "seed24,b24_liger,trl24",
    ]
    cmd += ["--out", str(out), "--work", str(tmp_path / "work"), "--budget-s", "600"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=700)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {r["case"]: r for r in json.loads((out / "throughput.json").read_text())["results"]}
    assert all(results[c]["status"] == "ok" for c in ("seed24", "b24_liger", "trl24")), results
    for case in ("seed24", "b24_liger", "trl24"):
        assert results[case]["positions_per_s"] > 0 and results[case]["loss_per_s"] > 0
    # The same conversations on both sides: (a) pads each to 512, (b) packs them.
    assert results["seed24"]["real_per_s"] < results["seed24"]["positions_per_s"]
    mix = json.loads((out / "throughput.json").read_text())["mix"]
    assert mix["pad_fraction_packed"] < 0.05 < mix["pad_fraction_unpadded_to_max"]
    # ... and every token and every loss token of the packed rows is in the padded ones, none more.
    assert (mix["seed_tokens"], mix["seed_loss_tokens"]) == (mix["packed_tokens"], mix["packed_loss_tokens"])
    assert mix["packed_loss_tokens"] < mix["packed_tokens"]
    table = (out / "throughput.md").read_text()
    assert "| seed24 |" in table and "| b24_liger |" in table and "x, " in table  # the (b)/(a) ratios
    assert "x (trl24) |" in table  # and (b) against its TRL peer


def _sweep(tmp_path: Path, results: dict[str, tuple[float, float, float]]) -> list[Path]:
    """Sweep directories as bench/real_model/run.sh leaves them: results/eval/<experiment>/metrics.json with
    (SFT held-out loss, DPO reward accuracy, DPO's held-out loss change in %) per experiment."""
    dirs = []
    for i, (name, (loss, accuracy, rise)) in enumerate(results.items()):
        d = tmp_path / f"g{i % 2}"
        (d / "results/eval" / name).mkdir(parents=True)
        metrics = {
            "validation": {
                "base": {"loss": 2.09},
                "tuned": {"loss": loss},
                "dpo": {"loss": loss * (1 + rise / 100)},
                "dpo_loss_change_pct": rise,
            },
            "preference": {
                "dpo": {"reward_accuracy": accuracy, "reward_accuracy_ci95": [0, 1], "reward_margin": 0}
            },
        }
        (d / "results/eval" / name / "metrics.json").write_text(json.dumps(metrics))
        dirs.append(d)
    return sorted(set(dirs))


def test_the_real_model_sweep_picks_by_its_written_rule(tmp_path):
    """bench/real_model/real_model_select.py: the SFT rate of lowest held-out loss; then the DPO rate of best reward accuracy
    among those that raise the held-out loss by at most 2% (swept under the chosen SFT rate, else the nearest);
    and the example's two learning_rate lines rewritten, nothing else."""
    sys.path.insert(0, str(REPO / "bench/real_model"))
    import real_model_select as sel

    example = tmp_path / "example.yaml"
    text = (REPO / "config/examples/smollm2-135m-real.yaml").read_text()
    example.write_text(text)
    dirs = _sweep(
        tmp_path,
        {
            "s3e-5": (1.99, 0.55, 0.0),
            "s1e-4": (1.93, 0.52, 0.0),
            "s3e-4": (1.96, 0.70, 0.0),  # best accuracy, but not the chosen SFT rate's
            "s1e-4_d1e-6": (1.93, 0.48, 0.0),
            "s1e-4_d2e-5": (1.93, 0.66, 2.5),  # best accuracy under 1e-4, but DPO cost 2.5% of held-out loss
            "s3e-5_d2e-5": (1.99, 0.61, 0.1),
        },
    )
    assert sel.main([*map(str, dirs), "--example", str(example), "--out", str(tmp_path / "sel.json")]) == 0
    chosen = json.loads((tmp_path / "sel.json").read_text())
    default_dpo = float(yaml.safe_load(text)["preference"]["train"]["learning_rate"])
    assert (chosen["sft_lr"], chosen["dpo_lr"]) == (1e-4, default_dpo)
    new = yaml.safe_load(example.read_text())
    assert (
        new["train"]["learning_rate"] == 1e-4 and new["preference"]["train"]["learning_rate"] == default_dpo
    )
    changed = [
        (a, b) for a, b in zip(text.splitlines(), example.read_text().splitlines(), strict=True) if a != b
    ]
    assert all("learning_rate:" in a for a, _ in changed)
    # A chosen SFT rate without its own DPO sweep takes the nearest swept one's (3e-4 -> 1e-4 here).
    recs = sel.records(dirs, 5e-6)
    for r in recs:
        r["sft_loss"] = 1.9 if r["sft_lr"] == 3e-4 else 2.0
    assert sel.choose(recs) == (3e-4, 5e-6)  # under 1e-4: 2e-5 excluded (loss), 5e-6 (0.52) over 1e-6 (0.48)
