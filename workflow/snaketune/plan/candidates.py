"""What `train.strategy: auto` weighs (snaketune.plan.search): the strategies of snaketune.plan.strategies for one
training, each at its best micro-batch and checkpointing, with 8-bit states, the step in backward and activation
offload where those make it fit, fastest first; and the pick."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from snaketune.plan.arch import Arch
from snaketune.plan.budget import Budget
from snaketune.plan.memory import Setup, counted, estimate
from snaketune.plan.setups import plan_entry, setup_for
from snaketune.plan.strategies import (
    CHECKPOINTED,
    MICRO_SPEED,
    MICRO_SPEED_LORA,
    OFFLOAD_ACTIVATIONS_SPEED,
    PICK_MARGIN_GIB,
    SPEED_8BIT,
    SPEED_IN_BACKWARD,
    candidate_strategies,
    checkpointed_speed,
    strategy_name,
)


@dataclasses.dataclass(frozen=True)
class Training:
    """One training stage as its plan weighs it: the architecture, the train section, the DeepSpeed file (its path
    and contents), the GPU budget, the candidate strategies' files, and `common`, the run's shape (world, seq_len,
    precision, objective, capped). `longest_row` weighs it again at other row lengths and settings (`replace`)."""

    arch: Arch
    train: dict
    ds: dict
    deepspeed_config: str
    budget: Budget
    candidate_files: dict[str, str] | None
    common: dict

    def replace(self, **changes) -> Training:
        return dataclasses.replace(self, **changes)


def weigh(t: Training) -> tuple[dict, list[dict], dict | None]:
    """(the configured entry, the candidates, the pick): what the stage runs at common["seq_len"]."""
    arch, train, deepspeed_config, budget, common = t.arch, t.train, t.deepspeed_config, t.budget, t.common
    setup = setup_for(train, t.ds, **common)
    configured = plan_entry(
        strategy_name(setup), deepspeed_config, setup, estimate(arch, setup), budget, configured=True
    )
    candidates = _candidates(arch, train, setup, budget, t.candidate_files, common)
    if train.get("strategy", "as_configured") == "auto" and budget.gpu_gib is not None:
        return configured, candidates, next((c for c in candidates if c["fits"]), None)
    return configured, candidates, configured


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
        # The same stage without checkpointing (what the number of checkpointed layers is weighed against).
        base = speed / CHECKPOINTED if strat.gradient_checkpointing else speed
        if strategy == "auto" and strat.gradient_checkpointing and counted(s) and s.expandable_segments:
            s, speed = _fastest_checkpointing(arch, s, budget, base)
        elif strategy == "auto":
            s, speed = _largest_fitting_micro(arch, s, budget, speed)
        name = strategy_name(s, micro=setup.micro_batch)
        entry = plan_entry(name, path, s, estimate(arch, s), budget, relative_speed=speed)
        candidates.append(entry)
        if strategy == "auto" and strat.gradient_checkpointing and not entry["fits"]:
            candidates += _offloading_activations(arch, s, budget, path, base, setup.micro_batch)
    if strategy == "auto" and not lora and not setup.states_8bit and not setup.in_backward:
        candidates = _with_8bit_states(candidates, arch, budget)
        candidates += _with_backward_step(candidates, arch, budget, setup)
    return _by_speed(candidates)


def _fastest_checkpointing(arch: Arch, s: Setup, budget: Budget, speed: float) -> tuple[Setup, float]:
    """`train.strategy: auto`, a checkpointing strategy whose memory the model counts (snaketune.plan.memory.counted)
    on ranks with expandable segments (gpu_memory_gib set: what they reserve is what they allocate):
    the fastest pair of checkpointed layers (the first N, 1..all) and micro-batch (the configured one, its halvings
    and doublings with the same global batch) that fits, by `checkpointed_speed` and MICRO_SPEED(_LORA) per halving
    against `speed`, that of the same stage without checkpointing. Fewer than every layer must leave PICK_MARGIN_GIB
    of the budget. Every layer at the configured micro-batch where nothing fits (the entry then says it does not)."""
    lora = bool(s.lora_rank)
    per_halving = MICRO_SPEED_LORA if lora else MICRO_SPEED
    every = s.replace(checkpoint_layers=None)
    best = (every, round(speed * checkpointed_speed(lora, arch.layers, arch.layers), 3))
    if budget.gpu_gib is None:
        return best
    found = None
    for micro, halvings in _micro_sizes(s):
        at = s.replace(micro_batch=micro, accumulation=s.micro_batch * s.accumulation // micro)
        for n in range(1, arch.layers + 1):  # fewer layers checkpointed: faster, more memory
            candidate = at.replace(checkpoint_layers=None if n == arch.layers else n)
            est = estimate(arch, candidate)
            margin = 0.0 if n == arch.layers else PICK_MARGIN_GIB
            if budget.fits(est) and est.gpu_gib <= budget.gpu_gib - margin:
                v = speed * per_halving**halvings * checkpointed_speed(lora, arch.layers, n)
                if found is None or v > found[1]:
                    found = (candidate, round(v, 3))
                break  # the first that fits is this micro-batch's fastest
    return found or best


def _micro_sizes(s: Setup) -> list[tuple[int, int]]:
    """(micro-batch, halvings against the configured one; negative: doublings) with the same global batch: every
    power-of-two multiple or fraction of the configured micro-batch that divides the batch per rank and step."""
    per_rank = s.micro_batch * s.accumulation
    sizes = [(s.micro_batch, 0)]
    micro, halvings = s.micro_batch, 0
    while micro % 2 == 0:
        micro, halvings = micro // 2, halvings + 1
        sizes.append((micro, halvings))
    micro, halvings = s.micro_batch, 0
    while per_rank % (micro * 2) == 0:
        micro, halvings = micro * 2, halvings - 1
        sizes.append((micro, halvings))
    return sizes


def _offloading_activations(
    arch: Arch, s: Setup, budget: Budget, path: str, base: float, micro: int
) -> list[dict]:
    """`train.strategy: auto`: a checkpointing candidate that does not fit, again with the checkpointed layers' inputs
    in host memory (train.offload_activations, OFFLOAD_ACTIVATIONS_SPEED; `base`: the speed of the same stage without
    checkpointing): what long rows need once every other saving is taken."""
    if s.offload_params or s.offload_optimizer:
        return []
    offloaded = s.replace(offload_activations=True)
    base *= OFFLOAD_ACTIVATIONS_SPEED
    if counted(offloaded) and offloaded.expandable_segments:
        offloaded, speed = _fastest_checkpointing(arch, offloaded, budget, base)
    else:
        offloaded, speed = _largest_fitting_micro(arch, offloaded, budget, base * CHECKPOINTED)
    name = strategy_name(offloaded, micro=micro)
    return [plan_entry(name, path, offloaded, estimate(arch, offloaded), budget, relative_speed=speed)]


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
