"""Stage 6, evaluate: the base model, the fine-tuned (SFT) model and, with preference tuning, the DPO model,
on the same data and prompts.

- Validation loss and perplexity of the SFT data: the token-weighted mean next-token loss over the tokenized
  validation split, with exactly the training stage's masking (snaketune.model.inference), so the fine-tuned
  model's figure equals the train stage's final ``val/loss``. Does DPO cost SFT quality: compare the three.
- Preferences (when the preference stages ran): on the held-out pairs, for every model, the preference
  accuracy (share of pairs where the model gives the chosen reply the higher summed log-probability) and
  the mean log-probability margin; and the implicit reward of DPO, beta x (log pi - log ref) against the
  reference model (`preference.reference`: the SFT or the base model) as this stage scores it, with the same
  loading, precision and kernels as every other model here: its accuracy (chosen reward larger) and mean margin.
  The reference model scores 0 against itself (no pair is ranked: accuracy 0). Each accuracy comes with its
  95% Wilson interval and the reward margin with a 95% interval of its mean (``*_ci95``), the length-normalized
  accuracy (per reply token) beside the summed one.
- Greedy generations for the prompts (``eval.prompts``; ``auto``: the builtin questions on the builtin data,
  else the first user message of config.AUTO_PROMPTS validation conversations, with the data's own reply as
  the expected answer), rendered with the chat template and the generation prompt.
- For the builtin dataset: exact-match accuracy on ``builtin_data.eval_examples`` (stripped generated text ==
  the example's answer), overall, per task and per language.

Models are loaded one after the other onto the device (snaketune.model.inference), so a 7B evaluation needs the
memory of one model only; the batch size is the memory plan's (`plan.evaluate.batch_size`), and each
phase's peak memory is recorded beside the memory model's estimate for the lengths met here.
CUDA when available (bf16), else CPU (fp32).
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from snaketune import device_memory
from snaketune.config.load import from_dict
from snaketune.config.schema import ModelConfig
from snaketune.data.builtin import eval_examples
from snaketune.data.prompts import resolve_prompts
from snaketune.data.tokenization import load_tokenizer
from snaketune.io import atomic_files, write_json
from snaketune.model import batching
from snaketune.model.build import causal_lm
from snaketune.model.inference import (  # noqa: F401 - the stage's public names include the inference helpers
    DTYPES,
    decode_new_tokens,
    generate,
    load_base_model,
    load_tuned_model,
    longest_prompt,
    pad_id,
    peak_memory,
    pick_device,
    release_memory,
    render_prompt,
    validation_loss,
)
from snaketune.plan import memory
from snaketune.plan.arch import arch_from_hf_config
from snaketune.preference.logprobs import split_logprobs

log = logging.getLogger("snaketune.evaluation.evaluate")

EVAL_EXAMPLES_SEED = 1
"""Seed of ``builtin_data.eval_examples``: the same questions for every experiment and every run."""
MODELS = ("base", "tuned", "dpo")
VERSIONED_PACKAGES = ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "peft", "safetensors")
"""Packages whose versions metrics.json records: the environment that ran the models (the train env)."""


# ---- exact match ---------------------------------------------------------------------------------


def exact_match(generated: str, answer: str) -> bool:
    """A reply is correct when its text, stripped of outer whitespace, is exactly the expected answer."""
    return generated.strip() == answer.strip()


def _share(correct: int, n: int) -> dict[str, float | int]:
    return {"n": n, "correct": correct, "accuracy": correct / n if n else None}


def score(examples: Sequence[dict[str, str]], replies: Sequence[str]) -> dict[str, Any]:
    """Exact-match accuracy overall, per task and per language."""
    if len(examples) != len(replies):
        raise ValueError(f"{len(examples)} examples but {len(replies)} replies")
    hits = [exact_match(r, e["answer"]) for e, r in zip(examples, replies, strict=True)]
    out: dict[str, Any] = _share(sum(hits), len(hits))
    for field in ("task", "lang"):
        groups: dict[str, list[bool]] = {}
        for example, hit in zip(examples, hits, strict=True):
            groups.setdefault(example[field], []).append(hit)
        out[f"by_{field}"] = {k: _share(sum(v), len(v)) for k, v in sorted(groups.items())}
    return out


# ---- preferences ----------------------------------------------------------------------------------


def preference_scores(
    logprobs: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor, beta: float
) -> dict[str, float]:
    """Accuracy and mean margin of a model's summed log-probabilities of (chosen, rejected) pairs, the same per reply
    token (length-normalized: a longer chosen reply has a lower sum without being less likely per token), and
    of its implicit reward beta x (log pi - log ref)."""
    if not len(logprobs):
        return {"pairs": 0}
    margin = logprobs[:, 0] - logprobs[:, 1]
    per_token = logprobs / counts.clamp(min=1)
    rewards = beta * (logprobs - reference)
    reward_margin = rewards[:, 0] - rewards[:, 1]
    wins = {
        "accuracy": margin > 0,
        "accuracy_per_token": per_token[:, 0] > per_token[:, 1],
        "reward_accuracy": reward_margin > 0,
    }
    out: dict[str, Any] = {"pairs": len(margin)}
    for name, won in wins.items():
        out[name] = float(won.double().mean())
        out[f"{name}_ci95"] = wilson_interval(int(won.sum()), len(won))
    out["logprob_margin"] = float(margin.mean())
    out["reward_margin"] = float(reward_margin.mean())
    out["reward_margin_ci95"] = mean_interval(reward_margin)
    out["chosen_reward"] = float(rewards[:, 0].mean())
    out["rejected_reward"] = float(rewards[:, 1].mean())
    return out


Z95 = 1.959964
"""The standard normal's 97.5% quantile: two-sided 95% intervals."""


