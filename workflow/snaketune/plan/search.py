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

from snaketune.config.schema import checkpointed_layers
from snaketune.plan.advice import not_fitting_message
from snaketune.plan.arch import Arch, resolve_arch
from snaketune.plan.budget import Budget, detect_budget
from snaketune.plan.memory import (
    EvalEstimate,
    EvalSetup,
    Setup,
    estimate,
    estimate_eval,
)
from snaketune.plan.setups import plan_entry, setup_for
from snaketune.plan.strategies import (  # noqa: F401 - the plan's public names include the strategies'
    MICRO_SPEED,
    MICRO_SPEED_LORA,
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
    stage = plan_training(arch, train, max_length, deepspeed_config, budget, candidate_files, objective)
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
) -> dict:
    """One training stage's plan: the configured strategy, the candidates, the one chosen (train.strategy),
    whether it fits and, if not, what would."""
    strategy = train.get("strategy", "as_configured")
    precision = train.get("precision", "auto")
    if precision == "auto":
        precision = "fp32" if budget.gpu_gib is None else "bf16"
    world = int(train["gpus"]) * int(train.get("nodes", 1))  # train.gpus is per node
    common = dict(world=world, seq_len=max_length, precision=precision, objective=objective)
    # A ConfigError where train.gradient_checkpointing names more layers than the model has.
    checkpointed_layers(train.get("gradient_checkpointing"), arch.layers)
    ds = json.loads(Path(deepspeed_config).read_text())
    setup = setup_for(train, ds, **common)
    configured = plan_entry(
        strategy_name(setup), deepspeed_config, setup, estimate(arch, setup), budget, configured=True
    )
    candidates = _candidates(arch, train, setup, budget, candidate_files, common)
    if strategy == "auto" and budget.gpu_gib is not None:
        pick = next((c for c in candidates if c["fits"]), None)
    else:
        pick = configured
    chosen = _chosen(pick, train, deepspeed_config)
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
    if fits is False:
        stage["message"] = not_fitting_message(stage, arch, train, ds, common, budget, candidate_files)
        stage["status"] = "does not fit"
    elif fits:
        stage["status"] = f"fits: {chosen['name']} on {world} x {budget.gpu_gib:.1f} GiB"
    else:
        stage["status"] = budget.source
    stage["fits"] = fits
    return stage


def _candidates(
    arch: Arch,
    train: dict,
    setup: Setup,
    budget: Budget,
    candidate_files: dict[str, str] | None,
    common: dict,
) -> list[dict]:
    """The strategies of `candidate_files` for this training, fastest first (with `train.strategy: auto` each at its
    largest fitting micro-batch, and a full fine-tune's with 8-bit states and with the step in backward too)."""
    strategy = train.get("strategy", "as_configured")
    lora = bool((train.get("lora") or {}).get("enabled"))
    candidates = []
    for strat in candidate_strategies(lora, setup.states_8bit) if candidate_files else []:
        path = candidate_files.get(strat.deepspeed_file)
        if path is None:
            continue
        ds = json.loads(Path(path).read_text())
        s = setup_for(train, ds, gradient_checkpointing=strat.gradient_checkpointing, **common)
        speed = strat.relative_speed
        if strategy == "auto":
            s, speed = _largest_fitting_micro(arch, s, budget, speed)
        name = strategy_name(s, micro=setup.micro_batch)
        candidates.append(plan_entry(name, path, s, estimate(arch, s), budget, relative_speed=speed))
    if strategy == "auto" and not lora and not setup.states_8bit and not setup.in_backward:
        candidates = _with_8bit_states(candidates, arch, budget)
        candidates += _with_backward_step(candidates, arch, budget, setup)
    return _by_speed(candidates)


def _chosen(pick: dict | None, train: dict, deepspeed_config: str) -> dict:
    """What the train rule runs: the picked candidate's strategy, micro-batch and optimizer, or the configuration
    as it is where nothing was picked."""
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
    chosen["estimate"] = pick["estimate"]
    return chosen


def _with_8bit_states(candidates: list[dict], arch: Arch, budget: Budget) -> list[dict]:
    """`train.strategy: auto` of a full fine-tune with fp32 states: each strategy without offload again with
    8-bit states (snaketune.train.adam8bit), ranked after every fp32 one without offload and before offload: exact
    fp32 states wherever they fit, 8-bit ones (SPEED_8BIT, slightly different arithmetic) before CPU offload
    (10x slower, docs/facts.md)."""
    exact = [c for c in candidates if not c["estimate"]["offload"]]
    offloaded = [c for c in candidates if c["estimate"]["offload"]]
    quantized = []
    for c in exact:
        s = Setup(**{**c["setup"], "lora_targets": tuple(c["setup"]["lora_targets"]), "states_8bit": True})
        quantized.append(
            plan_entry(
                c["name"] + "+8bit",
                c["deepspeed_config"],
                s,
                estimate(arch, s),
                budget,
                relative_speed=round(c["relative_speed"] * SPEED_8BIT, 3),
            )
        )
    return exact + quantized + offloaded


