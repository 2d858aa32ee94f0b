"""A hand-made results tree for tests/test_report.py: every file the report reads, shaped as the stages write
them, for two experiments with known figures: `default` trains on CPU ranks and then runs the preference stage
(its final model is DPO), `lora` trains on GPUs and stops at SFT. A provenance manifest names the jobs behind
them; one benchmark file is a leftover of an experiment no longer in the config."""

from __future__ import annotations

import csv
import dataclasses
import json
from pathlib import Path

from snaketune.evaluation.intervals import wilson_interval
from snaketune.report.inputs import ExperimentFiles, ReportInputs

KEY = "0123456789abcdef"
"""The tokenized data's key."""

EXPERIMENTS = {
    # name: (base val loss, tuned val loss, base accuracy, tuned accuracy, world size, tokens/s, mfu, memory)
    "default": (6.8950, 0.9322, 0.0, 0.796875, 3, 2968.3, None, [0.664, 0.666, 0.655]),
    "lora": (6.8950, 1.8500, 0.0, 0.40625, 2, 3510.0, 0.0123, [0.61, 0.62]),
}
PAIRS_KEY = "fedcba9876543210"
"""The tokenized pairs' key."""
DPO = {"loss": 0.993, "exact_match_correct": 24, "pairs": 128}
"""The `default` experiment's DPO model: validation loss, exact-match questions right of 64, held-out pairs."""
PAIRS_WON = {"base": (64, 54), "tuned": (71, 0), "dpo": (123, 123)}
"""Held-out pairs each model ranks right: (by log-probability, by implicit reward against the SFT reference)."""
COMMIT = "ab" * 20
"""The commit every job of the manifest ran at."""
GPU_SECONDS = 100.0 * 2 + 36.0 * 1
"""GPU time of the manifest's jobs: train[lora] (100 s on 2 of the host's 4 GPUs), evaluate[lora] (36 s on 1)."""


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return path


def write_json(path: Path, obj) -> Path:
    return write_text(path, json.dumps(obj, indent=2))


def benchmark_result(
    root: Path, owner: str, label: str, kind: str, values: list[float], *, task: str = "builtin_choice"
) -> str:
    """A benchmark result file (snaketune.benchmark.run's shape, one metric: acc, higher is better) where the
    workflow writes it under `root`: base/<key>/<task>.json for the base (owner: the key), else
    <experiment>/<label>/<task>.json; `values`: each example's score."""
    path = root / (f"base/{owner}" if kind == "base" else f"{owner}/{label}") / f"{task}.json"
    acc = {"metric": "acc", "filter": "none", "value": sum(values) / len(values), "stderr": 0.05}
    write_json(
        path,
        {
            "task": task,
            "n": len(values),
            "spec": {"num_fewshot": 0},
            "model": {"label": label, "experiment": None if kind == "base" else owner, "kind": kind},
            "metrics": {"acc,none": {**acc, "higher_is_better": True}},
            "samples": [{"doc_id": i, "filter": "none", "acc": v} for i, v in enumerate(values)],
        },
    )
    return str(path)


