"""Issue #50 in one call: what a 24 GB card trains under `gpu_memory_gib: 24`, beside TRL + Liger under the same cap.

    python -m bench cards24 [--only capped,fp8,long_lora,trl_long,long_qlora] [--budget-s 560] [--tiny]

1. plan (no GPU, seconds): the memory plan for the 7B's LoRA r16 at 8 x 512 under gpu_memory_gib 24 with
   `train.strategy: auto` (the checkpointed layers and micro-batch it picks, the device peak it predicts), and the
   longest row it accepts, one row per step, for LoRA and QLoRA (`longest_row`): plan.json.
2. capped (+ fp8): bench/throughput/train_throughput.py's lora30_cap24_auto (bf16) and lora30_fp8_compile_cap24_auto
   (FP8 matmuls, compiled), each the plan's pick, with trl_lora30_cap24 (TRL SFTTrainer + Liger with gradient
   checkpointing under the same cap: without it TRL does not fit 24 GiB) in the same call: tokens/s, allocator and
   NVML peaks, the plan's prediction. Files under OUT/capped.
3. long_lora, long_qlora: one row of the plan's longest length per step, through Snakemake's train rule under
   gpu_memory_gib 24 with strategy auto (every layer checkpointed, the chunked loss; activation offload where the
   plan turns it on), LONG_STEPS steps, on conversations longer than the row (each row one conversation: attention
   over all of it). QLoRA loads a hub-format 7B that this script writes (random bf16 weights, the builtin tokenizer).
   A run that fails is tried once more as configured (every layer checkpointed, no activation offload) at the
   longest row the plan accepts that way (`<part>_as_configured`).
4. trl_long: TRL + Liger (its fused linear cross-entropy, gradient checkpointing, activation offloading) on the same
   conversations under the same cap at the LoRA row's length, then at halvings until one runs: its longest row.

OUT/cards24.json and OUT/cards24.md hold every figure (and the plan's), printed at the end. Parts run in the order
given until --budget-s runs out (each has an estimate, ESTIMATE_S; one that fails never stops the others): all five
take about 13 minutes on an H100, so on machines that allow 10 minutes a call, run `--only capped,fp8` (about 6) and
`--only long_lora,trl_long,long_qlora` (about 7) as two calls. --tiny runs the
builtin tiny model on CPU ranks (no QLoRA, no FP8) to check the script anywhere. On a GPU machine without network:
`bash bench/transport/run.sh cards24` with .carry/wheels built without LEAN (bitsandbytes for QLoRA).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench/throughput"))
sys.path.insert(0, str(REPO / "bench/overhead"))

import length_mix  # noqa: E402
from bookkeeping import sync as copy_workflow  # noqa: E402
from throughput_cases import LORA_LIGER  # noqa: E402
from train_throughput import run as run_logged  # noqa: E402  (its own process group, killed at the timeout)

PARTS = ("capped", "fp8", "long_lora", "trl_long", "long_qlora")
CAPPED = "lora30_cap24_auto"
FP8 = "lora30_fp8_compile_cap24_auto"
TRL_MODES = ("trl_lora30_cap24", "trl_lora30_cap24_bfd", "trl_lora30_cap24_wrapped")
"""TRL + Liger under the same cap: padded rows, packed padding-free (bfd), wrapped packing; ratios are against the
fastest."""
GPU_MEMORY_GIB = 24
LONG_STEPS = 4
"""Optimizer steps of a long row (the first two are warm-up and not timed: two timed steps)."""
LONG_TRAIN = {
    **LORA_LIGER,
    "fused_cross_entropy": True,
    "gradient_checkpointing": True,
    "strategy": "auto",
    "micro_batch_size": 1,
    "global_batch_size": 1,
}
"""One row per step, the chunked loss, every layer checkpointed unless the plan narrows it: the recipes' settings."""
CONVERSATIONS = 12
WORDS = 45_000
"""Words of each long conversation's reply: more tokens than the longest row the plan accepts for QLoRA."""
ESTIMATE_S = {"capped": 200, "fp8": 150, "long_lora": 110, "trl_long": 120, "long_qlora": 200}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- 1. the plan ---------------------------------------------------------------------------------------------


