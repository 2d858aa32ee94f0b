"""Faults: a killed workflow redoes what was cut short and ends where an uninterrupted run ends (failing writes:
tests/test_write_faults.py).

Killed runs (`interrupted`): one working directory runs the fast workflow (tests/configs/fast.yaml) and is
SIGKILLed, Snakemake's process group and every rank, once inside every stage of the default workflow:
download and plan (they run side by side) together, then conversations, train_tokenizer and preferences
together, tokenize, tokenize_pairs, train, reference, dpo, evaluate, manifest and report, each in the rerun
that redoes the job killed before it (export: its own test; plan_dpo, sub-second, is not killed). Each kill
comes at a fixed point, set by the test hook snaketune.io.PAUSE_ENV: a writer stops just before it renames
one output into place, with the outputs renamed before it already there (or, for tokenize and plan, before
their provenance record, all outputs in place). Training is killed after its last step, once its final
checkpoint is complete, before its outputs are in place. After each kill a dry run shows what Snakemake makes of the leftovers, `--unlock` removes the
stale lock and `--rerun-incomplete` reruns, as a user would. The end result is compared with `reference`,
an uninterrupted run of the same config (conftest.tiny_run, which tests/test_security.py greps for the fake hub
tokens in its environment). The reference run and the killed runs take about
3 minutes on 2 cores; the whole file about 3.5.
"""

from __future__ import annotations

import contextlib
import csv
import fnmatch
import json
import os
import re
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pandas as pd
import pytest

from conftest import (
    RUN_TIMEOUT_S,
    TEMPORARY,
    TINY_CONFIG,
    Result,
    file_bytes,
    finish,
    kill_everything,
    losses,
    snakemake,
    start,
    temporaries,
    workflow_copy,
)
from snaketune import io

EXPERIMENT = "default"
HOOK_LINE = re.compile(rf"test hook {io.PAUSE_ENV}: paused before renaming \S+ onto (\S+)")
POLL_S = 0.1


# ---- the workflow runs -----------------------------------------------------------------------------


def new_workdir(tmp_path_factory, name: str) -> Path:
    """A copy of the workflow (conftest.workflow_copy) with the config file that leaves the benchmark out."""
    workdir = workflow_copy(tmp_path_factory, name)
    (workdir / NO_BENCHMARK).write_text(json.dumps({"benchmark": {"enabled": False}}))
    return workdir


@contextlib.contextmanager
def environment(**values: str) -> Iterator[None]:
    """Variables for the snakemake commands started inside (conftest.start copies os.environ)."""
    with pytest.MonkeyPatch.context() as mp:
        for name, value in values.items():
            mp.setenv(name, value)
        yield


def tiny_args(*extra: str, more: tuple[str, ...] = ()) -> tuple[str, ...]:
    """A run of the tiny config, as conftest.tiny_run runs it; `extra` holds flags (--configfile comes last), `more`
    config files over the tiny config."""
    return (
        *extra,
        "--cores",
        "2",
        "--resources",
        "gpu=2",
        "--configfile",
        str(TINY_CONFIG),
        NO_BENCHMARK,
        *more,
    )


NO_BENCHMARK = "nobench.yaml"
"""The benchmark stage left out of these runs: every kill's rerun would pay its jobs (a minute of CPU) again, and no
kill falls in it (the stage writes through snaketune.io as the others do)."""


BOOKKEEPING = {"train": {"keep_checkpoints": 3, "checkpoint_every": 1, "log_every": 2, "eval_every": 3}}
"""Changed for the run that redoes the killed training only: checkpoint and logging cadence change no weight
(snaketune.config.owners), so the rerun resumes the killed run's checkpoint (issue #42: they once named it)."""


@pytest.fixture(scope="module")
def reference(tiny_run) -> Path:
    """The whole tiny workflow, uninterrupted (conftest.tiny_run, shared with other tests)."""
    return tiny_run


def tokenized_key(workdir: Path) -> str:
    (key,) = [p.name for p in (workdir / "results/tokenized").iterdir() if not p.name.startswith(".")]
    return key


# ---- killing every stage -----------------------------------------------------------------------------


@dataclass(frozen=True)
class Kill:
    """Where one run is killed: at the pause hook's `pause` globs, or (train) after a complete checkpoint."""

    rules: tuple[str, ...]
    pause: tuple[str, ...]
    outputs: tuple[str, ...]
    """Declared outputs of the killed jobs (globs under the working directory)."""


