"""End to end: the real `snakemake` command on a copy of the workflow, trained with CPU ranks.

Every run uses tests/configs/fast.yaml (150 builtin trees, 128-token blocks, 24 optimizer steps) and stops at
training, about 30 s on 2 cores, most of it imports: what these tests check (granted GPUs, two runs from scratch,
resume after SIGKILL, bad configs) ends there. The whole workflow on three ranks, a second invocation of it and
`--report`: tests/test_default_run.py, on the embedded default's run. The runs are shared between tests through
module-scoped fixtures; each works in its own copy of the workflow (Snakefile, workflow/, config/, envs/),
taken once from the repository, so that concurrent edits to the sources cannot give two runs different
cache keys. The assertions read Snakemake's own output and the files it produced.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import (
    FAST_CONFIG,
    NOTHING_TO_DO,
    RUN_TIMEOUT_S,
    Proc,
    Result,
    file_bytes,
    kill_everything,
    losses,
    snakemake,
    start,
    workflow_copy,
)

pytestmark = pytest.mark.slow

EXPERIMENT = "default"
RESUME_FROM_STEP = 8  # kill once a checkpoint of at least this step is complete (fast.yaml: every 4 steps)
# Runs other than the full one stop at training: evaluation and the report add nothing to what they test.
TRAIN_TARGET = f"results/train/{EXPERIMENT}/summary.json"
DATA_RULES = ("download", "conversations", "train_tokenizer", "tokenize")


def workflow_args(gpus: int, *extra: str) -> tuple[str, ...]:
    """A run with the fast config; `extra` holds flags and targets (--configfile takes several files, so
    it comes last)."""
    return (*extra, "--cores", "2", "--resources", f"gpu={gpus}", "--configfile", str(FAST_CONFIG))


# ---- reading results ---------------------------------------------------------------------------------


def read_summary(workdir: Path) -> dict:
    return json.loads((workdir / f"results/train/{EXPERIMENT}/summary.json").read_text())


def train_log(workdir: Path) -> str:
    return (workdir / f"logs/train/{EXPERIMENT}.log").read_text()


def tokenized_dir(workdir: Path) -> Path:
    dirs = sorted((workdir / "results/tokenized").iterdir())
    assert len(dirs) == 1, dirs
    return dirs[0]


# ---- fixtures ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def new_workdir(tmp_path_factory):
    """Factory of fresh working directories, each a copy of one snapshot of the repository's workflow."""
    return lambda name: workflow_copy(tmp_path_factory, name)


@dataclass(frozen=True)
class Run:
    workdir: Path
    result: Result
    seconds: float


def full_run(workdir: Path, gpus: int, *targets: str) -> Run:
    t0 = time.monotonic()
    result = snakemake(workdir, *workflow_args(gpus, *targets), timeout=RUN_TIMEOUT_S)
    return Run(workdir, result, time.monotonic() - t0)


@pytest.fixture(scope="module")
def run3(new_workdir) -> Run:
    """The workflow up to training from scratch with three granted GPUs (CPU ranks). The whole workflow on three
    ranks, down to the report, and a second invocation of it: tests/test_default_run.py (the embedded default)."""
    return full_run(new_workdir("gpu3"), 3, TRAIN_TARGET)


@pytest.fixture(scope="module")
def run3_again(new_workdir) -> Run:
    """The same run in another directory: its data and losses should equal run3's."""
    return full_run(new_workdir("gpu3_again"), 3, TRAIN_TARGET)


@pytest.fixture(scope="module")
def run2(new_workdir) -> Run:
    return full_run(new_workdir("gpu2"), 2, TRAIN_TARGET)


@dataclass(frozen=True)
class Resumed:
    workdir: Path
    killed_at_checkpoint: int
    survivors: list[Proc]
    locked: Result  # the first rerun, before --unlock
    dry_run: Result  # -n after --unlock, without --rerun-incomplete
    rerun: Result


