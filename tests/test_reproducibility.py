"""Reproducibility: a change reruns exactly the stages it touches, and every job leaves a provenance record.

One completed run of the tiny config in a copy of the workflow (conftest.tiny_run); then, for each kind of change, the change
is applied in the copy (an extra config file, or an edited file whose bytes and timestamps are restored
afterwards), Snakemake dry-runs, and the rules of its "Job stats" table must be exactly the expected ones.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from conftest import clone_run
from test_workflow import NOTHING_TO_DO, Result, snakemake

pytestmark = pytest.mark.slow

REALDATA_TOKENIZER = Path(__file__).resolve().parents[2] / "shared" / "realdata" / "deepseek-llm-7b-base"
CONFIG = "tiny.yaml"  # copied into the working directory with the workflow (conftest.tiny_run)
CHANGE = "change.yaml"  # a second --configfile holding the change under test

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
        # The real tokenizer's directory (a hub id would be pinned to a commit first: tests/test_hub_revisions.py).
        _config({"model": {"tokenizer": str(REALDATA_TOKENIZER)}}),
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


# ---- helpers -------------------------------------------------------------------------------------


def job_stats(result: Result) -> dict[str, int]:
    """rule -> job count from the first "Job stats" table of a dry run; {} when nothing is to be done."""
    out = result.output
    match = re.search(r"^Job stats:\njob\s+count\n-+\s+-+\n(.*?)^total\s+(\d+)\s*$", out, re.M | re.S)
    if match is None:
        assert NOTHING_TO_DO in out, out[-3000:]
        return {}
    stats = {
        name: int(count) for name, count in (line.split() for line in match.group(1).strip().splitlines())
    }
    assert sum(stats.values()) == int(match.group(2)), out[-3000:]
    return stats


def edit_line(path: Path, by: str) -> str:
    """A line that changes what a file does: code in a Python module (a comment would change no code hash), a
    comment in any other file (hashed by its bytes: a task's YAML)."""
    return f"_EDITED_BY_TEST = True  # {by}\n" if str(path).endswith(".py") else f"# edited by {by}\n"


@contextlib.contextmanager
def edited(path: Path, old: str | None, new: str | None) -> Iterator[None]:
    """The file changed for the duration; then its bytes and its timestamps are as before (Snakemake
    compares input mtimes, so a restored file must not look newer than the outputs)."""
    data, stat = path.read_bytes(), path.stat()
    text = data.decode()
    if old is None:
        changed = text + edit_line(path, "tests/test_reproducibility.py")
    else:
        assert text.count(old) == 1, f"{old!r} not found once in {path}"
        changed = text.replace(old, new)
    path.write_text(changed)
    try:
        yield
    finally:
        path.write_bytes(data)
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def args(*extra: str, configs: tuple[str, ...] = (CONFIG,)) -> tuple[str, ...]:
    return (*extra, "--cores", "2", "--resources", "gpu=2", "--configfile", *configs)


def dry_run(workdir: Path, configs: tuple[str, ...] = (CONFIG,)) -> dict[str, int]:
    return job_stats(snakemake(workdir, *args("-n", configs=configs)))


# ---- the completed run ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workdir(tiny_run, tmp_path_factory) -> Path:
    """A copy of the shared tiny run (conftest.tiny_run: one complete run from scratch, made with hub tokens in the
    environment), so that the edits below never touch the run other tests read."""
    return clone_run(tiny_run, tmp_path_factory.mktemp("reproducibility") / "wf")


def test_a_completed_run_reruns_nothing(workdir):
    result = snakemake(workdir, "--cores", "all", "--resources", "gpu=2", "--configfile", CONFIG)
    assert NOTHING_TO_DO in result.output
    assert result.finished_rules == []


@pytest.mark.parametrize("case", list(CASES))
def test_a_change_reruns_exactly_what_it_touches(workdir, case):
    (kind, change), expected = CASES[case]
    if case == "model.tokenizer" and not REALDATA_TOKENIZER.is_dir():
        pytest.skip(f"{REALDATA_TOKENIZER} absent (../shared/realdata, beside the checkout in CI)")
    if kind == "config":
        (workdir / CHANGE).write_text(json.dumps(change))  # JSON is YAML
        stats = dry_run(workdir, (CONFIG, CHANGE))
    else:
        path, old, new = change
        with edited(workdir / path, old, new):
            stats = dry_run(workdir)
    assert stats == dict(Counter(expected)), f"{case}: expected {sorted(expected)}, got {stats}"


def test_the_changes_left_the_run_complete(workdir):
    """Every change was undone exactly: the run still has nothing to do (the matrix above relies on it)."""
    assert dry_run(workdir) == {}


# ---- provenance ----------------------------------------------------------------------------------


def _records(workdir: Path) -> dict[str, dict]:
    root = workdir / "results/provenance"
    return {
        p.relative_to(root).with_suffix("").as_posix(): json.loads(p.read_text())
        for p in sorted(root.rglob("*.json"))
        if p.name != "manifest.json"
    }


def _jobs(workdir: Path, *, plans: bool = True) -> list[str]:
    """The records a run of the fast config leaves (the report's aside), by rule[/wildcards]; without `plans`, those
    behind the report (no stage reads a memory plan: each plans for itself where it starts)."""
    key = next((workdir / "results/tokenized").iterdir()).name
    pairs_key = next((workdir / "results/tokenized_pairs").iterdir()).name
    reference = next((workdir / "results/preference/default").glob("reference-*")).name.removeprefix(
        "reference-"
    )
    base = next((workdir / "results/benchmark/base").iterdir()).name
    jobs = [
        "download",
        "conversations",
        "train_tokenizer",
        f"tokenize/{key}",
        "train/default",
        "preferences/best_vs_rest",
        f"tokenize_pairs/{pairs_key}",
        f"reference/default_{reference}",
        "dpo/default",
        "evaluate/default",
        "export/default_dpo",
        "export/default_sft",
        f"benchmark_base/{base}_builtin_choice",
        "benchmark/default_sft_builtin_choice",
        "benchmark/default_dpo_builtin_choice",
        "benchmark_gguf/default_sft_q4_k_m_builtin_choice",
        "benchmark_gguf/default_dpo_q4_k_m_builtin_choice",
    ]
    return jobs + (["plan/default", "plan_dpo/default", "plan_eval/default"] if plans else [])


def test_every_job_has_a_record(workdir):
    records = _records(workdir)
    assert sorted(records) == sorted([*_jobs(workdir), "report"])
    for name, rec in records.items():
        assert re.fullmatch(r"[0-9a-f]{16}", rec["code"] or ""), name  # every stage's params hash its code
        assert rec["start"] <= rec["end"] and rec["wall_s"] >= 0, name
        assert rec["host"]["hostname"] and rec["gpus"] == [], name  # CPU ranks here
        assert rec["software"]["python"] and rec["software"]["snakemake"], name
        assert rec["git"] is None, name  # the copy is not a git checkout
        for path, entry in {**rec["inputs"], **rec["outputs"]}.items():
            if entry["type"] == "file":
                assert entry["sha256"] == hashlib.sha256((workdir / path).read_bytes()).hexdigest(), path
            else:
                assert entry["type"] == "directory" and entry["files"], path
    # The stages of the Snakefile's world ran without torch (tests/test_layout.py checks their imports); the
    # evaluation scores models with it in its own process (the launchers of train, reference and dpo need it only
    # on a machine with GPUs: their ranks do the work).
    light = {"download", "conversations", "train_tokenizer", "tokenize", "preferences", "tokenize_pairs", "plan",
             "plan_dpo", "plan_eval", "report"}  # fmt: skip
    for name, rec in records.items():
        assert not (rec["rule"] in light and rec["imported_torch"]), name
    assert records["evaluate/default"]["imported_torch"]
    train = records["train/default"]
    assert train["seeds"] == {"spec.train.seed": 1234}
    assert train["params"]["spec"]["train"]["learning_rate"] == 3.0e-3
    assert "config/deepspeed/zero2.json" in train["inputs"]
    assert records["download"]["seeds"] == {"spec.builtin.seed": 0}


def test_the_manifest_follows_the_records_back(workdir):
    manifest = json.loads((workdir / "results/provenance/manifest.json").read_text())
    jobs = manifest["jobs"]
    assert sorted(job["record"] for job in jobs) == sorted(
        f"results/provenance/{name}.json" for name in _jobs(workdir, plans=False)
    )
    # In pipeline order: every job comes after the jobs that wrote its inputs.
    written_by = {out: i for i, job in enumerate(jobs) for out in job["outputs"]}
    for i, job in enumerate(jobs):
        assert all(written_by.get(inp, -1) < i for inp in job["inputs"]), job["record"]
    assert {job["status"] for job in jobs} == {"ok"}
    assert manifest["missing"] == []
    assert "config/deepspeed/zero2.json" in manifest["sources"]
    assert not [src for src in manifest["sources"] if src.startswith("results/")]
    summary = manifest["summary"]
    assert summary["jobs"] == len(jobs) and summary["changed"] == []
    assert list(summary["git"]) == ["not a git checkout"]
    report = (workdir / "results/report/report.md").read_text()
    assert "### Jobs" in report
    for job in jobs:
        assert f"`{job['record']}`" in report, job["record"]
