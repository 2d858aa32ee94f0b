"""Stage 7, report: every stage's outputs in one document that opens from disk.

Reads the data stats (download, conversations, each tokenized cache), every experiment's training summary
and metrics.csv, its evaluation (metrics.json, generations.jsonl) and the per-job benchmarks, and writes:

- ``index.html``: self-contained (inline CSS, plots embedded as PNG data URIs, no JavaScript),
- ``report.md``: the same content in Markdown, next to the PNG plots it references,
- ``summary.json``: the headline figures for machines (data sizes; per experiment steps, world size, ZeRO
  stage, final losses, tokens/s, MFU, peak memory, base and tuned validation loss, perplexity, accuracy; the
  final model and its headline figures with 95% intervals; the run's wall time, GPU-hours and reproduce command),
- the plots: loss vs step and vs tokens, learning rate and gradient norm, throughput, memory per rank, and
  the preference stage's loss and reward accuracy.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import platform
from pathlib import Path
from typing import Any

from snaketune import provenance as provenance_module
from snaketune.config.benchmark import BenchmarkConfig
from snaketune.io import atomic_files, write_json
from snaketune.report import plots
from snaketune.report.benchmark import benchmark_section, benchmark_summary
from snaketune.report.export import export_section
from snaketune.report.headline import final_model, headline_section, headline_summary, run_cost
from snaketune.report.inputs import (
    Experiment,
    ReportInputs,
    current_benchmarks,
    load,
    manifest_jobs,
    read_benchmarks,
)
from snaketune.report.preference import preference_plot, preference_section, preference_summary
from snaketune.report.render import Para, to_html, to_markdown
from snaketune.report.reproducibility import (
    code_state,
    config_sha256,
    provenance_section,
    remote_code_allowed,
    reproduce_blocks,
    reproduce_command,
    run_inputs,
    short_commit,
    stage_wall_times,
)
from snaketune.report.sections import comparison_section, data_section, evaluation_section, training_section

log = logging.getLogger("snaketune.report.build")

TITLE = "snaketune report"
OUTPUTS = {
    "html": "index.html",
    "markdown": "report.md",
    "summary": "summary.json",
    "loss_vs_step": "loss_vs_step.png",
    "loss_vs_tokens": "loss_vs_tokens.png",
    "learning_rate": "learning_rate.png",
    "throughput": "throughput.png",
    "memory": "memory.png",
    "preference": "preference.png",
}
"""File names under the report directory; the report rule declares the same."""
PACKAGES = ("torch", "deepspeed", "transformers", "datasets", "peft", "snakemake")


def git_commit(state: dict | None) -> str:
    """HEAD of the report's checkout (provenance.git_state), marked when tracked files have uncommitted changes."""
    if state is None:
        return "not a git checkout"
    return state["commit"] + (" (with uncommitted changes)" if state["dirty"] else "")


def hardware() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    memory_gib = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                memory_gib = int(line.split()[1]) / 2**20  # kB
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cpu_count": os.cpu_count(),
        "memory_gib": memory_gib,
        "platform": platform.platform(),
        "python": platform.python_version(),
    }


def package_versions(recorded: dict[str, str]) -> dict[str, str]:
    """Versions of PACKAGES: those the evaluate job recorded (the environment that ran the models) first,
    then this process's (snakemake, and anything the evaluation did not record)."""
    mine = provenance_module.package_versions(PACKAGES)
    return {
        name: recorded[name] if recorded.get(name) and recorded[name] != "not installed" else mine[name]
        for name in PACKAGES
    }


# ---- summary.json --------------------------------------------------------------------------------


def _accuracy(ev: dict, which: str) -> float | None:
    em = ev.get("exact_match")
    return em[which]["accuracy"] if em and which in em else None


