"""Stage 6, evaluate: the base model against the fine-tuned one, on the same data and prompts.

- Validation loss and perplexity: the token-weighted mean next-token loss over the tokenized validation split,
  with exactly the training stage's masking (``snaketune.batching``: assistant-only labels, packed rows kept
  apart by a block-diagonal mask, the first token of each conversation never a target), so the fine-tuned
  model's figure equals the train stage's final ``val/loss``.
- Greedy generations for the configured prompts, rendered with the chat template and the generation prompt;
  only the new tokens are decoded, up to the first end-of-sequence token.
- For the builtin dataset: exact-match accuracy on ``builtin_data.eval_examples`` (stripped generated text ==
  the example's answer), overall, per task and per language.

The base model is, for builtin models (``builtin-tiny``, ``arch:*``), the exact random init the train stage
starts from: ``snaketune.model.load_model`` with the same ModelConfig, tokenizer sizes, seed and dtype gives
identical weights (tests/test_evaluate.py compares it with a real training run's starting point). For hub or
local models it is ``from_pretrained(model.base)``. The models are loaded one after the other, so a 7B
evaluation needs the memory of one model only. CUDA when available (bf16), else CPU (fp32).
"""

from __future__ import annotations

import gc
import importlib.metadata
import json
import logging
import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from snaketune import batching, gpus
from snaketune.builtin_data import eval_examples
from snaketune.config import ModelConfig, _build
from snaketune.io import atomic_files, write_json
from snaketune.model import load_model
from snaketune.tokenization import load_tokenizer

log = logging.getLogger("snaketune.evaluate")

EVAL_EXAMPLES_SEED = 1
"""Seed of ``builtin_data.eval_examples``: the same questions for every experiment and every run."""
MODELS = ("base", "tuned")
VERSIONED_PACKAGES = ("torch", "deepspeed", "transformers", "datasets", "tokenizers", "peft", "safetensors")
"""Packages whose versions metrics.json records: the environment that ran the models (the train env)."""
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA (bf16) when available, else CPU (fp32); `device` forces one ("cpu", "cuda", "cuda:1")."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32


def pad_id(tokenizer) -> int:
    """The id the training stage pads with: pad, or eos when the tokenizer has no pad."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


# ---- models --------------------------------------------------------------------------------------


def load_base_model(
    model: ModelConfig, tokenizer, *, seed: int, train_dtype: torch.dtype, dtype: torch.dtype
) -> torch.nn.Module:
    """The model before fine-tuning, in `dtype`.

    Builtin models are created exactly as the train stage creates them (same config, tokenizer sizes, seed
    and the dtype it trained in: random init in bf16 differs from fp32 init rounded to bf16), then cast.
    Hub and local models are loaded with from_pretrained in `dtype`.
    """
    net = load_model(
        model,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=train_dtype if model.is_builtin else dtype,
        seed=seed,
    )
    return net.to(dtype=dtype).eval()


def load_tuned_model(model_dir: str | Path, model: ModelConfig, *, dtype: torch.dtype) -> torch.nn.Module:
    """The fine-tuned model the train stage saved (merged weights for LoRA)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dtype,
        use_safetensors=True,
        trust_remote_code=model.trust_remote_code,
        attn_implementation="sdpa",
    ).eval()


# ---- validation loss -----------------------------------------------------------------------------


@torch.no_grad()
def validation_loss(
    net: torch.nn.Module, split: batching.TokenizedSplit, *, pad_id: int, batch_size: int
) -> dict[str, float]:
    """Token-weighted mean next-token loss over a tokenized split and its perplexity exp(loss).

    Same masking as training: collate, the packed block-diagonal mask and token_loss_sum; the denominator
    is the split's loss-bearing target count (batching.target_mask), so batch size does not matter.
    """
    param = next(net.parameters())
    total = 0.0
    for start in range(0, len(split), batch_size):
        rows = np.arange(start, min(len(split), start + batch_size))
        batch = {k: v.to(param.device) for k, v in batching.collate(split, rows, pad_id).items()}
        mask = batching.packed_attention_mask(batch["position_ids"], param.dtype)
        out = net(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=mask,
            use_cache=False,
        )
        # Device-to-host sync once per batch; the sum is accumulated in float64 on the host.
        total += batching.token_loss_sum(out.logits, batch["labels"], batch["position_ids"]).item()
    tokens = int(split.loss_tokens.sum())
    if tokens == 0:
        raise ValueError("the validation split has no loss-bearing tokens")
    loss = total / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "loss_tokens": tokens, "rows": len(split)}


# ---- generation ----------------------------------------------------------------------------------


