"""Preflight memory plan: will a training fit on the GPUs it gets, and if not, what would.

The `plan` rule writes results/plan/<experiment>.json before the train rule may start: the estimated peak
memory per GPU and on the host for the configured strategy and for the alternatives, the budget they were
checked against (the top-level config key `gpu_memory_gib`, else the smallest GPU this machine offers the
workflow), and the strategy the train rule will use. A configuration that does not fit stops the workflow
there, with what would fit; with `train.strategy: auto` the plan picks the fastest strategy that fits.
The launcher checks the plan again against the GPUs a job is actually given (`check_devices`).

The memory model is snaketune.plan.memory.

The strategies `train.strategy: auto` chooses among, fastest first, are snaketune.plan.strategies.
"""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from snaketune.config.deepspeed import zero_stage
from snaketune.config.schema import checkpointed_layers
from snaketune.plan.advice import not_fitting_message
from snaketune.plan.arch import Arch, resolve_arch
from snaketune.plan.budget import Budget, detect_budget
from snaketune.plan.candidates import Training, weigh
from snaketune.plan.evaluation import plan_evaluation
from snaketune.plan.strategies import (  # noqa: F401 - the plan's public names include the strategies'
    MICRO_SPEED,
    MICRO_SPEED_LORA,
    PICK_MARGIN_GIB,
    SPEED_8BIT,
    SPEED_IN_BACKWARD,
    STRATEGIES,
    STRATEGY_FILES,
    Strategy,
    candidate_strategies,
    checkpointing_setting,
    strategy_name,
)

log = logging.getLogger("snaketune.plan.search")


class PlanError(RuntimeError):
    """The training does not fit; the message says what would."""


STRATEGY_MODES = ("as_configured", "auto")


def make_plan(
    *,
    experiment: str,
    model: dict,
    train: dict,
    max_length: int,
    deepspeed_config: str,
    gpu_memory_gib: float | None,
    budget: Budget,
    candidate_files: dict[str, str] | None = None,
    allow_download: bool = False,
    evaluation: dict | None = None,
    objective: str = "sft",
) -> dict:
    """The plan as a JSON-able dict; `fits` is False when the chosen strategy does not fit (then `message`
    says what would), None when there is nothing to check against. The preference stage has a plan of its own
    (rule plan_dpo, `objective` preference): its merged train settings, rows of both sides of a pair, and its own
    log-probabilities instead of the SFT loss (`setup_for`). The evaluate stage's (rule plan_eval, `objective`
    evaluate, `evaluation` {"batch_size", "max_new_tokens"}) plans its batch size alone (`plan_evaluation`).
    Where train.strategy is auto or gpu_memory_gib is set, an architecture or a GPU budget that is not known here
    is an error (PlanError): the plan cannot do what the config asks of it, and must not pass unplanned."""
    plan: dict[str, Any] = {
        "experiment": experiment,
        "gpu_memory_gib": gpu_memory_gib,
        "budget": dataclasses.asdict(budget),
        "model": {"base": model["base"]},
    }
    arch, source = resolve_arch(model, allow_download=allow_download)
    plan["model"]["source"] = source
    _check_plannable(arch, source, train, gpu_memory_gib, budget, objective)
    if arch is None:
        plan.update(_unplanned(train, deepspeed_config, source), arch=None)
        return plan
    plan["arch"] = dataclasses.asdict(arch)
    if objective == "evaluate":
        precision = train.get("precision", "auto")
        if precision == "auto":
            precision = "fp32" if budget.gpu_gib is None else "bf16"
        evaluation = {**(evaluation or {}), "quantize": (train.get("lora") or {}).get("quantize", "none")}
        ev = plan_evaluation(arch, evaluation, max_length=max_length, precision=precision, budget=budget)
        status = ev.get("message") or f"evaluate: batch size {ev['batch_size']}"
        plan.update(evaluate=ev, fits=ev["fits"], message=ev.get("message"), status=status)
        plan["model"].update(params=arch.params())
        return plan
    capped = gpu_memory_gib is not None
    stage = plan_training(
        arch, train, max_length, deepspeed_config, budget, candidate_files, objective, capped
    )
    plan.update(stage)
    plan["model"].update(
        params=stage["configured"]["estimate"]["params"],
        trainable=stage["configured"]["estimate"]["trainable"],
    )
    return plan


