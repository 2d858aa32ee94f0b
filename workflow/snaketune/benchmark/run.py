"""Stage 10, benchmark: lm-evaluation-harness tasks on the base, SFT and DPO models (transformers, the harness's `hf`
model on the loaded model) and on the exported GGUF files (llama.cpp in this process,
snaketune.benchmark.llama_lm), one task per job, so that a new task reruns only its own jobs.

Every model renders its prompts with the same tokenizer and chat template (the data stages' tokenizer with
`tokenize.chat_template`), as the harness does for chat models (`apply_chat_template`; few-shot examples as earlier
turns, `fewshot_as_multiturn`). Each result file holds the harness's scores with their standard errors, every
example's score (so that the report can pair two models' examples), the few-shot settings, the first rendered
prompt, and the versions and times.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import math
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from snaketune.benchmark import local_tasks
from snaketune.config.load import from_dict
from snaketune.config.schema import ModelConfig
from snaketune.data.tokenization import load_tokenizer
from snaketune.io import sha256_file, write_json

log = logging.getLogger("snaketune.benchmark.run")

BOOTSTRAP_ITERS = 1000
"""The harness's bootstrap for the standard error of metrics that are not means (accuracies are: closed form)."""
SEEDS = {"random_seed": 0, "numpy_random_seed": 1234, "torch_random_seed": 1234, "fewshot_random_seed": 1234}
"""The harness's own defaults, passed explicitly and recorded: they pick the few-shot examples. torch's is set where
a model runs on torch (the harness's `hf` model); llama.cpp's GGUF files never draw from it (evaluate_task)."""


def versions() -> dict[str, str]:
    out = {}
    for name in ("lm_eval", "transformers", "torch", "llama_cpp_python"):
        try:
            out[name] = importlib.metadata.version(name.replace("_python", "-python"))
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


# ---- the model under test --------------------------------------------------------------------------


def _load_transformers(source: dict, tokenizer, device: str | None):
    """The base or a tuned model as the evaluate stage loads it (snaketune.model.inference)."""
    import torch

    from snaketune.model.inference import load_base_model, load_tuned_model, pick_device

    dev, dtype = pick_device(device)
    model_cfg: ModelConfig = from_dict(ModelConfig, source["model"], "model.")
    quantize = source.get("quantize", "none")
    if source["kind"] == "base":
        precision = source["precision"]
        if precision == "auto":  # as training resolves it on this device (snaketune.train.trainer)
            precision = "bf16" if dev.type == "cuda" else "fp32"
        train_dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        net = load_base_model(
            model_cfg,
            tokenizer,
            seed=source["seed"],
            train_dtype=train_dtype,
            dtype=dtype,
            device=dev,
            quantize=quantize,
        )
    else:
        net = load_tuned_model(source["dir"], model_cfg, dtype=dtype, device=dev, quantize=quantize)
    info = {
        "runtime": "transformers",
        "device": str(dev),
        "dtype": str(dtype).removeprefix("torch."),
        "quantize": quantize,
    }
    return net, info


@contextlib.contextmanager
def open_model(
    source: dict,
    tokenizer,
    *,
    batch_size: int,
    max_length: int,
    threads: int,
    device: str | None = None,
) -> Iterator[tuple[Any, dict]]:
    """The harness's model for `source` (kind base, tuned or gguf) and what describes it."""
    if source["kind"] == "gguf":
        from snaketune.benchmark.llama_lm import LlamaCppLM
        from snaketune.export.runtime import GGUFRuntime

        gguf = Path(source["gguf"])
        info = {
            "runtime": "llama.cpp (llama-cpp-python, in process)",
            "file": gguf.name,
            "bytes": gguf.stat().st_size,
            "sha256": sha256_file(gguf),
            "threads": threads,
        }
        with GGUFRuntime(gguf, n_ctx=max_length, threads=threads) as runtime:
            yield LlamaCppLM(runtime, tokenizer), info
        return
    from lm_eval.models.huggingface import HFLM

    net, info = _load_transformers(source, tokenizer, device)
    yield HFLM(pretrained=net, tokenizer=tokenizer, batch_size=batch_size, max_length=max_length), info


# ---- one task ------------------------------------------------------------------------------------------


def _number(value) -> float | None:
    try:
        value = float(value)
    except (TypeError, ValueError):
        return None
    return value if math.isfinite(value) else None


