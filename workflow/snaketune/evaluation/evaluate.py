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

import json
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from snaketune import device_memory
from snaketune.config.load import from_dict
from snaketune.config.schema import ModelConfig
from snaketune.data.builtin import eval_examples
from snaketune.data.prompts import resolve_prompts
from snaketune.data.tokenization import load_tokenizer
from snaketune.evaluation.scores import preference_scores, score
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
from snaketune.plan import evaluation as eval_memory
from snaketune.plan.arch import arch_from_hf_config
from snaketune.preference.logprobs import split_logprobs
from snaketune.provenance import package_versions

log = logging.getLogger("snaketune.evaluation.evaluate")

EVAL_EXAMPLES_SEED = 1
"""Seed of ``builtin_data.eval_examples``: the same questions for every experiment and every run."""
VERSIONED_PACKAGES = ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "peft", "safetensors")
"""Packages whose versions metrics.json records: the environment that ran the models (the train env)."""


# ---- the stage -----------------------------------------------------------------------------------


@dataclass
class _Inputs:
    """What every model is measured on."""

    tokenizer: Any
    split: batching.TokenizedSplit
    """The SFT data's validation split (the loss)."""
    pairs: batching.TokenizedSplit | None
    """The held-out preference pairs, where the preference stages ran."""
    examples: list[dict]
    """The builtin dataset's exact-match questions (none for other data)."""
    asked: list[dict]
    """The prompts generated for: {"prompt", "expected"}."""

    @property
    def texts(self) -> list[str]:
        return [p["prompt"] for p in self.asked]


@dataclass(frozen=True)
class EvalJob:
    """What the evaluate stage is asked to do: the eval rule's params and inputs."""

    model: dict
    """The experiment's `model` settings (snaketune.config.schema.ModelConfig as a dict)."""
    seed: int
    """train.seed: a builtin base model's random init; checked against the train stage's summary."""
    chat_template: str
    """tokenize.chat_template: the prompts are rendered with it, as training rendered the data."""
    builtin_dataset: bool
    """The builtin dataset: its exact-match questions are asked, and its prompts' answers are known."""
    tuned_dir: str | Path
    """The SFT model (hub format)."""
    train_summary: str | Path
    """The train stage's summary.json (its seed and precision)."""
    tokenizer_dir: str | Path
    data_dir: str | Path
    """The tokenized SFT data (its validation split gives the loss)."""
    prompts: Sequence[str] | str
    """eval.prompts: prompts to generate for, or `auto` (snaketune.data.prompts)."""
    max_new_tokens: int
    builtin_examples: int
    """eval.builtin_examples: exact-match questions of the builtin dataset to ask."""
    batch_size: int
    """Rows per forward pass and prompts per generate() call (the memory plan's)."""
    metrics_out: str | Path
    generations_out: str | Path
    device: str | None = None
    """cpu | cuda | None (CUDA where there is one)."""
    memory_cap_gib: float | None = None
    """gpu_memory_gib, the card's memory: the process's device memory stays under it less the driver's share, as in
    training (snaketune.device_memory)."""
    conversations_dir: str | Path | None = None
    """Where `auto` prompts come from (the validation conversations)."""
    max_prompt_tokens: int | None = None
    """Longer prompts are cut, keeping their end."""
    dpo_dir: str | Path | None = None
    """The DPO model, where the preference stages ran."""
    pairs_dir: str | Path | None = None
    """The tokenized preference pairs (their validation split), where the preference stages ran."""
    reference: str = "sft"
    """preference.reference: which model scored here the rewards are taken against, `sft` (the tuned model) or
    `base`."""
    beta: float | None = None
    """preference.beta: the implicit reward's scale."""
    quantize: str = "none"
    """A QLoRA training's train.lora.quantize: with nf4 every model loads in 4 bits, as the base trained (what fits
    the GPUs that trained it)."""

    @property
    def models(self) -> list[str]:
        return ["base", "tuned"] + (["dpo"] if self.dpo_dir is not None else [])


