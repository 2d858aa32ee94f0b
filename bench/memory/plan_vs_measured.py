"""Predicted (snaketune.plan.search) against measured peak GPU memory of the train stage on one H200.

    python -m bench plan_vs_measured [--only NAME,NAME] [--budget-s 530] [--tiny] [--plan-only]

Each case trains the deepseek-llm-7b architecture (random init, built on the GPU) for 3 optimizer steps on the
builtin data packed into 512-token blocks, through snaketune.train.launch as the train rule does it: GPU lock,
the plan's launch-time check, the gpu_memory_gib allocator cap, torchrun, DeepSpeed. Then it compares the
plan's `peak_allocated_gib` with summary.json's `peak_memory_gib_per_rank` (torch.cuda.max_memory_allocated),
the plan's per-GPU need with nvidia-smi's peak (allocator cache + CUDA context; where memory is plentiful
the caching allocator keeps freed blocks, so that peak says more under the 24 GiB cap), and for offload the
plan's host memory with the machine's (MemTotal - MemAvailable, above the level before the case).

Cases, in the order they run (the riskiest last; one failing or timing out never stops the others):
  lora30_24g_as_configured  the plan refuses it (LoRA 30 layers, 8 x 512, no checkpointing, 24 GiB): no GPU time
  zero2_24                  full fine-tuning, 24 layers, ZeRO-2, 4 x 2   (bench/RESULTS.md: 116.8 GiB)
  lora30                    LoRA r16 all linear, 30 layers, ZeRO-2, 8 x 1 (an earlier harness: 45.4 GiB)
  lora30_24g_auto           the same under gpu_memory_gib 24, train.strategy auto (the plan picks checkpointing)
  zero3_offload_14          ZeRO-3 + CPU Adam offload, 14 layers, 4 x 2, checkpointing (an earlier harness: 10.6 GiB, 69 host)
DeepSpeedCPUAdam (offload) is JIT-compiled on first use; it is built in the background from the start.

--tiny runs the same cases on builtin-tiny (CPU ranks without CUDA) to check this script anywhere; --plan-only
prints the predictions without training.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))

from snaketune.config.load import from_dict, to_dict  # noqa: E402
from snaketune.config.schema import ModelConfig, TrainConfig  # noqa: E402
from snaketune.plan import search as memory_plan  # noqa: E402

SEQ = 512
STEPS = 3
DEEPSPEED = {name: str(REPO / "config/deepspeed" / name) for name in memory_plan.STRATEGY_FILES.values()}
LORA = {"enabled": True, "rank": 16}


@dataclass(frozen=True)
class Case:
    name: str
    layers: int
    deepspeed: str
    train: dict
    measured_elsewhere: str = ""
    gpu_memory_gib: float | None = None
    limit_s: int = 170
    expect_refusal: bool = False
    extra: dict = field(default_factory=dict)


CASES = [
    Case(
        "lora30_24g_as_configured",
        30,
        "zero2.json",
        {"micro_batch_size": 8, "global_batch_size": 8, "lora": LORA},
        gpu_memory_gib=24,
        expect_refusal=True,
    ),
    Case(
        "zero2_24",
        24,
        "zero2.json",
        {"micro_batch_size": 4, "global_batch_size": 8},
        "116.8 (bench/RESULTS.md 116.77)",
    ),
    Case(
        "lora30",
        30,
        "zero2.json",
        {"micro_batch_size": 8, "global_batch_size": 8, "lora": LORA},
        "45.4 (an earlier harness)",
    ),
    Case(
        "lora30_24g_auto",
        30,
        "zero2.json",
        {"micro_batch_size": 8, "global_batch_size": 8, "lora": LORA, "strategy": "auto"},
        "must stay under 24",
        gpu_memory_gib=24,
    ),
    Case(
        "zero3_offload_14",
        14,
        "zero3_offload.json",
        {"micro_batch_size": 4, "global_batch_size": 8, "gradient_checkpointing": True},
        "10.6, host 69 (an earlier harness)",
        limit_s=330,
    ),
    Case(
        "zero3_14",
        14,
        "zero3.json",
        {"micro_batch_size": 4, "global_batch_size": 8},
        "",
    ),
    Case(
        "zero3_offload_14_24g",
        14,
        "zero3_offload.json",
        {"micro_batch_size": 2, "global_batch_size": 8, "gradient_checkpointing": True},
        "must stay under 24",
        gpu_memory_gib=24,
        limit_s=330,
    ),
]


def say(*parts) -> None:
    print(f"[{time.strftime('%H:%M:%S')}]", *parts, flush=True)


# ---- one case (a child process) -------------------------------------------------------------------------------


def train_settings(case: Case) -> dict:
    values = dict(
        gpus=1,
        deepspeed=DEEPSPEED[case.deepspeed],
        learning_rate=1e-5,
        warmup_steps=1,
        max_steps=STEPS,
        precision="bf16",
        checkpoint_every=0,
        log_every=1,
        eval_every=0,
        **case.train,
    )
    return to_dict(from_dict(TrainConfig, values, "train."))


def model_settings(case: Case, tiny: bool) -> dict:
    if tiny:
        return to_dict(ModelConfig(base="builtin-tiny"))
    return to_dict(ModelConfig(base="arch:deepseek-llm-7b", num_layers=case.layers))


def make_plan(case: Case, tiny: bool) -> dict:
    train = train_settings(case)
    budget = memory_plan.detect_budget(case.gpu_memory_gib)
    return memory_plan.make_plan(
        experiment=case.name,
        model=model_settings(case, tiny),
        train=train,
        max_length=SEQ,
        deepspeed_config=train["deepspeed"],
        gpu_memory_gib=case.gpu_memory_gib,
        budget=budget,
        candidate_files=DEEPSPEED,
    )


def run_case(case: Case, work: Path, data: Path, tiny: bool) -> int:
    """Plan, then train through snaketune.train.launch; print one RESULT line (JSON)."""
    from snaketune.train.launch import LaunchError, launch

    plan = make_plan(case, tiny)
    chosen = plan["chosen"]
    result = {
        "case": case.name,
        "plan_status": plan["status"],
        "chosen": chosen["name"],
        "predicted": chosen.get("estimate") or plan.get("configured", {}).get("estimate"),
        "configured": (plan.get("configured") or {}).get("estimate"),
        "message": plan["message"],
    }
    say(f"{case.name}: plan {plan['status']}\n{memory_plan.format_table(plan)}")
    if plan["fits"] is False:
        result["outcome"] = "refused by the plan"
        print("RESULT " + json.dumps(result), flush=True)
        return 0
    run = work / case.name
    shutil.rmtree(run, ignore_errors=True)
    spec = {
        "experiment": case.name,
        "model": model_settings(case, tiny),
        "train": train_settings(case),
        "data_dir": str(data / "tokenized"),
        "tokenizer_dir": str(data / "tokenizer"),
        "deepspeed_config": DEEPSPEED[case.deepspeed],
        "output_dir": str(run / "out"),
        "checkpoint_dir": str(run / "checkpoints"),
        "max_length": SEQ,
        "run_key": case.name,
    }
    spec = memory_plan.apply_plan(spec, plan)
    log_file = run / "train.log"
    run.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    try:
        launch(
            spec,
            run / "run-spec.json",
            granted=1,
            log_file=log_file,
            threads=min(8, os.cpu_count() or 1),
            plan=plan,
        )
        summary = json.loads((run / "out" / "summary.json").read_text())
        result.update(
            outcome="trained",
            measured_gib=summary["peak_memory_gib_per_rank"][0],
            zero_stage=summary["zero_stage"],
            tokens_per_s=summary["tokens_per_s_per_gpu"],
            parameters=summary["parameters"],
            trainable=summary["trainable_parameters"],
        )
    except (LaunchError, OSError, KeyError) as e:
        text = log_file.read_text() if log_file.exists() else ""
        oom = "OutOfMemoryError" in text or "CUDA out of memory" in text
        result.update(outcome=("OOM: " if oom else "failed: ") + str(e)[:300])
        tail = "\n".join(text.splitlines()[-40:])
        say(f"{case.name}: train log tail\n{tail}")
    result["wall_s"] = round(time.time() - t0, 1)
    if log_file.exists():
        keep = [
            line
            for line in log_file.read_text().splitlines()
            if any(
                k in line
                for k in ("GPUs assigned", "memory plan", "capped", "NCCL", "step ", "done:", "rank(")
            )
        ]
        say(f"{case.name}: key lines of the train log\n" + "\n".join(keep[-25:]))
    shutil.rmtree(run / "out" / "model", ignore_errors=True)  # 11-14 GB of safetensors per case
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---- the parent -------------------------------------------------------------------------------------------------


def prepare_data(data: Path) -> None:
    """The workflow's data stages on the builtin sample, packed into 512-token blocks."""
    from snaketune.data import conversations, download, tokenization, tokenizer

    if (data / "tokenized" / "stats.json").exists():
        return
    download.materialize("builtin", data / "raw", builtin_trees=600)
    result = conversations.build_conversations(conversations.read_messages(data / "raw" / "messages.parquet"))
    conversations.write_conversations(result, data / "conversations")
    tokenizer.train_tokenizer(
        tokenizer.conversation_texts(data / "conversations" / "train.parquet"), 1024, data / "tokenizer"
    )
    tokenization.tokenize_conversations(
        data / "conversations",
        data / "tokenizer",
        data / "tokenized",
        max_length=SEQ,
        packing=True,
        assistant_only_loss=True,
        chat_template="deepseek",
    )


