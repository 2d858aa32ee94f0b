"""Using a plan: the train and dpo jobs take its strategy (`apply_plan`, for `train.strategy: auto`), and the
launcher checks it again against the GPUs a job is actually given (`check_devices`)."""

from __future__ import annotations

import math

from snaketune.device_memory import usable_gib
from snaketune.plan.arch import Arch
from snaketune.plan.budget import Budget
from snaketune.plan.memory import Setup, estimate


def apply_plan(run_spec: dict, plan: dict) -> dict:
    """The run spec with the plan's strategy (train.strategy: auto); its run key then names that strategy
    too, so a run never resumes a checkpoint written under another ZeRO stage."""
    from snaketune.io import sha256_file, sha256_text, stable_json

    chosen = plan["chosen"]
    current = run_spec["train"]
    states = chosen.get("optimizer_states", current.get("optimizer_states", "fp32"))
    step = chosen.get("optimizer_step", current.get("optimizer_step", "after_backward"))
    micro = chosen.get("micro_batch_size", current["micro_batch_size"])
    offload = chosen.get("offload_activations", current.get("offload_activations", False))
    same = (chosen["deepspeed_config"], chosen["gradient_checkpointing"], states, step, micro, offload) == (
        run_spec["deepspeed_config"],
        current["gradient_checkpointing"],
        current.get("optimizer_states", "fp32"),
        current.get("optimizer_step", "after_backward"),
        current["micro_batch_size"],
        current.get("offload_activations", False),
    )
    if plan.get("strategy") != "auto" or same:
        return run_spec
    train = {
        **current,
        "gradient_checkpointing": chosen["gradient_checkpointing"],
        "optimizer_states": states,
        "optimizer_step": step,
        "micro_batch_size": micro,
        "offload_activations": offload,
    }
    named = [run_spec["run_key"], chosen["name"], sha256_file(chosen["deepspeed_config"])]
    run_key = sha256_text(stable_json(named))[:16]
    return {**run_spec, "train": train, "deepspeed_config": chosen["deepspeed_config"], "run_key": run_key}


def check_devices(
    plan: dict | None, *, world: int, device_gib: float, host_gib: float | None
) -> tuple[bool, str]:
    """The launcher's check of the plan's chosen strategy against the GPUs a job was given, for the world
    size it really got (Snakemake may grant fewer GPUs than train.gpus). (fits, log line or message)."""
    if not plan or not plan.get("arch") or "setup" not in (plan.get("configured") or {}):
        return True, "memory plan: not available for this model, not checked"
    arch = Arch(**plan["arch"])
    chosen = plan["chosen"]
    entry = next(
        (c for c in [plan["configured"], *plan["candidates"]] if c["name"] == chosen["name"]),
        plan["configured"],
    )
    setup = Setup(**{**entry["setup"], "lora_targets": tuple(entry["setup"]["lora_targets"]), "world": world})
    if setup.precision == "fp32" and plan["train_precision"] == "auto":
        setup = setup.replace(precision="bf16")  # planned without a GPU; the ranks use bf16 on CUDA
    est = estimate(arch, setup)
    cap = plan.get("gpu_memory_gib")
    gib = usable_gib(min(device_gib, cap) if cap else device_gib)
    budget = Budget(
        gib,
        f"{device_gib:.1f} GiB GPUs"
        + (f", gpu_memory_gib {cap:g}" if cap else "")
        + f": {gib:.1f} GiB usable",
        host_gib,
    )
    fits = budget.fits(est)
    line = (
        f"memory plan: {entry['name']} on {world} GPU(s) needs {est.peak_allocated_gib:.1f} GiB allocated, "
        f"{est.gpu_gib:.1f} GiB per GPU with CUDA context and fragmentation; {budget.source}"
    )
    if est.offload:
        line += f"; host {est.host_gib:.0f} GiB of {host_gib or math.nan:.0f}"
    if fits:
        return True, line
    return False, (
        f"{line}: does not fit. Set gpu_memory_gib: {min(device_gib, cap or device_gib):g} so that the plan rule can choose (train.strategy: "
        "auto), or see results/plan/ for what fits"
    )
