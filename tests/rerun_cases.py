"""The changes the rerun tests make to a completed run of the tiny config, and the stages each reruns
(tests/test_reproducibility.py: a dry run lists exactly these; tests/test_rerun_clean.py: what reruns equals a clean
run of the changed config). A change is a config file over the tiny config, or an edit of a file of the workflow."""

from __future__ import annotations

from pathlib import Path

TOKENIZER = "deepseek-llm-7b-base"
"""model.tokenizer's change: the real DeepSeek tokenizer, a directory in the working directory where the tests put
conftest.deepseek_tokenizer (a hub id would be pinned to a commit first: tests/test_hub_revisions.py)."""

# What a change reruns, from the most upstream stage down. Every rerun ends in the manifest (unless only
# the report changed), the report and `all`.
# A rule named twice runs twice (the export stage: once for the SFT model, once for the DPO model).
END = ("manifest", "report", "all")
ONLY_EVALUATE = ("evaluate", *END)
# The benchmark stage (.test/config.yaml: one task, on the base, SFT and DPO model and each one's q4_k_m file): a
# job per model. The base model's job reads the tokenizer only; a GGUF file's job, its export directory.
BENCH_BASE = ("benchmark_base",)
BENCH_FILES = ("benchmark_gguf", "benchmark_gguf")
BENCH_ALL = ("benchmark_base", "benchmark", "benchmark", *BENCH_FILES)
# The export stage reads the eval prompts and eval.max_new_tokens too (snaketune.data.prompts, not evaluate.py).
FROM_EVALUATE = ("evaluate", "export", "export", *BENCH_FILES, *END)
ONLY_EXPORT = ("export", "export", *END)
FROM_EXPORT = ("export", "export", *BENCH_FILES, *END)
# The preference stages: the reference log-probs (of the SFT model), DPO on the SFT model, then evaluation and
# the DPO model's export, and the benchmark of the DPO model and its file.
FROM_DPO = ("dpo", "evaluate", "export", "benchmark", "benchmark_gguf", *END)
FROM_REFERENCE = ("reference", *FROM_DPO)
FROM_PAIRS = ("tokenize_pairs", *FROM_REFERENCE)
FROM_TRAIN = ("train", "export", "benchmark", "benchmark_gguf", *FROM_REFERENCE)
# The memory plans (rules plan, plan_dpo, plan_eval) read the memory settings and the DeepSpeed files; no stage reads
# a plan file (each plans for itself where it starts), so a plan reruns alone unless the change is also a stage's.
FROM_PLANS = ("plan", "plan_dpo", *FROM_TRAIN)
FROM_TOKENIZE = ("tokenize", *FROM_TRAIN)
# A new tokenizer remakes both tokenized caches, and the base model's benchmark reads it.
FROM_TOKENIZER = ("train_tokenizer", "tokenize", "tokenize_pairs", *BENCH_BASE, *FROM_TRAIN)
FROM_CONVERSATIONS = ("conversations", "preferences", *FROM_TOKENIZER)
FROM_DOWNLOAD = ("download", *FROM_CONVERSATIONS)
ONLY_REPORT = ("report", "all")


def _config(override: dict) -> tuple[str, dict]:
    return ("config", override)


def _edit(path: str, old: str | None = None, new: str | None = None) -> tuple[str, tuple]:
    """Replace `old` by `new` in a file of the copy; without them, append a line of code (a comment or a docstring
    changes no code hash: snaketune.keys.meaning_hash)."""
    return ("file", (path, old, new))