def host_used_gib() -> float:
    info = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        info[key] = int(value.split()[0]) * 1024
    return (info["MemTotal"] - info["MemAvailable"]) / 2**30


class Sampler:
    """Peak host memory in use and peak nvidia-smi memory.used while a case runs."""

    def __init__(self) -> None:
        self.base = host_used_gib()
        self.host_peak = self.base
        self.smi_peak_mib = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        smi = shutil.which("nvidia-smi")
        while not self._stop.wait(0.5):
            self.host_peak = max(self.host_peak, host_used_gib())
            if smi:
                try:
                    out = subprocess.run(
                        [smi, "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                        capture_output=True,
                        text=True,
                        timeout=5,
                    ).stdout
                    self.smi_peak_mib = max([self.smi_peak_mib, *[float(x) for x in out.split()]])
                except (OSError, subprocess.SubprocessError, ValueError):
                    pass

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {
            "host_above_start_gib": round(self.host_peak - self.base, 2),
            "nvidia_smi_peak_gib": round(self.smi_peak_mib / 1024, 2),
        }


def start_cpu_adam_build(out: Path) -> subprocess.Popen | None:
    """DeepSpeedCPUAdam is JIT-compiled on first use (~1-2 min); compile it while the other cases train."""
    code = "from deepspeed.ops.op_builder import CPUAdamBuilder; CPUAdamBuilder().load(); print('cpu_adam ready')"
    try:
        return subprocess.Popen(
            [sys.executable, "-c", code],
            stdout=open(out, "w"),  # noqa: SIM115 - closed with the process
            stderr=subprocess.STDOUT,
            env={**os.environ, "MAX_JOBS": "8"},
        )
    except OSError as e:
        say(f"cpu_adam build not started: {e}")
        return None


def kill_group(pgid: int) -> None:
    """SIGKILL the process group of a case's child (it started one of its own); ranks die with torchrun."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


def fmt(x, spec=".1f") -> str:
    return "-" if x is None else format(x, spec)


def row(case: Case, r: dict, sampled: dict) -> dict:
    pred = r.get("predicted") or {}
    measured = r.get("measured_gib")
    err = None
    if measured and pred.get("peak_allocated_gib"):
        err = 100 * (pred["peak_allocated_gib"] / measured - 1)
    return {
        "case": case.name,
        "strategy": r.get("chosen"),
        "predicted_alloc_gib": pred.get("peak_allocated_gib"),
        "measured_alloc_gib": measured,
        "error_pct": err,
        "predicted_gpu_need_gib": pred.get("gpu_gib"),
        "nvidia_smi_peak_gib": sampled.get("nvidia_smi_peak_gib"),
        "predicted_host_gib": pred.get("host_gib"),
        "host_above_start_gib": sampled.get("host_above_start_gib"),
        "elsewhere": case.measured_elsewhere,
        "outcome": r.get("outcome"),
        "wall_s": r.get("wall_s"),
        "tokens_per_s": r.get("tokens_per_s"),
        "message": r.get("message"),
    }


def table(rows: list[dict]) -> str:
    head = (
        "| case | strategy | predicted alloc GiB | measured alloc GiB | error | predicted need GiB | nvidia-smi peak GiB "
        "| predicted host GiB | host used GiB | measured elsewhere | outcome | wall s |"
    )
    lines = [head, "|" + "---|" * 12]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['strategy']} | {fmt(r['predicted_alloc_gib'])} | {fmt(r['measured_alloc_gib'])} "
            f"| {fmt(r['error_pct'], '+.1f')}% | {fmt(r['predicted_gpu_need_gib'])} | {fmt(r['nvidia_smi_peak_gib'])} "
            f"| {fmt(r['predicted_host_gib'], '.0f')} | {fmt(r['host_above_start_gib'])} | {r['elsewhere']} "
            f"| {r['outcome']} | {fmt(r['wall_s'], '.0f')} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--only", help="comma-separated case names")
    parser.add_argument("--budget-s", type=float, default=float(os.environ.get("BUDGET_S", 530)))
    parser.add_argument("--work", default="/tmp/plan_vs_measured")
    parser.add_argument("--out", default=os.environ.get("OUT", "/tmp/out"))
    parser.add_argument("--tiny", action="store_true", help="builtin-tiny instead of 7B (checks the script)")
    parser.add_argument("--plan-only", action="store_true", help="print the predictions, train nothing")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # internal: run one case in this process
    args = parser.parse_args(argv)
    t_start = time.monotonic()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    data = work / "data"
    cases = {c.name: c for c in CASES}
    if args.case:
        return run_case(cases[args.case], work, data, args.tiny)
    selected = [cases[n] for n in args.only.split(",")] if args.only else CASES

    if args.plan_only:
        for case in selected:
            p = make_plan(case, args.tiny)
            say(f"{case.name}: {p['status']}\n{memory_plan.format_table(p)}\n{p['message'] or ''}")
        return 0

    say(f"cases: {', '.join(c.name for c in selected)}; budget {args.budget_s:.0f} s")
    cpu_adam = None
    if not args.tiny and any(c.deepspeed == "zero3_offload.json" for c in selected):
        cpu_adam = start_cpu_adam_build(out / "cpu_adam_build.log")
    prepare_data(data)
    say(f"data ready ({time.monotonic() - t_start:.0f} s)")
    rows, results = [], []
    for case in selected:
        left = args.budget_s - (time.monotonic() - t_start)
        if case.deepspeed == "zero3_offload.json" and cpu_adam is not None and cpu_adam.poll() is None:
            say("waiting for the cpu_adam build")
            with contextlib.suppress(subprocess.TimeoutExpired):
                cpu_adam.wait(timeout=max(1, left - 150))
            left = args.budget_s - (time.monotonic() - t_start)
        if left < 60 and not case.expect_refusal:
            say(f"{case.name}: skipped, {left:.0f} s left")
            rows.append(row(case, {"outcome": f"skipped ({left:.0f} s left)"}, {}))
            continue
        limit = min(case.limit_s, left - 5)
        say(f"{case.name}: start (limit {limit:.0f} s)")
        sampler = Sampler()
        cmd = [sys.executable, __file__, "--case", case.name, "--work", str(work), "--out", str(out)]
        if args.tiny:
            cmd.append("--tiny")
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
        )
        result: dict = {}
        killer = threading.Timer(limit, kill_group, args=(proc.pid,))
        killer.start()
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            else:
                print(f"  {line}", end="", flush=True)
        proc.wait()
        killer.cancel()
        sampled = sampler.stop()
        if not result:
            killed = ", killed at the time limit" if proc.returncode == -signal.SIGKILL else ""
            result = {"outcome": f"no result (exit {proc.returncode}{killed})"}
        kill_group(proc.pid)  # a torchrun left behind would hold the GPU for the next case
        results.append(result)
        rows.append(row(case, result, sampled))
        say(f"{case.name}: {json.dumps(rows[-1])}")
        print(table(rows), flush=True)
    if cpu_adam is not None and cpu_adam.poll() is None:
        cpu_adam.kill()
    (out / "plan_vs_measured.json").write_text(json.dumps({"rows": rows, "results": results}, indent=2))
    (out / "plan_vs_measured.md").write_text(table(rows) + "\n")
    say(f"done in {time.monotonic() - t_start:.0f} s\n{table(rows)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