def _check_plannable(arch, source: str, train: dict, gpu_memory_gib, budget: Budget, objective: str) -> None:
    """PlanError where the config asks for a plan (train.strategy auto, or a memory cap) that cannot be made."""
    auto = train.get("strategy") == "auto" and objective != "evaluate"
    if arch is None and (auto or gpu_memory_gib is not None):
        asked = "train.strategy: auto" if auto else f"gpu_memory_gib: {gpu_memory_gib:g}"
        raise PlanError(
            f"{asked} needs the model's architecture, which is not known here: {source}. Make its config.json "
            "available (a hub-format directory as model.base, or run once with network access so that the hub "
            "cache has it), or remove the setting"
        )
    if auto and budget.gpu_gib is None:
        raise PlanError(
            "train.strategy: auto picks the fastest strategy that fits the GPUs, but there is no GPU memory to plan "
            "for: no CUDA device is visible and gpu_memory_gib is not set. Set gpu_memory_gib (GiB, or a card: "
            "rtx4090, h200) or train.strategy: as_configured"
        )


def as_configured(train: dict, deepspeed_config: str, gpu_memory_gib: float | None, why: str) -> dict:
    """A plan that checks nothing and chooses nothing: the stage runs as configured, under the memory cap."""
    return {**_unplanned(train, deepspeed_config, why), "gpu_memory_gib": gpu_memory_gib}


def _unplanned(train: dict, deepspeed_config: str, source: str) -> dict:
    chosen = {
        "name": "as configured",
        "deepspeed_config": deepspeed_config,
        "gradient_checkpointing": bool(train.get("gradient_checkpointing")),
    }
    return {
        "strategy": train.get("strategy", "as_configured"),
        "train_precision": train.get("precision", "auto"),
        "fits": None,
        "status": source,
        "chosen": chosen,
        "candidates": [],
        "message": None,
    }


def plan_training(
    arch: Arch,
    train: dict,
    max_length: int,
    deepspeed_config: str,
    budget: Budget,
    candidate_files: dict[str, str] | None,
    objective: str = "sft",
    capped: bool = False,
) -> dict:
    """One training stage's plan: the configured strategy, the candidates, the one chosen (train.strategy),
    whether it fits and, if not, what would; against a GPU budget also the longest row that fits (`longest_row`:
    a tokenize.max_length beyond it is refused naming it). `capped`: gpu_memory_gib is set (the ranks then use
    expandable segments, snaketune.device_memory)."""
    strategy = train.get("strategy", "as_configured")
    precision = train.get("precision", "auto")
    if precision == "auto":
        precision = "fp32" if budget.gpu_gib is None else "bf16"
    world = int(train["gpus"]) * int(train.get("nodes", 1))  # train.gpus is per node
    common = dict(world=world, seq_len=max_length, precision=precision, objective=objective, capped=capped)
    # A ConfigError where train.gradient_checkpointing names more layers than the model has.
    checkpointed_layers(train.get("gradient_checkpointing"), arch.layers)
    ds = json.loads(Path(deepspeed_config).read_text())
    training = Training(arch, train, ds, deepspeed_config, budget, candidate_files, common)
    configured, candidates, pick = weigh(training)
    chosen = _chosen(pick, train, deepspeed_config, budget)
    stage = {
        "strategy": strategy,
        "train_precision": train.get("precision", "auto"),
        "precision": precision,
        "seq_len": max_length,
        "configured": configured,
        "candidates": candidates,
        "chosen": chosen,
        "message": None,
    }
    fits = None if budget.gpu_gib is None else bool(pick and pick["fits"])
    if budget.gpu_gib is not None and objective == "sft":
        stage["longest_row"] = longest_row(training)
    if fits is False:
        stage["message"] = not_fitting_message(stage, arch, train, ds, common, budget, candidate_files)
        if stage.get("longest_row") and max_length > stage["longest_row"]["max_length"]:
            too_long = _too_long(stage, training)
            stage["message"] = f"{stage['message']} {too_long}".rstrip()
        stage["status"] = "does not fit"
    elif fits:
        stage["status"] = f"fits: {chosen['name']} on {world} x {budget.gpu_gib:.1f} GiB"
    else:
        stage["status"] = budget.source
    stage["fits"] = fits
    return stage


ROW_STEP = 256
"""The longest row is searched in steps of this many tokens (snaketune.model.sizes.CHUNK_ALIGN)."""
MAX_ROW = 2**20
"""Rows are not searched beyond this (a million tokens)."""