def evaluate(job: EvalJob) -> dict[str, Any]:
    """Evaluate base, fine-tuned and (with `dpo_dir`) DPO model; write metrics.json and generations.jsonl; return
    metrics.json's content.

    generations.jsonl has one row per prompt: {"prompt", "base", "tuned", ["dpo",] "expected"}; expected is the
    builtin dataset's exact answer, or the data's own reply for auto prompts (None otherwise)."""
    t0 = time.perf_counter()
    model_cfg: ModelConfig = from_dict(ModelConfig, job.model, "model.")
    summary = json.loads(Path(job.train_summary).read_text())
    if summary.get("seed", job.seed) != job.seed:
        raise ValueError(
            f"{job.train_summary} was trained with seed {summary['seed']}, the params say {job.seed}"
        )
    dev, dtype = pick_device(job.device)
    sampler, budget = _watch_device(dev, job.memory_cap_gib)
    data = _inputs(job)
    _log_start(dev, dtype, job.models, data)
    results, peaks, arch = _measure_models(job, model_cfg, DTYPES[summary["precision"]], data, dev, dtype)
    models = job.models
    metrics: dict[str, Any] = {
        **_identity(job, summary, model_cfg, dev, dtype),
        "validation": _validation(results, models),
        "preference": None if data.pairs is None else _preferences(results, models, job.reference, job.beta),
        "generation": {
            "prompts": len(data.asked),
            "prompt_source": "auto" if job.prompts == "auto" else "eval.prompts",
            # What "expected" holds: the builtin dataset's exact answer, or the data's own reply (auto prompts).
            "expected": "exact"
            if job.builtin_dataset
            else ("reference reply" if job.prompts == "auto" else None),
            "max_new_tokens": job.max_new_tokens,
            "decoding": "greedy",
        },
        "exact_match": _exact_match(results, models, data.examples) if data.examples else None,
        "memory": {
            **_memory_record(arch, peaks, data, job, dtype, dev),
            "device": device_memory.record(sampler, dev, budget) or None,
        },
        "versions": package_versions(VERSIONED_PACKAGES),
        "time_s": {which: results[which]["time_s"] for which in models} | {"total": time.perf_counter() - t0},
    }
    _write(metrics, data.asked, {w: results[w]["replies"] for w in models}, job)
    return metrics


def _inputs(job: EvalJob) -> _Inputs:
    pairs = None
    if job.dpo_dir is not None or job.pairs_dir is not None:
        pairs = batching.load_split(Path(job.pairs_dir) / "validation")
    examples = []
    if job.builtin_dataset and job.builtin_examples:
        examples = eval_examples(job.builtin_examples, seed=EVAL_EXAMPLES_SEED)
    return _Inputs(
        tokenizer=load_tokenizer(job.tokenizer_dir, job.chat_template),
        split=batching.load_split(Path(job.data_dir) / "validation"),
        pairs=pairs,
        examples=examples,
        asked=resolve_prompts(
            job.prompts, builtin_dataset=job.builtin_dataset, conversations_dir=job.conversations_dir
        ),
    )


def _measure_models(
    job: EvalJob, model_cfg: ModelConfig, train_dtype: torch.dtype, data: _Inputs, dev: torch.device, dtype
) -> tuple[dict[str, dict[str, Any]], dict[str, float], Any]:
    """Each model loaded onto the device in turn, measured (`_measure`) and freed: {model: its results}, the peak
    memory of each phase over the models, the architecture (snaketune.plan.arch) of the first."""
    results: dict[str, dict[str, Any]] = {}
    peaks: dict[str, float] = {}
    arch = None
    for which in job.models:
        t = time.perf_counter()
        if which == "base":
            net = load_base_model(
                model_cfg,
                data.tokenizer,
                seed=job.seed,
                train_dtype=train_dtype,
                dtype=dtype,
                device=dev,
                quantize=job.quantize,
            )
        else:
            model_dir = job.tuned_dir if which == "tuned" else job.dpo_dir
            net = load_tuned_model(model_dir, model_cfg, dtype=dtype, device=dev, quantize=job.quantize)
        arch = arch or arch_from_hf_config(causal_lm(net).config.to_dict())
        results[which] = _measure(net, data, dev, peaks, job)
        results[which]["time_s"] = time.perf_counter() - t
        _log_model(which, results[which])
        del net
        release_memory()
    return results, peaks, arch


