"""The values config keys allow, and the error every bad value raises.

Kept apart from the dataclasses (snaketune.config.schema) so that the memory plan, the data stages and the
schema test can name what is allowed without building a config; every check in the package raises
ConfigError through `fail`, with the key and the allowed values in the message.
"""

from __future__ import annotations

import re
from pathlib import Path

BUILTIN_MODELS = ("builtin-tiny", "arch:deepseek-llm-7b")

GGUF_SUFFIX = ".gguf"
"""model.base naming a file with this suffix is a GGUF model (llama.cpp's format), imported once into a hub-format
directory under MODELS_DIR (rule import_gguf)."""
MODELS_DIR = "results/models"

EXPORT_TYPES = ("f32", "bf16", "f16")
"""The unquantized GGUF file's types (llama.cpp's converter --outtype); export.outtype also allows `auto`."""
EXPORT_QUANTS = ("q8_0", "q6_k", "q5_k_m", "q4_k_m", "q4_0")
"""export.quants: llama.cpp quant types the export stage makes (snaketune.export.llama_cpp.QUANTS)."""
EXPORT_MODELS = ("sft", "dpo")
"""export.models: which fine-tuned models are exported (dpo where the experiment's preference stage runs)."""


def gguf_model_dir(path: str) -> str:
    """The hub-format directory rule import_gguf makes of a GGUF file: its name (letters, digits and '-' only, so
    that it stays under MODELS_DIR) and 8 hex digits of the path as given."""
    import hashlib

    stem = (
        re.sub(r"[^A-Za-z0-9]+", "-", Path(path).name.removesuffix(GGUF_SUFFIX)).strip("-")[-40:] or "model"
    )
    return f"{MODELS_DIR}/{stem}-{hashlib.sha256(path.encode()).hexdigest()[:8]}"


HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
"""owner/name, as the hub spells repository ids."""

SOURCE_SUFFIXES = (".jsonl", ".jsonl.gz", ".parquet")
"""snaketune.data.messages.SUFFIXES (kept here so that the config does not import pandas)."""

DATASET_FORMATS = ("auto", "oasst", "chat")
"""dataset.format: `oasst` (message trees: flat rows or LAION's nested trees), `chat` (one conversation per line or
row, a `messages` list of {role, content}), `auto` (told from the file's fields when the config loads:
snaketune.data.formats)."""

PAIRS_FROM_DATASET = "dataset"
"""preference.source that takes the pairs from the dataset's ranked replies (oasst); else a pairs file."""

TREE_STATES = (
    "initial_prompt_review",
    "prompt_lottery_waiting",
    "growing",
    "ranking",
    "backlog_ranking",
    "ready_for_scoring",
    "scoring_failed",
    "ready_for_export",
    "aborted_low_grade",
    "halted_by_moderator",
)
"""The message tree states of Open-Assistant's backend (oasst_backend.models.message_tree_state.State)."""

PATHS_MODES = ("top1", "all")

CHAT_TEMPLATES = ("deepseek", "model")

PRECISIONS = ("auto", "bf16", "fp32")

STRATEGIES = ("as_configured", "auto")

OPTIMIZER_KERNELS = ("auto", "triton", "torch")

LOSS_KERNELS = ("auto", "triton", "torch")

ATTENTIONS = ("auto", "varlen", "sdpa")

KERNELS = ("auto", "torch", "liger")

QUANTIZE = ("none", "nf4")

OPTIMIZER_STATES = ("fp32", "8bit", "4bit")

OPTIMIZER_STEPS = ("after_backward", "in_backward")

FP8 = ("none", "tensorwise", "emulated")

EXPERIMENT_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

# ISO 639-1 codes plus the regional variants oasst1 uses (pt-BR, zh, ...): shape check only.
LANG_CODE = re.compile(r"^[a-z]{2,3}(-[A-Za-z]{2,4})?$")


class ConfigError(ValueError):
    """A config value is wrong; the message names the key and what is allowed."""

    def __init__(self, message: str, key: str | None = None, detail: str | None = None):
        super().__init__(message)
        # The dotted key the error is about and what is wrong with it (fail's arguments), where there is one.
        self.key, self.detail = key, detail

    def under(self, section: str, where: str) -> ConfigError:
        """The error with its key under `where` (`experiments.x.train.`, `preference.train.`) instead of the
        `section` the dataclass names itself by (`train`): the key as the config spells it."""
        if self.key is None or not (self.key == section or self.key.startswith(f"{section}.")):
            return self
        key = where.rstrip(".") + self.key[len(section) :]
        return ConfigError(f"config key '{key}': {self.detail}", key, self.detail)


def fail(key: str, message: str) -> None:
    raise ConfigError(f"config key '{key}': {message}", key, message)


DEFAULT_EVAL_PROMPTS = (
    "What is the capital of Zorvia?",
    "What colour is the fruit zimberry?",
    "What is 3 + 4?",
    "What is the first letter of moon?",
    "Say tree twice.",
    "Was ist die Hauptstadt von Kaldia?",
    "Tell me a joke about computers.",
)
"""Questions of the builtin dataset in English and German, and one it never asks (what happens off-distribution)."""

BUILTIN_EVAL_QUESTIONS = 320
"""Most exact-match questions eval.builtin_examples may ask: the distinct questions of the builtin data with tasks
in rotation (snaketune.data.builtin.eval_examples counts them; tests/test_builtin_data.py checks the two agree)."""

AUTO_PROMPTS = 8
"""eval.prompts auto on data other than the builtin sample: the first user message of this many validation
conversations (with the data's own reply as the expected answer)."""

PAIR_MODES = ("best_vs_rest", "all")

PREFERENCE_LOSSES = ("dpo", "ipo")

REFERENCES = ("sft", "base")

BF16_OPTIMIZERS = ("auto", "snaketune", "deepspeed")


REVISION_ALLOWED = (
    "a branch, tag or commit (letters, digits, '_', '-', '.', '/'; no '..', not starting with '/' or '.')"
)


def check_revision(key: str, revision: str) -> None:
    """A hub revision names a branch, tag or commit; huggingface_hub uses it as a path in its cache."""
    if not re.match(r"^[\w][\w.\-/]*$", revision) or ".." in revision:
        fail(key, f"{revision!r} is not a git revision; allowed: {REVISION_ALLOWED}")