KILLS = (
    Kill(
        ("download", "plan"),
        ("results/data/raw/source.json", f"results/provenance/plan/{EXPERIMENT}.json"),
        (
            "results/data/raw/messages.parquet",
            "results/data/raw/SHA256SUMS",
            "results/data/raw/source.json",
            f"results/plan/{EXPERIMENT}.json",
        ),
    ),
    Kill(
        ("conversations",),
        ("results/data/conversations/stats.json",),
        tuple(
            f"results/data/conversations/{n}" for n in ("train.parquet", "validation.parquet", "stats.json")
        ),
    ),
    Kill(  # two jobs that run side by side once the conversations exist
        ("train_tokenizer", "preferences"),
        (
            "results/tokenizer/builtin/tokenizer_config.json",
            "results/data/preferences/best_vs_rest/stats.json",
        ),
        (
            "results/tokenizer/builtin/tokenizer.json",
            "results/tokenizer/builtin/tokenizer_config.json",
            *(
                f"results/data/preferences/best_vs_rest/{n}"
                for n in ("train.parquet", "validation.parquet", "stats.json")
            ),
        ),
    ),
    Kill(("tokenize",), ("results/provenance/tokenize/*.json",), ("results/tokenized/*",)),
    Kill(("tokenize_pairs",), ("results/provenance/tokenize_pairs/*.json",), ("results/tokenized_pairs/*",)),
    Kill(  # after its last step and final checkpoint, before its outputs are in place: it resumes at the end
        ("train",),
        (f"results/train/{EXPERIMENT}/summary.json",),
        tuple(f"results/train/{EXPERIMENT}/{n}" for n in ("model", "metrics.csv", "tb", "summary.json")),
    ),
    Kill(
        ("reference",),
        (f"results/preference/{EXPERIMENT}/reference-*/reference.json",),
        tuple(
            f"results/preference/{EXPERIMENT}/reference-*/{n}"
            for n in ("reference.parquet", "reference.json")
        ),
    ),
    Kill(
        ("dpo",),
        (f"results/dpo/{EXPERIMENT}/summary.json",),
        tuple(f"results/dpo/{EXPERIMENT}/{n}" for n in ("model", "metrics.csv", "tb", "summary.json")),
    ),
    Kill(
        ("evaluate",),
        (f"results/eval/{EXPERIMENT}/generations.jsonl",),
        (f"results/eval/{EXPERIMENT}/metrics.json", f"results/eval/{EXPERIMENT}/generations.jsonl"),
    ),
    Kill(("manifest",), ("results/provenance/manifest.json",), ("results/provenance/manifest.json",)),
    Kill(("report",), ("results/report/memory.png",), ("results/report/*",)),
)
"""In the order the workflow reaches them; every stage of the default workflow is killed once."""


@dataclass
class Killed:
    kill: Kill
    paused_at: list[str]
    """Outputs the hook held back (empty for train)."""
    existing: list[str]
    """Declared outputs of the killed jobs that were in place at the kill."""
    temporaries: list[str]
    checkpoints: list[int]
    """Steps of the complete checkpoints at the kill."""
    survivors: list
    dry_run: Result
    rerun: Result | None = None
    """The next command (with --rerun-incomplete), which redid the killed jobs; killed itself in turn."""

    @property
    def incomplete_listed(self) -> list[str]:
        """The files Snakemake's IncompleteFilesException lists in the dry run."""
        match = re.search(r"Incomplete files:\n((?:[^\n]+\n?)+)", self.dry_run.output)
        return sorted(match.group(1).split()) if match else []


@dataclass
class Interrupted:
    workdir: Path
    killed: list[Killed] = field(default_factory=list)
    final: Result | None = None


def _wait(run, what: str, done: Callable[[], bool]) -> None:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not done():
        if run.proc.poll() is not None:
            pytest.fail(f"the run ended before {what}:\n{run.output[-4000:]}")
        if time.monotonic() > deadline:
            kill_everything(run.proc)
            pytest.fail(f"no {what} after {RUN_TIMEOUT_S} s:\n{run.output[-4000:]}")
        time.sleep(POLL_S)