def _watch_device(dev: torch.device, memory_cap_gib: float | None) -> tuple[device_memory.PeakSampler, dict]:
    """On a GPU: what lies outside the allocator started, the allocator capped under `memory_cap_gib` (the card's
    memory), and NVML sampling the device peak while the stage runs; (sampler, budget)."""
    nvml = device_memory.device_memory(dev)
    budget: dict = {}
    if dev.type == "cuda":
        device_memory.warm_up(dev)
        capped, budget = device_memory.cap_allocator(dev, memory_cap_gib, nvml)
        if capped:
            log.info("%s", capped)
    return device_memory.PeakSampler(nvml), budget


def _log_start(dev: torch.device, dtype: torch.dtype, models: list[str], data: _Inputs) -> None:
    log.info(
        "device %s (%s); models %s; %d validation rows (%s loss tokens); %d prompts; %d exact-match questions; "
        "%s held-out pairs",
        dev,
        str(dtype).removeprefix("torch."),
        ", ".join(models),
        len(data.split),
        f"{int(data.split.loss_tokens.sum()):,}",
        len(data.asked),
        len(data.examples),
        len(data.pairs) if data.pairs is not None else "no",
    )


def _measure(net, data: _Inputs, dev: torch.device, peaks: dict, job: EvalJob) -> dict[str, Any]:
    """One model on everything: its validation loss, its pairs' log-probabilities, its replies to the prompts and to
    the exact-match questions; each phase's peak memory into `peaks` (the largest over the models)."""
    pad, batch_size, max_new = pad_id(data.tokenizer), job.batch_size, job.max_new_tokens
    out: dict[str, Any] = {}
    with peak_memory(dev, peaks, "validation"):
        out["validation"] = validation_loss(net, data.split, pad_id=pad, batch_size=batch_size)
    if data.pairs is not None:
        with peak_memory(dev, peaks, "preference"):
            out["pair_logprobs"] = split_logprobs(net, data.pairs, pad_id=pad, batch_size=batch_size)
    with peak_memory(dev, peaks, "generation"):
        out["replies"] = generate(
            net,
            data.tokenizer,
            data.texts,
            max_new_tokens=max_new,
            batch_size=batch_size,
            max_prompt_tokens=job.max_prompt_tokens,
        )
        if data.examples:
            questions = [e["prompt"] for e in data.examples]
            answers = generate(net, data.tokenizer, questions, max_new_tokens=max_new, batch_size=batch_size)
            out["exact_match"] = {**score(data.examples, answers), "replies": answers}
    return out


def _log_model(which: str, res: dict[str, Any]) -> None:
    v = res["validation"]
    acc = res.get("exact_match", {}).get("accuracy")
    pref = None
    if "pair_logprobs" in res:
        pref = float((res["pair_logprobs"][0].diff(dim=1) < 0).double().mean())
    log.info(
        "%s: validation loss %.4f, perplexity %.3f%s%s (%.1f s)",
        which,
        v["loss"],
        v["perplexity"],
        f", exact match {acc:.1%}" if acc is not None else "",
        f", preference accuracy {pref:.1%}" if pref is not None else "",
        res["time_s"],
    )


