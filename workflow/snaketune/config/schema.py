"""Typed configuration: one dataclass per config section, checked on construction.

The workflow validates the YAML against workflow/schemas/config.schema.yaml and then builds these
dataclasses (``load_config``), which add what a JSON schema cannot say well: "did you mean" for typos,
cross-field checks and derived values. Every error names the key and the allowed values.
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
    SOURCE_SUFFIXES,
    STRATEGIES,
    TREE_STATES,
    check_revision,
    fail,
    gguf_model_dir,
)
from snaketune.config.evaluation import EvalConfig
from snaketune.config.export import ExportConfig
from snaketune.config.preference import PreferenceConfig


@dataclass(frozen=True)
class DatasetConfig:
    source: str = "builtin"
    """`builtin` | `hub:<dataset id>` (oasst schema) | path to a local .jsonl, .jsonl.gz or .parquet file in the oasst
    message schema or the common chat format (`format`)."""
    format: str = "auto"
    """What a local file holds: `oasst` (message trees: flat rows or LAION's nested trees), `chat` (one conversation
    per line or row: `messages`, a list of {role, content} with roles system, user, assistant), `auto` (told from the
    file's fields when the config loads; builtin and hub sources are oasst)."""
    revision: str = "main"
    """Hub revision (branch, tag or commit) of a `hub:` dataset, pinned to a commit once (snaketune.hub)."""
    builtin_trees: int = 1000
    """Number of message trees the builtin generator makes (only for source `builtin`)."""
    builtin_seed: int = 0
    """Seed of the builtin generator."""
    languages: tuple[str, ...] = ()
    """Language codes to keep, matched against each tree's root message; empty keeps all."""
    paths: str = "top1"
    """`top1`: the best-ranked path per tree; `all`: every root-to-leaf path."""
    validation_fraction: float = 0.15
    """Share of trees held out for validation when the source has no split of its own."""
    tree_states: tuple[str, ...] = ("ready_for_export",)
    """Keep trees whose root has one of these tree_state values (a tree without one is kept); empty keeps all."""

    def __post_init__(self) -> None:
        src = self.source
        if not src:
            fail("dataset.source", "is empty; allowed: builtin | hub:<dataset id> | a .jsonl/.parquet file")
        if src != "builtin" and not src.startswith("hub:") and not src.endswith(SOURCE_SUFFIXES):
            fail(
                "dataset.source",
                f"{src!r} is not allowed; allowed: builtin | hub:<dataset id> | a path ending in "
                f"{', '.join(SOURCE_SUFFIXES)} (oasst message rows or trees, or chat-format conversations)",
            )
        if src.startswith("hub:") and not re.match(r"^hub:[\w.-]+(/[\w.-]+)?$", src):
            fail("dataset.source", f"{src!r} is not a hub dataset id (expected hub:<owner>/<name>)")
        check_revision("dataset.revision", self.revision)
        if self.format not in DATASET_FORMATS:
            fail("dataset.format", f"{self.format!r} is not allowed; allowed: {', '.join(DATASET_FORMATS)}")
        if self.format == "chat" and (src == "builtin" or src.startswith("hub:")):
            fail(
                "dataset.format",
                f"'chat' with dataset.source {src!r}, which is read in the oasst schema; allowed: auto, oasst (chat-"
                "format data: a local .jsonl, .jsonl.gz or .parquet file as dataset.source)",
            )
        if self.paths not in PATHS_MODES:
            fail("dataset.paths", f"{self.paths!r} is not allowed; allowed: {', '.join(PATHS_MODES)}")
        if not 0.0 < self.validation_fraction < 1.0:
            fail("dataset.validation_fraction", f"{self.validation_fraction} must be > 0 and < 1")
        if self.builtin_trees < 10:
            fail("dataset.builtin_trees", f"{self.builtin_trees} must be >= 10")
        for state in self.tree_states:
            if state not in TREE_STATES:
                fail("dataset.tree_states", f"{state!r} is not allowed; allowed: {', '.join(TREE_STATES)}")
        for code in self.languages:
            if not isinstance(code, str) or not LANG_CODE.match(code):
                fail("dataset.languages", f"{code!r} is not a language code (e.g. en, de, pt-BR)")


@dataclass(frozen=True)
class ModelConfig:
    base: str = "builtin-tiny"
    """`builtin-tiny` | `arch:deepseek-llm-7b` | a hub model id | a local model directory | a local `.gguf` file
    (llama.cpp's format: imported once into a hub-format directory, `pretrained`)."""
    tokenizer: str = "auto"
    """`auto` (the model's own; the builtin BPE for builtin-tiny and arch:*) | a hub id | a local directory."""
    revision: str = "main"
    """Hub revision (branch, tag or commit) of hub models and tokenizers, pinned to a commit once (snaketune.hub)."""
    tokenizer_revision: str | None = None
    """Hub revision of `tokenizer` where it names another hub repository than `base`; None: `revision`."""
    trust_remote_code: bool = False
    """Allow code shipped with a hub model to run. Off unless you trust the model's authors."""
    num_layers: int | None = None
    """For arch:* models only: cut the architecture to this many layers (benchmarks); None keeps all."""

    def __post_init__(self) -> None:
        if not self.base:
            fail(
                "model.base",
                "is empty; allowed: builtin-tiny | arch:deepseek-llm-7b | a hub id | a local directory",
            )
        if self.is_gguf and not Path(self.base).is_file():
            fail(
                "model.base",
                f"{self.base!r}: no such file; allowed: a GGUF model file that exists (or a hub id ...)",
            )
        if self.base.startswith("arch:") and self.base not in BUILTIN_MODELS:
            fail("model.base", f"{self.base!r} is unknown; allowed arch: models: arch:deepseek-llm-7b")
        if self.num_layers is not None and (self.num_layers < 1 or not self.base.startswith("arch:")):
            fail("model.num_layers", "must be >= 1 and is only allowed with an arch: model")
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
    max_length: int = 256
    """Tokens per training sequence: longer conversations are truncated; packed blocks have this size."""
    packing: bool = True
    """Pack several conversations into each max_length block (position ids restart per conversation)."""
    assistant_only_loss: bool = True
    """Train only on assistant turns (their text and end-of-turn token); False trains on every token."""
    chat_template: str = "deepseek"
    """`deepseek`: the DeepSeek-LLM chat format (bos, `User: ..\\n\\n`, `Assistant: ..<eos>`); `model`: the tokenizer's own."""

    def __post_init__(self) -> None:
        if not 16 <= self.max_length <= 131072:
            fail("tokenize.max_length", f"{self.max_length} must be between 16 and 131072")
        if self.chat_template not in CHAT_TEMPLATES:
            fail(
                "tokenize.chat_template",
                f"{self.chat_template!r} is not allowed; allowed: {', '.join(CHAT_TEMPLATES)}",
            )


@dataclass(frozen=True)
class LoraConfig:
    enabled: bool = False
    """Train LoRA adapters instead of all weights (peft); the final model is also saved merged."""
    rank: int = 16
    """LoRA rank r."""
    alpha: int = 32
    """LoRA alpha (scale = alpha / rank)."""
    dropout: float = 0.0
    """Dropout on the LoRA branch."""
    targets: tuple[str, ...] = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
    """Module names that get adapters."""
    quantize: str = "none"
    """`nf4`: QLoRA, the frozen base weights in 4-bit NormalFloat (bitsandbytes, double quantization, bf16 compute
    and storage) while the adapters train; hub-format models only. `none`: the base in the training precision."""

    def __post_init__(self) -> None:
        if self.quantize not in QUANTIZE:
            fail("train.lora.quantize", f"{self.quantize!r} is not allowed; allowed: {', '.join(QUANTIZE)}")
        if self.quantize != "none" and not self.enabled:
            fail(
                "train.lora.quantize",
                f"{self.quantize!r} needs train.lora.enabled: true (QLoRA trains adapters)",
            )
        if self.rank < 1:
            fail("train.lora.rank", f"{self.rank} must be >= 1")
        if not 0.0 <= self.dropout < 1.0:
            fail("train.lora.dropout", f"{self.dropout} must be in [0, 1)")
        if not self.targets:
            fail("train.lora.targets", "must name at least one module")


@dataclass(frozen=True)
class TrainConfig:
    CHOICES: ClassVar[dict[str, tuple[str, ...]]] = {
        "precision": PRECISIONS,
        "strategy": STRATEGIES,
        "bf16_optimizer": BF16_OPTIMIZERS,
        "optimizer_kernel": OPTIMIZER_KERNELS,
        "loss_kernel": LOSS_KERNELS,
        "optimizer_states": OPTIMIZER_STATES,
        "optimizer_step": OPTIMIZER_STEPS,
        "fp8": FP8,
        "attention": ATTENTIONS,
        "kernels": KERNELS,
    }
    """The keys that take one of a few strings (config loading names them also for a value of the wrong type)."""

    gpus: int = 3
    """GPUs (ranks) to ask Snakemake for, per node; on a machine without CUDA, CPU ranks over gloo."""
    nodes: int = 1
    """Nodes to train on: more than 1 needs SLURM (--profile workflow/profiles/slurm), one torchrun per node."""
    deepspeed: str = "config/deepspeed/zero2.json"
    """DeepSpeed JSON (ZeRO stage, offload, buckets); batch sizes, optimizer and precision come from here, not it."""
    learning_rate: float = 3e-3
    """Peak learning rate (AdamW)."""
    min_lr_ratio: float = 0.1
    """Cosine decay ends at learning_rate * min_lr_ratio."""
    warmup_steps: int = 10
    """Linear warmup, in optimizer steps."""
    weight_decay: float = 0.0
    """AdamW weight decay (not applied to norms and biases)."""
    adam_betas: tuple[float, float] = (0.9, 0.95)
    """AdamW betas."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this; 0 turns clipping off."""
    max_steps: int | None = 60
    """Optimizer steps to train; set this or `epochs`, not both."""
    epochs: float | None = None
    """Passes over the training split (alternative to max_steps)."""
    global_batch_size: int = 24
    """Sequences per optimizer step across all ranks (= micro_batch_size x world size x accumulation)."""
    micro_batch_size: int = 4
    """Sequences per rank per forward/backward."""
    precision: str = "auto"
    """`auto` (bf16 on GPU, fp32 on CPU) | `bf16` | `fp32`."""
    gradient_checkpointing: bool | int = False
    """Recompute activations in backward to save memory: `true` (every decoder layer; a second forward pass, about
    25% slower for full fine-tuning), `false`, or N: the first N decoder layers only, the others keep their
    activations (N up to the model's layers; 0 is false). `strategy: auto` sets true, false or, under gpu_memory_gib
    where the plan counts every saved tensor (LoRA with Liger's kernels), the fewest N that fit
    (snaketune.plan.strategies)."""
    bf16_optimizer: str = "auto"
    """Who keeps the fp32 master weights in bf16 training: `snaketune` (bf16 weights and gradients on the GPU, fp32
    masters and Adam states updated chunk by chunk by a fused AdamW: 16 B/param; ZeRO stage 0 only), `deepspeed`
    (DeepSpeed's bf16 optimizer or ZeRO, with fp32 gradient copies); `auto`: snaketune at ZeRO stage 0, else deepspeed."""
    optimizer_kernel: str = "auto"
    """The step of bf16_optimizer `snaketune`: `triton` (one fused pass per tensor: bf16 gradient in, fp32 master,
    m, v and bf16 weight out; CUDA with triton), `torch` (fp32 gradient copies + torch's fused AdamW); `auto`: triton
    where it runs. With `optimizer_step: in_backward` and 4-bit states, `triton` is one pass over the weight, the
    gradient and the 4-bit m and v (snaketune.train.adam4bit), `torch` torchao's update."""
    optimizer_states: str = "fp32"
    """Adam's m and v: `fp32` (8 B per trained parameter), `8bit` (block-wise 8-bit states, 2 B: bitsandbytes', the
    fp32 master weights stay fp32; torchao's with `optimizer_step: in_backward`) or `4bit` (torchao's 4-bit states,
    1.06 B; `optimizer_step: in_backward` only). With `strategy: auto` the plan switches fp32 to 8bit, then to the
    in-backward step with 4bit, where that is what makes a training fit without CPU offload (snaketune.plan.search).
    Not with optimizer offload (DeepSpeed's CPU Adam)."""
    optimizer_step: str = "after_backward"
    """`after_backward`: the usual step once the gradients of the whole batch exist; `in_backward`: each parameter is
    updated as soon as backward has produced its gradient, which is freed at once, and the weights are their own
    masters (bf16 with stochastic rounding on a GPU): a full fine-tune of the 7B in 12.9 GiB of weights and 6.8 GiB
    of 4bit states. ZeRO stage 0, one micro-batch per rank per step (no accumulation), and clipping by the previous
    step's gradient norm (snaketune.train.backward_step says why)."""
    fp8: str = "none"
    """`tensorwise`: the decoder's linear layers multiply in FP8 (compute capability >= 8.9); `emulated`: the same
    rounding on any device; `none` (snaketune.model.fp8)."""
    loss_kernel: str = "auto"
    """The cross-entropy on the logits (where fused_cross_entropy is false): `triton` (snaketune.model.losses: two passes
    over the bf16 logits, the gradient written over them: 2 B per token and vocabulary entry instead of 12; CUDA
    with triton), `torch` (fp32 upcast + F.cross_entropy); `auto`: triton where it runs."""
    fused_cross_entropy: bool = False
    """Compute the loss from the final hidden states chunk by chunk, never materializing the [tokens, vocabulary]
    logits (snaketune.model.losses): less memory for long sequences, 2% slower at 8 x 512 on an H200 (bench/RESULTS.md);
    not under ZeRO-3, whose partitioned lm_head weight only its own forward gathers."""
    attention: str = "auto"
    """`varlen`: packed conversations attend only to themselves through FlashAttention's varlen kernel (CUDA, bf16;
    block-masked SDPA elsewhere); `sdpa`: SDPA with an explicit block-diagonal mask; `auto`: varlen where it runs."""
    kernels: str = "auto"
    """RMSNorm, RoPE and SwiGLU: `liger` (Liger-Kernel's fused Triton kernels; CUDA, requirements-kernels.txt),
    `torch` (transformers' modules); `auto`: liger where it runs (snaketune.model.kernels)."""
    compile: bool = False
    """torch.compile every decoder layer (one compiled graph shared by all layers; the first step pays the compile)."""
    offload_activations: bool = False
    """With gradient checkpointing: each checkpointed layer's input waits in pinned host memory until backward
    recomputes the layer (snaketune.model.offload), so that long rows hold one layer's input on the GPU instead of
    every layer's (a*hidden bytes per token each: 8 KiB for the 7B, 3.75 GiB for 30 layers of a 16,384-token row).
    The same losses and gradients; one copy each way per layer and step. `strategy: auto` turns it on where
    nothing fits without it."""
    strategy: str = "as_configured"
    """`as_configured`: `deepspeed` and `gradient_checkpointing` as given; `auto`: the fastest ZeRO stage, offload,
    checkpointing (how many layers), micro-batch and activation offload that fits the GPUs (snaketune.plan.search;
    results/plan/<experiment>.json names it and the device peak it predicts)."""
    seed: int = 1234
    """Seed for model init (builtin models), data order and dropout."""
    checkpoint_every: int = 40
    """Write a resumable DeepSpeed checkpoint every this many optimizer steps (0 = never)."""
    keep_checkpoints: int = 2
    """How many of the newest complete checkpoints to keep while the stage runs."""
    keep_final_checkpoint: bool = False
    """Keep the last checkpoint once the stage's outputs are in place; else it goes then, with superseded runs'."""
    log_every: int = 5
    """Log metrics every this many optimizer steps."""
    eval_every: int = 40
    """Compute validation loss every this many optimizer steps (0 = only at the end)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA settings."""

    def __post_init__(self) -> None:
        if self.gpus < 1:
            fail("train.gpus", f"{self.gpus} must be >= 1")
        if self.nodes < 1:
            fail("train.nodes", f"{self.nodes} must be >= 1 (more than 1 needs a SLURM cluster)")
        if (self.max_steps is None) == (self.epochs is None):
            fail("train.max_steps", "set exactly one of train.max_steps and train.epochs")
        if self.max_steps is not None and self.max_steps < 1:
            fail("train.max_steps", f"{self.max_steps} must be >= 1")
        if self.epochs is not None and self.epochs <= 0:
            fail("train.epochs", f"{self.epochs} must be > 0")
        if self.learning_rate <= 0:
            fail("train.learning_rate", f"{self.learning_rate} must be > 0")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            fail("train.min_lr_ratio", f"{self.min_lr_ratio} must be in [0, 1]")
        if self.micro_batch_size < 1 or self.global_batch_size < 1:
            fail("train.global_batch_size", "global_batch_size and micro_batch_size must be >= 1")
        if self.global_batch_size % self.micro_batch_size:
            fail(
                "train.global_batch_size",
                f"{self.global_batch_size} is not a multiple of train.micro_batch_size {self.micro_batch_size}",
            )
        for key, allowed in self.CHOICES.items():
            if getattr(self, key) not in allowed:
                fail(f"train.{key}", f"{getattr(self, key)!r} is not allowed; allowed: {', '.join(allowed)}")
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
        if not isinstance(self.gradient_checkpointing, bool) and self.gradient_checkpointing < 0:
            fail(
                "train.gradient_checkpointing",
                f"{self.gradient_checkpointing} is not allowed; allowed: true, false or a number of layers >= 0",
            )
        if self.offload_activations and not self.gradient_checkpointing and self.strategy != "auto":
            fail(
                "train.offload_activations",
                "true needs train.gradient_checkpointing (true or a number of layers): it offloads the inputs of "
                "the layers that recompute; allowed without it: false",
            )
        if self.keep_checkpoints < 1:
            fail("train.keep_checkpoints", f"{self.keep_checkpoints} must be >= 1")
        if not self.deepspeed.endswith(".json"):
            fail(
                "train.deepspeed",
                f"{self.deepspeed!r} must be a .json file (e.g. config/deepspeed/zero2.json)",
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
    raw: dict[str, Any]
    """The config as given (after experiment merging it is still the user's mapping)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation settings, shared by all experiments."""
    export: ExportConfig = field(default_factory=ExportConfig)
    """GGUF export settings, shared by all experiments."""
    benchmark: BenchmarkConfig = field(default_factory=BenchmarkConfig)
    """lm-evaluation-harness tasks on the base, fine-tuned and exported models, shared by all experiments."""
    gpu_memory_gib: float | None = None
    """The memory of the cards to plan for, GiB (a card name in the YAML resolves to its memory: rtx4090 is
    24,564 MiB): each process keeps what nvidia-smi shows for it under this less 0.5 GiB for the driver
    (snaketune.device_memory), so a large GPU behaves like a smaller one; None: the GPUs' own memory."""
    gpu_ids: tuple[str, ...] | None = None
    """GPU ids (as CUDA_VISIBLE_DEVICES takes them) the workflow may use; None: every visible GPU."""
