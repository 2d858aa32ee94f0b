"""The report's first screen, piece by piece: the verdict computed from the intervals (within or beyond the noise,
none without them), the wall time of overlapping jobs, a run without GPUs, and the plots' axis labels. The whole
first screen, built and laid out in a browser, is tests/test_report.py's."""

from __future__ import annotations

import json

import torch

from report_tree import first_screen, make_results, write_json
from snaketune.report import build as report
from snaketune.report.headline import Measure, busy_seconds, cell_text, change_sentence


def _measure(key: str, values: dict, intervals: dict | None = None, percent: bool = True) -> Measure:
    return Measure(key, key.replace("_", " ") + " (n)", percent, values, intervals or {})


def test_a_change_within_its_intervals_is_called_noise():
    """The verdict is computed: overlapping intervals of a small change hold zero, far-apart ones do not, and a
    figure without intervals gets no noise verdict at all."""
    small = _measure(
        "exact_match", {"base": 0.30, "tuned": 0.34}, {"base": [0.20, 0.42], "tuned": [0.24, 0.46]}
    )
    large = _measure("exact_match", {"base": 0.0, "tuned": 0.8}, {"base": [0.0, 0.06], "tuned": [0.68, 0.88]})
    loss = _measure("val_loss", {"base": 6.9, "tuned": 0.93}, percent=False)
    # Newcombe's bounds: 0.04 ∓ hypot(0.10, 0.12) and 0.04 + hypot(0.12, 0.10).
    assert change_sentence(small, "tuned").endswith("+4.0 points [−11.6, +19.6], within the noise.")
    assert change_sentence(large, "tuned").endswith(", beyond the noise.")
    assert "SFT lowered val loss from 6.900 (base) to **0.9300**" in change_sentence(loss, "tuned")
    assert "no noise verdict" in change_sentence(loss, "tuned")
    assert cell_text(large, "tuned", "tuned") == "**80.0%** [68.0, 88.0]"


def test_a_loss_interval_gets_a_noise_verdict(tmp_path):
    """Where the evaluation records an interval for the loss (validation.<model>.loss_ci95), the first screen shows
    it and judges the loss's change as it does the accuracies'."""
    from snaketune.report.headline import measures, verdicts
    from snaketune.report.inputs import load

    _, experiments = load(make_results(tmp_path))
    default = experiments[0]
    for model, half in (("base", 0.2), ("tuned", 0.06), ("dpo", 0.06)):
        loss = default.eval["validation"][model]["loss"]
        default.eval["validation"][model]["loss_ci95"] = [loss - half, loss + half]
    figures = measures(default)
    assert cell_text(figures[0], "dpo", "dpo") == "**0.9930** [0.9330, 1.053]"
    (loss_verdict,) = [v for v in verdicts(default, figures) if "validation loss" in v]
    # 0.0608 ± hypot(0.06, 0.06) holds zero; the fall from the base, 5.902 ± hypot(0.2, 0.06), does not.
    assert "(DPO): −5.902 [−6.111, −5.693] (−85.6%), beyond the noise;" in loss_verdict
    assert loss_verdict.endswith(
        "DPO's part, from 0.9322 (SFT): +0.061 [−0.024, +0.146] (+6.5%), within the noise."
    )


def test_the_report_computes_the_interval_the_evaluate_stage_records(tmp_path):
    """Where the evaluation recorded only counts (exact match), the first screen's interval is the one the evaluate
    stage writes beside its accuracies for the same counts, to the last bit: one Wilson interval and one quantile
    for both layers (two copies with their own constant once gave intervals apart in the ninth digit)."""
    from snaketune.evaluation.scores import preference_scores
    from snaketune.report.headline import measures
    from snaketune.report.inputs import load

    _, experiments = load(make_results(tmp_path))
    em = experiments[0].eval["exact_match"]
    (figure,) = [m for m in measures(experiments[0]) if m.key == "exact_match"]
    for model, interval in figure.intervals.items():
        n, correct = em[model]["n"], em[model]["correct"]
        # The stage's accuracy of `correct` wins among n pairs, through its own code path.
        logprobs = torch.tensor([[0.0, -1.0]] * correct + [[-1.0, 0.0]] * (n - correct))
        recorded = preference_scores(logprobs, torch.ones_like(logprobs), logprobs, beta=0.1)["accuracy_ci95"]
        assert interval == recorded, model


def test_wall_time_counts_overlapping_jobs_once_and_no_idle_gap():
    assert busy_seconds([(0.0, 10.0), (5.0, 15.0), (100.0, 110.0)]) == 25.0
    assert busy_seconds([(0.0, 10.0), (2.0, 3.0)]) == 10.0


def test_a_run_without_gpus_says_so(tmp_path):
    """CPU ranks hold no GPU even where the rule asks for the gpu resource: the first screen says CPU run."""
    inputs = make_results(tmp_path)
    manifest = json.loads(inputs.manifest.read_text())
    for job in manifest["jobs"]:
        job["gpus"] = []
    write_json(inputs.manifest, manifest)
    summary = report.build_report(inputs, tmp_path / "out", workdir=tmp_path)
    assert summary["run"]["gpu_hours"] == 0
    assert "**CPU run**: no job held a GPU." in first_screen((tmp_path / "out/report.md").read_text())


def test_every_plot_labels_its_axes(tmp_path, monkeypatch):
    """Every axis that shows data has a label (the learning-rate plot had none on y)."""
    from snaketune.report import plots, preference
    from snaketune.report.inputs import load

    figures = []
    for module in (plots, preference):
        monkeypatch.setattr(module, "save_png", lambda fig, path: figures.append((path.name, fig)))
    _, experiments = load(make_results(tmp_path))
    report.make_plots(experiments, tmp_path)
    assert len(figures) == 6
    for name, fig in figures:
        for ax in fig.axes:
            if ax.lines or ax.patches:
                assert ax.get_xlabel() and ax.get_ylabel(), f"{name}: {ax.get_title()!r}"