def experiment_summary(exp: Experiment) -> dict[str, Any]:
    s, ev = exp.summary, exp.eval
    val = ev["validation"]
    splits = exp.tokenized["splits"]
    memory = [m for m in s.get("peak_memory_gib_per_rank") or [] if m is not None]
    return {
        "model": exp.config.get("model", {}).get("base", ev.get("model")),
        # Whether code shipped with the hub model or tokenizer was allowed to run (off unless configured).
        "trust_remote_code": remote_code_allowed(exp),
        "parameters": s.get("parameters"),
        "trainable_parameters": s.get("trainable_parameters"),
        "lora": s.get("lora"),
        "lora_quantize": s.get("lora_quantize", "none"),
        "optimizer_states": s.get("optimizer_states", "fp32"),
        "optimizer_step": s.get("optimizer_step", "after_backward"),
        "fp8": s.get("fp8", "none"),
        "data_key": exp.data_key,
        "tokens": {split: v["tokens"] for split, v in splits.items()},
        "loss_tokens": {split: v["loss_tokens"] for split, v in splits.items()},
        "steps": s.get("steps"),
        "world_size": s.get("world_size"),
        "device": s.get("device"),
        "zero_stage": s.get("zero_stage"),
        "precision": s.get("precision"),
        "global_batch_size": s.get("global_batch_size"),
        "final_train_loss": s.get("final_train_loss"),
        "final_val_loss": s.get("final_val_loss"),
        "tokens_per_s_per_gpu": s.get("tokens_per_s_per_gpu"),
        "loss_tokens_per_s_per_gpu": s.get("loss_tokens_per_s_per_gpu"),
        "mfu": s.get("mfu"),
        "peak_memory_gib": max(memory) if memory else None,
        "peak_memory_gib_per_rank": s.get("peak_memory_gib_per_rank"),
        "train_wall_time_s": s.get("wall_time_s"),
        "run_key": s.get("run_key"),
        "seed": s.get("seed"),
        "base_val_loss": val["base"]["loss"],
        "tuned_val_loss": val["tuned"]["loss"],
        "val_loss_change_pct": val["loss_change_pct"],
        "base_perplexity": val["base"]["perplexity"],
        "tuned_perplexity": val["tuned"]["perplexity"],
        "exact_match_n": ev["exact_match"]["n"] if ev.get("exact_match") else None,
        "base_accuracy": _accuracy(ev, "base"),
        "tuned_accuracy": _accuracy(ev, "tuned"),
        "dpo_accuracy": _accuracy(ev, "dpo"),
        # The first screen: the final model (dpo where the preference stage ran, else tuned) and each headline
        # figure per model with its 95% interval.
        "final_model": final_model(exp),
        "headline": headline_summary(exp),
        "preference": preference_summary(exp),
        # The GGUF files of the export stage: what each quant costs and gains (snaketune.export.export).
        "export": {
            model: [
                {
                    k: f[k]
                    for k in (
                        "type",
                        "file",
                        "bytes",
                        "perplexity",
                        "perplexity_ratio",
                        "kl_mean",
                        "top1_agreement",
                        "prompt_tokens_per_s",
                        "generation_tokens_per_s",
                        "replies_agreeing",
                        "replies_ended",
                        "failing",
                    )
                }
                for f in m["files"]
            ]
            for model, m in exp.exports.items()
        },
    }


def make_summary(data: dict, experiments: list[Experiment], provenance: dict, run: dict) -> dict[str, Any]:
    conv = data["conversations"]
    tokenized: dict[str, Any] = {}
    for exp in experiments:
        entry = tokenized.setdefault(
            exp.data_key,
            {
                "experiments": [],
                "settings": exp.tokenized.get("settings"),
                "splits": {
                    split: {
                        k: v.get(k)
                        for k in ("conversations", "sequences", "tokens", "loss_tokens", "truncated")
                    }
                    for split, v in exp.tokenized["splits"].items()
                },
            },
        )
        entry["experiments"].append(exp.name)
    return {
        "data": {
            "source": data["source"].get("source"),
            "messages": conv.get("messages"),
            "messages_kept": conv.get("messages_kept"),
            "trees": conv.get("trees"),
            "conversations": conv.get("conversations"),
            "tokenized": tokenized,
        },
        "experiments": {exp.name: experiment_summary(exp) for exp in experiments},
        # What the whole run took (wall time, GPU-hours) and how to make it again (command, commit, config hash).
        "run": run,
        "provenance": provenance,
    }


# ---- the stage -----------------------------------------------------------------------------------


def make_plots(experiments: list[Experiment], out_dir: Path) -> dict[str, Path]:
    paths = {k: out_dir / v for k, v in OUTPUTS.items() if v.endswith(".png")}
    runs = {exp.name: exp.rows for exp in experiments}
    base = {exp.name: exp.eval["validation"]["base"]["loss"] for exp in experiments}
    plots.loss_plot(runs, base, paths["loss_vs_step"], x="step", xlabel="optimizer step")
    plots.loss_plot(
        runs,
        base,
        paths["loss_vs_tokens"],
        x="train/tokens_seen",
        xlabel="tokens seen (global batch × max_length)",
    )
    plots.optimizer_plot(runs, paths["learning_rate"])
    plots.throughput_plot(runs, paths["throughput"])
    plots.memory_plot(
        {
            exp.name: [m or 0.0 for m in exp.summary.get("peak_memory_gib_per_rank") or []]
            for exp in experiments
        },
        {exp.name: exp.summary.get("device", "") for exp in experiments},
        paths["memory"],
    )
    preference_plot({exp.name: exp.dpo["rows"] for exp in experiments if exp.dpo}, paths["preference"])
    return paths


