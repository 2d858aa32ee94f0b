"""The one module of shared test helpers and fixtures (a test module never imports another: tests/test_layout.py):
copies of the workflow and the one way to run snakemake in them (`snakemake`, or `start` and `finish` for a run to
kill; a command that starts no job runs forked in-process), the shared tiny run, the real data chain on a small builtin
sample, and a helper that trains on it with real DeepSpeed ranks (CPU ranks over gloo when there is no GPU).
What a test builds its inputs from lives beside it by kind: chat_data, oasst_trees, bad_data, report_tree,
rerun_cases, states4bit_scenarios."""

from __future__ import annotations

import contextlib
import csv
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# The suite runs two pytest workers on CI's two cores, and each starts processes with OpenMP thread teams of their
# own (CPU ranks, the evaluate and export rules): the cores are oversubscribed by design. OpenMP threads that
# spin while they wait (libgomp's default) then burn the other processes' time: a forward and backward of the
# 135M SmolLM2 at 2 x 128 tokens, two threads, beside two other busy processes, took 14-44 s spinning and 3.2-3.3 s
# with passive waiting (this 2-core machine, 2026-12-03). Set before any torch loads, inherited by every process.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
DEEPSPEED_DIR = REPO / "config" / "deepspeed"
IN_CI = os.environ.get("CI", "").lower() not in ("", "0", "false")
"""CI sets CI (.ci/run; GitHub Actions and GitLab do too)."""


_CURRENT: dict[str, object] = {}
"""The test being set up or run: its id and whether it is marked slow (pytest_runtest_setup)."""


def pytest_runtest_setup(item):
    _CURRENT.update(id=item.nodeid, slow=item.get_closest_marker("slow") is not None)


def heavy(what: str) -> None:
    """Called where a test starts DeepSpeed ranks or Snakemake jobs: only a test marked slow may (make check's tier
    runs neither, to stay within its 3 minutes); an unmarked one fails, saying so, instead of slowing the tier."""
    if _CURRENT.get("slow") is False:
        pytest.fail(
            f"{_CURRENT['id']} {what} but is not marked slow: add @pytest.mark.slow (make test's tier)"
        )


def needs(missing: str | bool | None) -> None:
    """A test's prerequisite that is not a Python package: a system package CI installs (chromium, SLURM's daemons)
    or a SLURM cluster this machine should start. Where it is `missing` (why, in words), the test fails in CI, where
    .ci/run installs everything and a skip would hide a broken setup, and skips with the reason on a user's machine,
    which may lack SLURM or root (the test then checks nothing there, and says so). Pinned Python packages never
    skip: tests/test_envs.py fails on a broken install."""
    if missing:
        if IN_CI:
            pytest.fail(f"{missing} (CI is set: a missing prerequisite fails there instead of skipping)")
        pytest.skip(missing)


WORKFLOW_FILES = ("Snakefile", "workflow", "config", "envs")
"""What a copy of the workflow needs (tests run Snakemake in copies, never in the checkout)."""


def copy_workflow(dest: Path) -> Path:
    """Copy the workflow's files into `dest` (without caches, results or logs); returns `dest`."""
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", ".snakemake", "results", "logs")
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES:
        src = REPO / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)
    return dest


def assert_close_to_scale(actual, expected, *, terms: int, eps: float | None = None, msg: str = "") -> None:
    """`actual` equals `expected` within the rounding error of summing `terms` values: every entry within
    terms x eps x max|expected| (eps: of expected's dtype, 2^-23 for fp32). The bound: summing n terms in floating
    point errs by at most (n - 1) u sum|x_i| (Higham, Accuracy and Stability of Numerical Algorithms, 2nd ed.,
    eq. 4.4, u = eps / 2), so two summation orders differ by at most (n - 1) eps sum|x_i|; with terms no larger
    than the tensor's largest entry, sum|x_i| <= n max|expected| is the scale, and this allows n of its ulps, well
    above the sqrt(n) that random rounding gives. Relative to the tensor, not to each entry: an entry whose terms
    cancel to near zero keeps the rounding error of the terms that cancelled, so an elementwise rtol fails on one
    CPU and passes on another, as the kernels' summation order differs (tests/test_fast_path.py on two hosts)."""
    import torch

    eps = torch.finfo(expected.dtype).eps if eps is None else eps
    bound = terms * eps * float(expected.abs().max())
    err = float((actual - expected).abs().max())
    assert err <= bound, (
        f"{msg}: max |difference| {err:.3g} > {terms} x {eps:.3g} x max|expected| = {bound:.3g}"
    )


