"""Training throughput on one GPU: the seed recipe (a) against this project's train rule (b), same data.

    python -m bench throughput [--only seed24,b24,...] [--no-peer] [--budget-s 540] [--tiny]
    python3 bench/throughput/train_throughput.py --out DIR [the same options]

Everything runs on one GPU in one call, on the same data and the same tokens per optimizer step (8 sequences of 512
positions); a (b) case's TRL peer (Case.peer) joins the run right after it unless --no-peer:
1. A copy of the workflow in --work, and length_mix.py's oasst1-format dataset (1,200 threads of oasst1-like
   lengths) as dataset.source.
2. (b) cases: the workflow's own `train` rule, started by Snakemake as a user would
   (`snakemake results/train/<case>/summary.json --configfile bench.yaml`), on the deepseek-llm-7b
   architecture (random init) with the tokenized, packed data: download -> conversations -> train_tokenizer
   -> tokenize -> plan -> train. Each case is an experiment of bench.yaml (throughput_cases.py).
3. (a) cases: seed_recipe.py (HF Trainer, DeepSpeed fp16 ZeRO-2, micro-batch 1 x 8, every sample padded to 512)
   under torchrun, on the same conversations tokenized with packing off (snaketune.data.tokenization).
4. trl cases: trl_peer.py, TRL's SFTTrainer with Liger's kernels on the same unpacked conversations, 8 per step
   (the outside reference a user would otherwise pick; positions reported as real tokens: no padding to 512).
5. A table: tokens/s (positions the GPU computed, real tokens, loss-bearing tokens), MFU, seconds per step,
   peak memory (and the memory plan's prediction), each (b) case's ratio to (a) at the same depth and to its
   TRL peer (Case.peer).

MFU here is 6 x parameters x positions/s / 790 TFLOP/s (the bf16 matmul rate measured on the H200: an 8192^3 bf16
matmul on the lent machine);
summary.json's perf/mfu (6 x non-embedding parameters + attention, real tokens, the datasheet's 989 TFLOP/s) is
reported beside it. The first 2 optimizer steps of every case are warm-up and not timed.
Cases run in the order given; one that fails, runs out of memory or would overrun the budget never stops the
others. Results: DIR/throughput.{json,md}, the train logs in DIR/logs.tar.gz. bench/RESULTS.md has the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench/throughput"))
sys.path.insert(0, str(REPO / "bench/overhead"))  # bookkeeping.sync: the copy of the workflow

import length_mix  # noqa: E402
from bookkeeping import sync as copy_workflow  # noqa: E402  (the workflow sources, results kept)
from throughput_cases import BY_NAME, CASES, Case  # noqa: E402

SEQ = 512
STEPS = 14
WARMUP = 2
TINY_STEPS = 3  # --tiny: one timed step after the warm-up, enough to check the script
MEASURED_MATMUL_FLOPS = 790e12  # an 8192^3 bf16 matmul measured on the lent H200


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def bench_config(work: Path, cases: list[Case], tiny: bool) -> Path:
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["dataset"]["source"] = str(work / "data" / "mix.jsonl")
    cfg["tokenize"].update(max_length=SEQ, packing=True)
    cfg["train"].update(
        gpus=1,
        learning_rate=1e-5,
        warmup_steps=WARMUP,
        max_steps=TINY_STEPS if tiny else STEPS,
        global_batch_size=8,
        log_every=1,
        eval_every=0,
        checkpoint_every=0,
        seed=1234,
    )
    experiments = {}
    for case in cases:
        if case.kind != "train":
            continue
        train = dict(case.train)
        if tiny:  # CPU ranks: fp32, no Liger (CUDA only), no FP8 matmuls, torch.compile would spend minutes
            train.update(precision="fp32", compile=False, kernels="auto", fp8="none")
        model = {} if tiny else {"base": "arch:deepseek-llm-7b", "num_layers": case.layers}
        experiments[case.name] = {"model": model, "tokenize": dict(case.tokenize), "train": train}
    cfg["experiments"] = experiments
    path = work / "bench.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return path


def run(cmd: list[str], *, cwd: Path, log_path: Path, timeout: float, env: dict | None = None) -> int | str:
    """Run in its own process group; kill the whole group at the timeout. Exit code, or 'timeout'."""
    with open(log_path, "a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        proc = subprocess.Popen(
            cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env
        )
        try:
            return proc.wait(timeout=max(1.0, timeout))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return "timeout"


def snakemake(
    work: Path, config: Path, targets: list[str], log_path: Path, timeout: float, gpu_memory_gib=None
) -> int | str:
    cores = str(os.cpu_count() or 2)
    # greedy: one job at a time needs no ILP solver (the device wheels leave pulp out)
    cmd = [
        sys.executable,
        "-m",
        "snakemake",
        *targets,
        "--cores",
        cores,
        "--resources",
        "gpu=1",
        "--scheduler",
        "greedy",
    ]
    cmd += ["--configfile", str(config)]
    if gpu_memory_gib is not None:
        cmd += ["--config", f"gpu_memory_gib={gpu_memory_gib}"]
    return run(cmd, cwd=work, log_path=log_path, timeout=timeout)


def tokenized_dir(work: Path, packing: bool) -> Path | None:
    for stats in sorted((work / "results" / "tokenized").glob("*/stats.json")):
        if json.loads(stats.read_text())["settings"]["packing"] == packing:
            return stats.parent
    return None


def seed_data(work: Path) -> Path:
    """The conversations tokenized with packing off (one conversation per row, truncated to 512)."""
    from snaketune.data.tokenization import tokenize_conversations

    out = work / "seed_data"
    if not (out / "stats.json").exists():
        tokenize_conversations(
            work / "results/data/conversations",
            work / "results/tokenizer/builtin",
            out,
            max_length=SEQ,
            packing=False,
            assistant_only_loss=True,
            chat_template="deepseek",
        )
    return out


# ---- measuring ---------------------------------------------------------------------------------------------


def train_result(work: Path, case: Case, rc) -> dict:
    res: dict = {"case": case.name, "kind": "train", "what": case.what, "layers": case.layers, "rc": rc}
    summary_path = work / "results/train" / case.name / "summary.json"
    plan_path = work / "results/plan" / f"{case.name}.json"
    if plan_path.exists():
        plan = json.loads(plan_path.read_text())
        est = (plan.get("chosen") or {}).get("estimate") or {}
        res["plan_peak_gib"] = est.get("peak_allocated_gib")
        res["plan_gpu_gib"] = est.get("gpu_gib")  # what the device must hold, the budget's side (NVML)
        res["plan_status"] = plan.get("status")
        res["plan_chosen"] = (plan.get("chosen") or {}).get("name")
    if not summary_path.exists():
        log_file = work / "logs/train" / f"{case.name}.log"
        tail = log_file.read_text().splitlines()[-12:] if log_file.exists() else []
        oom = any("OutOfMemoryError" in line or "out of memory" in line for line in tail)
        res["status"] = "out of memory" if oom else f"failed ({rc})"
        res["log_tail"] = tail
        return res
    s = json.loads(summary_path.read_text())
    res.update(
        status="ok",
        parameters=s["parameters"],
        trainable=s["trainable_parameters"],
        step_s=s["step_time_s"],
        positions_per_s=s.get("padded_tokens_per_s_per_gpu"),
        real_per_s=s["tokens_per_s_per_gpu"],
        loss_per_s=s["loss_tokens_per_s_per_gpu"],
        mfu_project=s["mfu"],
        peak_gib=s["peak_memory_gib_per_rank"][0],
        # What nvidia-smi shows for the process (NVML, sampled): the figure gpu_memory_gib bounds.
        device_peak_gib=((s.get("device_memory_per_rank") or [{}])[0] or {}).get("device_peak_gib"),
        alloc_retries=(s.get("cuda_alloc_retries_per_rank") or [None])[0],
        final_train_loss=s["final_train_loss"],
        settings={
            k: s.get(k)
            for k in (
                "zero_stage",
                "micro_batch_size",
                "gradient_accumulation_steps",
                "fp32_master_weights",
                "optimizer_kernel",
                "loss_kernel",
                "fused_cross_entropy",
                "attention",
                "kernels",
                "optimizer_states",
                "optimizer_step",
                "compile",
                "gradient_checkpointing",
                "offload_activations",
            )
        },
        wall_s=s["wall_time_s"],
    )
    metrics = work / "results/train" / case.name / "metrics.csv"
    if metrics.exists():
        res["metrics_csv"] = metrics.read_text()
    if res["positions_per_s"]:
        res["mfu_790"] = 6 * s["parameters"] * res["positions_per_s"] / MEASURED_MATMUL_FLOPS
    return res


def seed_result(case: Case, report_path: Path, rc) -> dict:
    res: dict = {"case": case.name, "kind": case.kind, "what": case.what, "layers": case.layers, "rc": rc}
    if not report_path.exists():
        res["status"] = f"failed ({rc})"
        return res
    r = json.loads(report_path.read_text())
    res.update(status=r["status"], peak_gib=r.get("peak_memory_gib"), parameters=r.get("parameters"))
    res["device_peak_gib"] = (r.get("device_memory") or {}).get("device_peak_gib")
    res["losses"] = r.get("losses")
    times = r["step_times"][WARMUP:]
    if r["status"] == "ok" and times:
        step = sum(times) / len(times)
        per_step = 8  # (a) micro-batch 1 x accumulation 8; trl micro-batch 8 x 1
        res.update(
            step_s=step,
            positions_per_s=per_step * r["positions_per_sample"] / step,
            real_per_s=per_step * r["real_per_sample"] / step,
            loss_per_s=per_step * r["loss_tokens_per_sample"] / step,
            skipped_steps=r.get("skipped_steps"),
        )
        res["mfu_790"] = 6 * r["parameters"] * res["positions_per_s"] / MEASURED_MATMUL_FLOPS
    return res


def mix_stats(work: Path) -> dict:
    import numpy as np

    from snaketune.model.batching import load_split

    out: dict = {}
    packed = tokenized_dir(work, True)
    if packed is not None:
        split = json.loads((packed / "stats.json").read_text())["splits"]["train"]
        out.update(
            {
                k: split[k]
                for k in (
                    "conversations",
                    "mean_conversation_tokens",
                    "truncated_pct",
                    "pad_fraction_unpadded_to_max",
                    "pad_fraction_packed",
                    "packed_blocks",
                )
            }
        )
        # What the seed and TRL sides train on must be the same conversations: compared in tests/test_bench.py.
        out.update(packed_tokens=split["tokens"], packed_loss_tokens=split["loss_tokens"])
    seed = work / "seed_data" / "train"
    if seed.exists():
        s = load_split(seed)
        lengths = s.lengths
        out.update(
            median_tokens_after_truncation=float(np.median(lengths)),
            p90_tokens_after_truncation=float(np.percentile(lengths, 90)),
            loss_share_of_real_tokens=float(s.loss_tokens.sum() / lengths.sum()),
            seed_tokens=int(lengths.sum()),
            seed_loss_tokens=int(s.loss_tokens.sum()),
        )
    return out


def fmt(v, spec: str = ",.0f") -> str:
    return "-" if v is None else format(v, spec)


def table(results: list[dict]) -> str:
    seeds = {r["layers"]: r for r in results if r["kind"] == "seed" and r.get("step_s")}
    head = (
        "| case | what | layers | step s | positions/s | real tok/s | loss tok/s | MFU (6N, 790) | "
        "perf/mfu (989) | peak GiB (plan) | device GiB | alloc retries | vs (a): positions, real, loss | vs TRL: real | "
        "status |"
    )
    lines = [head, "|" + "---|" * 15]
    by_name = {r["case"]: r for r in results}
    for r in results:
        ratio = "-"
        peer = by_name.get(BY_NAME[r["case"]].peer or "")
        versus = "-"
        if peer and peer.get("real_per_s") and r.get("real_per_s"):
            versus = f"{r['real_per_s'] / peer['real_per_s']:.2f}x ({peer['case']})"
        base = seeds.get(r["layers"]) or seeds.get(24)
        if r["kind"] == "train" and r.get("step_s") and base:
            ratio = ", ".join(
                f"{r[k] / base[k]:.2f}x" for k in ("positions_per_s", "real_per_s", "loss_per_s")
            )
            if base["layers"] != r["layers"]:
                ratio += f" (vs {base['case']})"
        peak = fmt(r.get("peak_gib"), ".1f")
        if r.get("plan_peak_gib") is not None:
            peak += f" ({r['plan_peak_gib']:.1f})"
        lines.append(
            f"| {r['case']} | {r['what']} | {r['layers']} | {fmt(r.get('step_s'), '.3f')} | "
            f"{fmt(r.get('positions_per_s'))} | {fmt(r.get('real_per_s'))} | {fmt(r.get('loss_per_s'))} | "
            f"{fmt(r.get('mfu_790'), '.3f')} | {fmt(r.get('mfu_project'), '.3f')} | {peak} | "
            f"{fmt(r.get('device_peak_gib'), '.2f')} | "
            f"{fmt(r.get('alloc_retries'), 'd')} | {ratio} | {versus} | {r['status']}"
            + (f", plan: {r['plan_chosen']}" if r.get("plan_chosen") else "")
            + " |"
        )
    return "\n".join(lines)


def with_peers(names: list[str]) -> list[str]:
    """The cases named, each (b) case's TRL peer right after the first case that names it (same call: the peers'
    speed varies from machine to machine by more than the ratios' precision)."""
    out: list[str] = []
    for name in names:
        if name not in out:
            out.append(name)
        peer = BY_NAME[name].peer
        if peer and peer not in names and peer not in out:
            out.append(peer)
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/throughput-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/snaketune-throughput"))
    parser.add_argument("--only", default="", help="comma-separated case names, in the order to run")
    parser.add_argument("--budget-s", type=float, default=540)
    parser.add_argument("--tiny", action="store_true", help="builtin-tiny on CPU ranks: checks the script")
    parser.add_argument("--no-peer", action="store_true", help="only the cases named: no TRL peers")
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    names = [n for n in args.only.split(",") if n] or [c.name for c in CASES]
    unknown = [n for n in names if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown case(s) {unknown}; cases: {', '.join(BY_NAME)}")
    if not args.no_peer:
        names = with_peers(names)
    cases = [BY_NAME[n] for n in names]
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work
    (work / "data").mkdir(parents=True, exist_ok=True)
    copy_workflow(work)
    length_mix.write_jsonl(work / "data/mix.jsonl", trees=300 if args.tiny else 1200)
    config = bench_config(work, cases, args.tiny)
    logs = work / "bench-logs"
    logs.mkdir(exist_ok=True)
    log(f"work dir {work}; cases {', '.join(names)}; budget {args.budget_s:.0f} s")

    # The data stages once, for every case: Snakemake's tokenizer and conversations.
    left = args.budget_s - (time.monotonic() - t0)
    rc = snakemake(work, config, ["results/tokenizer/builtin/tokenizer.json"], logs / "data.log", left)
    log(f"data stages: exit {rc} ({time.monotonic() - t0:.0f} s)")
    if rc != 0:
        print((logs / "data.log").read_text()[-3000:])
        return 1

    results = []
    for case in cases:
        left = args.budget_s - (time.monotonic() - t0)
        if left < case.estimate_s:
            log(f"{case.name}: skipped ({left:.0f} s left, needs ~{case.estimate_s} s)")
            results.append(
                {
                    "case": case.name,
                    "kind": case.kind,
                    "what": case.what,
                    "layers": case.layers,
                    "status": "skipped (budget)",
                }
            )
            continue
        start = time.monotonic()
        log(f"{case.name}: start ({case.what})")
        if case.kind == "train":
            target = f"results/train/{case.name}/summary.json"
            rc = snakemake(
                work, config, [target], logs / f"{case.name}.log", left, gpu_memory_gib=case.gpu_memory_gib
            )
            res = train_result(work, case, rc)
            shutil.rmtree(work / "results/train" / case.name / "model", ignore_errors=True)  # free the disk
        else:
            data = seed_data(work)
            from transformers import AutoTokenizer

            tok = AutoTokenizer.from_pretrained(work / "results/tokenizer/builtin")
            report = work / f"{case.name}.json"
            report.unlink(missing_ok=True)
            steps = str(TINY_STEPS if args.tiny else STEPS)
            if case.kind == "trl":
                cmd = [sys.executable, str(REPO / "bench/throughput/trl_peer.py"), "--data", str(data / "train"),
                       "--tokenizer", str(work / "results/tokenizer/builtin"), "--layers", str(case.layers),
                       "--steps", steps, "--out", str(report), *case.options]  # fmt: skip
            else:
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "1",
                       str(REPO / "bench/throughput/seed_recipe.py"), "--data", str(data / "train"), "--pad-id",
                       str(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id),
                       "--vocab", str(len(tok)), "--layers", str(case.layers), "--steps", steps,
                       "--out", str(report)]  # fmt: skip
            cmd += ["--tiny"] if args.tiny else []
            paths = [str(REPO / "workflow"), os.environ.get("PYTHONPATH", "")]
            env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in paths if p)}
            if args.tiny:
                env["OMP_NUM_THREADS"] = "2"
            rc = run(cmd, cwd=work, log_path=logs / f"{case.name}.log", timeout=left, env=env)
            res = seed_result(case, report, rc)
        res["case_wall_s"] = round(time.monotonic() - start, 1)
        results.append(res)
        brief = {
            k: res.get(k)
            for k in (
                "status",
                "step_s",
                "positions_per_s",
                "real_per_s",
                "loss_per_s",
                "mfu_790",
                "peak_gib",
                "plan_peak_gib",
                "device_peak_gib",
                "case_wall_s",
            )
        }
        log(f"{case.name}: {json.dumps(brief)}")
        (args.out / "throughput.json").write_text(
            json.dumps({"results": results, "mix": mix_stats(work)}, indent=2)
        )

    mix = mix_stats(work)
    text = table(results)
    (args.out / "throughput.json").write_text(json.dumps({"results": results, "mix": mix}, indent=2))
    (args.out / "throughput.md").write_text(text + "\n\nlength mix: " + json.dumps(mix) + "\n")
    with tarfile.open(args.out / "logs.tar.gz", "w:gz") as tar:
        for path in [*logs.glob("*.log"), *(work / "logs").rglob("*.log")]:
            tar.add(path, arcname=str(path.relative_to(work)))
    print("\nlength mix:", json.dumps(mix))
    print(text)
    log(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