def _train(**changes) -> dict:
    from snaketune.config.load import to_dict
    from snaketune.config.schema import LoraConfig, TrainConfig

    changes = dict(changes)
    lora = {**to_dict(LoraConfig()), **changes.pop("lora", {})}
    train = to_dict(TrainConfig(**{k: v for k, v in changes.items() if k != "learning_rate"}))
    return {
        **train,
        "lora": lora,
        "gpus": 1,
        "deepspeed": str(REPO / changes.get("deepspeed", LORA_LIGER["deepspeed"])),
    }


def plan(tiny: bool) -> dict:
    """The plan's figures for this call, as the plan rule will make them (snaketune.plan.search), torch-free."""
    from snaketune.device_memory import usable_gib
    from snaketune.plan import search
    from snaketune.plan.budget import Budget

    model = {"base": "arch:deepseek-llm-7b", "num_layers": 30}
    budget = Budget(usable_gib(GPU_MEMORY_GIB), f"gpu_memory_gib: {GPU_MEMORY_GIB}", 125.0)
    files = search.candidate_files(REPO / "config/deepspeed")
    common = dict(model=model, gpu_memory_gib=GPU_MEMORY_GIB, budget=budget, candidate_files=files)
    capped_train = _train(**{**LORA_LIGER, "strategy": "auto", "global_batch_size": 8})
    capped = search.make_plan(experiment=CAPPED, train=capped_train, max_length=512,
                              deepspeed_config=capped_train["deepspeed"], **common)  # fmt: skip
    fp8_train = {**capped_train, "fp8": "tensorwise", "compile": True}
    fp8 = search.make_plan(experiment=FP8, train=fp8_train, max_length=512, deepspeed_config=fp8_train["deepspeed"],
                           **common)  # fmt: skip
    out = {"budget_gib": budget.gpu_gib, "capped": _chosen(capped), "fp8": _chosen(fp8)}
    for name, quantize in (("long_lora", "none"), ("long_qlora", "nf4")):
        train = _train(**{**LONG_TRAIN, "lora": {"enabled": True, "quantize": quantize}})
        made = search.make_plan(experiment=name, train=train, max_length=1024, deepspeed_config=train["deepspeed"],
                                **common)  # fmt: skip
        out[name] = made["longest_row"]
        # The same row as configured (every layer checkpointed, no activation offload): what a long row falls back
        # to where the plan's own (offloading) pick fails on the GPU.
        as_set = search.make_plan(experiment=name, train={**train, "strategy": "as_configured"}, max_length=1024,
                                  deepspeed_config=train["deepspeed"], **common)  # fmt: skip
        out[name]["without_offload"] = as_set["longest_row"]["max_length"]
    if tiny:  # the tiny model on CPU ranks: short rows, the same code path
        for name in ("long_lora", "long_qlora"):
            planned_7b = {"planned_for_the_7b": out[name]["max_length"], "without_offload": 512}
            out[name] = {**out[name], **planned_7b, "max_length": 1024}
    return out


def _chosen(made: dict) -> dict:
    chosen = made["chosen"]
    return {k: chosen.get(k) for k in ("name", "gradient_checkpointing", "micro_batch_size", "offload_activations",
                                       "why")} | {"estimate": chosen.get("estimate")}  # fmt: skip


# ---- 2. the capped rows ----------------------------------------------------------------------------------------