TINY_CONFIG = REPO / ".test" / "config.yaml"
HUB_TOKENS = {
    "HF_TOKEN": "hf_SnaketuneFakeToken0123456789abcdefXYZ",
    "HUGGING_FACE_HUB_TOKEN": "snaketune-fake-hub-token-7f3a9c1e",
}
"""Hub tokens in the environment of the shared run: recognizable, fake (nothing here uses the hub), and written
nowhere (tests/test_security.py greps every file of the run for them)."""


def shared_dir(tmp_path_factory) -> Path:
    """A directory every pytest-xdist worker of this test session shares (its own base directory without xdist)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


# ---- running snakemake: the one runner -------------------------------------------------------------------

FAST_CONFIG = REPO / "tests" / "configs" / "fast.yaml"
"""150 builtin trees, 128-token blocks, 24 optimizer steps: a full workflow run in under a minute on 2 idle cores."""
# Snakemake 9's message (snakemake.common.NOTHING_TO_BE_DONE_MSG) when no job needs to run.
NOTHING_TO_DO = "Nothing to be done (all requested files are present and up to date)."
RUN_TIMEOUT_S = 420  # one full run of the fast config; about 40 s when the machine is idle
SHORT_TIMEOUT_S = 120  # commands that run no job (dry runs, --report, --lint, bad configs)
TEMPORARY = re.compile(r"^\..+\.[^.]+\.(?:tmp|old)$")
"""The names snaketune.io gives temporaries: .<name>.<random>.tmp (.old: a directory being replaced)."""


def snakemake_bin() -> Path:
    """The venv's snakemake (a pinned requirement: a missing one is a broken install, never a skip)."""
    path = Path(sys.executable).parent / "snakemake"
    assert path.exists(), f"{path} is missing: snakemake is pinned in requirements.txt (make reinstalls it)"
    return path


@dataclass(frozen=True)
class Result:
    """One finished snakemake command. Snakemake 9 logs to stderr, but to stdout in a dry run (-n)."""

    args: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + self.stderr

    @property
    def finished_rules(self) -> list[str]:
        """Rules of the jobs this command ran to completion, from Snakemake's progress lines."""
        return re.findall(r"Finished jobid: \d+ \(Rule: (\w+)\)", self.output)

    @property
    def planned_rules(self) -> list[str]:
        """Rules of the jobs a dry run (-n) lists."""
        return re.findall(r"^\s*(?:local)?rule (\w+):$", self.output, flags=re.MULTILINE)


@dataclass(frozen=True)
class Proc:
    pid: int
    pgid: int
    state: str
    cmdline: str


def _processes() -> dict[int, tuple[int, Proc]]:
    """pid -> (parent pid, process) for every process we can see, from /proc."""
    table = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
        except OSError:
            continue
        # The command name in parentheses may hold spaces; the fields after it are state, ppid, pgrp.
        state, ppid, pgrp = text.rsplit(")", 1)[1].split()[:3]
        pid = int(stat.parent.name)
        table[pid] = (int(ppid), Proc(pid, int(pgrp), state, cmdline))
    return table


def process_tree(root: int) -> list[Proc]:
    """Every live descendant of `root`."""
    table = _processes()
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            found.append(table[pid][1])
            todo.append(pid)
    return found


def alive(p: Proc) -> bool:
    """Still running, and still the process we saw (its pid not reused)."""
    proc = Path(f"/proc/{p.pid}")
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode().strip()
    except OSError:
        return False
    return state != "Z" and cmdline == p.cmdline


def _signal(p: Proc, sig: int) -> None:
    if alive(p):
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, sig)


def kill_everything(proc: subprocess.Popen) -> list[Proc]:
    """SIGKILL snakemake's process group (SIGTERM would be a graceful stop for Snakemake) and every process
    it started. Returns the descendants outside that group, which a kill of the group alone leaves running:
    they are frozen first, so they cannot go on writing while we look, and killed last."""
    tree = process_tree(proc.pid)
    outside = [p for p in tree if p.pgid != proc.pid]
    for p in outside:
        _signal(p, signal.SIGSTOP)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    # A rank that follows its launcher (e.g. through PR_SET_PDEATHSIG) dies now, even while stopped.
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(alive(p) for p in outside):
        time.sleep(0.1)
    survivors = [p for p in outside if alive(p)]
    for p in tree:
        _signal(p, signal.SIGKILL)
    return survivors