def paused_targets(workdir: Path) -> list[str]:
    """The outputs whose writers stopped at the pause hook, from the jobs' logs."""
    found = []
    for log in (workdir / "logs").rglob("*.log"):
        with contextlib.suppress(OSError):
            found += HOOK_LINE.findall(log.read_text(errors="replace"))
    return sorted(found)


def complete_checkpoints(workdir: Path) -> list[int]:
    pattern = f"results/checkpoints/{EXPERIMENT}/*/step*/COMPLETE.json"
    return sorted(int(p.parent.name.removeprefix("step")) for p in workdir.glob(pattern))


def _matching(workdir: Path, globs: tuple[str, ...]) -> list[str]:
    return sorted({str(p.relative_to(workdir)) for g in globs for p in workdir.glob(g)})


@pytest.fixture(scope="module")
def interrupted(tmp_path_factory, reference) -> Interrupted:
    """Kill the fast workflow in every stage (KILLS), rerunning after each kill, then run it to the end."""
    workdir = new_workdir(tmp_path_factory, "faults_killed")
    state = Interrupted(workdir)
    rerun_flags: tuple[str, ...] = ()
    more: tuple[str, ...] = ()
    (workdir / "bookkeeping.yaml").write_text(json.dumps(BOOKKEEPING))
    for kill in KILLS:
        hook = {io.PAUSE_ENV: os.pathsep.join(kill.pause)}
        with environment(**hook):
            run = start(workdir, *tiny_args(*rerun_flags, more=more))

        def all_paused(kill=kill):
            held = paused_targets(workdir)
            return all(any(fnmatch.fnmatchcase(t, p) for t in held) for p in kill.pause)

        _wait(run, f"the pause hook at {kill.pause}", all_paused)
        survivors = kill_everything(run.proc)
        if state.killed:
            state.killed[-1].rerun = Result(tuple(run.proc.args[1:]), run.proc.returncode, *_texts(run))
        results = workdir / "results"
        # Declared outputs only: a glob such as results/report/* also finds the staging directory.
        existing = [p for p in _matching(workdir, kill.outputs) if not TEMPORARY.match(Path(p).name)]
        state.killed.append(
            Killed(
                kill=kill,
                paused_at=paused_targets(workdir),
                existing=existing,
                temporaries=temporaries(results),
                checkpoints=complete_checkpoints(workdir),
                survivors=survivors,
                dry_run=snakemake(workdir, *tiny_args("-n"), check=False),
            )
        )
        snakemake(workdir, "--unlock", "--configfile", str(TINY_CONFIG))
        rerun_flags = ("--rerun-incomplete",)
        more = ("bookkeeping.yaml",) if kill.rules == ("train",) else ()
    run = start(workdir, *tiny_args(*rerun_flags))
    state.final = finish(run, RUN_TIMEOUT_S)
    state.killed[-1].rerun = state.final
    return state


def _texts(run) -> tuple[str, str]:
    return run.out.read_text(), run.err.read_text()


def _killed(interrupted: Interrupted, rule: str) -> Killed:
    (found,) = [k for k in interrupted.killed if rule in k.kill.rules]
    return found


@pytest.mark.slow  # a whole workflow run
def test_every_stage_is_killed_inside_its_job(interrupted):
    rules = [r for k in interrupted.killed for r in k.kill.rules]
    expected = (
        "download",
        "plan",
        "conversations",
        "train_tokenizer",
        "preferences",
        "tokenize",
        "tokenize_pairs",
        "train",
        "reference",
        "dpo",
        "evaluate",
    )
    assert rules == [*expected, "manifest", "report"]
    for k in interrupted.killed:
        assert k.survivors == [], [p.cmdline for p in k.survivors]
        # Killed mid-write: the hook held every target back, a temporary holds what was not renamed yet.
        assert all(any(fnmatch.fnmatchcase(t, p) for t in k.paused_at) for p in k.kill.pause), k
        assert k.temporaries, k.kill.rules
    train = _killed(interrupted, "train")
    # Killed at the last rename: the other outputs are in place (and listed as incomplete), summary.json is not.
    assert f"results/train/{EXPERIMENT}/summary.json" not in train.existing, train.existing
    assert train.checkpoints == [2, 4], (
        "the final step's checkpoint is durable before the outputs are written"
    )