def make_results(root: Path) -> ReportInputs:
    """Every file the report reads, shaped like the stages write them, with known figures."""
    r = root / "results"
    write_json(
        r / "data/raw/source.json",
        {"source": "builtin", "messages": 2827, "splits": [], "sha256": {"messages.parquet": "89" * 32}},
    )
    write_text(r / "data/raw/SHA256SUMS", f"{'89' * 32}  messages.parquet\n")
    write_json(
        r / "data/conversations/stats.json",
        {
            "trees": 600,
            "messages": 2827,
            "messages_kept": 2405,
            "paths": "top1",
            "split_source": "hash",
            "conversations": {"train": 530, "validation": 26},
            "trees_by_split": {"train": 530, "validation": 26},
            "turns_mean": {"train": 2.9208, "validation": 3.1538},
            "by_language": {"train": {"en": 365, "de": 58}, "validation": {"en": 14, "de": 5}},
            "dropped": {"deleted": 126, "review_failed": 122, "orphan": 0},
            "paths_dropped": {"no_exchange": 44, "duplicate": 0},
            "paths_trimmed_prompter": 60,
        },
    )
    split = {
        "conversations": 530,
        "sequences": 65,
        "tokens": 15656,
        "loss_tokens": 5377,
        "truncated": 0,
        "truncated_pct": 0.0,
        "mean_conversation_tokens": 29.54,
        "max_conversation_tokens": 68,
        "pad_fraction_unpadded_to_max": 0.884611,
        "pad_fraction_packed": 0.059135,
    }
    write_json(
        r / f"tokenized/{KEY}/stats.json",
        {
            "settings": {
                "max_length": 256,
                "packing": True,
                "assistant_only_loss": True,
                "chat_template": "deepseek",
            },
            "splits": {
                "train": split,
                "validation": {**split, "conversations": 26, "tokens": 857, "loss_tokens": 300},
            },
            "conversation_files_sha256": {"train": "aa" * 32, "validation": "bb" * 32},
            "tokenizer_files_sha256": {"tokenizer.json": "cc" * 32},
            "chat_template_sha256": "dd" * 32,
        },
    )
    files = []
    for name, (base, tuned, acc0, acc1, world, tps, mfu, memory) in EXPERIMENTS.items():
        write_json(
            r / f"train/{name}/summary.json",
            {
                "experiment": name,
                "steps": 120,
                "world_size": world,
                "device": "cpu" if mfu is None else "NVIDIA H200",
                "precision": "float32",
                "zero_stage": 2,
                "global_batch_size": 24,
                "micro_batch_size": 4,
                "gradient_accumulation_steps": 24 // (4 * world),
                "parameters": 1037440,
                "trainable_parameters": 1037440 if name == "default" else 16384,
                "lora": name == "lora",
                "final_train_loss": 0.0583,
                "final_val_loss": tuned,
                "tokens_per_s_per_gpu": tps,
                "loss_tokens_per_s_per_gpu": tps / 3,
                "mfu": mfu,
                "peak_memory_gib_per_rank": memory,
                "wall_time_s": 155.4,
                "seed": 1234,
                "run_key": f"run{name}",
            },
        )
        with open(write_text(r / f"train/{name}/metrics.csv", ""), "w", newline="") as f:
            writer = csv.writer(f)
            writer.writerow(
                ["step", "train/loss", "train/lr", "train/grad_norm", "train/tokens_seen",
                 "perf/tokens_per_s_per_gpu", "perf/loss_tokens_per_s_per_gpu", "perf/mfu",
                 "memory/max_allocated_gib", "val/loss"]
            )  # fmt: skip
            for step in range(5, 125, 5):
                val = tuned + (base - tuned) * (1 - step / 120) ** 3 if step % 40 == 0 else ""
                writer.writerow(
                    [step, 6.0 * (0.97**step), 3e-3 * (1 - step / 130), 1.0 / step**0.5, step * 24 * 256,
                     tps, tps / 3, "" if mfu is None else mfu, max(memory), val]
                )  # fmt: skip
        em = {
            which: {
                "n": 64,
                "correct": round(acc * 64),
                "accuracy": acc,
                "by_task": {"add": {"n": 32, "correct": round(acc * 32), "accuracy": acc}},
                "by_lang": {"en": {"n": 64, "correct": round(acc * 64), "accuracy": acc}},
            }
            for which, acc in (("base", acc0), ("tuned", acc1))
        }
        em.update(
            n=64,
            seed=1,
            examples=[
                {
                    "task": "add",
                    "lang": "en",
                    "prompt": "What is 3 + 4?",
                    "answer": "3 + 4 = 7.",
                    "base": "x",
                    "tuned": "3 + 4 = 8.",
                },
                {
                    "task": "add",
                    "lang": "en",
                    "prompt": "What is 5 + 5?",
                    "answer": "5 + 5 = 10.",
                    "base": "x",
                    "tuned": "5 + 5 = 10.",
                },
            ],
        )
        write_json(
            r / f"eval/{name}/metrics.json",
            {
                "experiment": name,
                "model": "builtin-tiny",
                "base_model": "random init of builtin-tiny (seed 1234, float32): the train stage's start",
                "device": "cpu",
                "dtype": "float32",
                "validation": {
                    "rows": 4,
                    "loss_tokens": 300,
                    "base": {"loss": base, "perplexity": 2.718281828**base},
                    "tuned": {"loss": tuned, "perplexity": 2.718281828**tuned},
                    "loss_change_pct": 100 * (tuned - base) / base,
                },
                "generation": {"prompts": 2, "max_new_tokens": 32, "decoding": "greedy"},
                "exact_match": em,
                "versions": {
                    "torch": "2.13.0+cpu",
                    "deepspeed": "0.19.8",
                    "transformers": "5.23.0",
                    "datasets": "5.2.0",
                    "peft": "0.21.2",
                },  # fmt: skip
            },
        )
        write_text(
            r / f"eval/{name}/generations.jsonl",
            json.dumps(
                {
                    "prompt": "What is 3 + 4?",
                    "base": "let let <b>",
                    "tuned": "3 + 4 = 7.",
                    "expected": "3 + 4 = 7.",
                }
            )
            + "\n"
            + json.dumps(
                {"prompt": "Tell me a joke | please", "base": "", "tuned": "6 + 6", "expected": None}
            )
            + "\n",
        )
        files.append(
            ExperimentFiles(
                name,
                r / f"train/{name}/summary.json",
                r / f"train/{name}/metrics.csv",
                r / f"eval/{name}/metrics.json",
                r / f"eval/{name}/generations.jsonl",
                r / f"tokenized/{KEY}",
            )
        )
    bench = root / "benchmarks"
    header = "s\th:m:s\tmax_rss\tmax_vms\tmax_uss\tmax_pss\tio_in\tio_out\tmean_load\tcpu_time\n"
    write_text(bench / "download.tsv", header + "0.70\t0:00:00\t111.7\t1\t1\t1\t0\t0\t0\t0.5\n")
    write_text(bench / "train/default.tsv", header + "173.76\t0:02:53\t3678.32\t1\t1\t1\t0\t0\t0\t214.14\n")
    write_text(bench / "eval/default.tsv", header + "9.5\t0:00:09\tNA\t1\t1\t1\t0\t0\t0\t10.1\n")
    # A removed experiment's leftover: no job of the manifest logs to logs/train/removed.log.
    write_text(bench / "train/removed.tsv", header + "999.0\t0:16:39\t1\t1\t1\t1\t0\t0\t0\t999.0\n")
    files[0] = add_preference_stage(r, files[0])
    config = {
        "dataset": {"source": "builtin", "builtin_seed": 0},
        "experiments": {n: {} for n in EXPERIMENTS},
    }
    return ReportInputs(
        experiments=files,
        source=r / "data/raw/source.json",
        sha256sums=r / "data/raw/SHA256SUMS",
        conversations=r / "data/conversations/stats.json",
        config=config,
        benchmarks=bench,
        manifest=write_manifest(r / "provenance/manifest.json"),
        invocation={
            "configfiles": ["config/mine.yaml"],
            "configfile_sha256": {"config/mine.yaml": "5e1f" * 16},
            "config_args": [],
        },
    )