@dataclass(frozen=True)
class Started:
    """A running snakemake command; its output goes to files (a full pipe would block it while we poll)."""

    proc: subprocess.Popen
    workdir: Path
    out: Path
    err: Path

    @property
    def output(self) -> str:
        return self.out.read_text() + self.err.read_text()


def start(workdir: Path, *args: str, env: dict | None = None) -> Started:
    """snakemake in a process group of its own, so that it can be killed with everything it started. Its
    environment is this process's with `env` over it, and the GPUs hidden (CPU ranks everywhere, so the rank
    counts of the tests hold on a machine with fewer GPUs than ranks too)."""
    heavy(f"starts snakemake {' '.join(args)}")
    n = len(list(workdir.glob(".cmd*.err")))
    out, err = workdir / f".cmd{n}.out", workdir / f".cmd{n}.err"
    with open(out, "w") as stdout, open(err, "w") as stderr:
        proc = subprocess.Popen(
            [str(snakemake_bin()), *args],
            cwd=workdir,
            stdout=stdout,
            stderr=stderr,
            env={**os.environ, **(env or {}), "CUDA_VISIBLE_DEVICES": ""},
            start_new_session=True,
        )
    return Started(proc, workdir, out, err)


def finish(run: Started, timeout: float, *, check: bool = True) -> Result:
    """Wait for a started command; past `timeout` it is killed with everything it started. With `check`, a
    failure shows its output and the jobs' logs."""
    try:
        run.proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_everything(run.proc)
        pytest.fail(f"{' '.join(run.proc.args)} ran longer than {timeout} s\n{run.output[-4000:]}")
    result = Result(tuple(run.proc.args[1:]), run.proc.returncode, run.out.read_text(), run.err.read_text())
    if check and result.returncode != 0:
        logs = "".join(
            f"\n--- {log.relative_to(run.workdir)} ---\n{log.read_text()[-3000:]}"
            for log in sorted(run.workdir.glob("logs/**/*.log"))
        )
        pytest.fail(
            f"snakemake {' '.join(result.args)}: exit {result.returncode}\n{result.output[-4000:]}{logs}"
        )
    return result


NO_JOBS = {"-n", "--dry-run", "--unlock"}
"""Commands that start no job: `snakemake` runs them in a forked child of this process (`_forked`)."""


def snakemake(
    workdir: Path, *args: str, timeout: float = SHORT_TIMEOUT_S, check: bool = True, env: dict | None = None
) -> Result:
    """`snakemake args` in `workdir`, to its end. A command that starts no job (a dry run, --unlock) runs in a
    forked child of this process (its output all in `stdout`), others in a process of their own (start, then
    finish)."""
    if NO_JOBS & set(args):
        code, output = _forked(workdir, args, env=env, timeout=timeout)
        result = Result(tuple(args), code, output, "")
        if check and code != 0:
            pytest.fail(f"snakemake {' '.join(args)} in {workdir}: exit {code}\n{output[-4000:]}")
        return result
    return finish(start(workdir, *args, env=env), timeout, check=check)


def dry_run(workdir: Path, args: Sequence[str]) -> tuple[int, str]:
    """`snakemake -n args` in `workdir`, forked (`_forked`): (exit code, output)."""
    return _forked(workdir, ["-n", *args])