@pytest.mark.slow  # a whole workflow run
def test_snakemake_never_takes_a_killed_jobs_outputs_as_complete(interrupted):
    """What was renamed into place before the kill is complete-looking; Snakemake's incomplete marker says
    otherwise, and without --rerun-incomplete it refuses to go on, naming exactly those files. Where
    nothing was in place yet, the dry run simply plans the job again."""
    with_outputs = []
    for k in interrupted.killed:
        if k.existing:
            with_outputs.append(k.kill.rules)
            assert k.dry_run.returncode != 0, k.dry_run.output[-2000:]
            assert "IncompleteFilesException" in k.dry_run.output
            assert k.incomplete_listed == k.existing, k.dry_run.output[-2000:]
        else:
            assert k.dry_run.returncode == 0, k.dry_run.output[-2000:]
            assert set(k.kill.rules) <= set(k.dry_run.planned_rules), k.dry_run.planned_rules
    # Most kill points leave complete-looking outputs behind, the case a workflow must not be fooled by.
    assert len(with_outputs) >= 6, with_outputs


@pytest.mark.slow  # a whole workflow run
def test_every_killed_job_is_redone(interrupted):
    for k in interrupted.killed:
        assert k.rerun is not None
        assert set(k.kill.rules) <= set(k.rerun.finished_rules), (k.kill.rules, k.rerun.finished_rules)
    # The final run redid only the report: everything before was redone by the earlier reruns.
    assert interrupted.final.finished_rules == ["report", "all"], interrupted.final.finished_rules


@pytest.mark.slow  # a rerun of the export stage
def test_a_killed_export_is_redone_to_the_uninterrupted_files(tmp_path_factory, reference):
    """The export stage killed as it renames its directory into place (the GGUF files written and measured): the
    directory is not there, the rerun redoes the job, and its files are the uninterrupted run's byte for byte.
    (The killed runs above do not pause it: it runs beside evaluate and DPO in an order Snakemake picks.)"""
    from conftest import clone_run

    workdir = clone_run(reference, tmp_path_factory.mktemp("faults_export") / "wf")
    (workdir / NO_BENCHMARK).write_text(json.dumps({"benchmark": {"enabled": False}}))
    target = f"results/export/{EXPERIMENT}/sft"
    shutil.rmtree(
        workdir / target
    )  # asked for by name: Snakemake does not remake a missing intermediate itself
    with environment(**{io.PAUSE_ENV: target}):
        run = start(workdir, target, *tiny_args())
    _wait(run, f"the pause hook at {target}", lambda: target in paused_targets(workdir))
    assert kill_everything(run.proc) == []
    assert not (workdir / target).exists() and temporaries(workdir / "results")
    assert snakemake(workdir, target, *tiny_args("-n"), check=False).planned_rules == ["export"]
    snakemake(workdir, "--unlock", "--configfile", str(TINY_CONFIG))
    rerun = finish(start(workdir, target, *tiny_args("--rerun-incomplete")), RUN_TIMEOUT_S)
    assert "export" in rerun.finished_rules and temporaries(workdir / "results") == []
    want = {p.name: p.read_bytes() for p in sorted((reference / target).glob("*.gguf"))}
    assert want and {p.name: p.read_bytes() for p in sorted((workdir / target).glob("*.gguf"))} == want
    got, ref = (json.loads((w / target / "metrics.json").read_text()) for w in (workdir, reference))
    for a, b in zip(got["files"], ref["files"], strict=True):
        assert (a["perplexity"], a["kl_mean"], a["top1_agreement"]) == (
            b["perplexity"],
            b["kl_mean"],
            b["top1_agreement"],
        )


@pytest.mark.slow  # a whole workflow run
def test_no_temporary_survives(interrupted, reference):
    assert temporaries(interrupted.workdir / "results") == []
    assert temporaries(reference / "results") == []


@pytest.mark.slow  # a whole workflow run
def test_data_outputs_equal_an_uninterrupted_run(interrupted, reference):
    key = tokenized_key(reference)
    assert tokenized_key(interrupted.workdir) == key
    for sub in ("data/raw", "data/conversations", "tokenizer/builtin", f"tokenized/{key}", "plan"):
        assert_same_files(interrupted.workdir, reference, sub)


def assert_same_files(workdir: Path, reference: Path, sub: str) -> None:
    """results/<sub> of the killed run holds the uninterrupted run's files, byte for byte."""
    want = file_bytes(reference / "results" / sub)
    got = file_bytes(workdir / "results" / sub)
    assert want, sub
    assert sorted(got) == sorted(want), sub
    differ = [name for name in want if got[name] != want[name]]
    assert not differ, f"{sub}: differs from the uninterrupted run: {differ}"