def _with_backward_step(candidates: list[dict], arch: Arch, budget: Budget, configured: Setup) -> list[dict]:
    """`train.strategy: auto` of a full fine-tune: ZeRO-0 without and with checkpointing again with the optimizer
    step in backward and 4-bit states (snaketune.train.backward_step), at the micro-batch that makes one per rank and
    step (it cannot accumulate), ranked after the 8-bit ones and before offload (SPEED_IN_BACKWARD)."""
    global_batch = configured.micro_batch * configured.world * configured.accumulation
    if global_batch % configured.world:
        return []
    out = []
    for c in candidates:
        if c["estimate"]["offload"] or c["setup"]["zero_stage"] != 0 or c["setup"]["states_8bit"]:
            continue
        fields = {**c["setup"], "lora_targets": tuple(c["setup"]["lora_targets"])}
        fields.update(
            in_backward=True,
            states_4bit=True,
            master_weights=False,
            accumulation=1,
            micro_batch=global_batch // configured.world,
        )
        s = Setup(**fields)
        out.append(
            plan_entry(
                strategy_name(s, micro=configured.micro_batch),
                c["deepspeed_config"],
                s,
                estimate(arch, s),
                budget,
                relative_speed=round(c["relative_speed"] * SPEED_IN_BACKWARD, 3),
            )
        )
    return out


def _largest_fitting_micro(arch: Arch, s: Setup, budget: Budget, speed: float) -> tuple[Setup, float]:
    """`train.strategy: auto`: a setup that does not fit at its micro-batch size, at the largest halving that fits
    with the same global batch (micro_batch x ranks x accumulation), and its relative speed (MICRO_SPEED or
    MICRO_SPEED_LORA per halving); unchanged where the configured size fits or none does."""
    if budget.gpu_gib is None or budget.fits(estimate(arch, s)):
        return s, speed
    global_batch = s.micro_batch * s.world * s.accumulation
    micro, halvings = s.micro_batch, 0
    while micro > 1 and micro % 2 == 0:
        micro, halvings = micro // 2, halvings + 1
        per_step = micro * s.world
        if global_batch % per_step:
            break
        smaller = s.replace(micro_batch=micro, accumulation=global_batch // per_step)
        if budget.fits(estimate(arch, smaller)):
            per_halving = MICRO_SPEED_LORA if s.lora_rank else MICRO_SPEED
            return smaller, round(speed * per_halving**halvings, 3)
    return s, speed


def _by_speed(candidates: list[dict]) -> list[dict]:
    """Fastest first within each group, the groups in _with_8bit_states' order (fp32 states, 8-bit states,
    offload): the micro-batch halvings of `_largest_fitting_micro` run slower than their strategy's figure."""

    def group(c: dict) -> int:
        if c["estimate"]["offload"]:
            return 3
        return 2 if c["setup"].get("in_backward") else int(bool(c["setup"]["states_8bit"]))

    return sorted(candidates, key=lambda c: (group(c), -c["relative_speed"]))


def plan_evaluation(arch: Arch, evaluation: dict, *, max_length: int, precision: str, budget: Budget) -> dict:
    """The evaluate stage's memory at eval.batch_size and, where that does not fit, the largest batch size that
    does (halving): the stage then runs with it (`batch_size`), so a recipe that fits training never dies in
    evaluation. Planned for the longest inputs there can be: validation rows and prompts of tokenize.max_length
    (the stage records its own estimate for the lengths it meets beside the measured peak)."""
    requested = int(evaluation["batch_size"])
    new_tokens = int(evaluation["max_new_tokens"])

    def at(batch: int) -> EvalEstimate:
        setup = EvalSetup(
            batch=batch,
            seq_len=max_length,
            prompt_len=max_length,
            new_tokens=new_tokens,
            precision="fp32" if precision == "fp32" else "bf16",
            varlen=precision == "bf16",
            quantized=evaluation.get("quantize", "none") != "none",
        )
        return estimate_eval(arch, setup)

    batch, est = requested, at(requested)
    if budget.gpu_gib is not None:
        while est.gpu_gib > budget.gpu_gib and batch > 1:
            batch //= 2
            est = at(batch)
    fits = None if budget.gpu_gib is None else est.gpu_gib <= budget.gpu_gib
    out = {"requested_batch_size": requested, "batch_size": batch, "estimate": est.as_dict(), "fits": fits}
    if fits is False:
        out["message"] = (
            f"evaluation does not fit {budget.gpu_gib:.1f} GiB ({budget.source}): one {arch.params():,}-parameter "
            f"model in {precision} needs {est.gpu_gib:.1f} GiB per GPU at eval.batch_size 1 with "
            f"{max_length} tokens (weights {est.weights_gib:.1f} GiB); use larger GPUs or a shorter "
            "tokenize.max_length"
        )
    elif batch < requested:
        log.info(
            "evaluation: eval.batch_size %d needs more than %.1f GiB; the evaluate stage uses %d",
            requested,
            budget.gpu_gib,
            batch,
        )
    return out


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