def _forked(
    workdir: Path, args: Sequence[str], *, env: dict | None = None, timeout: float = SHORT_TIMEOUT_S
) -> tuple[int, str]:
    """`snakemake args` without Snakemake's start-up each time: snakemake.cli is imported once per process (1.6 s
    of a 2 s dry run on two cores), then each command is a forked child that runs its command line and exits, so
    no state of one run reaches the next (the Snakefile's module-level code and snaketune's modules load afresh in
    each child, from the working directory). For commands that start no job: a job would be a child of pytest's
    process. The environment is `start`'s; past `timeout` the child is killed (SIGALRM). (exit code, output)."""
    import snakemake.cli  # once per process; the children inherit it

    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            signal.alarm(max(1, int(timeout)))
            os.close(read)
            os.dup2(write, 1)
            os.dup2(write, 2)
            # pytest's capture replaced sys.stdout and sys.stderr: write to the pipe instead.
            sys.stdout = open(1, "w", buffering=1, closefd=False)  # noqa: SIM115
            sys.stderr = open(2, "w", buffering=1, closefd=False)  # noqa: SIM115
            os.environ.update({**(env or {}), "CUDA_VISIBLE_DEVICES": ""})
            os.chdir(workdir)
            # The Snakefile imports snaketune from the working directory's copy (common.smk puts its workflow/
            # first on sys.path), which is what its code hashes read: forget the copy this process imported.
            for name in [m for m in sys.modules if m == "snaketune" or m.startswith("snaketune.")]:
                del sys.modules[name]
            snakemake.cli.main(list(args))
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
        except BaseException:  # noqa: BLE001 - reported through the output and the exit code
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    os.close(write)
    chunks = []
    while chunk := os.read(read, 1 << 16):
        chunks.append(chunk)
    os.close(read)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), b"".join(chunks).decode(errors="replace")


def job_stats(output: str) -> dict[str, int]:
    """rule -> job count from a dry run's first "Job stats" table; {} when nothing is to be done."""
    match = re.search(r"^Job stats:\njob\s+count\n-+\s+-+\n(.*?)^total\s+(\d+)\s*$", output, re.M | re.S)
    if match is None:
        assert NOTHING_TO_DO in output, output[-3000:]
        return {}
    stats = {name: int(n) for name, n in (line.split() for line in match.group(1).strip().splitlines())}
    assert sum(stats.values()) == int(match.group(2)), output[-3000:]
    return stats