def build_report(inputs: ReportInputs, out_dir: str | Path, *, workdir: str | Path = ".") -> dict[str, Any]:
    """Write every file of OUTPUTS into out_dir; return the summary (also summary.json)."""
    if not inputs.experiments:
        raise ValueError("no experiments to report")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    data, experiments = load(inputs)
    recorded = {}
    for exp in experiments:
        recorded.update({k: v for k, v in (exp.eval.get("versions") or {}).items() if k not in recorded})
    seeds = {"dataset.builtin_seed": inputs.config.get("dataset", {}).get("builtin_seed")}
    for exp in experiments:
        seeds[f"{exp.name}: train.seed"] = exp.summary.get("seed")
        if exp.eval.get("exact_match"):
            seeds[f"{exp.name}: exact-match questions (eval_examples seed)"] = exp.eval["exact_match"].get(
                "seed"
            )
    manifest = json.loads(Path(inputs.manifest).read_text()) if inputs.manifest else {}
    benchmarks = current_benchmarks(read_benchmarks(inputs.benchmarks), manifest)
    summary_of_jobs = manifest.get("summary", {})
    jobs = manifest_jobs(manifest)
    report_git = provenance_module.git_state(Path(workdir))
    git = code_state(manifest, report_git)
    run = {
        **run_cost(jobs, benchmarks),
        "command": reproduce_command(experiments, inputs.invocation),
        "git_commit": git["commit"],
        "git_dirty": git["dirty"],
        "git_commits": git["commits"],
        "config_sha256": config_sha256(inputs.config),
        "inputs": run_inputs(manifest, inputs.invocation, Path(workdir)),
    }
    provenance = {
        "git_commit": git_commit(report_git),
        "generated": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "versions": package_versions(recorded),
        "hardware": hardware(),
        "devices": {
            exp.name: {"device": exp.summary.get("device"), "world_size": exp.summary.get("world_size")}
            for exp in experiments
        },
        "seeds": seeds,
        "wall_time_s": {b["job"]: b["wall_s"] for b in benchmarks},
        "stage_wall_time_s": {k: v["wall_s"] for k, v in stage_wall_times(benchmarks).items()},
        "manifest": str(inputs.manifest) if inputs.manifest else None,
        "jobs": jobs,
        "jobs_without_record": manifest.get("missing", []),
        # Every value seen across the jobs, with the jobs that saw it: one entry each when they agree.
        "job_git": summary_of_jobs.get("git", {}),
        "job_hosts": summary_of_jobs.get("hosts", {}),
        "job_software": {k: v for k, v in summary_of_jobs.get("software", {}).items() if len(v) > 1},
    }
    summary = make_summary(data, experiments, provenance, run)
    bench = inputs.config.get("benchmark", {})
    summary["benchmark"] = benchmark_summary(
        inputs.benchmark_results,
        inputs.benchmark_bases,
        bench.get("max_drop", BenchmarkConfig.max_drop),
    )
    summary["benchmark"]["fail_on_drop"] = bench.get("fail_on_drop", False)
    summary["benchmark"]["tasks_reason"] = bench.get("tasks_reason")
    # Every file of the report, or none: all are written into a staging directory (the plots under their own
    # names, which report.md links to) and renamed into place together.
    with atomic_files(*(out_dir / name for name in OUTPUTS.values())) as staged:
        write_report(data, experiments, summary, provenance, benchmarks, inputs.config, staged[0].parent)
    log.info("report written to %s", out_dir / OUTPUTS["html"])
    return summary


def write_report(
    data: dict,
    experiments: list[Experiment],
    summary: dict,
    provenance: dict,
    benchmarks: list[dict],
    config: dict,
    out_dir: Path,
) -> None:
    """The files of OUTPUTS, into out_dir as it is (build_report gives a staging directory)."""
    plot_paths = make_plots(experiments, out_dir)
    blocks = (
        headline_section(experiments, summary, reproduce_blocks(summary["run"]))
        + data_section(data, experiments)
        + training_section(experiments, summary, plot_paths)
        + evaluation_section(experiments, summary)
        + preference_section(experiments, plot_paths["preference"])
        + comparison_section(experiments, summary)
        + export_section(experiments)
        + benchmark_section(summary.get("benchmark"))
        + provenance_section(data, experiments, provenance, benchmarks, config)
    )
    names = ", ".join(exp.name for exp in experiments)
    subtitle = (
        f"{len(experiments)} experiment{'s' if len(experiments) > 1 else ''} ({names}) on `{data['source'].get('source')}` "
        f"data · generated {provenance['generated']} · {short_commit(provenance['git_commit'])}"
    )
    (out_dir / OUTPUTS["html"]).write_text(to_html(TITLE, subtitle, blocks), encoding="utf-8")
    (out_dir / OUTPUTS["markdown"]).write_text(
        to_markdown(TITLE, [Para(subtitle, muted=True), *blocks]), encoding="utf-8"
    )
    write_json(out_dir / OUTPUTS["summary"], summary)