@pytest.mark.slow  # a whole workflow run
def test_preference_outputs_equal_an_uninterrupted_run(interrupted, reference):
    """The pairs and their tokens byte for byte, the reference log-probs and DPO's logged losses as the
    uninterrupted run's (each of those stages was killed once)."""
    for sub in ("data/preferences", "tokenized_pairs"):
        assert_same_files(interrupted.workdir, reference, sub)

    def reference_logprobs(workdir: Path) -> pd.DataFrame:
        (path,) = (workdir / "results/preference" / EXPERIMENT).glob("reference-*/reference.parquet")
        return pd.read_parquet(path)

    pd.testing.assert_frame_equal(
        reference_logprobs(interrupted.workdir), reference_logprobs(reference), rtol=1e-6, atol=0
    )

    def dpo_losses(workdir: Path) -> dict[int, float]:
        with open(workdir / f"results/dpo/{EXPERIMENT}/metrics.csv", newline="") as f:
            return {
                int(float(r["step"])): float(r["dpo/loss"]) for r in csv.DictReader(f) if r.get("dpo/loss")
            }

    got, want = dpo_losses(interrupted.workdir), dpo_losses(reference)
    assert want and got.keys() == want.keys()
    for step in want:
        assert got[step] == pytest.approx(want[step], abs=1e-5), f"dpo/loss at step {step}"


@pytest.mark.slow  # a whole workflow run
def test_training_resumes_from_its_last_complete_checkpoint(interrupted, reference):
    """Killed after its last step, before its outputs were in place: the rerun, with other checkpoint and logging
    cadences (BOOKKEEPING), resumes at the final checkpoint, trains nothing more, and writes what the uninterrupted
    run wrote (mid-run resume: tests/test_workflow.py)."""
    k = _killed(interrupted, "train")
    log = (interrupted.workdir / f"logs/train/{EXPERIMENT}.log").read_text()
    match = re.search(r"resuming from checkpoint \S+ at step (\d+)", log)
    assert match, log[-3000:]
    step = int(match.group(1))
    assert step == max(k.checkpoints)  # the newest complete one at the kill
    summary = json.loads((interrupted.workdir / f"results/train/{EXPERIMENT}/summary.json").read_text())
    assert summary["resumed_from_step"] == step
    for column in ("train/loss", "val/loss"):
        got, want = losses(interrupted.workdir, column), losses(reference, column)
        assert got.keys() == want.keys() and max(got) == step, column
        for s in got:
            assert got[s] == pytest.approx(want[s], abs=1e-5), f"{column} at step {s} (resumed at {step})"


@pytest.mark.slow  # a whole workflow run
def test_evaluation_report_and_manifest_match_an_uninterrupted_run(interrupted, reference):
    def read(workdir: Path, name: str) -> dict:
        return json.loads((workdir / name).read_text())

    got, want = (read(w, f"results/eval/{EXPERIMENT}/metrics.json") for w in (interrupted.workdir, reference))
    for which in ("base", "tuned"):
        assert got["validation"][which]["loss"] == pytest.approx(want["validation"][which]["loss"], abs=1e-5)
    got, want = (read(w, "results/report/summary.json") for w in (interrupted.workdir, reference))
    for name in ("final_train_loss", "final_val_loss", "base_val_loss", "tuned_val_loss"):
        assert got["experiments"][EXPERIMENT][name] == pytest.approx(
            want["experiments"][EXPERIMENT][name], abs=1e-5
        )
    # One record per job behind the report, each describing the outputs as they are now.
    manifest = read(interrupted.workdir, "results/provenance/manifest.json")
    jobs = sorted(j["rule"] for j in manifest["jobs"])
    assert jobs == sorted(
        (
            "download",
            "conversations",
            "preferences",
            "train_tokenizer",
            "tokenize",
            "tokenize_pairs",
            # not the memory plans: no stage reads them (each plans for itself where it starts)
            "train",
            "reference",
            "dpo",
            "evaluate",
            "export",
            "export",
        )
    )
    assert [j["rule"] for j in manifest["jobs"] if j["status"] != "ok"] == []
    assert manifest["missing"] == []
