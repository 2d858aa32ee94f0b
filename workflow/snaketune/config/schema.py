"""Typed configuration: one dataclass per config section, checked on construction.

Each field is the one definition of its config key (snaketune.config.fields): its type, default, the values it
allows (`setting`) and the docstring under it. The workflow builds these dataclasses from the YAML
(``load_config``); workflow/schemas/config.schema.yaml is generated from them (snaketune.config.generate). Each
__post_init__ first checks every field against its declaration (`check`), then what one key cannot say alone:
one key against another, derived values. Every error names the key and the allowed values.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from snaketune.config.benchmark import BenchmarkConfig
from snaketune.config.choices import (
    ATTENTIONS,
    BF16_OPTIMIZERS,
    BUILTIN_MODELS,
    CHAT_TEMPLATES,
    DATASET_FORMATS,
    FP8,
    GGUF_SUFFIX,
    KERNELS,
    LANG_CODE,
    LOSS_KERNELS,
    OPTIMIZER_KERNELS,
    OPTIMIZER_STATES,
    OPTIMIZER_STEPS,
    PATHS_MODES,
    PRECISIONS,
    QUANTIZE,
    REVISION_ALLOWED,
    SOURCE_SUFFIXES,
    STRATEGIES,
    TREE_STATES,
    check_revision,
    fail,
    gguf_model_dir,
)
from snaketune.config.evaluation import EvalConfig
from snaketune.config.export import ExportConfig
from snaketune.config.fields import check, setting
from snaketune.config.preference import PreferenceConfig

SOURCE_ALLOWED = (
    f"builtin | hub:<dataset id> | a path ending in {', '.join(SOURCE_SUFFIXES)} (oasst message rows or trees, or "
    "chat-format conversations)"
)


@dataclass(frozen=True)
class DatasetConfig:
    """The data every experiment trains on (shared by all experiments)."""

    SECTION: ClassVar[str] = "dataset"

    source: str = setting(
        "builtin",
        pattern=r"^(builtin|hub:.+|.+(" + "|".join(re.escape(x) for x in SOURCE_SUFFIXES) + "))$",
        allowed=SOURCE_ALLOWED,
    )
    """`builtin` | `hub:<dataset id>` (oasst schema) | path to a local .jsonl, .jsonl.gz or .parquet file in the oasst
    message schema or the common chat format (`format`)."""
    format: str = setting("auto", choices=DATASET_FORMATS)
    """What a local file holds: `oasst` (message trees: flat rows or LAION's nested trees), `chat` (one conversation
    per line or row: `messages`, a list of {role, content} with roles system, user, assistant), `auto` (told from the
    file's fields when the config loads; builtin and hub sources are oasst)."""
    revision: str = setting("main", pattern=".", allowed=REVISION_ALLOWED)
    """Hub revision (branch, tag or commit) of a `hub:` dataset, pinned to a commit once (snaketune.hub)."""
    builtin_trees: int = setting(1000, minimum=10)
    """Number of message trees the builtin generator makes (only for source `builtin`)."""
    builtin_seed: int = 0
    """Seed of the builtin generator."""
    languages: tuple[str, ...] = setting(
        (), pattern=LANG_CODE.pattern, allowed="a language code (e.g. en, de, pt-BR)"
    )
    """Language codes to keep, matched against each tree's root message; empty keeps all."""
    paths: str = setting("top1", choices=PATHS_MODES)
    """`top1`: the best-ranked path per tree; `all`: every root-to-leaf path."""
    validation_fraction: float = setting(0.15, exclusive_minimum=0, exclusive_maximum=1)
    """Share of trees held out for validation when the source has no split of its own."""
    tree_states: tuple[str, ...] = setting(("ready_for_export",), choices=TREE_STATES)
    """Keep trees whose root has one of these tree_state values (a tree without one is kept); empty keeps all."""
    max_trees: int | None = setting(None, minimum=1, hint="null keeps every tree")
    """At most this many trees, after the filters above (a chat file's conversations count one each): a sample
    chosen by a hash of each tree's id, the same on any machine, a larger sample holding a smaller one. For a first
    run of a real model on a CPU (config/examples/smollm2-135m-cpu.yaml); null keeps every tree."""

    def __post_init__(self) -> None:
        check(self)
        src = self.source
        if src.startswith("hub:") and not re.match(r"^hub:[\w.-]+(/[\w.-]+)?$", src):
            fail("dataset.source", f"{src!r} is not a hub dataset id (expected hub:<owner>/<name>)")
        check_revision("dataset.revision", self.revision)
        if self.format == "chat" and (src == "builtin" or src.startswith("hub:")):
            fail(
                "dataset.format",
                f"'chat' with dataset.source {src!r}, which is read in the oasst schema; allowed: auto, oasst (chat-"
                "format data: a local .jsonl, .jsonl.gz or .parquet file as dataset.source)",
            )


@dataclass(frozen=True)
class ModelConfig:
    """The model each experiment starts from, and its tokenizer."""

    SECTION: ClassVar[str] = "model"

    base: str = setting(
        "builtin-tiny",
        pattern=r".",
        allowed="builtin-tiny | arch:deepseek-llm-7b | a hub id | a local directory | a local .gguf file",
    )
    """`builtin-tiny` | `arch:deepseek-llm-7b` | a hub model id | a local model directory | a local `.gguf` file
    (llama.cpp's format: imported once into a hub-format directory, `pretrained`)."""
    tokenizer: str = setting("auto", pattern=r".", allowed="auto | a hub id | a local directory")
    """`auto` (the model's own; the builtin BPE for builtin-tiny and arch:*) | a hub id | a local directory."""
    revision: str = setting("main", pattern=".", allowed=REVISION_ALLOWED)
    """Hub revision (branch, tag or commit) of hub models and tokenizers, pinned to a commit once (snaketune.hub)."""
    tokenizer_revision: str | None = setting(None, pattern=".", allowed=REVISION_ALLOWED)
    """Hub revision of `tokenizer` where it names another hub repository than `base`; None: `revision`."""
    trust_remote_code: bool = False
    """Allow code shipped with a hub model to run. Off unless you trust the model's authors."""
    num_layers: int | None = setting(None, minimum=1)
    """For arch:* models only: cut the architecture to this many layers (benchmarks); None keeps all."""

    def __post_init__(self) -> None:
        check(self)
        if self.is_gguf and not Path(self.base).is_file():
            fail(
                "model.base",
                f"{self.base!r}: no such file; allowed: a GGUF model file that exists (or a hub id ...)",
            )
        if self.base.startswith("arch:") and self.base not in BUILTIN_MODELS:
            fail("model.base", f"{self.base!r} is unknown; allowed arch: models: arch:deepseek-llm-7b")
        if self.num_layers is not None and not self.base.startswith("arch:"):
            fail("model.num_layers", f"{self.num_layers} is only allowed with an arch: model; allowed: null")
        check_revision("model.revision", self.revision)
        if self.tokenizer_revision is not None:
            check_revision("model.tokenizer_revision", self.tokenizer_revision)

    @property
    def is_builtin(self) -> bool:
        return self.base in BUILTIN_MODELS

    @property
    def is_gguf(self) -> bool:
        return self.base.lower().endswith(GGUF_SUFFIX)

    @property
    def pretrained(self) -> str:
        """What from_pretrained reads: model.base, or for a GGUF file the hub-format directory rule import_gguf
        makes of it (snaketune.model.gguf)."""
        return gguf_model_dir(self.base) if self.is_gguf else self.base

    @property
    def tokenizer_name(self) -> str:
        """What the tokenizer is loaded from: the model's own (`pretrained`) or model.tokenizer."""
        return self.pretrained if self.tokenizer == "auto" else self.tokenizer

    @property
    def tokenizer_hub_revision(self) -> str:
        return self.revision if self.tokenizer == "auto" else self.tokenizer_revision or self.revision

    @property
    def uses_builtin_tokenizer(self) -> bool:
        return self.tokenizer == "auto" and self.is_builtin


@dataclass(frozen=True)
class TokenizeConfig:
    """How conversations become training sequences."""

    SECTION: ClassVar[str] = "tokenize"

    max_length: int = setting(256, minimum=16, maximum=131072)
    """Tokens per training sequence: longer conversations are truncated; packed blocks have this size."""
    packing: bool = True
    """Pack several conversations into each max_length block (position ids restart per conversation)."""
    assistant_only_loss: bool = True
    """Train only on assistant turns (their text and end-of-turn token); False trains on every token."""
    chat_template: str = setting("deepseek", choices=CHAT_TEMPLATES)
    """`deepseek`: the DeepSeek-LLM chat format (bos, `User: ..\\n\\n`, `Assistant: ..<eos>`); `model`: the tokenizer's own."""

    def __post_init__(self) -> None:
        check(self)


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters (peft) instead of full fine-tuning."""

    SECTION: ClassVar[str] = "train.lora"

    enabled: bool = False
    """Train LoRA adapters instead of all weights (peft); the final model is also saved merged."""
    rank: int = setting(16, minimum=1)
    """LoRA rank r."""
    alpha: int = setting(32, exclusive_minimum=0)
    """LoRA alpha (scale = alpha / rank)."""
    dropout: float = setting(0.0, minimum=0, exclusive_maximum=1)
    """Dropout on the LoRA branch."""
    targets: tuple[str, ...] = setting(
        ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
        min_items=1,
        allowed="a list of at least one module name",
    )
    """Module names that get adapters."""
    quantize: str = setting("none", choices=QUANTIZE)
    """`nf4`: QLoRA, the frozen base weights in 4-bit NormalFloat (bitsandbytes, double quantization, bf16 compute
    and storage) while the adapters train; hub-format models only. `none`: the base in the training precision."""

    def __post_init__(self) -> None:
        check(self)
        if self.quantize != "none" and not self.enabled:
            fail(
                "train.lora.quantize",
                f"{self.quantize!r} needs train.lora.enabled: true (QLoRA trains adapters)",
            )


@dataclass(frozen=True)
class TrainConfig:
    """How each experiment trains (SFT; the preference stage's `preference.train` is merged over it)."""

    SECTION: ClassVar[str] = "train"

    gpus: int = setting(3, minimum=1)
    """GPUs (ranks) to ask Snakemake for, per node; on a machine without CUDA, CPU ranks over gloo."""
    nodes: int = setting(1, minimum=1, hint="more than 1 needs a SLURM cluster")
    """Nodes to train on: more than 1 needs SLURM (--profile workflow/profiles/slurm), one torchrun per node."""
    deepspeed: str = setting(
        "config/deepspeed/zero2.json",
        pattern=r"\.json$",
        allowed="a .json file (e.g. config/deepspeed/zero2.json)",
    )
    """DeepSpeed JSON (ZeRO stage, offload, buckets); batch sizes, optimizer and precision come from here, not it."""
    learning_rate: float = setting(3e-3, exclusive_minimum=0)
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = setting(0.1, minimum=0, maximum=1)
    """Cosine decay ends at learning_rate * min_lr_ratio."""
    warmup_steps: int = setting(10, minimum=0)
    """Linear warmup, in optimizer steps."""
    weight_decay: float = setting(0.0, minimum=0)
    """AdamW weight decay (not applied to norms and biases)."""
    adam_betas: tuple[float, float] = setting((0.9, 0.95), minimum=0, exclusive_maximum=1)
    """AdamW betas."""
    grad_clip: float = setting(1.0, minimum=0)
    """Clip the global gradient norm to this; 0 turns clipping off."""
    max_steps: int | None = setting(60, minimum=1)
    """Optimizer steps to train; set this or `epochs`, not both."""
    epochs: float | None = setting(None, exclusive_minimum=0)
    """Passes over the training split (alternative to max_steps)."""
    global_batch_size: int = setting(24, minimum=1)
    """Sequences per optimizer step across all ranks (= micro_batch_size x world size x accumulation)."""
    micro_batch_size: int = setting(4, minimum=1)
    """Sequences per rank per forward/backward."""
    precision: str = setting("auto", choices=PRECISIONS)
    """`auto` (bf16 on GPU, fp32 on CPU) | `bf16` | `fp32`."""
    gradient_checkpointing: bool | int = setting(
        False, minimum=0, allowed="true, false or a number of layers >= 0"
    )
    """Recompute activations in backward to save memory: `true` (every decoder layer; a second forward pass, about
    25% slower for full fine-tuning), `false`, or N: the first N decoder layers only, the others keep their
    activations (N up to the model's layers; 0 is false). `strategy: auto` sets true, false or, under gpu_memory_gib
    where the plan counts every saved tensor (LoRA with Liger's kernels), the fewest N that fit
    (snaketune.plan.strategies)."""
    bf16_optimizer: str = setting("auto", choices=BF16_OPTIMIZERS)
    """Who keeps the fp32 master weights in bf16 training: `snaketune` (bf16 weights and gradients on the GPU, fp32
    masters and Adam states updated chunk by chunk by a fused AdamW: 16 B/param; ZeRO stage 0 only), `deepspeed`
    (DeepSpeed's bf16 optimizer or ZeRO, with fp32 gradient copies); `auto`: snaketune at ZeRO stage 0, else deepspeed."""
    optimizer_kernel: str = setting("auto", choices=OPTIMIZER_KERNELS)
    """The step of bf16_optimizer `snaketune`: `triton` (one fused pass per tensor: bf16 gradient in, fp32 master,
    m, v and bf16 weight out; CUDA with triton), `torch` (fp32 gradient copies + torch's fused AdamW); `auto`: triton
    where it runs. With `optimizer_step: in_backward` and 4-bit states, `triton` is one pass over the weight, the
    gradient and the 4-bit m and v (snaketune.train.adam4bit), `torch` torchao's update."""
    optimizer_states: str = setting("fp32", choices=OPTIMIZER_STATES)
    """Adam's m and v: `fp32` (8 B per trained parameter), `8bit` (block-wise 8-bit states, 2 B: bitsandbytes', the
    fp32 master weights stay fp32; torchao's with `optimizer_step: in_backward`) or `4bit` (torchao's 4-bit states,
    1.06 B; `optimizer_step: in_backward` only). With `strategy: auto` the plan switches fp32 to 8bit, then to the
    in-backward step with 4bit, where that is what makes a training fit without CPU offload (snaketune.plan.search).
    Not with optimizer offload (DeepSpeed's CPU Adam)."""
    optimizer_step: str = setting("after_backward", choices=OPTIMIZER_STEPS)
    """`after_backward`: the usual step once the gradients of the whole batch exist; `in_backward`: each parameter is
    updated as soon as backward has produced its gradient, which is freed at once, and the weights are their own
    masters (bf16 with stochastic rounding on a GPU): a full fine-tune of the 7B in 12.9 GiB of weights and 6.8 GiB
    of 4bit states. ZeRO stage 0, one micro-batch per rank per step (no accumulation), and clipping by the previous
    step's gradient norm (snaketune.train.backward_step says why)."""
    fp8: str = setting("none", choices=FP8)
    """`tensorwise`: the decoder's linear layers multiply in FP8 (compute capability >= 8.9); `emulated`: the same
    rounding on any device; `none` (snaketune.model.fp8)."""
    loss_kernel: str = setting("auto", choices=LOSS_KERNELS)
    """The cross-entropy on the logits (where fused_cross_entropy is false): `triton` (snaketune.model.losses: two passes
    over the bf16 logits, the gradient written over them: 2 B per token and vocabulary entry instead of 12; CUDA
    with triton), `torch` (fp32 upcast + F.cross_entropy); `auto`: triton where it runs."""
    fused_cross_entropy: bool = False
    """Compute the loss from the final hidden states chunk by chunk, never materializing the [tokens, vocabulary]
    logits (snaketune.model.losses): less memory for long sequences, 2% slower at 8 x 512 on an H200 (bench/RESULTS.md);
    not under ZeRO-3, whose partitioned lm_head weight only its own forward gathers."""
    attention: str = setting("auto", choices=ATTENTIONS)
    """`varlen`: packed conversations attend only to themselves through FlashAttention's varlen kernel (CUDA, bf16;
    block-masked SDPA elsewhere); `sdpa`: SDPA with an explicit block-diagonal mask; `auto`: varlen where it runs."""
    kernels: str = setting("auto", choices=KERNELS)
    """RMSNorm, RoPE and SwiGLU: `liger` (Liger-Kernel's fused Triton kernels; CUDA, requirements-kernels.txt),
    `torch` (transformers' modules); `auto`: liger where it runs (snaketune.model.kernels)."""
    compile: bool = False
    """torch.compile every decoder layer (one compiled graph shared by all layers; the first step pays the compile)."""
    offload_activations: bool = False
    """With gradient checkpointing: each checkpointed layer's input waits in pinned host memory until backward
    recomputes the layer (snaketune.model.offload), so that long rows hold one layer's input on the GPU instead of
    every layer's (a*hidden bytes per token each: 8 KiB for the 7B, 3.75 GiB for 30 layers of a 16,384-token row).
    The same losses and gradients; one copy each way per layer and step, on a copy stream of its own, the next
    layer's input fetched back ahead. `strategy: auto` turns it on where nothing fits without it."""
    strategy: str = setting("as_configured", choices=STRATEGIES)
    """`as_configured`: `deepspeed` and `gradient_checkpointing` as given; `auto`: the fastest ZeRO stage, offload,
    checkpointing (how many layers), micro-batch and activation offload that fits the GPUs (snaketune.plan.search;
    results/plan/<experiment>.json names it and the device peak it predicts)."""
    seed: int = 1234
    """Seed for model init (builtin models), data order and dropout."""
    checkpoint_every: int = setting(40, minimum=0)
    """Write a resumable DeepSpeed checkpoint every this many optimizer steps (0 = never)."""
    keep_checkpoints: int = setting(2, minimum=1)
    """How many of the newest complete checkpoints to keep while the stage runs."""
    keep_final_checkpoint: bool = False
    """Keep the last checkpoint once the stage's outputs are in place; else it goes then, with superseded runs'."""
    log_every: int = setting(5, minimum=1)
    """Log metrics every this many optimizer steps."""
    eval_every: int = setting(40, minimum=0)
    """Compute validation loss every this many optimizer steps (0 = only at the end)."""
    lora: LoraConfig = setting(default_factory=LoraConfig)
    """LoRA settings."""

    def __post_init__(self) -> None:
        check(self)
        if (self.max_steps is None) == (self.epochs is None):
            fail("train.max_steps", "set exactly one of train.max_steps and train.epochs")
        if self.global_batch_size % self.micro_batch_size:
            fail(
                "train.global_batch_size",
                f"{self.global_batch_size} is not a multiple of train.micro_batch_size {self.micro_batch_size}",
            )
        if self.optimizer_states == "4bit" and self.optimizer_step != "in_backward":
            fail(
                "train.optimizer_states",
                "'4bit' needs train.optimizer_step: in_backward (torchao's 4-bit states have no fp32-master "
                "step here); allowed with after_backward: fp32, 8bit",
            )
        if self.optimizer_step == "in_backward" and self.bf16_optimizer != "auto":
            fail(
                "train.bf16_optimizer",
                f"{self.bf16_optimizer!r} with train.optimizer_step: in_backward, whose weights are their own "
                "masters; allowed: auto",
            )
        if self.offload_activations and not self.gradient_checkpointing and self.strategy != "auto":
            fail(
                "train.offload_activations",
                "true needs train.gradient_checkpointing (true or a number of layers): it offloads the inputs of "
                "the layers that recompute; allowed without it: false",
            )

    def accumulation_steps(self, world_size: int) -> int:
        """Micro-batches per rank per optimizer step, so that the global batch is the same for any world size."""
        per_step = self.micro_batch_size * world_size
        if self.global_batch_size % per_step:
            fail(
                "train.global_batch_size",
                f"{self.global_batch_size} is not divisible by micro_batch_size x world size "
                f"= {self.micro_batch_size} x {world_size}; choose a multiple of {per_step}",
            )
        return self.global_batch_size // per_step


def checkpointed_layers(value: bool | int | None, layers: int) -> int:
    """train.gradient_checkpointing as a number of decoder layers (the first ones) of a model with `layers`:
    true every layer, false or 0 none, N those N; more than the model has is an error."""
    if isinstance(value, bool) or value is None:
        return layers if value else 0
    if not 0 <= value <= layers:
        fail(
            "train.gradient_checkpointing",
            f"{value} layers, but the model has {layers} decoder layers; allowed: true, false or 1..{layers}",
        )
    return value


@dataclass(frozen=True)
class ExperimentConfig:
    """Everything one experiment depends on: the shared dataset plus its own model/tokenize/train/preference."""

    name: str
    dataset: DatasetConfig
    model: ModelConfig
    tokenize: TokenizeConfig
    train: TrainConfig
    preference: PreferenceConfig = field(default_factory=PreferenceConfig)
    dpo_train: TrainConfig | None = None
    """The preference stage's train settings: `train` with preference.train merged over it (None when off)."""


@dataclass(frozen=True)
class Config:
    dataset: DatasetConfig
    experiments: dict[str, ExperimentConfig]
    """Experiment name -> overrides of model, tokenize, train and preference, merged key by key over those
    sections; every experiment is built (names: letters, digits, '_', '-', '.')."""
    raw: dict[str, Any]
    """The config as given (after experiment merging it is still the user's mapping)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation settings, shared by all experiments."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """GGUF export settings, shared by all experiments."""
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    """lm-evaluation-harness tasks on the base, fine-tuned and exported models, shared by all experiments."""
    gpu_memory_gib: float | None = setting(None, schema={"type": ["number", "string", "null"]})
    """The memory of the cards to plan for, GiB (a card name in the YAML resolves to its memory: rtx4090 is
    24,564 MiB): each process keeps what nvidia-smi shows for it under this less 0.5 GiB for the driver
    (snaketune.device_memory), so a large GPU behaves like a smaller one; None: the GPUs' own memory."""
    gpu_ids: tuple[str, ...] | None = setting(
        None, schema={"type": ["array", "null"], "items": {"type": ["integer", "string"]}, "minItems": 1}
    )
    """GPU ids (as CUDA_VISIBLE_DEVICES takes them) the workflow may use; None: every visible GPU."""
