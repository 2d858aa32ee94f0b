"""What would fit, when a training does not: the plan's message names the fastest strategy that fits, LoRA,
smaller micro-batches, 8-bit Adam states, the step in backward, more GPUs (snaketune.plan.search calls it)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from snaketune.plan.arch import Arch
from snaketune.plan.budget import Budget
from snaketune.plan.memory import ENV_HOST_MEMORY, HOST_USABLE, Estimate, Setup, estimate
from snaketune.plan.setups import format_entry, setup_for
from snaketune.plan.strategies import STRATEGY_FILES, candidate_strategies


def _fastest_fitting(
    arch: Arch, train: dict, files: dict[str, str], common: dict, budget: Budget
) -> tuple[str, Setup, Estimate] | None:
    """The fastest strategy (STRATEGIES order) that fits `budget` with these train settings (ZeRO-0 only for the
    step in backward, which runs nowhere else)."""
    lora = bool((train.get("lora") or {}).get("enabled"))
    in_backward = train.get("optimizer_step") == "in_backward"
    for strat in candidate_strategies(lora, train.get("optimizer_states", "fp32") == "8bit"):
        if strat.deepspeed_file not in files or (
            in_backward and not strat.deepspeed_file.startswith("zero0")
        ):
            continue
        ds = json.loads(Path(files[strat.deepspeed_file]).read_text())
        s = setup_for(train, ds, gradient_checkpointing=strat.gradient_checkpointing, **common)
        e = estimate(arch, s)
        if budget.fits(e):
            return strat.name + ("+in_backward" if s.in_backward else ""), s, e
    return None


def not_fitting_message(
    plan: dict,
    arch: Arch,
    train: dict,
    ds: dict,
    common: dict,
    budget: Budget,
    candidate_files: dict[str, str] | None,
) -> str:
    """'... zero2 needs 113.8 GiB per GPU as configured. What would fit: zero3_offload needs 9.6 GiB per GPU
    and 98 GiB host RAM (...); LoRA (train.lora.enabled: true) with zero2 needs 16.2 GiB per GPU.'

    Tried in this order, each with the fastest strategy that fits, at most four kept: the configured
    training with another strategy, with 8-bit Adam states, with the step in backward and 4-bit states (one
    micro-batch per step), LoRA instead of full fine-tuning, micro_batch_size 1,
    LoRA and micro_batch_size 1, more GPUs.
    """
    configured = plan["configured"]
    world = common["world"]
    head = f"train.gpus {world} x {budget.gpu_gib:.1f} GiB ({budget.source})"
    if budget.host_gib is not None:
        head += f", {budget.host_gib:.0f} GiB host RAM"
    where = configured["deepspeed_config"] + (
        ", gradient checkpointing on" if configured["gradient_checkpointing"] else ""
    )
    text = f"{head}: {format_entry(configured)} as configured ({where})"
    if plan["strategy"] == "auto":
        text = f"{head}: no strategy fits; {format_entry(configured)} as configured ({where})"
    files = dict(candidate_files or {})
    files.setdefault(Path(configured["deepspeed_config"]).name, configured["deepspeed_config"])
    would = _what_would_fit(arch, train, files, common, budget)
    text += _host_short(plan, budget)
    if would:
        return f"{text}. What would fit: " + "; ".join(would) + "."
    return f"{text}. Nothing tried fits: use more or larger GPUs, a shorter tokenize.max_length or LoRA."


def _variants(train: dict, world: int) -> list[tuple[str, dict]]:
    """The trainings to try in `not_fitting_message`'s order: (how the message names the change, the train config)."""
    full = not (train.get("lora") or {}).get("enabled")
    lora_train = {**train, "lora": {**(train.get("lora") or {}), "enabled": True}}
    micro = int(train["micro_batch_size"])
    variants = [("", train)]
    if full and train.get("optimizer_states", "fp32") != "8bit":
        variants.append(
            ("8-bit Adam states (train.optimizer_states: 8bit) with ", {**train, "optimizer_states": "8bit"})
        )
    global_batch = int(train.get("global_batch_size", micro * world))
    if full and train.get("optimizer_step") != "in_backward" and global_batch % world == 0:
        one_micro = global_batch // world
        label = (
            "the step in backward with 4-bit states (train.optimizer_step: in_backward, optimizer_states: "
            f"4bit, micro_batch_size {one_micro}: it cannot accumulate) with "
        )
        changes = {"optimizer_step": "in_backward", "optimizer_states": "4bit", "micro_batch_size": one_micro}
        variants.append((label, {**train, **changes}))
    if full:
        variants.append(("LoRA (train.lora.enabled: true) with ", lora_train))
    if micro > 1:
        variants.append(("micro_batch_size 1 with ", {**train, "micro_batch_size": 1}))
        if full:
            variants.append(("LoRA and micro_batch_size 1 with ", {**lora_train, "micro_batch_size": 1}))
    return variants


def _what_would_fit(
    arch: Arch, train: dict, files: dict[str, str], common: dict, budget: Budget
) -> list[str]:
    """At most four variants that fit, each with its fastest strategy; failing all, the fewest GPUs that would do."""
    would = []
    for label, variant in _variants(train, common["world"]):
        found = _fastest_fitting(arch, variant, files, common, budget)
        if found:
            name, s, e = found
            hint = ""
            if not label:
                hint = (
                    f" (train.deepspeed: {files[STRATEGY_FILES[name]]}, gradient_checkpointing: "
                    f"{str(s.gradient_checkpointing).lower()}; or train.strategy: auto)"
                )
            entry = format_entry({"name": name, "setup": dataclasses.asdict(s), "estimate": e.as_dict()})
            would.append(label + entry + hint)
        if len(would) == 4:
            return would
    if not would:
        for more in (2, 4, 8, 16, 32, 64):
            if more > common["world"]:
                found = _fastest_fitting(arch, train, files, {**common, "world": more}, budget)
                if found:
                    name, s, e = found
                    return [f"{name} on {more} GPUs needs {e.gpu_gib:.1f} GiB per GPU"]
    return would


def _host_short(plan: dict, budget: Budget) -> str:
    """A strategy that fits the GPUs but not the host is worth naming: more RAM would do."""
    host_short = [
        c
        for c in plan["candidates"]
        if not c["fits"] and c["estimate"]["offload"] and c["estimate"]["gpu_gib"] <= budget.gpu_gib
    ]
    if not host_short or budget.host_gib is None:
        return ""
    c = host_short[0]
    return (
        f"; {c['name']} would fit the GPUs ({c['estimate']['gpu_gib']:.1f} GiB) but needs "
        f"{c['estimate']['host_gib']:.0f} GiB host RAM ({HOST_USABLE:.0%} of {budget.host_gib:.0f} GiB "
        f"is usable; {ENV_HOST_MEMORY} overrides the RAM)"
    )