def longest_row(training: Training) -> dict:
    """The longest tokenize.max_length (a multiple of ROW_STEP) at which this training fits the budget, as it would
    run there: with train.strategy auto whatever the plan would pick at that length (fewer micro-batches,
    checkpointing, activation offload, 8-bit states...), else as configured. A binary search over the memory model,
    whose peak grows with the row. {"max_length": 0, ...} where not even ROW_STEP tokens fit."""

    def pick_at(rows: int) -> dict | None:
        pick = weigh(training.replace(common={**training.common, "seq_len": rows}))[2]
        return pick if pick and pick["fits"] else None

    lo, hi, best = 0, MAX_ROW // ROW_STEP, None
    while lo < hi:  # the largest m with pick_at(m * ROW_STEP); lo always fits (0: nothing)
        mid = (lo + hi + 1) // 2
        found = pick_at(mid * ROW_STEP)
        if found:
            lo, best = mid, found
        else:
            hi = mid - 1
    if best is None:
        return {"max_length": 0, "strategy": None, "gpu_gib": None}
    return {
        "max_length": lo * ROW_STEP,
        "strategy": best["name"],
        "gradient_checkpointing": best["gradient_checkpointing"],
        "micro_batch_size": best["setup"]["micro_batch"],
        "offload_activations": best["setup"]["offload_activations"],
        "gpu_gib": best["estimate"]["gpu_gib"],
    }


def _too_long(stage: dict, training: Training) -> str:
    """What the refusal of a tokenize.max_length beyond the longest row that fits adds: that row and how it would
    run; where train.strategy is as configured, what `auto` (fewer micro-batches, checkpointing, activation offload)
    would reach; where the loss is not the chunked one, what train.fused_cross_entropy would reach. "" where no row
    length fits as configured (the message before it says what would)."""
    train, longest = training.train, stage["longest_row"]
    if not longest["max_length"]:
        return ""  # no row length fits as configured: the row is not what to change
    parts = []
    if longest["max_length"]:
        parts.append(
            f"{longest['max_length']:,} tokens as configured ({longest['strategy']}, {longest['gpu_gib']:.1f} GiB "
            "per GPU)"
        )
    if train.get("strategy", "as_configured") != "auto":
        auto = longest_row(training.replace(train={**train, "strategy": "auto"}))
        if auto["max_length"] > longest["max_length"]:
            parts.append(f"{auto['max_length']:,} with train.strategy: auto ({auto['strategy']})")
    if not train.get("fused_cross_entropy") and zero_stage(training.ds) != 3:
        fused = longest_row(training.replace(train={**train, "fused_cross_entropy": True}))
        if fused["max_length"] > longest["max_length"]:
            parts.append(
                f"{fused['max_length']:,} with train.fused_cross_entropy: true (the loss chunk by chunk)"
            )
    if not parts:
        return ""
    return (
        f"tokenize.max_length {training.common['seq_len']:,} is longer than the longest row that fits: "
        + "; ".join(parts)
        + "."
    )


def _chosen(pick: dict | None, train: dict, deepspeed_config: str, budget: Budget | None = None) -> dict:
    """What the train rule runs: the picked candidate's strategy, micro-batch and optimizer, or the configuration
    as it is where nothing was picked; `why` says so in a line, with the predicted device peak."""
    if pick is None:
        return {
            "name": "as configured",
            "deepspeed_config": deepspeed_config,
            "gradient_checkpointing": train.get("gradient_checkpointing", False),
        }
    chosen = {k: pick[k] for k in ("name", "deepspeed_config", "gradient_checkpointing")}
    chosen["micro_batch_size"] = pick["setup"]["micro_batch"]
    chosen["optimizer_states"] = (
        "4bit" if pick["setup"]["states_4bit"] else "8bit" if pick["setup"]["states_8bit"] else "fp32"
    )
    chosen["optimizer_step"] = "in_backward" if pick["setup"]["in_backward"] else "after_backward"
    chosen["offload_activations"] = pick["setup"]["offload_activations"]
    chosen["estimate"] = pick["estimate"]
    if budget is not None and budget.gpu_gib is not None:
        est = pick["estimate"]
        chosen["why"] = (
            f"{pick['name']}: {est['gpu_gib']:.2f} GiB per GPU predicted ({est['peak_allocated_gib']:.2f} allocated)"
            f" of {budget.gpu_gib:.2f}"
            + (
                f", the fastest that fits (relative speed {pick['relative_speed']:.3f})"
                if "relative_speed" in pick
                else ""
            )
        )
    return chosen