def add_preference_stage(r: Path, files: ExperimentFiles) -> ExperimentFiles:
    """The preference stage's files for one experiment, and the DPO model in its evaluation: better preferences,
    a slightly higher loss, fewer exact matches than SFT."""
    name = files.name
    metrics = json.loads(files.eval_metrics.read_text())
    metrics["validation"]["dpo"] = {"loss": DPO["loss"], "perplexity": 2.718281828 ** DPO["loss"]}
    em, correct = metrics["exact_match"], DPO["exact_match_correct"]
    em["dpo"] = {
        **em["tuned"],
        "correct": correct,
        "accuracy": correct / 64,
        "by_task": {"add": {"n": 32, "correct": correct // 2, "accuracy": correct / 64}},
        "by_lang": {"en": {"n": 64, "correct": correct, "accuracy": correct / 64}},
    }
    # DPO answers the question SFT got wrong, and misses the one SFT got right.
    em["examples"][0]["dpo"], em["examples"][1]["dpo"] = "3 + 4 = 7.", "5 + 5 = 11."
    n = DPO["pairs"]
    metrics["preference"] = {
        model: {
            "pairs": n,
            "accuracy": won / n,
            "accuracy_ci95": wilson_interval(won, n),
            "reward_accuracy": rewarded / n,
            "reward_accuracy_ci95": wilson_interval(rewarded, n),
            "logprob_margin": 0.5,
            "reward_margin": 0.1,
        }
        for model, (won, rewarded) in PAIRS_WON.items()
    }
    write_json(files.eval_metrics, metrics)
    d = r / f"dpo/{name}"
    write_json(
        d / "summary.json",
        {"experiment": name, "objective": "dpo", "beta": 0.1, "reference": "sft", "steps": 40, "world_size": 3,
         "device": "cpu", "zero_stage": 2, "global_batch_size": 12, "lora": False, "final_train_loss": 0.2,
         "final_val_reward_accuracy": 0.96, "tokens_per_s_per_gpu": 900.0, "peak_memory_gib_per_rank": [0.7],
         "wall_time_s": 60.0},
    )  # fmt: skip
    with open(write_text(d / "metrics.csv", ""), "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", "dpo/loss", "dpo/reward_accuracy", "val/dpo_loss", "val/reward_accuracy"])
        for step in range(1, 41):
            val = [0.69 - step / 100, step / 41] if step % 10 == 0 else ["", ""]
            writer.writerow([step, 0.69 - step / 80, min(1.0, step / 30), *val])
    reference = write_json(r / f"preference/{name}/reference-{PAIRS_KEY}/reference.json",
                           {"reference": "sft", "time_s": 12.0})  # fmt: skip
    side = {"pairs": n, "tokens": 9000, "sides_cut_in_prompt": 3, "sides_cut_in_reply": 0}
    write_json(r / f"tokenized_pairs/{PAIRS_KEY}/stats.json", {"splits": {"train": side, "validation": side}})
    preferences = write_json(
        r / "data/preferences/best_vs_rest/stats.json",
        {"pairs": {"train": 900, "validation": n}, "trees_with_pairs": {"train": 400, "validation": 40},
         "groups": 600, "groups_dropped": {"fewer_than_two_ranked": 20}, "dropped": {"deleted": 126},
         "unranked_replies": 60, "pairs_mode": "best_vs_rest"},
    )  # fmt: skip
    return dataclasses.replace(
        files,
        dpo_summary=d / "summary.json",
        dpo_metrics=d / "metrics.csv",
        reference=reference,
        pairs=r / f"tokenized_pairs/{PAIRS_KEY}",
        preferences=preferences,
    )


def write_manifest(path: Path) -> Path:
    """The provenance manifest (snaketune.provenance.build_manifest's shape, the fields the report reads): jobs
    one after the other from 10:00, train[lora] and evaluate[lora] on GPUs."""
    jobs, clock = [], 0.0

    def job(rule, wildcards, log, wall_s, gpus=(), resources=None):
        nonlocal clock
        start, clock = clock, clock + wall_s + 5  # 5 s between jobs
        stamp = lambda t: f"2026-11-29T10:{int(t) // 60:02d}:{t % 60:06.3f}Z"  # noqa: E731
        jobs.append(
            {"record": f"results/provenance/{rule}.json", "status": "ok", "rule": rule, "wildcards": wildcards,
             "start": stamp(start), "end": stamp(start + wall_s), "wall_s": wall_s, "log": [log],
             "resources": resources or {}, "host": {"hostname": "node1"}, "gpus": list(gpus),
             "code": "0123456789abcdef", "seeds": {}, "software": {}, "git": {"commit": COMMIT, "dirty": False}}
        )  # fmt: skip

    h200s = ["NVIDIA H200"] * 4  # the host's GPUs, all visible to every job
    job("download", {}, "logs/download.log", 0.5)
    job("train", {"experiment": "default"}, "logs/train/default.log", 170.0, (), {"gpu": 3, "nodes": 1})
    job("train", {"experiment": "lora"}, "logs/train/lora.log", 100.0, h200s, {"gpu": 2, "nodes": 1})
    job("dpo", {"experiment": "default"}, "logs/dpo/default.log", 60.0, (), {"gpu": 3, "nodes": 1})
    job("evaluate", {"experiment": "default"}, "logs/eval/default.log", 9.0, (), {"gpu": 1})
    job("evaluate", {"experiment": "lora"}, "logs/eval/lora.log", 36.0, h200s, {"gpu": 1})
    job("export", {"experiment": "lora", "model": "sft"}, "logs/export/lora/sft.log", 20.0, h200s)
    return write_json(path, {"format": 1, "jobs": jobs, "missing": [], "summary": {}})


def first_screen(md: str) -> str:
    """The report's first screen in report.md: from its answer to the data section."""
    return md[md.index("## Did it help?") : md.index("## Data")]