def wilson_interval(wins: int, n: int, z: float = Z95) -> list[float]:
    """Wilson's score interval of a share (wins of n): unlike the normal approximation it stays inside [0, 1]
    and is honest at the small n of a held-out pair set (60-200 pairs here)."""
    if n == 0:
        return [0.0, 1.0]
    p = wins / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return [max(0.0, centre - half), min(1.0, centre + half)]


def mean_interval(values: torch.Tensor, z: float = Z95) -> list[float]:
    """Normal-approximation interval of a mean (the pairs are independent draws; n >= 30 in practice)."""
    x = values.double()
    mean = float(x.mean())
    if len(x) < 2:
        return [mean, mean]
    half = z * float(x.std(unbiased=True)) / math.sqrt(len(x))
    return [mean - half, mean + half]


# ---- the stage -----------------------------------------------------------------------------------


def package_versions() -> dict[str, str]:
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def evaluate(
    *,
    model: dict,
    seed: int,
    chat_template: str,
    builtin_dataset: bool,
    tuned_dir: str | Path,
    train_summary: str | Path,
    tokenizer_dir: str | Path,
    data_dir: str | Path,
    prompts: Sequence[str] | str,
    max_new_tokens: int,
    builtin_examples: int,
    batch_size: int,
    metrics_out: str | Path,
    generations_out: str | Path,
    device: str | None = None,
    memory_cap_gib: float | None = None,
    conversations_dir: str | Path | None = None,
    max_prompt_tokens: int | None = None,
    dpo_dir: str | Path | None = None,
    pairs_dir: str | Path | None = None,
    reference: str = "sft",
    beta: float | None = None,
    quantize: str = "none",
) -> dict[str, Any]:
    """Evaluate base, fine-tuned and (with `dpo_dir`) DPO model; write metrics.json and generations.jsonl.

    generations.jsonl has one row per prompt: {"prompt", "base", "tuned", ["dpo",] "expected"}; expected is the
    builtin dataset's exact answer, or the data's own reply for auto prompts (None otherwise). The preference
    metrics need `pairs_dir`, `beta` and `reference` (which of the models scored here the rewards are taken against:
    `sft`, the tuned model, or `base`). `memory_cap_gib` (gpu_memory_gib, the card's memory) keeps the process's
    device memory under it less the driver's share, as in training (snaketune.device_memory); `max_prompt_tokens` cuts longer prompts (keeping their end). With
    `quantize` nf4 (a QLoRA training's train.lora.quantize) every model loads in 4 bits, as the base trained:
    what fits the GPUs that trained it.
    """
    t0 = time.perf_counter()
    model_cfg: ModelConfig = from_dict(ModelConfig, model, "model.")
    summary = json.loads(Path(train_summary).read_text())
    if summary.get("seed", seed) != seed:
        raise ValueError(f"{train_summary} was trained with seed {summary['seed']}, the params say {seed}")
    train_dtype = DTYPES[summary["precision"]]
    dev, dtype = pick_device(device)
    nvml = device_memory.device_memory(dev)
    budget: dict = {}
    if dev.type == "cuda":
        device_memory.warm_up(dev)
        capped, budget = device_memory.cap_allocator(dev, memory_cap_gib, nvml)
        if capped:
            log.info("%s", capped)
    sampler = device_memory.PeakSampler(nvml)
    tokenizer = load_tokenizer(tokenizer_dir, chat_template)
    split = batching.load_split(Path(data_dir) / "validation")
    examples = (
        eval_examples(builtin_examples, seed=EVAL_EXAMPLES_SEED)
        if builtin_dataset and builtin_examples
        else []
    )
    asked = resolve_prompts(prompts, builtin_dataset=builtin_dataset, conversations_dir=conversations_dir)
    texts = [p["prompt"] for p in asked]
    pairs = None
    if dpo_dir is not None or pairs_dir is not None:
        pairs = batching.load_split(Path(pairs_dir) / "validation")
    models = ["base", "tuned"] + (["dpo"] if dpo_dir is not None else [])
    log.info(
        "device %s (%s); models %s; %d validation rows (%s loss tokens); %d prompts; %d exact-match questions; "
        "%s held-out pairs",
        dev,
        str(dtype).removeprefix("torch."),
        ", ".join(models),
        len(split),
        f"{int(split.loss_tokens.sum()):,}",
        len(texts),
        len(examples),
        len(pairs) if pairs is not None else "no",
    )
    results: dict[str, dict[str, Any]] = {}
    replies: dict[str, list[str]] = {}
    peaks: dict[str, float] = {}
    arch = None
    for which in models:
        t = time.perf_counter()
        if which == "base":
            net = load_base_model(
                model_cfg,
                tokenizer,
                seed=seed,
                train_dtype=train_dtype,
                dtype=dtype,
                device=dev,
                quantize=quantize,
            )
        else:
            net = load_tuned_model(
                tuned_dir if which == "tuned" else dpo_dir,
                model_cfg,
                dtype=dtype,
                device=dev,
                quantize=quantize,
            )
        arch = arch or arch_from_hf_config(causal_lm(net).config.to_dict())
        with peak_memory(dev, peaks, "validation"):
            res = {"validation": validation_loss(net, split, pad_id=pad_id(tokenizer), batch_size=batch_size)}
        if pairs is not None:
            with peak_memory(dev, peaks, "preference"):
                res["pair_logprobs"] = split_logprobs(
                    net, pairs, pad_id=pad_id(tokenizer), batch_size=batch_size
                )
        with peak_memory(dev, peaks, "generation"):
            replies[which] = generate(
                net,
                tokenizer,
                texts,
                max_new_tokens=max_new_tokens,
                batch_size=batch_size,
                max_prompt_tokens=max_prompt_tokens,
            )
            if examples:
                answers = generate(
                    net,
                    tokenizer,
                    [e["prompt"] for e in examples],
                    max_new_tokens=max_new_tokens,
                    batch_size=batch_size,
                )
                res["exact_match"] = score(examples, answers)
                res["exact_match"]["replies"] = answers
        res["time_s"] = time.perf_counter() - t
        results[which] = res
        v = res["validation"]
        acc = res.get("exact_match", {}).get("accuracy")
        pref = (
            float((res["pair_logprobs"][0].diff(dim=1) < 0).double().mean())
            if "pair_logprobs" in res
            else None
        )
        log.info(
            "%s: validation loss %.4f, perplexity %.3f%s%s (%.1f s)",
            which,
            v["loss"],
            v["perplexity"],
            f", exact match {acc:.1%}" if acc is not None else "",
            f", preference accuracy {pref:.1%}" if pref is not None else "",
            res["time_s"],
        )
        del net
        release_memory()

    base_v = results["base"]["validation"]
    metrics: dict[str, Any] = {
        "experiment": summary.get("experiment"),
        "model": model_cfg.base,
        "models": models,
        "base_model": (
            f"random init of {model_cfg.base} (seed {seed}, {summary['precision']}): the train stage's start"
            if model_cfg.is_builtin
            else f"from_pretrained({model_cfg.base!r}, revision {model_cfg.revision!r})"
        ),
        "tuned_model": str(tuned_dir),
        "dpo_model": None if dpo_dir is None else str(dpo_dir),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "validation": {
            "rows": base_v["rows"],
            "loss_tokens": base_v["loss_tokens"],
            **{w: {k: results[w]["validation"][k] for k in ("loss", "perplexity")} for w in models},
            "loss_change_pct": 100.0
            * (results["tuned"]["validation"]["loss"] - base_v["loss"])
            / base_v["loss"],
        },
        "preference": None,
        "generation": {
            "prompts": len(texts),
            "prompt_source": "auto" if prompts == "auto" else "eval.prompts",
            # What "expected" holds: the builtin dataset's exact answer, or the data's own reply (auto prompts).
            "expected": "exact" if builtin_dataset else ("reference reply" if prompts == "auto" else None),
            "max_new_tokens": max_new_tokens,
            "decoding": "greedy",
        },
        "exact_match": None,
        "memory": {
            **_memory_record(
                arch,
                peaks,
                split,
                tokenizer,
                texts,
                batch_size,
                max_new_tokens,
                dtype,
                dev,
                quantize != "none",
            ),
            "device": device_memory.record(sampler, dev, budget) or None,
        },
        "versions": package_versions(),
        "time_s": {which: results[which]["time_s"] for which in models},
    }
    if "dpo" in models:
        tuned_loss = results["tuned"]["validation"]["loss"]
        metrics["validation"]["dpo_loss_change_pct"] = (
            100.0 * (results["dpo"]["validation"]["loss"] - tuned_loss) / tuned_loss
        )
    if pairs is not None:
        # The rewards against the reference model as scored here: the same loading and kernels on both sides.
        ref = results["tuned" if reference == "sft" else "base"]["pair_logprobs"]
        metrics["preference"] = {
            "beta": beta,
            "reference": reference,
            **{w: preference_scores(*results[w].pop("pair_logprobs"), ref[0], beta) for w in models},
        }
    if examples:
        metrics["exact_match"] = {
            "n": len(examples),
            "seed": EVAL_EXAMPLES_SEED,
            **{w: {k: v for k, v in results[w]["exact_match"].items() if k != "replies"} for w in models},
            "examples": [
                {**example, **{w: results[w]["exact_match"]["replies"][i] for w in models}}
                for i, example in enumerate(examples)
            ],
        }
    metrics["time_s"]["total"] = time.perf_counter() - t0
    rows = [
        {"prompt": p["prompt"], **{w: replies[w][i] for w in models}, "expected": p["expected"]}
        for i, p in enumerate(asked)
    ]
    # Both files or neither: renamed into place together once both are written.
    with atomic_files(metrics_out, generations_out) as (metrics_tmp, generations_tmp):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        generations_tmp.write_text(text, encoding="utf-8")
        write_json(metrics_tmp, metrics)
    return metrics


def _memory_record(
    arch, peaks, split, tokenizer, texts, batch_size, max_new_tokens, dtype, dev, quantized=False
) -> dict:
    """Measured peak per phase (CUDA) beside the memory model's estimate for these lengths."""
    if arch is None:
        return {}
    setup = memory.EvalSetup(
        batch=min(batch_size, len(split)),
        seq_len=int(split.lengths.max(initial=0)),
        prompt_len=longest_prompt(tokenizer, texts),
        new_tokens=max_new_tokens,
        precision="fp32" if dtype == torch.float32 else "bf16",
        varlen=dev.type == "cuda",
        quantized=quantized,
    )
    est = memory.estimate_eval(arch, setup)
    return {
        "batch_size": batch_size,
        "validation_row_tokens": setup.seq_len,
        "longest_prompt_tokens": setup.prompt_len,
        "measured_peak_gib": {k: round(v, 3) for k, v in peaks.items()} or None,
        "predicted_peak_gib": {
            "validation": round(est.validation_gib, 3),
            "generation": round(est.generation_gib, 3),
        },
    }