def file_bytes(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def temporaries(root: Path) -> list[str]:
    """Every temporary of snaketune.io under root (none may survive a finished run)."""
    return sorted(str(p.relative_to(root)) for p in root.rglob(".*") if TEMPORARY.match(p.name))


_SNAPSHOTS: dict[Path, Path] = {}


def workflow_copy(tmp_path_factory, name: str) -> Path:
    """A fresh working directory holding a copy of the workflow, taken once per test session (and worker): every
    run made here gets the same code hashes (and tokenized-cache key), even while someone edits the sources."""
    base = tmp_path_factory.getbasetemp()
    if base not in _SNAPSHOTS:
        _SNAPSHOTS[base] = copy_workflow(tmp_path_factory.mktemp("workflow_snapshot"))
    workdir = tmp_path_factory.mktemp(name)
    shutil.copytree(_SNAPSHOTS[base], workdir, dirs_exist_ok=True)
    return workdir


def clone_run(src: Path, dest: Path) -> Path:
    """A copy of a workflow directory and its run (results, logs, Snakemake's metadata), timestamps kept: Snakemake
    sees the same completed run there."""
    shutil.copytree(src, dest, symlinks=True)
    return dest


@pytest.fixture(scope="session")
def tiny_run(tmp_path_factory) -> Path:
    """One complete run of .test/config.yaml (the tiny config) in a copy of the workflow, made once per test session (the
    xdist workers share it under a lock), with HUB_TOKENS in the environment. Read-only: a test that changes
    anything works on `clone_run(tiny_run, ...)`."""
    from filelock import FileLock

    root = shared_dir(tmp_path_factory)
    workdir = root / "tiny_run"
    with FileLock(str(root / "tiny_run.lock")):
        if not (workdir / ".complete").exists():
            shutil.rmtree(workdir, ignore_errors=True)
            copy_workflow(workdir)
            shutil.copy2(TINY_CONFIG, workdir / "tiny.yaml")
            snakemake(
                workdir,
                *("--cores", "2", "--resources", "gpu=2", "--configfile", "tiny.yaml"),
                env=HUB_TOKENS,
                timeout=900,
            )
            (workdir / ".complete").touch()
    return workdir


REAL_OASST = REPO / "tests" / "data" / "oasst"
"""Real OpenAssistant samples, gzip-compressed (tests/data/README.md: what each holds, its source and licence)."""


@pytest.fixture(scope="session")
def llama_cpp_vocab(tmp_path_factory) -> Path:
    """llama.cpp's vocabulary file of deepseek-llm (ggml-vocab-deepseek-llm.gguf) with its test strings beside it
    (`.inp`, `.out`), out of the pinned llama-cpp-python's source archive once per test session (tests/
    deepseek_tokenizer.py). Read-only."""
    from filelock import FileLock

    import deepseek_tokenizer

    root = shared_dir(tmp_path_factory)
    out = root / "llama_cpp_vocab"
    with FileLock(str(root / "llama_cpp_vocab.lock")):
        if not (out / "done").exists():
            deepseek_tokenizer.extract(out)
            (out / "done").touch()
    return out / deepseek_tokenizer.VOCAB


@pytest.fixture(scope="session")
def deepseek_tokenizer(tmp_path_factory, llama_cpp_vocab) -> Path:
    """A directory with deepseek-llm-7b-base's tokenizer.json and tokenizer_config.json, rebuilt once per test
    session (the xdist workers share it under a lock) from llama.cpp's vocabulary file (tests/deepseek_tokenizer.py).
    Read-only."""
    from filelock import FileLock

    import deepseek_tokenizer

    root = shared_dir(tmp_path_factory)
    out = root / "deepseek-llm-7b-base"
    with FileLock(str(root / "deepseek_tokenizer.lock")):
        if not (out / "done").exists():
            deepseek_tokenizer.rebuild(llama_cpp_vocab, out)
            (out / "done").touch()
    return out


MAX_LENGTH = 128
# Settings every training test shares unless it overrides them: a 4-sequence global batch on the tiny model,
# metrics at every step (per-step losses are what the tests compare), no checkpoints, validation at the end.
TRAIN_DEFAULTS = dict(
    gpus=1,
    max_steps=20,
    global_batch_size=4,
    micro_batch_size=4,
    log_every=1,
    eval_every=0,
    checkpoint_every=0,
    precision="fp32",
)


@dataclass(frozen=True)
class TinyData:
    """Outputs of the data stages on the builtin sample (about 100 conversations, 33 packed rows)."""

    raw_dir: Path
    conversations_dir: Path
    tokenizer_dir: Path
    data_dir: Path
    max_length: int


@pytest.fixture(scope="session")
def tiny_data(tmp_path_factory) -> TinyData:
    """download -> conversations -> tokenizer -> tokenized cache, exactly as the workflow chains them."""
    from snaketune.data import conversations, download, tokenization, tokenizer

    root = tmp_path_factory.mktemp("tiny_data")
    data = TinyData(root / "raw", root / "conversations", root / "tokenizer", root / "tokenized", MAX_LENGTH)
    download.materialize("builtin", data.raw_dir, builtin_trees=120)
    result = conversations.build_conversations(conversations.read_messages(data.raw_dir / "messages.parquet"))
    conversations.write_conversations(result, data.conversations_dir)
    tokenizer.train_tokenizer(
        tokenizer.conversation_texts(data.conversations_dir / "train.parquet"), 512, data.tokenizer_dir
    )
    tokenization.tokenize_conversations(
        data.conversations_dir,
        data.tokenizer_dir,
        data.data_dir,
        max_length=MAX_LENGTH,
        packing=True,
        assistant_only_loss=True,
        chat_template="deepseek",
    )
    return data


@dataclass(frozen=True)
class TrainRun:
    """One finished training run: where it wrote, its metrics.csv rows (numbers as floats) and summary."""

    out_dir: Path
    checkpoint_dir: Path
    log_file: Path
    rows: list[dict]
    summary: dict

    @property
    def losses(self) -> list[float]:
        """train/loss of every logged step, in step order (log_every=1: one per optimizer step)."""
        return [row["train/loss"] for row in self.rows]


def _number(value: str):
    if value == "":
        return None
    try:
        return float(value)
    except ValueError:
        return value


def read_metrics(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return [{k: _number(v) for k, v in row.items()} for row in csv.DictReader(f)]


def losses(workdir: Path, column: str = "train/loss", experiment: str = "default") -> dict[int, float]:
    """step -> value of every logged step that has one, from a workflow run's results/train/<experiment>."""
    rows = read_metrics(workdir / f"results/train/{experiment}/metrics.csv")
    return {int(r["step"]): r[column] for r in rows if r.get(column) is not None}


def run_spec(
    root: Path,
    data: TinyData,
    *,
    train_overrides: dict | None = None,
    deepspeed: str | Path = "zero2",
    checkpoint_dir: Path | None = None,
    data_dir: Path | None = None,
    model: dict | None = None,
    preference: dict | None = None,
) -> dict:
    """The RunSpec dict workflow/scripts/train.py (or dpo.py, with `preference`) writes, for a run under `root`."""
    from snaketune.config.load import from_dict, to_dict
    from snaketune.config.schema import ModelConfig, TrainConfig

    ds_path = Path(deepspeed)
    if ds_path.suffix != ".json":
        ds_path = DEEPSPEED_DIR / f"{deepspeed}.json"
    train = from_dict(TrainConfig, {**TRAIN_DEFAULTS, **(train_overrides or {})}, "train.")
    spec = {
        "experiment": "test",
        "model": to_dict(ModelConfig(**(model or {}))),
        "train": to_dict(train),
        "data_dir": str(data_dir or data.data_dir),
        "tokenizer_dir": str(data.tokenizer_dir),
        "deepspeed_config": str(ds_path),
        "output_dir": str(root / "out"),
        "checkpoint_dir": str(checkpoint_dir or root / "checkpoints"),
        "max_length": data.max_length,
        "run_key": "test",
    }
    if preference is not None:
        spec.update(preference=preference, max_length=preference["max_length"])
    return spec


def run_training(
    tmp_path: Path,
    tiny_data: TinyData,
    nproc: int = 1,
    train_overrides: dict | None = None,
    deepspeed: str | Path = "zero2",
    *,
    checkpoint_dir: Path | None = None,
    module: str = "snaketune.train.trainer",
    data_dir: Path | None = None,
    model: dict | None = None,
    preference: dict | None = None,
) -> TrainRun:
    """Train with `nproc` ranks through snaketune.train.launch (torchrun, as the train rule does).

    `deepspeed` is a file name in config/deepspeed (zero0, zero2, zero3) or a path to a JSON file.
    Raises snaketune.train.launch.LaunchError when the run fails; the ranks' output is in tmp_path/train.log.
    """
    from snaketune.train.launch import launch

    heavy("starts DeepSpeed ranks (run_training)")
    spec = run_spec(
        tmp_path,
        tiny_data,
        train_overrides=train_overrides,
        deepspeed=deepspeed,
        checkpoint_dir=checkpoint_dir,
        data_dir=data_dir,
        model=model,
        preference=preference,
    )
    log_file = tmp_path / "train.log"
    launch(
        spec,
        Path(spec["checkpoint_dir"]) / "run-spec.json",
        granted=nproc,
        log_file=log_file,
        threads=2,
        module=module,
    )
    return finished_run(tmp_path, Path(spec["output_dir"]), Path(spec["checkpoint_dir"]))


def finished_run(root: Path, out: Path | None = None, checkpoint_dir: Path | None = None) -> TrainRun:
    """The TrainRun of a finished run_training under `root` (its default directories unless named)."""
    out = out or root / "out"
    return TrainRun(
        out_dir=out,
        checkpoint_dir=checkpoint_dir or root / "checkpoints",
        log_file=root / "train.log",
        rows=read_metrics(out / "metrics.csv"),
        summary=json.loads((out / "summary.json").read_text()),
    )


@pytest.fixture(scope="session")
def default_training_run(tiny_data, tmp_path_factory) -> TrainRun:
    """run_training with every default (1 rank, ZeRO-2, TRAIN_DEFAULTS: micro-batch 4 x accumulation 1, 20 steps),
    made once per test session: the baseline of tests/test_training.py and tests/test_quantized.py (the xdist
    workers share it under a lock; the outputs are read-only)."""
    from filelock import FileLock

    root = shared_dir(tmp_path_factory) / "default_training_run"
    with FileLock(f"{root}.lock"):
        if not (root / "done").exists():
            shutil.rmtree(root, ignore_errors=True)
            run_training(root, tiny_data)
            (root / "done").touch()
    return finished_run(root)


def run_reference(
    root: Path,
    data: TinyData,
    *,
    data_dir: Path,
    model: dict,
    nproc: int = 1,
    train_overrides: dict | None = None,
    reference: str = "sft",
    max_length: int = 64,
) -> Path:
    """The reference stage's ranks (snaketune.preference.reference) as the reference rule launches them; returns
    the directory holding reference.parquet and reference.json."""
    from snaketune.train.launch import launch

    heavy("starts DeepSpeed ranks (run_reference)")
    train = {**TRAIN_DEFAULTS, **(train_overrides or {})}
    train["global_batch_size"] = train["micro_batch_size"]  # as workflow/scripts/reference.py sets it
    spec = run_spec(
        root,
        data,
        train_overrides=train,
        data_dir=data_dir,
        model=model,
        preference={"reference": reference, "max_length": max_length},
    )
    launch(
        spec,
        Path(spec["checkpoint_dir"]) / "run-spec.json",
        granted=nproc,
        log_file=root / "reference.log",
        threads=2,
        module="snaketune.preference.reference",
    )
    return Path(spec["output_dir"])


# ---- a small trained tokenizer on random conversations (tests/chat_data.py): tokenization and packing -------


@pytest.fixture(scope="module")
def conv_dir(tmp_path_factory) -> Path:
    import chat_data

    rng = random.Random(0)
    directory = tmp_path_factory.mktemp("conversations")
    for split, n in (("train", 120), ("validation", 20)):
        chat_data.write_conversations(
            directory / f"{split}.parquet", [chat_data.conversation(rng, rng.randint(1, 3)) for _ in range(n)]
        )
    return directory


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory, conv_dir) -> Path:
    from snaketune.data.tokenizer import conversation_texts, train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(conversation_texts(conv_dir / "train.parquet"), 320, out)
    return out


CHATML = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}"
    "{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template with a default system turn where the conversation has none (as SmolLM2's and Qwen's)."""