@pytest.fixture(scope="module")
def resumed(new_workdir) -> Resumed:
    """Start the workflow, SIGKILL everything once a checkpoint of step >= 8 is complete, then rerun."""
    workdir = new_workdir("resume")
    run = start(workdir, *workflow_args(3, TRAIN_TARGET))
    deadline = time.monotonic() + RUN_TIMEOUT_S
    pattern = f"results/checkpoints/{EXPERIMENT}/*/step*/COMPLETE.json"
    while True:
        steps = [int(p.parent.name.removeprefix("step")) for p in workdir.glob(pattern)]
        if any(s >= RESUME_FROM_STEP for s in steps):
            break
        if run.proc.poll() is not None:
            pytest.fail(f"the run ended before a step-{RESUME_FROM_STEP} checkpoint:\n{run.output[-4000:]}")
        if time.monotonic() > deadline:
            kill_everything(run.proc)
            pytest.fail(f"no step-{RESUME_FROM_STEP} checkpoint after {RUN_TIMEOUT_S} s")
        time.sleep(0.05)
    survivors = kill_everything(run.proc)
    assert not (workdir / f"results/train/{EXPERIMENT}/summary.json").exists(), "killed too late"
    locked = snakemake(workdir, *workflow_args(3, TRAIN_TARGET), check=False)
    snakemake(workdir, "--unlock", "--configfile", str(FAST_CONFIG))
    dry_run = snakemake(workdir, *workflow_args(3, "-n", TRAIN_TARGET))
    rerun = snakemake(workdir, *workflow_args(3, "--rerun-incomplete", TRAIN_TARGET), timeout=RUN_TIMEOUT_S)
    return Resumed(workdir, max(steps), survivors, locked, dry_run, rerun)


# ---- tests -------------------------------------------------------------------------------------------


def test_three_granted_gpus_train_three_ranks(run3):
    out = run3.workdir / f"results/train/{EXPERIMENT}"
    for name in ("model/model.safetensors", "metrics.csv", "summary.json"):
        assert (out / name).is_file(), name
    finished = run3.result.finished_rules
    assert sorted(finished) == sorted([*DATA_RULES, "train"]), finished  # each once
    # Snakemake's job line shows the granted value of the gpu resource.
    assert re.search(r"resources: .*\bgpu=3\b", run3.result.output)
    assert read_summary(run3.workdir)["world_size"] == 3
    log = train_log(run3.workdir)
    assert "--nproc_per_node=3" in log and " x 3 ranks " in log, log[-3000:]
    train = losses(run3.workdir)
    first, last = train[min(train)], train[max(train)]
    assert last < first, train
    assert max(train) == 24 and len(train) == 12  # fast.yaml: 24 steps, logged every 2


def test_fewer_granted_gpus_cut_the_world_size(run2):
    # train.gpus is 3; Snakemake cuts the declared value to the 2 granted and the launcher follows it.
    assert re.search(r"resources: .*\bgpu=2\b", run2.result.output)
    assert read_summary(run2.workdir)["world_size"] == 2
    log = train_log(run2.workdir)
    assert "--nproc_per_node=2" in log and " x 2 ranks " in log, log[-3000:]
    train = losses(run2.workdir)
    assert train[max(train)] < train[min(train)]


def test_second_invocation_does_nothing(run3):
    """The training's target again: nothing to do, also with fewer granted GPUs (the whole workflow's second
    invocation: tests/test_default_run.py)."""
    summary = run3.workdir / f"results/train/{EXPERIMENT}/summary.json"
    mtime = summary.stat().st_mtime_ns
    dry = snakemake(run3.workdir, *workflow_args(3, "-n", TRAIN_TARGET))
    assert NOTHING_TO_DO in dry.output and dry.planned_rules == []
    assert NOTHING_TO_DO in snakemake(run3.workdir, *workflow_args(2, "-n", TRAIN_TARGET)).output
    assert summary.stat().st_mtime_ns == mtime


def test_data_stages_are_not_redone(run3):
    target = str(tokenized_dir(run3.workdir).relative_to(run3.workdir))
    dry = snakemake(run3.workdir, "-n", target, "--configfile", str(FAST_CONFIG))
    assert NOTHING_TO_DO in dry.output
    assert dry.planned_rules == []