def capped(out: Path, work: Path, parts: list[str], budget_s: float, tiny: bool) -> list[dict]:
    cases = [c for c, part in ((CAPPED, "capped"), (FP8, "fp8")) if part in parts]
    if "capped" in parts:
        cases += TRL_MODES[1:]  # TRL's packed modes beside its padded rows (the peer, which joins on its own)
    cmd = [sys.executable, str(REPO / "bench/throughput/train_throughput.py"), "--out", str(out / "capped"),
           "--work", str(work / "capped"), "--only", ",".join(cases), "--budget-s", str(int(budget_s))]  # fmt: skip
    if "capped" not in parts:
        cmd.append("--no-peer")
    cmd += ["--tiny"] if tiny else []
    log(f"capped: {' '.join(cmd[1:])}")
    subprocess.run(cmd, cwd=REPO, check=False)
    report = out / "capped" / "throughput.json"
    return json.loads(report.read_text())["results"] if report.exists() else []


# ---- 3. the long rows ----------------------------------------------------------------------------------------


def long_conversations(path: Path, *, conversations: int, words: int, seed: int = 0) -> Path:
    """`messages` rows, each a short question and a reply of `words` words (length_mix's lexicon): conversations
    longer than any row trained here, so that each row is one conversation cut to tokenize.max_length."""
    rng = random.Random(seed)
    lexicon = length_mix._lexicon(rng)
    weights = [1.0 / (rank + 1) for rank in range(len(lexicon))]
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        for _ in range(conversations):
            question = " ".join(rng.choices(lexicon, weights=weights, k=20)).capitalize() + "?"
            reply = " ".join(rng.choices(lexicon, weights=weights, k=words)).capitalize() + "."
            row = {
                "messages": [{"role": "user", "content": question}, {"role": "assistant", "content": reply}]
            }
            f.write(json.dumps(row) + "\n")
    return path