def scores(out: dict, name: str) -> dict:
    """The harness's output for one task: metrics (value, standard error, direction), every example's score."""
    res = out["results"][name]
    better = out.get("higher_is_better", {}).get(name, {})
    metrics = {}
    for key, value in res.items():
        if "," not in key or "_stderr," in key:
            continue
        metric, filt = key.split(",", 1)
        if _number(value) is None:
            continue
        metrics[key] = {
            "metric": metric,
            "filter": filt,
            "value": _number(value),
            "stderr": _number(res.get(f"{metric}_stderr,{filt}")),
            "higher_is_better": better.get(metric),
        }
    names = {m["metric"] for m in metrics.values()}
    samples = [
        {
            "doc_id": s["doc_id"],
            "filter": s.get("filter", "none"),
            **{m: _number(s[m]) for m in names if m in s and _number(s[m]) is not None},
        }
        for s in out.get("samples", {}).get(name, [])
    ]
    first = out.get("samples", {}).get(name, [{}])[0] if out.get("samples", {}).get(name) else {}
    return {
        "metrics": metrics,
        "n": (out.get("n-samples", {}).get(name) or {}).get("effective", len({s["doc_id"] for s in samples})),
        "n_shot": out.get("n-shot", {}).get(name),
        "task_version": out.get("versions", {}).get(name),
        "samples": samples,
        "example": {"prompt": first["arguments"][0][0], "target": first.get("target")} if first else None,
    }


@contextlib.contextmanager
def _without_environment_report() -> Iterator[None]:
    """simple_evaluate without its last step, the harness's environment report (lm_eval.loggers.utils.add_env_info:
    torch.utils.collect_env, which imports torch and runs `pip list` and compiler versions in subprocesses, about
    0.6 s a job on two cores). No result file keeps it: each records versions() instead."""
    import lm_eval.evaluator

    report = lm_eval.evaluator.add_env_info  # an AttributeError here: the pinned harness changed
    lm_eval.evaluator.add_env_info = lambda results: None
    try:
        yield
    finally:
        lm_eval.evaluator.add_env_info = report


def evaluate_task(lm, task: dict, scratch: Path) -> dict:
    """Run one task (a config.BenchmarkConfig.task_spec) on `lm` with the harness; its scores.

    The harness seeds torch only where torch is loaded: a model that runs on torch has loaded it by now, and seeding
    it would cost a job on a GGUF file (llama.cpp, numpy) torch's import, about 1.5 s on two cores."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    local = local_tasks.is_local(task["name"])
    # The harness's own task index takes ~12 s to build (every task file it ships): the local tasks skip it.
    manager = TaskManager(include_defaults=not local)
    what = local_tasks.materialize(task["name"], scratch) if local else task["name"]
    seeds = {**SEEDS, "torch_random_seed": SEEDS["torch_random_seed"] if "torch" in sys.modules else None}
    with _without_environment_report():
        out = lm_eval.simple_evaluate(
            model=lm,
            tasks=[what],
            num_fewshot=task["num_fewshot"],
            limit=task["limit"],
            apply_chat_template=task["chat_template"],
            fewshot_as_multiturn=task["fewshot_as_multiturn"],
            log_samples=True,
            bootstrap_iters=BOOTSTRAP_ITERS,
            task_manager=manager,
            **seeds,
        )
    return scores(out, task["name"])


def benchmark(
    *,
    source: dict,
    tasks: list[dict],
    outs: list[str | Path],
    tokenizer_dir: str | Path,
    chat_template: str,
    batch_size: int,
    max_length: int,
    threads: int,
    device: str | None = None,
) -> list[dict]:
    """Score `source` on each task (BenchmarkConfig.task_spec), writing one result file per task to `outs`."""
    t0 = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_dir, chat_template)
    results = []
    with open_model(
        source,
        tokenizer,
        batch_size=batch_size,
        max_length=max_length,
        threads=threads,
        device=device,
    ) as (lm, info):
        load_s = time.perf_counter() - t0
        for task, out in zip(tasks, outs, strict=True):
            t = time.perf_counter()
            with tempfile.TemporaryDirectory(prefix="snaketune-benchmark-") as scratch:
                result = evaluate_task(lm, task, Path(scratch))
            result.update(
                task=task["name"],
                spec=task,
                model={
                    "label": source["label"],
                    "experiment": source.get("experiment"),
                    "kind": source["kind"],
                    **info,
                },
                settings={
                    "batch_size": batch_size,
                    "max_length": max_length,
                    "bootstrap_iters": BOOTSTRAP_ITERS,
                    **SEEDS,
                },
                versions=versions(),
                load_s=load_s,
                time_s=time.perf_counter() - t,
            )
            write_json(out, result)
            results.append(result)
            log.info(
                "%s on %s: %s (n=%s, %d-shot), %.1f s (model loaded in %.1f s)",
                source["label"],
                task["name"],
                ", ".join(
                    f"{k} {m['value']:.4g} ± {m['stderr'] or 0:.2g}" for k, m in result["metrics"].items()
                ),
                result["n"],
                task["num_fewshot"],
                result["time_s"],
                load_s,
            )
    return results