def render_prompt(tokenizer, prompt: str) -> list[int]:
    """Token ids of a one-turn user message with the generation prompt, as the chat template renders it.

    The template writes bos itself, so the text is encoded without added special tokens (as in training).
    """
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def decode_new_tokens(tokenizer, ids: Sequence[int]) -> str:
    """The generated text: tokens up to the first eos, special tokens dropped, outer whitespace stripped
    (the chat format's generation prompt is `Assistant:`, so replies start with a space)."""
    ids = list(ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


@torch.no_grad()
def generate(
    net: torch.nn.Module, tokenizer, prompts: Sequence[str], *, max_new_tokens: int, batch_size: int
) -> list[str]:
    """Greedy replies to `prompts`, `batch_size` at a time, left-padded (generate derives the position
    ids from the attention mask, so padding does not change the result)."""
    from transformers import GenerationConfig

    device = next(net.parameters()).device
    pad = pad_id(tokenizer)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    replies: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [render_prompt(tokenizer, p) for p in prompts[start : start + batch_size]]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        attention = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            attention[row, width - len(ids) :] = 1
        out = net.generate(
            input_ids=input_ids.to(device), attention_mask=attention.to(device), generation_config=config
        )
        replies += [decode_new_tokens(tokenizer, row[width:].tolist()) for row in out.cpu()]
    return replies


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


# ---- the stage -----------------------------------------------------------------------------------


def package_versions() -> dict[str, str]:
    versions = {}
    for name in VERSIONED_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = "not installed"
    return versions


def _release_memory() -> None:
    """Return a dropped model's memory before the next one loads (7B: one model at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


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
    prompts: Sequence[str],
    max_new_tokens: int,
    builtin_examples: int,
    batch_size: int,
    metrics_out: str | Path,
    generations_out: str | Path,
    device: str | None = None,
    memory_cap_gib: float | None = None,
) -> dict[str, Any]:
    """Evaluate base and fine-tuned model; write metrics.json and generations.jsonl; return the metrics.

    generations.jsonl has one row per prompt: {"prompt", "base", "tuned", "expected"}, where expected is the
    builtin dataset's exact answer to that prompt (None for other prompts or datasets). `memory_cap_gib`
    caps the CUDA allocator (gpu_memory_gib), as in training.
    """
    from snaketune.builtin_data import expected_answer

    t0 = time.perf_counter()
    model_cfg: ModelConfig = _build(ModelConfig, model, "model.")
    summary = json.loads(Path(train_summary).read_text())
    if summary.get("seed", seed) != seed:
        raise ValueError(f"{train_summary} was trained with seed {summary['seed']}, the params say {seed}")
    train_dtype = DTYPES[summary["precision"]]
    dev, dtype = pick_device(device)
    capped = gpus.cap_memory(dev, memory_cap_gib)
    if capped:
        log.info("%s", capped)
    tokenizer = load_tokenizer(tokenizer_dir, chat_template)
    split = batching.load_split(Path(data_dir) / "validation")
    examples = (
        eval_examples(builtin_examples, seed=EVAL_EXAMPLES_SEED)
        if builtin_dataset and builtin_examples
        else []
    )
    prompts = list(prompts)
    log.info(
        "device %s (%s); %d validation rows (%s loss tokens); %d prompts; %d exact-match questions",
        dev,
        str(dtype).removeprefix("torch."),
        len(split),
        f"{int(split.loss_tokens.sum()):,}",
        len(prompts),
        len(examples),
    )

    results: dict[str, dict[str, Any]] = {}
    replies: dict[str, list[str]] = {}
    for which in MODELS:
        t = time.perf_counter()
        if which == "base":
            net = load_base_model(model_cfg, tokenizer, seed=seed, train_dtype=train_dtype, dtype=dtype)
        else:
            net = load_tuned_model(tuned_dir, model_cfg, dtype=dtype)
        net.to(dev)
        res = {"validation": validation_loss(net, split, pad_id=pad_id(tokenizer), batch_size=batch_size)}
        replies[which] = generate(
            net, tokenizer, prompts, max_new_tokens=max_new_tokens, batch_size=batch_size
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
        log.info(
            "%s: validation loss %.4f, perplexity %.3f%s (%.1f s)",
            which,
            v["loss"],
            v["perplexity"],
            f", exact match {acc:.1%}" if acc is not None else "",
            res["time_s"],
        )
        del net
        _release_memory()

    base_v, tuned_v = results["base"]["validation"], results["tuned"]["validation"]
    metrics: dict[str, Any] = {
        "experiment": summary.get("experiment"),
        "model": model_cfg.base,
        "base_model": (
            f"random init of {model_cfg.base} (seed {seed}, {summary['precision']}): the train stage's start"
            if model_cfg.is_builtin
            else f"from_pretrained({model_cfg.base!r}, revision {model_cfg.revision!r})"
        ),
        "tuned_model": str(tuned_dir),
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "validation": {
            "rows": base_v["rows"],
            "loss_tokens": base_v["loss_tokens"],
            "base": {k: base_v[k] for k in ("loss", "perplexity")},
            "tuned": {k: tuned_v[k] for k in ("loss", "perplexity")},
            "loss_change_pct": 100.0 * (tuned_v["loss"] - base_v["loss"]) / base_v["loss"],
        },
        "generation": {"prompts": len(prompts), "max_new_tokens": max_new_tokens, "decoding": "greedy"},
        "exact_match": None,
        "versions": package_versions(),
        "time_s": {which: results[which]["time_s"] for which in MODELS},
    }
    if examples:
        metrics["exact_match"] = {
            "n": len(examples),
            "seed": EVAL_EXAMPLES_SEED,
            **{
                which: {k: v for k, v in results[which]["exact_match"].items() if k != "replies"}
                for which in MODELS
            },
            "examples": [
                {
                    **example,
                    "base": results["base"]["exact_match"]["replies"][i],
                    "tuned": results["tuned"]["exact_match"]["replies"][i],
                }
                for i, example in enumerate(examples)
            ],
        }
    metrics["time_s"]["total"] = time.perf_counter() - t0
    rows = [
        {
            "prompt": p,
            "base": replies["base"][i],
            "tuned": replies["tuned"][i],
            "expected": expected_answer(p) if builtin_dataset else None,
        }
        for i, p in enumerate(prompts)
    ]
    # Both files or neither: renamed into place together once both are written.
    with atomic_files(metrics_out, generations_out) as (metrics_tmp, generations_tmp):
        text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
        generations_tmp.write_text(text, encoding="utf-8")
        write_json(metrics_tmp, metrics)
    return metrics
