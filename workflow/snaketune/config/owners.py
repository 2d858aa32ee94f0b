"""Which stages each config key can change (its owners), and the settings each stage's params hold.

Snakemake reruns a job when its params change, and then everything downstream of it. So each stage's params hold
exactly the values of the keys it owns (`train_settings`, and the rules' spec functions for the other sections),
and a key that cannot change a stage's outputs stays out of them. Every leaf key of the config is one of:

- owned: it can change the outputs of its owner stages (`OWNERS`; the train keys by `TRAIN_FIELDS`' facets);
- runtime: it changes how a stage runs, never what it produces (checkpoint cadence and retention, threads, which
  GPUs): no owner. The train and dpo rules get the train keys of this kind as Snakemake resources, which no rerun
  trigger compares (and `--set-resources` may override);
- record: it changes only what a stage records about its run (metrics every N steps, validation every N steps):
  no owner either, by decision. metrics.csv keeps the cadence it was written with (summary.json says which); a
  rerun with `-R train` rewrites it. Retraining a 7B to log more often is the cost this avoids. The trained
  weights do not depend on them (tests/test_training.py trains with other cadences and compares every weight);
- placement: where a stage runs (train.gpus, train.nodes, gpu_memory_gib): owned by the memory plans, which check
  that the run fits where it is asked to run. One rank and N ranks train the same model up to float rounding
  (tests/test_training.py), so a finished training does not rerun for them. Under `train.strategy: auto` the plan
  chooses the strategy from them (ZeRO stage, checkpointing, 8-bit or 4-bit Adam states): they then own the stages
  the plan's choice reaches;
- structure: it adds or removes stages (preference.enabled, export.enabled, export.models).

docs/rerun.md publishes the table (key -> stages that rerun after a change), and tests/test_rerun_owners.py walks
the config's leaf keys, changes each by one step after a finished run, and compares the dry run's jobs with these
owners and everything downstream of them: a key added without an owner fails it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

from snaketune.config.choices import HUB_ID
from snaketune.config.schema import ExperimentConfig, LoraConfig, ModelConfig, TrainConfig

# Facets of a train key: what it changes.
MEMORY = "memory"  # the memory a stage needs: its plan (plan, plan_dpo)
WEIGHTS = "weights"  # what the stage trains: train, dpo
LOGPROBS = "logprobs"  # the reference log-probabilities: how the model is built and computes, its data order
EVALUATE = "evaluate"  # the evaluate stage: how it builds the base model (seed) or loads the models (4-bit)
BASE = "base"  # how a builtin base model is built for the benchmark stage (seed, precision)
BENCHMARK = "benchmark"  # how the benchmark stage loads the models (4-bit)
EVAL_MEMORY = "eval_memory"  # the evaluate stage's memory plan (plan_eval)
RUNTIME = "runtime"
RECORD = "record"
PLACEMENT = "placement"

_MODEL = (MEMORY, WEIGHTS, LOGPROBS)
"""How the model is built and computes: its memory, what it trains, its log-probabilities."""

TRAIN_FIELDS: dict[str, tuple[str, ...]] = {
    "gpus": (PLACEMENT,),
    "nodes": (PLACEMENT,),
    "deepspeed": _MODEL,
    "learning_rate": (WEIGHTS,),
    "min_lr_ratio": (WEIGHTS,),
    "warmup_steps": (WEIGHTS,),
    "weight_decay": (WEIGHTS,),
    "adam_betas": (WEIGHTS,),
    "grad_clip": (WEIGHTS,),
    "max_steps": (WEIGHTS,),
    "epochs": (WEIGHTS,),
    "global_batch_size": (MEMORY, WEIGHTS),  # accumulation: the plan counts its gradient buffers
    "micro_batch_size": _MODEL,
    "precision": (
        *_MODEL,
        BASE,
    ),  # the evaluate stage computes in bf16 on CUDA, fp32 on CPU, whatever trained
    "gradient_checkpointing": _MODEL,
    "bf16_optimizer": (MEMORY, WEIGHTS),
    "optimizer_kernel": (MEMORY, WEIGHTS),
    "optimizer_states": (MEMORY, WEIGHTS),
    "optimizer_step": (MEMORY, WEIGHTS),
    "fp8": _MODEL,
    "loss_kernel": (MEMORY, WEIGHTS),
    "fused_cross_entropy": (MEMORY, WEIGHTS),
    "attention": _MODEL,
    "kernels": _MODEL,
    "compile": _MODEL,
    "offload_activations": (MEMORY, WEIGHTS),
    "strategy": _MODEL,
    # The data order and dropout; the weights of a builtin model (the base the evaluate stage rebuilds) and of
    # LoRA's adapters at step 0.
    "seed": (WEIGHTS, LOGPROBS, EVALUATE, BASE),
    "checkpoint_every": (RUNTIME,),
    "keep_checkpoints": (RUNTIME,),
    "keep_final_checkpoint": (RUNTIME,),
    "log_every": (RECORD,),
    "eval_every": (RECORD,),
    "lora.enabled": _MODEL,
    "lora.rank": _MODEL,
    "lora.alpha": _MODEL,
    "lora.dropout": _MODEL,
    "lora.targets": _MODEL,
    # QLoRA's models are evaluated in 4 bits, as they trained.
    "lora.quantize": (*_MODEL, EVALUATE, EVAL_MEMORY, BASE, BENCHMARK),
}
"""Every train key (lora's as lora.<key>) and what it changes."""

SFT_STAGES = {
    MEMORY: "plan",
    WEIGHTS: "train",
    EVALUATE: "evaluate",
    EVAL_MEMORY: "plan_eval",
    BASE: "benchmark_base",
    BENCHMARK: "benchmark",
}
"""The stage each facet reaches when the key is read from `train` (the SFT side)."""
DPO_STAGES = {MEMORY: "plan_dpo", WEIGHTS: "dpo", LOGPROBS: "reference"}
"""The stage each facet reaches when the key is read from the preference stage's train settings (`preference.train`
merged over `train`)."""

_PLANS = ("plan", "plan_dpo", "plan_eval")
_BENCHMARKS = ("benchmark_base", "benchmark", "benchmark_gguf")
_MODEL_USERS = (*_PLANS, "train", "reference", "dpo", "evaluate", *_BENCHMARKS)
"""The stages that load or size the model."""

OWNERS: dict[str, tuple[str, ...]] = {
    "dataset.source": ("download",),
    "dataset.format": ("download",),
    "dataset.revision": ("download",),
    "dataset.builtin_trees": ("download",),
    "dataset.builtin_seed": ("download",),
    "dataset.languages": ("conversations", "preferences"),
    "dataset.paths": ("conversations",),
    "dataset.validation_fraction": ("conversations", "preferences"),  # a pairs file's split by prompt hash
    "dataset.tree_states": ("conversations", "preferences"),
    "dataset.max_trees": (
        "conversations",
    ),  # the preferences stage keeps the pairs of the conversations' trees
    "model.base": ("tokenizer", "import_gguf", *_MODEL_USERS),
    "model.tokenizer": ("tokenizer",),
    "model.tokenizer_revision": ("tokenizer",),
    "model.revision": ("tokenizer", *_MODEL_USERS),
    "model.trust_remote_code": ("tokenizer", "import_gguf", *_MODEL_USERS, "export"),
    "model.num_layers": _MODEL_USERS,
    "tokenize.max_length": ("tokenize", "plan", "plan_eval", "evaluate", "export"),
    "tokenize.packing": ("tokenize",),
    "tokenize.assistant_only_loss": ("tokenize",),
    "tokenize.chat_template": ("tokenize", "tokenize_pairs", "evaluate", "export", *_BENCHMARKS),
    "preference.source": ("preferences", "tokenize_pairs"),
    "preference.pairs": ("preferences", "tokenize_pairs"),
    "preference.max_length": ("tokenize_pairs", "plan_dpo", "reference", "dpo"),
    "preference.loss": ("dpo",),
    "preference.beta": ("dpo", "evaluate"),
    "preference.reference": ("reference", "dpo", "evaluate"),
    "preference.sft_weight": ("dpo",),
    "eval.prompts": ("evaluate", "export"),
    "eval.max_new_tokens": ("evaluate", "export", "plan_eval"),
    "eval.builtin_examples": ("evaluate",),
    "eval.batch_size": ("evaluate", "plan_eval"),
    "export.outtype": ("export",),
    "export.quants": ("export",),
    "export.max_kl": ("export",),
    "export.eval_tokens": ("export",),
    "gpu_memory_gib": _PLANS,
    "benchmark.limit": _BENCHMARKS,
    "benchmark.num_fewshot": _BENCHMARKS,
    "benchmark.task_settings": _BENCHMARKS,
    "benchmark.chat_template": _BENCHMARKS,
    "benchmark.batch_size": _BENCHMARKS,
    "benchmark.max_length": _BENCHMARKS,
    # What the report flags among the scores, never the scores: the benchmark jobs keep theirs.
    "benchmark.max_drop": ("report",),
}
"""Every key outside train (and preference.train) that changes an output, and the stages whose outputs it changes."""

UNOWNED: dict[str, str] = {
    "preference.enabled": "structure: adds or removes the preference stages (preferences, tokenize_pairs, "
    "reference, plan_dpo, dpo) and the DPO model's evaluation and export",
    "export.enabled": "structure: adds or removes the export stage",
    "export.models": "structure: which models the export stage exports (a job each)",
    "gpu_ids": "runtime: which GPUs the jobs may use (the environment, not a param)",
    "benchmark.enabled": "structure: adds or removes the benchmark stage",
    "benchmark.tasks": "structure: adds or removes a task's jobs (one per model); the others are kept",
    "benchmark.models": "structure: which models the benchmark stage scores (a job each)",
    "benchmark.quants": "structure: which GGUF files the benchmark stage scores (a job each)",
    "benchmark.fail_on_drop": "structure: adds or removes the check after the report that fails the run on a drop "
    "beyond max_drop (rule benchmark_gate)",
    "experiments": "structure: adds or removes experiments (each its own jobs)",
}
"""Keys that own no stage, and why."""


def train_keys() -> list[str]:
    """TrainConfig's fields as keys (lora's as lora.<key>)."""
    out = []
    for f in dataclasses.fields(TrainConfig):
        if f.name == "lora":
            out += [f"lora.{g.name}" for g in dataclasses.fields(LoraConfig)]
        else:
            out.append(f.name)
    return out


def _value(train: TrainConfig, key: str):
    section, _, name = key.rpartition(".")
    return getattr(train.lora if section == "lora" else train, name)


def facet_keys(facets: Iterable[str]) -> list[str]:
    """The train keys with any of these facets."""
    wanted = set(facets)
    return [k for k in train_keys() if wanted & set(TRAIN_FIELDS[k])]


def train_settings(train: TrainConfig, facet: str, *, placement: dict | None = None) -> dict:
    """The values of the train keys with `facet`, for a stage's params: {key: value} with lora's as `lora` (a
    mapping). Under `train.strategy: auto` the plan chooses from where the stage runs (`placement`: train.gpus,
    train.nodes, gpu_memory_gib), so a stage whose result the choice reaches (WEIGHTS, LOGPROBS) holds it too."""
    out: dict = {}
    for key in facet_keys([facet]):
        if _unread(train, key):
            continue
        value = _value(train, key)
        if key.startswith("lora."):
            out.setdefault("lora", {})[key[5:]] = list(value) if isinstance(value, tuple) else value
        else:
            out[key] = list(value) if isinstance(value, tuple) else value
    if facet in (WEIGHTS, LOGPROBS) and train.strategy == "auto" and placement is not None:
        out["placement"] = placement
    if facet == LOGPROBS and train.strategy == "auto":
        # The reference pass builds the model as DPO's plan chooses, from DPO's memory settings too.
        out.update({k: v for k, v in train_settings(train, MEMORY).items() if k not in out})
    return out


def _unread(train: TrainConfig, key: str) -> bool:
    """A train key the stage never reads: LoRA's settings without LoRA."""
    return key.startswith("lora.") and key != "lora.enabled" and not train.lora.enabled


def runtime_settings(train: TrainConfig) -> dict[str, int]:
    """The runtime and record train keys as Snakemake resources (integers): compared by no rerun trigger."""
    return {k: int(_value(train, k)) for k in facet_keys([RUNTIME, RECORD])}


def full_train(settings: dict, resources, placement: dict) -> dict:
    """A stage's whole train section for its ranks: the settings its params hold, the runtime and record keys from
    its resources, gpus and nodes from `placement`; a key none of them holds keeps TrainConfig's default (the
    reference pass's optimizer and schedule, which it never uses)."""
    out = {k: v for k, v in settings.items() if k != "placement"}
    out.update({k: int(getattr(resources, k)) for k in facet_keys([RUNTIME, RECORD])})
    out.update(gpus=max(1, placement["gpus"]), nodes=placement["nodes"])
    out["keep_final_checkpoint"] = bool(out["keep_final_checkpoint"])
    return out


def model_settings(model: ModelConfig) -> dict:
    """The model keys a stage that loads the model depends on, where the model reads them: the revision of a hub
    model, trust_remote_code of a model that is not built here, num_layers of an arch: model."""
    out: dict = {"base": model.base}
    if HUB_ID.match(model.pretrained) and not model.is_builtin:
        out["revision"] = model.revision
    if not model.is_builtin:
        out["trust_remote_code"] = model.trust_remote_code
    if model.base.startswith("arch:"):
        out["num_layers"] = model.num_layers
    return out


def unused(key: str, exp: ExperimentConfig) -> bool:
    """Whether the experiment's sources never read `key` (a builtin setting of a file dataset, the revision of a
    model that is not on the hub, ...): then it owns nothing for that experiment."""
    model = exp.model
    if key.startswith("preference.") and key != "preference.enabled" and not exp.preference.enabled:
        return True
    if key in ("dataset.builtin_trees", "dataset.builtin_seed"):
        return exp.dataset.source != "builtin"
    if key == "dataset.format":  # the builtin sample and hub datasets are oasst, whatever the key says
        return exp.dataset.source == "builtin" or exp.dataset.source.startswith("hub:")
    if key in ("dataset.paths", "dataset.tree_states"):  # oasst's trees: chat-format data has none
        return exp.dataset.format == "chat"
    if key == "preference.pairs":  # the pairing of ranked replies: a pairs file has its pairs
        return exp.preference.from_file
    if key == "dataset.revision":
        return not exp.dataset.source.startswith("hub:")
    if key in ("model.revision", "model.tokenizer_revision"):
        return key.removeprefix("model.") not in model_settings(model) and (
            model.uses_builtin_tokenizer or not HUB_ID.match(model.tokenizer_name)
        )
    if key == "model.trust_remote_code":
        return model.is_builtin and model.uses_builtin_tokenizer
    if key == "model.num_layers":
        return not model.base.startswith("arch:")
    return False


def _reads_model(stage: str, model: ModelConfig) -> bool:
    """Whether a stage reads the model's keys: the tokenizer stage only a tokenizer the model brings (the builtin
    one is trained on the data, the same for builtin-tiny and arch:*), import_gguf only a GGUF file's."""
    if stage == "tokenizer":
        return model.tokenizer != "auto" or not model.uses_builtin_tokenizer
    if stage == "import_gguf":
        return model.is_gguf
    return True


def owners(
    key: str, exp: ExperimentConfig | None = None, overridden: Iterable[str] | dict = ()
) -> tuple[str, ...]:
    """The stages whose outputs a change of `key` can change (dotted: `train.learning_rate`, `eval.batch_size`,
    `preference.train.max_steps`); () for the runtime, record and structure keys, and for a key the experiment's
    sources never read (`unused`). A train key reaches the preference stage's copy of it too, unless
    preference.train sets that key itself (`overridden`)."""
    if exp is not None and unused(key, exp):
        return ()
    if exp is not None and key.startswith("model."):
        return tuple(s for s in OWNERS[key] if _reads_model(s, exp.model))
    sft_train = exp.train if exp is not None else None
    dpo_train = exp.dpo_train if exp is not None else None
    no_dpo = exp is not None and dpo_train is None  # preference.enabled false: no preference stages
    if key.startswith("preference.train."):
        return () if no_dpo else _train_owners(key.removeprefix("preference.train."), DPO_STAGES, dpo_train)
    if key.startswith("train."):
        name = key.removeprefix("train.")
        inherited = not no_dpo and not _overrides(overridden, name)
        dpo = _train_owners(name, DPO_STAGES, dpo_train) if inherited else ()
        sft = _train_owners(name, SFT_STAGES, sft_train)
        if exp is not None and not exp.model.is_builtin and name in ("seed", "precision"):
            sft = tuple(s for s in sft if s != "benchmark_base")  # a pretrained base is loaded, not built
        return tuple(dict.fromkeys(sft + dpo))
    if key in OWNERS:
        if exp is not None and exp.preference.from_file and key.startswith("dataset."):
            # A pairs file's pairs read none of the dataset's keys but the split's fraction.
            return tuple(s for s in OWNERS[key] if s != "preferences" or key == "dataset.validation_fraction")
        return OWNERS[key]
    if key in UNOWNED:
        return ()
    raise KeyError(f"{key}: no owner declared in snaketune.config.owners (OWNERS, TRAIN_FIELDS or UNOWNED)")


def _overrides(overridden, name: str) -> bool:
    """Whether preference.train (`overridden`: its keys, lora's as a mapping) sets the train key `name`."""
    if name.startswith("lora."):
        lora = overridden.get("lora") if isinstance(overridden, dict) else None
        return isinstance(lora, dict) and name[5:] in lora
    return name in overridden


def _train_owners(name: str, stages: dict[str, str], train: TrainConfig | None = None) -> tuple[str, ...]:
    """The stages of one side (SFT_STAGES or DPO_STAGES) a train key reaches; none where that side never reads it
    (`train`: that side's settings, None: the general answer) or does not run."""
    if train is not None and _unread(train, name):
        return ()
    facets = TRAIN_FIELDS[name]
    if stages is DPO_STAGES and train is not None and train.strategy == "auto" and MEMORY in facets:
        facets = (*facets, LOGPROBS)  # the reference follows DPO's plan's choice (train_settings)
    if PLACEMENT in facets:
        return ("plan",) if stages is SFT_STAGES else ("plan_dpo",)
    return tuple(stages[f] for f in facets if f in stages)


def table() -> str:
    """The published table (docs/rerun.md): every key, what it is, the stages it reruns; their downstream stages
    rerun after them (tests/test_rerun_owners.py checks both against Snakemake's dry runs)."""
    rows = ["| key | kind | reruns (and what follows them) |", "|---|---|---|"]
    for key, stages in OWNERS.items():
        rows.append(f"| `{key}` | owned | {', '.join(stages)} |")
    for name in train_keys():
        facets = TRAIN_FIELDS[name]
        kind = next((f for f in (RUNTIME, RECORD, PLACEMENT) if f in facets), "owned")
        sft = ", ".join(_train_owners(name, SFT_STAGES)) or "-"
        dpo = ", ".join(_train_owners(name, DPO_STAGES)) or "-"
        rows.append(f"| `train.{name}` | {kind} | {sft}; as `preference.train.{name}`: {dpo} |")
    for key, why in UNOWNED.items():
        kind, _, reason = why.partition(": ")
        rows.append(f"| `{key}` | {kind} | - ({reason}) |")
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    print(table(), end="")