def write_hub_model(out: Path, tokenizer: Path) -> None:
    """A hub-format deepseek-llm-7b (random bf16 weights built on the GPU) with the builtin tokenizer, for QLoRA."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from snaketune.model.architectures import DEEPSEEK_LLM_7B

    tok = AutoTokenizer.from_pretrained(tokenizer)
    cfg = LlamaConfig(**{**DEEPSEEK_LLM_7B, "bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id,
                         "pad_token_id": None})  # fmt: skip
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        net = LlamaForCausalLM(cfg).to(torch.bfloat16)
    net.save_pretrained(out, max_shard_size="5GB", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    del net


def long_rows(
    out: Path, work: Path, parts: list[str], planned: dict, deadline: float, tiny: bool
) -> list[dict]:
    """Parts long_lora and long_qlora through Snakemake; trl_long with trl_peer.py. One result per run."""
    copy_workflow(work)
    data = long_conversations(work / "data/long.jsonl", conversations=CONVERSATIONS,
                              words=2_000 if tiny else WORDS)  # fmt: skip
    cfg = yaml.safe_load((REPO / "config/config.yaml").read_text())
    cfg["dataset"] = {**cfg["dataset"], "source": str(data)}
    cfg["preference"] = {**cfg["preference"], "enabled": False}
    base = {**cfg["train"], "max_steps": LONG_STEPS, "warmup_steps": 1, "log_every": 1, "eval_every": 0,
            "checkpoint_every": 0, "learning_rate": 1e-4}  # fmt: skip
    experiments, results = {}, []
    for name in ("long_lora", "long_qlora"):
        if name not in parts or (tiny and name == "long_qlora"):
            continue
        train = {**base, **LONG_TRAIN, "deepspeed": LORA_LIGER["deepspeed"]}
        train["lora"] = {"enabled": True, "rank": 16, "quantize": "nf4" if name == "long_qlora" else "none"}
        if tiny:
            train.update(precision="fp32", kernels="auto", strategy="as_configured")
        model = {} if tiny else {"base": "arch:deepseek-llm-7b"}
        if name == "long_qlora":
            model = {"base": str(work / "hub-7b")}
        rows = planned[name]["max_length"]
        experiments[name] = {
            "model": model,
            "tokenize": {"max_length": rows, "packing": False},
            "train": train,
        }
    logs = out / "long_logs"
    logs.mkdir(parents=True, exist_ok=True)

    def snakemake(experiment: dict, targets: list[str], log_name: str) -> int | str:
        """One experiment per config file: the QLoRA one names a model directory written after the others ran."""
        config = work / f"{log_name}.yaml"
        config.write_text(yaml.safe_dump({**cfg, "experiments": experiment}, sort_keys=False))
        cmd = [sys.executable, "-m", "snakemake", *targets, "--cores", str(os.cpu_count() or 2), "--resources",
               "gpu=1", "--scheduler", "greedy", "--configfile", str(config)]  # fmt: skip
        if not tiny:
            cmd += ["--config", f"gpu_memory_gib={GPU_MEMORY_GIB}"]
        return run_logged(
            cmd, cwd=work, log_path=logs / f"{log_name}.log", timeout=deadline - time.monotonic()
        )

    # The data stages and the builtin tokenizer (which the QLoRA model directory and TRL's rows take) first.
    rc = snakemake({"default": {}}, ["results/tokenizer/builtin/tokenizer.json"], "data")
    log(f"long rows: data stages exit {rc}")
    for name, experiment in experiments.items():
        if deadline - time.monotonic() < ESTIMATE_S[name]:
            results.append({"case": name, "status": "skipped (budget)"})
            continue
        if name == "long_qlora" and not (work / "hub-7b/config.json").exists():
            log("long_qlora: writing a hub-format 7B")  # in a process of its own: its GPU memory goes with it
            cmd = [sys.executable, __file__, "--write-hub-model", str(work / "hub-7b"),
                   str(work / "results/tokenizer/builtin")]  # fmt: skip
            run_logged(cmd, cwd=REPO, log_path=logs / "hub_model.log", timeout=deadline - time.monotonic())
        rows = experiment["tokenize"]["max_length"]
        log(f"{name}: one row of {rows:,} tokens per step")
        rc = snakemake({name: experiment}, [f"results/train/{name}/summary.json"], name)
        results.append({**_train_result(work, name, rc, planned[name]), "max_length": rows})
        shutil.rmtree(work / "results/train" / name / "model", ignore_errors=True)  # the disk
        log(f"{name}: {json.dumps(results[-1])}")
        fallback = planned[name].get("without_offload")
        if results[-1]["status"] != "ok" and fallback and deadline - time.monotonic() > ESTIMATE_S[name]:
            again = (
                f"{name}_as_configured"  # every layer checkpointed, no activation offload, the plan's longest
            )
            train = {**experiment["train"], "strategy": "as_configured", "offload_activations": False}
            retry = {
                **experiment,
                "tokenize": {**experiment["tokenize"], "max_length": fallback},
                "train": train,
            }
            log(f"{again}: one row of {fallback:,} tokens per step")
            rc = snakemake({again: retry}, [f"results/train/{again}/summary.json"], again)
            results.append({**_train_result(work, again, rc, planned[name]), "max_length": fallback})
            shutil.rmtree(work / "results/train" / again / "model", ignore_errors=True)
            log(f"{again}: {json.dumps(results[-1])}")
    if "trl_long" in parts:
        results += trl_long(out, work, planned["long_lora"]["max_length"], deadline, tiny)
    return results


def _train_result(work: Path, name: str, rc, planned: dict) -> dict:
    res: dict = {"case": name, "rc": rc, "planned_longest_row": planned}
    plan_path = work / "results/plan" / f"{name}.json"
    if plan_path.exists():
        made = json.loads(plan_path.read_text())
        res["plan"] = {
            "chosen": _chosen(made),
            "longest_row": made.get("longest_row"),
            "status": made.get("status"),
        }
    summary = work / "results/train" / name / "summary.json"
    if not summary.exists():
        tail = work / "logs/train" / f"{name}.log"
        lines = tail.read_text().splitlines()[-15:] if tail.exists() else []
        oom = any("out of memory" in line or "OutOfMemoryError" in line for line in lines)
        return {**res, "status": "out of memory" if oom else f"failed ({rc})", "log_tail": lines}
    s = json.loads(summary.read_text())
    device = ((s.get("device_memory_per_rank") or [{}])[0]) or {}
    return {
        **res,
        "status": "ok",
        "tokens_per_s": s["tokens_per_s_per_gpu"],
        "step_time_s": s["step_time_s"],
        "mfu": s["mfu"],
        "allocator_peak_gib": s["peak_memory_gib_per_rank"][0],
        "device_peak_gib": device.get("device_peak_gib"),
        "reserved_peak_gib": device.get("reserved_peak_gib"),
        "outside_allocator_gib": device.get("outside_allocator_gib"),
        "allocator_settings": device.get("allocator_settings"),
        "gradient_checkpointing": s.get("gradient_checkpointing"),
        "offload_activations": s.get("offload_activations"),
        "final_train_loss": s["final_train_loss"],
    }


def trl_long(out: Path, work: Path, rows: int, deadline: float, tiny: bool) -> list[dict]:
    """TRL + Liger's longest row under the same cap: the LoRA row's length, then halvings, until one runs."""
    from snaketune.data.tokenization import tokenize_conversations

    results = []
    while rows >= 256 and deadline - time.monotonic() > ESTIMATE_S["trl_long"]:
        data = work / f"trl_rows_{rows}"
        if not (data / "stats.json").exists():
            tokenize_conversations(work / "results/data/conversations", work / "results/tokenizer/builtin", data,
                                   max_length=rows, packing=False, assistant_only_loss=True,
                                   chat_template="deepseek")  # fmt: skip
        report = out / f"trl_long_{rows}.json"
        cmd = [sys.executable, str(REPO / "bench/throughput/trl_peer.py"), "--data", str(data / "train"),
               "--tokenizer", str(work / "results/tokenizer/builtin"), "--layers", "30", "--steps", str(LONG_STEPS),
               "--lora", "--checkpointing", "--max-length", str(rows), "--micro", "1", "--accumulation", "1",
               "--out", str(report)]  # fmt: skip
        # TRL's activation offloading needs a CUDA device (its CPU path fails on torch.accelerator).
        cmd += ["--tiny"] if tiny else ["--cap", str(GPU_MEMORY_GIB), "--offload-activations"]
        log(f"trl_long: {rows:,} tokens per row")
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(REPO / "workflow"), os.environ.get("PYTHONPATH", "")]),
        }
        run_logged(cmd, cwd=work, log_path=out / "long_logs" / "trl_long.log", timeout=deadline - time.monotonic(),
                   env=env)  # fmt: skip
        r = json.loads(report.read_text()) if report.exists() else {"status": "no report"}
        times = r.get("step_times", [])[2:]
        res = {"case": "trl_long", "max_length": rows, "status": r.get("status"),
               "allocator_peak_gib": r.get("peak_memory_gib"),
               "device_peak_gib": (r.get("device_memory") or {}).get("device_peak_gib")}  # fmt: skip
        if times and r.get("status") == "ok":
            res["tokens_per_s"] = r["real_per_sample"] / (sum(times) / len(times))
        results.append(res)
        log(f"trl_long: {json.dumps(res)}")
        if r.get("status") == "ok":
            break
        rows = rows // 2 // 256 * 256
    return results


# ---- the report ----------------------------------------------------------------------------------------------


def summary(planned: dict, capped_rows: list[dict], long: list[dict]) -> str:
    def f(v, spec=",.0f"):
        return "-" if v is None else format(v, spec)

    lines = [
        f"## The plan (gpu_memory_gib {GPU_MEMORY_GIB}: {planned['budget_gib']:.2f} GiB usable)",
        "",
        f"- LoRA r16, 30 layers, 8 x 512, strategy auto: {planned['capped']['why']}",
        f"- the same with FP8, compiled: {planned['fp8']['why']}",
        f"- longest row, LoRA: {planned['long_lora']['max_length']:,} tokens ({planned['long_lora']['strategy']}, "
        f"{planned['long_lora']['gpu_gib']} GiB predicted)",
        f"- longest row, QLoRA: {planned['long_qlora']['max_length']:,} tokens ({planned['long_qlora']['strategy']}, "
        f"{planned['long_qlora']['gpu_gib']} GiB predicted)",
        "",
        "## Measured",
        "",
        "| case | status | row tokens | tokens/s | vs TRL (its fastest) | allocator GiB | NVML GiB | plan GiB (device) | plan's pick |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    trl = max((r for r in capped_rows if r["case"] in TRL_MODES and r.get("real_per_s")),
              key=lambda r: r["real_per_s"], default=None)  # TRL at its fastest of its modes  # fmt: skip
    for r in capped_rows:
        versus = "-"
        if trl and r.get("real_per_s") and r["case"] not in TRL_MODES:
            versus = f"{r['real_per_s'] / trl['real_per_s']:.2f}x"
        lines.append(
            f"| {r['case']} | {r.get('status')} | 512 | {f(r.get('real_per_s'))} | {versus} | "
            f"{f(r.get('peak_gib'), '.2f')} | {f(r.get('device_peak_gib'), '.2f')} | "
            f"{f(r.get('plan_gpu_gib'), '.2f')} | {r.get('plan_chosen') or '-'} |"
        )
    trl_long_ok = next((r for r in long if r["case"] == "trl_long" and r.get("status") == "ok"), None)
    for r in long:
        chosen = (r.get("plan") or {}).get("chosen") or {}
        versus = "-"
        if trl_long_ok and r["case"] != "trl_long" and r.get("max_length"):
            versus = f"{r['max_length'] / trl_long_ok['max_length']:.2f}x the row"
        lines.append(
            f"| {r['case']} | {r.get('status')} | {f(r.get('max_length'))} | {f(r.get('tokens_per_s'))} | {versus} | "
            f"{f(r.get('allocator_peak_gib'), '.2f')} | {f(r.get('device_peak_gib'), '.2f')} | "
            f"{f((chosen.get('estimate') or {}).get('gpu_gib'), '.2f')} | {chosen.get('name') or '-'} |"
        )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if argv[:1] == ["--write-hub-model"]:
        write_hub_model(Path(argv[1]), Path(argv[2]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/cards24-out")))
    parser.add_argument("--work", type=Path, default=Path("/tmp/snaketune-cards24"))
    parser.add_argument(
        "--only", default=",".join(PARTS), help=f"comma-separated parts of {', '.join(PARTS)}"
    )
    parser.add_argument("--budget-s", type=float, default=560)
    parser.add_argument("--tiny", action="store_true", help="builtin-tiny on CPU ranks: checks the script")
    args = parser.parse_args(argv)
    parts = [p for p in args.only.split(",") if p]
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; parts: {', '.join(PARTS)}")
    t0 = time.monotonic()
    deadline = t0 + args.budget_s
    args.out.mkdir(parents=True, exist_ok=True)
    planned = plan(args.tiny)
    (args.out / "plan.json").write_text(json.dumps(planned, indent=2))
    log(f"plan: {json.dumps(planned)}")
    capped_rows: list[dict] = []
    if {"capped", "fp8"} & set(parts):
        share = sum(ESTIMATE_S[p] for p in ("capped", "fp8") if p in parts)
        rest = sum(ESTIMATE_S[p] for p in parts if p not in ("capped", "fp8"))
        capped_budget = max(60.0, (deadline - time.monotonic()) * share / (share + rest))
        capped_rows = capped(args.out, args.work, parts, capped_budget, args.tiny)
    long = []
    if {"long_lora", "long_qlora", "trl_long"} & set(parts):
        long = long_rows(args.out, args.work / "long", parts, planned, deadline, args.tiny)
    text = summary(planned, capped_rows, long)
    record = {"plan": planned, "capped": capped_rows, "long": long, "wall_s": round(time.monotonic() - t0, 1)}
    (args.out / "cards24.json").write_text(json.dumps(record, indent=2))
    (args.out / "cards24.md").write_text(text + "\n")
    print(text)
    log(f"done in {time.monotonic() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