def chatml_tokenizer(tok_dir: Path, out: Path, template: str = CHATML) -> Path:
    """A copy of a builtin tokenizer as a ChatML model's: `<|im_start|>` and `<|im_end|>` added as special tokens,
    eos `<|im_end|>` (SmolLM2's and Qwen's instruct models), `template` its chat template."""
    from tokenizers import AddedToken, Tokenizer

    shutil.copytree(tok_dir, out)
    backend = Tokenizer.from_file(str(out / "tokenizer.json"))
    backend.add_special_tokens([AddedToken(t, special=True) for t in ("<|im_start|>", "<|im_end|>")])
    backend.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.update(chat_template=template, eos_token="<|im_end|>", pad_token="<|im_end|>")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


@pytest.fixture(scope="module")
def tok(tok_dir):
    from snaketune.data.tokenization import load_tokenizer

    return load_tokenizer(tok_dir, "deepseek")


HEAVY_FIRST = (
    "test_rerun_clean.py",
    "test_faults.py",
    "test_default_run.py",
    "test_hub_workflow.py",
    "test_workflow.py",
    "test_real_model.py",
    "test_rerun_owners.py",
    "test_slurm.py",
    "test_bench.py",
    "test_training.py",
    "test_quantized.py",
    "test_preferences.py",
    "test_own_data.py",
    "test_reproducibility.py",
    "test_security.py",
    "test_fast_path.py",
    "test_write_faults.py",
    "test_gpus.py",
)
"""The files with the longest runs, longest first (`make test`'s slowest durations, CI 2026-12-06; test_reproducibility.py
later since its dry runs fork in-process): the two workers of
`make test` (pytest-xdist, --dist loadfile with --no-loadscope-reorder) take files in collection order, so the long
ones start first and short ones fill the end. The first two files start together; the second (test_faults.py, through
its `reference`) makes the shared tiny run while the first trains its own experiments, before most of its users start.
xdist's default order (files with the most tests first) started the two dry-run walks over the schema first, one of
them idle for the 100 s the other spent making the tiny run, and left the long runs for the end."""


def pytest_collection_modifyitems(items):
    # The shared tiny run is a whole workflow run: whatever reads it belongs to `make test`'s tier, marked or not.
    for item in items:
        if "tiny_run" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)

    def rank(item) -> int:
        name = Path(str(item.fspath)).name
        return HEAVY_FIRST.index(name) if name in HEAVY_FIRST else len(HEAVY_FIRST)

    items.sort(key=rank)  # stable: a file's tests keep their order


def zero(path: Path, offset: int, length: int, *, keep_mtime: bool = False) -> None:
    """Overwrite `length` bytes in place with zeros (the size stays), as a disk error or a stray dd would;
    `keep_mtime` puts the modification time back, as bit rot leaves it."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(b"\0" * length)
    if keep_mtime:
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_size == st.st_size