def _identity(job: EvalJob, summary: dict, model_cfg: ModelConfig, dev, dtype) -> dict[str, Any]:
    """Which models were evaluated, on what."""
    return {
        "experiment": summary.get("experiment"),
        "model": model_cfg.base,
        "models": job.models,
        "base_model": (
            f"random init of {model_cfg.base} (seed {job.seed}, {summary['precision']}): the train stage's start"
            if model_cfg.is_builtin
            else f"from_pretrained({model_cfg.base!r}, revision {model_cfg.revision!r})"
        ),
        "tuned_model": str(job.tuned_dir),
        "dpo_model": None if job.dpo_dir is None else str(job.dpo_dir),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
    }


def _validation(results: dict, models: list[str]) -> dict[str, Any]:
    """The validation loss and perplexity of each model, and the change each tuning made to the loss."""
    base = results["base"]["validation"]
    out = {
        "rows": base["rows"],
        "loss_tokens": base["loss_tokens"],
        **{w: {k: results[w]["validation"][k] for k in ("loss", "perplexity")} for w in models},
        "loss_change_pct": 100.0 * (results["tuned"]["validation"]["loss"] - base["loss"]) / base["loss"],
    }
    if "dpo" in models:
        tuned = results["tuned"]["validation"]["loss"]
        out["dpo_loss_change_pct"] = 100.0 * (results["dpo"]["validation"]["loss"] - tuned) / tuned
    return out


def _preferences(results: dict, models: list[str], reference: str, beta: float | None) -> dict[str, Any]:
    """Each model's preference scores, the rewards against the reference model as scored here: the same loading and
    kernels on both sides."""
    ref = results["tuned" if reference == "sft" else "base"]["pair_logprobs"]
    return {
        "beta": beta,
        "reference": reference,
        **{w: preference_scores(*results[w]["pair_logprobs"], ref[0], beta) for w in models},
    }


def _exact_match(results: dict, models: list[str], examples: list[dict]) -> dict[str, Any]:
    return {
        "n": len(examples),
        "seed": EVAL_EXAMPLES_SEED,
        **{w: {k: v for k, v in results[w]["exact_match"].items() if k != "replies"} for w in models},
        "examples": [
            {**example, **{w: results[w]["exact_match"]["replies"][i] for w in models}}
            for i, example in enumerate(examples)
        ],
    }


def _write(metrics: dict, asked: list[dict], replies: dict[str, list[str]], job: EvalJob) -> None:
    """metrics.json and generations.jsonl, both or neither: renamed into place together once both are written."""
    rows = [
        {"prompt": p["prompt"], **{w: replies[w][i] for w in replies}, "expected": p["expected"]}
        for i, p in enumerate(asked)
    ]
    with atomic_files(job.metrics_out, job.generations_out) as (metrics_tmp, generations_tmp):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        generations_tmp.write_text(text, encoding="utf-8")
        write_json(metrics_tmp, metrics)


def _memory_record(
    arch, peaks: dict, data: _Inputs, job: EvalJob, dtype: torch.dtype, dev: torch.device
) -> dict:
    """Measured peak per phase (CUDA) beside the memory model's estimate for these lengths."""
    if arch is None:
        return {}
    setup = eval_memory.EvalSetup(
        batch=min(job.batch_size, len(data.split)),
        seq_len=int(data.split.lengths.max(initial=0)),
        prompt_len=longest_prompt(data.tokenizer, data.texts),
        new_tokens=job.max_new_tokens,
        precision="fp32" if dtype == torch.float32 else "bf16",
        varlen=dev.type == "cuda",
        quantized=job.quantize != "none",
    )
    est = eval_memory.estimate_eval(arch, setup)
    return {
        "batch_size": job.batch_size,
        "validation_row_tokens": setup.seq_len,
        "longest_prompt_tokens": setup.prompt_len,
        "measured_peak_gib": {k: round(v, 3) for k, v in peaks.items()} or None,
        "predicted_peak_gib": {
            "validation": round(est.validation_gib, 3),
            "generation": round(est.generation_gib, 3),
        },
    }