def format_table(plan: dict) -> str:
    """The plan as a text table for the log."""
    rows = ([plan["configured"]] if plan.get("configured") else []) + plan.get("candidates", [])
    lines = [
        f"model {plan['model']['base']} ({plan['model'].get('source')}): "
        f"{plan['model'].get('params', 0):,} parameters, {plan['model'].get('trainable', 0):,} trained",
        f"budget: {plan['budget']['source']}; host RAM {plan['budget'].get('host_gib') or 0:.0f} GiB",
        f"{'strategy':<26}{'speed':>6}{'peak alloc':>12}{'per GPU':>10}{'host':>8}  phase / fits",
    ]
    for r in rows:
        e = r["estimate"]
        name = r["name"] + (" (configured)" if r.get("configured") else "")
        speed = f"{r['relative_speed']:.2f}" if "relative_speed" in r else "-"
        lines.append(
            f"{name:<26}{speed:>6}{e['peak_allocated_gib']:>10.1f}Gi{e['gpu_gib']:>8.1f}Gi"
            f"{e['host_gib']:>6.0f}Gi  {e['peak_phase']} / {r['fits']}"
        )
    if plan.get("evaluate"):
        ev = plan["evaluate"]
        e = ev["estimate"]
        lines.append(
            f"{'evaluate':<26}{'-':>6}{e['peak_allocated_gib']:>10.1f}Gi{e['gpu_gib']:>8.1f}Gi{0:>6.0f}Gi  "
            f"batch {ev['batch_size']} (eval.batch_size {ev['requested_batch_size']}) / {ev['fits']}"
        )
    lines.append(f"chosen: {plan['chosen']['name']} ({plan['chosen']['deepspeed_config']}); {plan['status']}")
    if plan["chosen"].get("why"):
        lines.append(f"why: {plan['chosen']['why']}")
    if plan.get("longest_row", {}).get("max_length"):
        longest = plan["longest_row"]
        lines.append(
            f"longest row that fits: tokenize.max_length {longest['max_length']:,} ({longest['strategy']})"
        )
    return "\n".join(lines)


DEEPSPEED_DIR = Path("config/deepspeed")


def candidate_files(root: str | Path = DEEPSPEED_DIR) -> dict[str, str]:
    """The shipped DeepSpeed files that train.strategy auto chooses among (STRATEGIES), name -> path, those that
    exist under `root`."""
    names = sorted({s.deepspeed_file for s in STRATEGIES})
    return {name: str(Path(root) / name) for name in names if (Path(root) / name).is_file()}


def stage_plan(*, out: str | Path | None = None, **kwargs) -> dict:
    """A stage's plan, made where the stage starts (snaketune.train.launch, the evaluate stage) from the same
    settings and code as its plan rule's, against the GPUs this machine offers: its strategy (train.strategy auto),
    memory cap and batch size. The plan rules' files are the preflight check and the record; no stage reads them,
    so that a plan rerun for where a stage runs never reruns the stage (a Snakemake input that an upstream rerun
    marks updated would). Refuses, as the plan rule does, what does not fit; `out` also writes it."""
    plan = make_plan(budget=detect_budget(kwargs["gpu_memory_gib"]), **kwargs)
    if plan.get("configured"):
        log.info("memory plan for %s:\n%s", plan["experiment"], format_table(plan))
    if plan["fits"] is False:
        raise PlanError(plan["message"])
    if out is not None:
        from snaketune.io import write_json

        write_json(out, plan)
    return plan


def write_plan(*, out: str | Path, **kwargs) -> dict:
    """The plan rule: make the plan, log it, refuse a training that does not fit, write the JSON."""
    from snaketune.io import write_json

    gpu_memory_gib = kwargs["gpu_memory_gib"]
    budget = kwargs.pop("budget", None) or detect_budget(gpu_memory_gib)
    plan = make_plan(budget=budget, **kwargs)
    if plan.get("configured"):
        log.info("memory plan for %s:\n%s", plan["experiment"], format_table(plan))
    else:
        log.info("memory plan for %s: %s", plan["experiment"], plan["status"])
    if plan["fits"] is False:
        raise PlanError(plan["message"])
    write_json(out, plan)
    return plan
