"""The export stage (snaketune.export.export: GGUF through llama.cpp's converter and quantizer, then scored against
transformers) on the full-size deepseek-llm-7b architecture with random bf16 weights.

Two phases, both writing into --out (bench/export/export_7b.sh runs each in its own process, so that each one's
peak memory is its own; --phase all runs both in this one):
  build   the data stages' functions on the rows file (download -> conversations -> fetch_tokenizer -> tokenize,
          as the workflow's rules call them, with config/config.yaml's settings), then the model as rule train
          builds `arch:deepseek-llm-7b` (snaketune.model.build.load_model, on the GPU where there is one) and
          saves it as the train stage does (save_pretrained, safetensors shards, and the tokenizer with the chat
          template it trained with): out/model
  export  snaketune.export.export.export(ExportJob(...)) with the arguments workflow/scripts/export.py passes (the config's
          export and eval defaults), every call into the converter, quantizer and scoring timed
Each phase merges its figures into out/export_7b.json (the export's metrics.json is copied in).

    python3 bench/export/export_7b.py --phase build|export|all --out DIR --tokenizer DIR --data ROWS.jsonl \
        [--num-layers N] [--eval-tokens N] [--threads N] [--config YAML ...] [--tiny]
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import logging
import os
import resource
import shutil
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))

from snaketune.config.load import load_config, merge_config_files  # noqa: E402
from snaketune.config.schema import Config, ExperimentConfig  # noqa: E402

EXPERIMENT, MODEL = "default", "sft"  # the names rule export would give: results/export/default/sft


def load_cfg(args: argparse.Namespace) -> tuple[Config, ExperimentConfig]:
    """config/config.yaml, any --config overlays, then the rows file and the 7B architecture (with the given tokenizer)."""
    raw = merge_config_files([REPO / "config" / "config.yaml", *args.config])
    raw["dataset"] = {**raw["dataset"], "source": str(args.data)}
    raw["model"] = {**raw["model"], "base": "arch:deepseek-llm-7b", "tokenizer": str(args.tokenizer),
                    "num_layers": args.num_layers}  # fmt: skip
    raw.pop("experiments", None)
    cfg = load_config(raw)
    return cfg, cfg.experiments[EXPERIMENT]


def rusage() -> dict[str, float]:
    """Peak resident memory so far, GiB (Linux gives ru_maxrss in KiB), of this process and of its waited-for
    children. A child's ru_maxrss starts from its parent's high-water mark (fork, then exec), so the children's
    figure is at least this process's peak at the converter's start: the sampler's figures are the converter's own."""
    return {
        "peak_rss_self_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "peak_rss_children_gib": resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20,
    }


class Sampler(threading.Thread):
    """Every `every` seconds: the RSS of this process, of its live descendants (the converter) and of both together,
    and the machine's used memory (page cache excluded); keeps the peaks, GiB."""

    def __init__(self, every: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.every, self.peaks, self.stop = every, defaultdict(float), threading.Event()

    def run(self) -> None:
        import psutil

        me = psutil.Process()
        while not self.stop.wait(self.every):
            own, kids = me.memory_info().rss, 0
            for c in me.children(recursive=True):
                with contextlib.suppress(psutil.Error):  # ended between the listing and the reading
                    kids += c.memory_info().rss
            for k, v in (("self", own), ("children", kids), ("self_and_children", own + kids),
                         ("machine_used", psutil.virtual_memory().used)):  # fmt: skip
                self.peaks[k] = max(self.peaks[k], v / 2**30)

    def result(self) -> dict[str, float]:
        self.stop.set()
        self.join()
        return {f"sampled_peak_rss_{k}_gib" if k != "machine_used" else "sampled_peak_machine_used_gib": round(v, 3)
                for k, v in self.peaks.items()}  # fmt: skip


def build(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from snaketune.data.chat import load_tokenizer
    from snaketune.data.conversations import build_conversations, read_messages, write_conversations
    from snaketune.data.download import materialize
    from snaketune.data.tokenization import tokenize_conversations
    from snaketune.data.tokenizer import fetch_tokenizer
    from snaketune.keys import tokenize_settings
    from snaketune.model.build import builtin_config, load_model

    cfg, exp = load_cfg(args)
    data = out / "data"
    t0 = time.perf_counter()
    # The data rules, as their scripts call these functions (workflow/scripts/{download,conversations,
    # fetch_tokenizer,tokenize_data}.py).
    ds = cfg.dataset
    materialize(ds.source, data / "raw", builtin_trees=ds.builtin_trees, builtin_seed=ds.builtin_seed)
    conv = build_conversations(read_messages(data / "raw" / "messages.parquet"), languages=ds.languages,
                               paths=ds.paths, validation_fraction=ds.validation_fraction,
                               tree_states=ds.tree_states, source_name=str(data / "raw" / "messages.parquet"))  # fmt: skip
    write_conversations(conv, data / "conversations")
    fetch_tokenizer(str(args.tokenizer), data / "tokenizer")
    stats = tokenize_conversations(data / "conversations", data / "tokenizer", data / "tokenized",
                                   **tokenize_settings(exp.tokenize), threads=args.threads)  # fmt: skip
    data_s = time.perf_counter() - t0

    # The model as rule train builds it: builtin_config's numbers (snaketune.model.architectures), bf16, built
    # straight on the GPU where there is one (seconds; minutes on a CPU core).
    tokenizer = load_tokenizer(data / "tokenizer", exp.tokenize.chat_template)
    ids = dict(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    device = torch.device("cuda") if torch.cuda.is_available() else None
    t0 = time.perf_counter()
    if args.tiny:  # CPU check only: the same config, narrower
        from transformers import AutoModelForCausalLM

        lc = builtin_config(exp.model, **ids)
        lc.hidden_size, lc.intermediate_size, lc.num_attention_heads, lc.num_key_value_heads = 256, 688, 2, 2
        torch.manual_seed(exp.train.seed)
        net = AutoModelForCausalLM.from_config(lc, dtype=torch.bfloat16)
    else:
        net = load_model(exp.model, **ids, dtype=torch.bfloat16, seed=exp.train.seed, device=device)
    if device is not None:
        torch.cuda.synchronize()
    build_s = time.perf_counter() - t0
    params = sum(p.numel() for p in net.parameters())
    t0 = time.perf_counter()
    model_dir = out / "model"
    shutil.rmtree(model_dir, ignore_errors=True)
    net.save_pretrained(model_dir, max_shard_size="5GB", safe_serialization=True)
    tokenizer.save_pretrained(model_dir)  # as the train stage does: its template is the one the export checks
    save_s = time.perf_counter() - t0
    return {
        "config": net.config.to_diff_dict() | {"parameters": params},
        "tokenized_validation": stats["splits"]["validation"],
        "data_s": data_s,
        "model_build_s": build_s,
        "model_save_s": save_s,
        "model_dir_bytes": sum(p.stat().st_size for p in model_dir.iterdir()),
        "shards": sorted(p.name for p in model_dir.glob("*.safetensors")),
        "gpu_peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30 if device is not None else None,
    }


def timed(table: dict[str, list[tuple[float, float]]], module: Any, name: str) -> None:
    """Replace module.name by a wrapper that appends each call's (wall, CPU) seconds to table[name], CPU being user +
    system of this process and its children (export.py calls these through their modules, so it sees the wrapper)."""
    fn = getattr(module, name)

    def cpu() -> float:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system

    @functools.wraps(fn)
    def wrapper(*a, **k):
        t, c = time.perf_counter(), cpu()
        try:
            return fn(*a, **k)
        finally:
            table[name].append((time.perf_counter() - t, cpu() - c))

    setattr(module, name, wrapper)


def export_phase(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from snaketune.data.prompts import resolve_prompts
    from snaketune.export import llama_cpp, measure
    from snaketune.export.export import ExportJob, export

    cfg, exp = load_cfg(args)
    data = out / "data"
    log_file = out / "export.log"
    # As _stage.run sets up a rule's script: logging (and stderr) into the rule's log.
    stream = open(log_file, "a", buffering=1, encoding="utf-8")  # noqa: SIM115
    sys.stderr = stream
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s",
                        stream=stream, force=True)  # fmt: skip
    calls: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for name in ("convert", "quantize", "gguf_metadata"):
        timed(calls, llama_cpp, name)
    for name in (
        "validation_segments",
        "reference_logprobs",
        "reference_replies",
        "score_gguf",
        "greedy_gguf",
    ):
        timed(calls, measure, name)
    # workflow/scripts/export.py with rule export's params (workflow/rules/common_report.smk: export_params).
    torch.set_num_threads(args.threads)
    prompts = resolve_prompts(cfg.eval.prompts if isinstance(cfg.eval.prompts, str) else list(cfg.eval.prompts),
                              builtin_dataset=cfg.dataset.source == "builtin",
                              conversations_dir=data / "conversations")  # fmt: skip
    export_dir = out / "export"
    t0 = time.perf_counter()
    job = ExportJob(
        outtype=cfg.export.outtype,
        quants=list(cfg.export.quants),
        max_kl=cfg.export.thresholds(),
        eval_tokens=args.eval_tokens or cfg.export.eval_tokens,
        max_new_tokens=cfg.eval.max_new_tokens,
        max_prompt_tokens=exp.tokenize.max_length,
        trust_remote_code=exp.model.trust_remote_code,
        prompts=[p["prompt"] for p in prompts],
        model_dir=out / "model",
        name=f"{EXPERIMENT}-{MODEL}",
        out_dir=export_dir,
        data_dir=data / "tokenized",
        conversations=data / "conversations" / "validation.parquet",
        threads=args.threads,
        log_file=log_file,
    )
    metrics = export(job)
    export_s = time.perf_counter() - t0
    sys.stderr = sys.__stderr__
    # Wall and CPU seconds per call in order: convert once, quantize per quant, per file open/score/greedy x prompts.
    return {
        "export_s": export_s,
        "calls_s": {
            k: {
                "n": len(v),
                "total": sum(w for w, _ in v),
                "cpu_total": sum(c for _, c in v),
                "each": [round(w, 2) for w, _ in v],
                "cpu_each": [round(c, 2) for _, c in v],
            }
            for k, v in calls.items()
        },  # fmt: skip
        "gguf_bytes": {p.name: p.stat().st_size for p in sorted(export_dir.glob("*.gguf"))},
        "metrics": metrics,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--phase", choices=("build", "export", "all"), default="all")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--tokenizer", type=Path, required=True, help="directory with tokenizer.json, tokenizer_config.json"
    )
    p.add_argument("--data", type=Path, required=True, help="oasst rows (hf_rows .jsonl)")
    p.add_argument("--num-layers", type=int, default=None, help="default: all 30")
    p.add_argument("--eval-tokens", type=int, default=None, help="default: the config's export.eval_tokens")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--config", nargs="*", default=[], help="YAML files merged over config/config.yaml")
    p.add_argument("--tiny", action="store_true", help="CPU check only: hidden 256, intermediate 688")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    report_path = args.out / "export_7b.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    for phase in ("build", "export") if args.phase == "all" else (args.phase,):
        t0 = time.perf_counter()
        sampler = Sampler()
        sampler.start()
        part = build(args, args.out) if phase == "build" else export_phase(args, args.out)
        part |= {"wall_s": time.perf_counter() - t0, "threads": args.threads, "cpus": os.cpu_count(),
                 "args": {k: str(v) for k, v in vars(args).items()}} | rusage() | sampler.result()  # fmt: skip
        if phase == "export":
            shutil.copy(args.out / "export" / "metrics.json", args.out / "metrics.json")
            part["gpu_peak_allocated_gib"] = (
                None  # the export stage runs on the CPU only (llama.cpp, transformers fp32)
            )
        report[phase] = part
        report_path.write_text(json.dumps(report, indent=2, default=str) + "\n")
        brief = {k: v for k, v in part.items() if k not in ("metrics", "config", "args", "calls_s")}
        brief |= {
            f"{k}_s": f"{v['total']:.1f} (cpu {v['cpu_total']:.1f})"
            for k, v in part.get("calls_s", {}).items()
        }
        print(f"=== {phase}: {json.dumps(brief, default=str)}", flush=True)


if __name__ == "__main__":
    main()