CASES = {
    # config: data
    "dataset.languages": (_config({"dataset": {"languages": ["en"]}}), FROM_CONVERSATIONS),
    "dataset.paths": (_config({"dataset": {"paths": "all"}}), FROM_CONVERSATIONS),
    # config: tokenization and tokenizer
    "tokenize.packing": (_config({"tokenize": {"packing": False}}), FROM_TOKENIZE),
    "model.tokenizer": (
        _config({"model": {"tokenizer": TOKENIZER}}),
        ("fetch_tokenizer", "tokenize", "tokenize_pairs", *BENCH_BASE, *FROM_TRAIN),
    ),
    "tokenizer vocabulary (rule file)": (
        _edit("workflow/rules/data.smk", "vocab_size=1024", "vocab_size=1000"),
        FROM_TOKENIZER,
    ),
    # config and files: training
    "train.learning_rate": (_config({"train": {"learning_rate": 1.0e-3}}), FROM_TRAIN),
    "ZeRO config file contents": (
        _edit("config/deepspeed/zero2.json", '"reduce_bucket_size": 200000000', '"reduce_bucket_size": 5e8'),
        FROM_PLANS,
    ),
    "train.deepspeed (ZeRO-2 -> ZeRO-3)": (
        _config({"train": {"deepspeed": "config/deepspeed/zero3.json"}}),
        FROM_PLANS,
    ),
    # config: evaluation, experiments
    "eval.prompts": (_config({"eval": {"prompts": ["What is 2 + 2?"]}}), FROM_EVALUATE),
    # config: export (GGUF files). Only the export stage and the report.
    "export.quants": (_config({"export": {"quants": ["q8_0"]}}), ONLY_EXPORT),
    "export.py": (_edit("workflow/snaketune/export/export.py"), FROM_EXPORT),
    # config: the benchmark. A task added runs its jobs only; a setting of the files, their jobs only.
    "benchmark.tasks (one added)": (
        _config({"benchmark": {"tasks": ["builtin_choice", "builtin_answer"]}}),
        (*BENCH_ALL, *END),
    ),
    "benchmark.limit": (_config({"benchmark": {"limit": 3}}), (*BENCH_ALL, *END)),
    "benchmark task file (builtin_choice.yaml)": (
        _edit("workflow/snaketune/benchmark/tasks/builtin_choice.yaml"),
        (*BENCH_ALL, *END),
    ),
    "benchmark/llama_lm.py": (_edit("workflow/snaketune/benchmark/llama_lm.py"), (*BENCH_ALL, *END)),
    # config: preference tuning. beta is not in the reference log-probs: they stay cached.
    "preference.beta": (_config({"preference": {"beta": 0.2}}), FROM_DPO),
    "preference.pairs": (_config({"preference": {"pairs": "all"}}), ("preferences", *FROM_PAIRS)),
    "preference.max_length": (_config({"preference": {"max_length": 64}}), ("plan_dpo", *FROM_PAIRS)),
    # the preference stage's own train settings: its plan and what follows, never SFT
    "preference.train.learning_rate": (
        _config(
            {
                "preference": {
                    "train": {
                        "learning_rate": 5.0e-4,
                        "max_steps": 8,
                        "global_batch_size": 12,
                        "micro_batch_size": 2,
                        "warmup_steps": 2,
                        "log_every": 2,
                        "eval_every": 4,
                        "checkpoint_every": 4,
                    }
                }
            }
        ),  # fmt: skip
        ("plan_dpo", *FROM_DPO),  # global and micro-batch change too: the DPO stage's memory
    ),
    "added experiment": (
        _config({"experiments": {"default": {}, "lr2": {"train": {"learning_rate": 1.0e-3}}}}),
        (
            "plan_eval",
            *FROM_PLANS,
        ),  # the three plans, train, reference, dpo, evaluate for lr2; caches are shared
    ),
    # the report has no options of its own: its template modules
    "report template (report_sections.py)": (_edit("workflow/snaketune/report/sections.py"), ONLY_REPORT),
    "report.py": (_edit("workflow/snaketune/report/build.py"), ONLY_REPORT),
    # each stage's module
    "download.py": (_edit("workflow/snaketune/data/download.py"), FROM_DOWNLOAD),
    # download reads local sources with snaketune.data.messages, so it runs messages.py too
    "messages.py": (_edit("workflow/snaketune/data/messages.py"), FROM_DOWNLOAD),
    # the cleaning rules of conversations and preferences, and the split by hash that download's chat-format reader
    # shares (snaketune.data.chat_format)
    "forest.py": (_edit("workflow/snaketune/data/forest.py"), FROM_DOWNLOAD),
    # the preferences read the conversations' split: a rewritten conversations file reruns them too
    "conversations.py": (_edit("workflow/snaketune/data/conversations.py"), FROM_CONVERSATIONS),
    "preferences.py": (_edit("workflow/snaketune/data/preferences.py"), ("preferences", *FROM_PAIRS)),
    # the chat template code of every stage that tokenizes, loads the tokenizer or writes it
    "tokenizer.py": (_edit("workflow/snaketune/data/tokenizer.py"), FROM_TOKENIZER),
    # (the benchmark stage loads the tokenizer through it: the base model's job too)
    "tokenization.py": (
        _edit("workflow/snaketune/data/tokenization.py"),
        ("tokenize", "tokenize_pairs", *BENCH_BASE, *FROM_TRAIN),
    ),
    "pairs.py": (_edit("workflow/snaketune/data/pairs.py"), FROM_PAIRS),
    "training.py": (_edit("workflow/snaketune/train/trainer.py"), FROM_TRAIN),
    # the reference stage runs DPO's trainer without training: the same model, kernels and attention
    "dpo.py": (_edit("workflow/snaketune/preference/dpo.py"), FROM_REFERENCE),
    "logprobs.py": (_edit("workflow/snaketune/preference/logprobs.py"), FROM_REFERENCE),
    "evaluate.py": (_edit("workflow/snaketune/evaluation/evaluate.py"), ONLY_EVALUATE),
    # the dataclasses: imported by plan, training, the preference stages, evaluate and the benchmark; not by the
    # data stages, which use only the allowed values (config/choices.py)
    "config/schema.py": (
        _edit("workflow/snaketune/config/schema.py"),
        ("plan", "plan_dpo", "plan_eval", *BENCH_BASE, *FROM_TRAIN),
    ),
    # what cannot change an output reruns nothing: a reworded docstring, comments and formatting (issue #42)
    "docstring (train/metrics.py)": (
        _edit("workflow/snaketune/train/metrics.py", '"""Training metrics', '"""The training metrics'),
        (),
    ),
    "comments and formatting (train/trainer.py)": (
        _edit(
            "workflow/snaketune/train/trainer.py",
            "from __future__ import annotations\n",
            "from __future__ import annotations  # noqa\n\n\n",
        ),
        (),
    ),
    # records are not outputs: a new record format remakes the manifest, and the evaluation, which reports package
    # versions as records do (provenance.package_versions), never a training stage
    "provenance.py": (_edit("workflow/snaketune/provenance.py"), ONLY_EVALUATE),
    # Snakemake's own trigger: a script newer than the outputs (even a comment: Snakemake compares its mtime)
    "workflow/scripts/evaluate.py": (_edit("workflow/scripts/evaluate.py"), ONLY_EVALUATE),
}


def edit_line(path: Path, by: str) -> str:
    """A line that changes what a file does: code in a Python module (a comment would change no code hash), a
    comment in any other file (hashed by its bytes: a task's YAML)."""
    return f"_EDITED_BY_TEST = True  # {by}\n" if str(path).endswith(".py") else f"# edited by {by}\n"