def test_two_runs_from_scratch_are_identical(run3, run3_again):
    a, b = run3.workdir / "results", run3_again.workdir / "results"
    key = tokenized_dir(run3.workdir).name
    assert tokenized_dir(run3_again.workdir).name == key
    for sub in ("data/raw", "data/conversations", "tokenizer/builtin", f"tokenized/{key}"):
        files_a, files_b = file_bytes(a / sub), file_bytes(b / sub)
        assert files_a, sub
        assert sorted(files_a) == sorted(files_b), sub
        differ = [name for name in files_a if files_a[name] != files_b[name]]
        assert not differ, f"{sub}: files differ between two runs: {differ}"
    loss_a, loss_b = losses(run3.workdir), losses(run3_again.workdir)
    assert loss_a.keys() == loss_b.keys()
    max_diff = max(abs(loss_a[s] - loss_b[s]) for s in loss_a)
    assert loss_a == loss_b, f"train/loss differs between two runs by up to {max_diff:.3g}"


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        (
            {"dataset": {"paths": "best"}},
            "config key 'dataset.paths': 'best' is not allowed; allowed: top1, all",
        ),
        (
            {"train": {"learning_rat": 1e-3}},
            "'train.learning_rat': unknown key; did you mean 'learning_rate'?",
        ),
        (
            {"tokenize": {"chat_template": "chatml"}},
            "config key 'tokenize.chat_template': 'chatml' is not allowed; allowed: deepseek, model",
        ),
    ],
    ids=["paths", "typo", "chat_template"],
)
def test_invalid_config_fails_before_any_job(new_workdir, tmp_path, override, expected):
    workdir = new_workdir("bad_config")
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps(override))  # JSON is YAML
    result = snakemake(workdir, "--cores", "2", "--resources", "gpu=3", "--configfile", str(bad), check=False)
    assert result.returncode != 0
    assert "Invalid configuration" in result.stderr and expected in result.stderr, result.output[-3000:]
    assert result.finished_rules == []
    for made in ("results", "logs", "benchmarks"):
        assert not (workdir / made).exists(), made


def test_resume_after_sigkill(resumed, run3):
    # A SIGKILL leaves Snakemake's lock behind: the next run refuses to start until --unlock.
    assert resumed.locked.returncode != 0
    assert "Directory cannot be locked" in resumed.locked.output
    # --rerun-incomplete is not needed: the train rule writes its outputs only when training ends, and
    # Snakemake's incomplete-output check only looks at outputs that exist.
    assert "IncompleteFilesException" not in resumed.dry_run.output
    assert resumed.dry_run.planned_rules == ["train"]
    assert resumed.rerun.finished_rules == ["train"]  # the data stages are not redone

    log = train_log(resumed.workdir)
    match = re.search(r"resuming from checkpoint \S+ at step (\d+)", log)
    assert match, log[-3000:]
    step = int(match.group(1))
    assert step >= RESUME_FROM_STEP
    assert read_summary(resumed.workdir)["resumed_from_step"] == step

    for column in ("train/loss", "val/loss"):
        got, want = losses(resumed.workdir, column), losses(run3.workdir, column)
        assert got.keys() == want.keys(), column
        assert any(s > step for s in got), column
        for s in got:
            assert got[s] == pytest.approx(want[s], abs=1e-5), f"{column} at step {s} (resumed at {step})"


def test_sigkill_of_snakemake_stops_the_ranks(resumed):
    """torchrun starts ranks in sessions of their own; each rank asks to die with its parent (PDEATHSIG),
    so a SIGKILL of Snakemake leaves no rank training on into a job Snakemake marks incomplete."""
    assert resumed.survivors == [], [p.cmdline for p in resumed.survivors]


def test_lint_is_clean(new_workdir):
    # The shipped config (no --configfile); the lints do not depend on results.
    result = snakemake(new_workdir("lint"), "--lint")
    assert result.returncode == 0
    assert "Congratulations, your workflow is in a good condition!" in result.output, result.output
