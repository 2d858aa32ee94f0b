"""The outside peer of bench/device_real_model.sh (issue #24): TRL's SFTTrainer, then its DPOTrainer from that SFT
model, on the data of a finished workflow run of config/examples/smollm2-135m-real.yaml, scored by the workflow's
own evaluation (snaketune.evaluation.evaluate: the same held-out conversations and pairs, masking, prompts and
metrics), so that the two pipelines differ only in how they train.

What is the same as the workflow's stages, read from its run directory and its config:
- Model: the hub-format directory rule import_gguf made of the GGUF file (results/models/*).
- SFT data: the train stage's own tokenized conversations (results/tokenized/*/train), each packed row cut back into
  its conversations (position 0 starts one), with the train stage's loss tokens as TRL's `completion_mask`: the same
  tokens, the same chat template, the same assistant-only masking. Rows are padded to the longest of each
  micro-batch: TRL's packed padding-free mode needs FlashAttention-2 (transformers' sdpa attends across the packed
  conversations), which the lent machine does not have. Same epochs, optimizer steps per epoch (conversations per
  step = conversations / the workflow's steps per epoch), peak rate, warm-up, cosine decay to min_lr_ratio, AdamW
  betas, weight decay, gradient clipping, bf16 mixed precision, seed; Liger's kernels (`use_liger_kernel`).
- DPO data: the preference stage's pairs (results/data/preferences/*/train.parquet) in TRL's conversational form
  (prompt messages, chosen and rejected assistant replies), tokenized by TRL with the same chat template, at most
  `preference.max_length` tokens per side (TRL keeps the start; the workflow drops old turns first). Same beta, the
  RPO term as TRL's `sft` loss weighted by `preference.sft_weight`, reference log-probs precomputed (as the
  workflow's reference stage caches them), pairs per step, epochs, schedule and seed.

Writes OUT/sft and OUT/dpo (hub-format), OUT/metrics.json and OUT/generations.jsonl (the evaluate stage's files),
and OUT/trl.json (wall time of each stage from process start to the saved model, step times, losses).

    python3 bench/real_model_trl.py --run DIR --config config/examples/smollm2-135m-real.yaml [more configs] \\
        [--experiment NAME] --out OUT [--stages sft,dpo,eval]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch
import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench"))

from seed_recipe import step_timer  # noqa: E402

from snaketune.config.load import _deep_merge, load_config  # noqa: E402
from snaketune.model.batching import IGNORE, load_split, steps_for_epochs  # noqa: E402


def one(paths: list[Path], what: str) -> Path:
    if len(paths) != 1:
        raise SystemExit(f"expected one {what} in the run directory, found {[str(p) for p in paths]}")
    return paths[0]


def run_files(run: Path) -> dict[str, Path]:
    """The workflow's files this peer reads (one tokenization, one pair set: the experiments share them)."""
    res = run / "results"
    return {
        "model": one([p.parent for p in res.glob("models/*/config.json")], "imported model"),
        "tokenizer": one([p.parent for p in res.glob("tokenizer/*/tokenizer.json")], "tokenizer"),
        "data": one([p.parent for p in res.glob("tokenized/*/stats.json")], "tokenized SFT data"),
        "pairs_tokenized": one(
            [p.parent for p in res.glob("tokenized_pairs/*/stats.json")], "tokenized pairs"
        ),
        "pairs": one([p.parent for p in res.glob("data/preferences/*/train.parquet")], "pair set"),
        "conversations": res / "data/conversations",
    }


def sft_rows(data_dir: Path) -> tuple[dict[str, list], int]:
    """The packed train split cut back into conversations: TRL's pre-tokenized form (input_ids, completion_mask).
    Also returns the packed rows' count (the workflow's samples per epoch)."""
    split = load_split(data_dir / "train")
    ids, masks = [], []
    for row_ids, labels, pos in zip(split.input_ids, split.labels, split.position_ids, strict=True):
        starts = np.flatnonzero(pos == 0).tolist() + [len(pos)]
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            mask = (labels[a:b] != IGNORE).astype(int)
            if mask[1:].any():  # pads are one-token sequences without a label
                ids.append(row_ids[a:b].tolist())
                masks.append(mask.tolist())
    return {"input_ids": ids, "completion_mask": masks}, len(split)


def dpo_rows(pairs_dir: Path) -> dict[str, list]:
    import pandas as pd

    frame = pd.read_parquet(pairs_dir / "train.parquet")
    prompts = [[{"role": m["role"], "content": m["content"]} for m in p] for p in frame["prompt"]]
    return {
        "prompt": prompts,
        "chosen": [[{"role": "assistant", "content": c}] for c in frame["chosen"]],
        "rejected": [[{"role": "assistant", "content": r}] for r in frame["rejected"]],
    }


def common_args(train, cuda: bool, out: Path, report: dict) -> dict:
    """TrainingArguments shared by both stages, from a train section of the workflow's config."""
    return dict(
        output_dir=str(out),
        learning_rate=train.learning_rate,
        lr_scheduler_type="cosine_with_min_lr",
        lr_scheduler_kwargs={"min_lr_rate": train.min_lr_ratio},
        warmup_steps=train.warmup_steps,
        weight_decay=train.weight_decay,
        adam_beta1=train.adam_betas[0],
        adam_beta2=train.adam_betas[1],
        max_grad_norm=train.grad_clip or 0.0,
        bf16=cuda,
        use_liger_kernel=cuda,
        optim="adamw_torch_fused" if cuda else "adamw_torch",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        disable_tqdm=True,
        seed=train.seed,
        data_seed=train.seed,
        use_cpu=not cuda,
    )


def train_sft(files: dict, exp, out: Path, report: dict) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    train = exp.train
    rows, packed = sft_rows(files["data"])
    steps_per_epoch = steps_for_epochs(packed, 1, train.global_batch_size)
    per_step = int(np.ceil(len(rows["input_ids"]) / steps_per_epoch))
    micro = min(per_step, 32)
    accumulation = int(np.ceil(per_step / micro))
    report.update(conversations=len(rows["input_ids"]), workflow_packed_rows=packed, steps_per_epoch=steps_per_epoch,
                  conversations_per_step=micro * accumulation, micro_batch=micro,
                  tokens=int(sum(map(len, rows["input_ids"]))))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(files["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32)
    config = SFTConfig(
        **common_args(train, cuda, out / "sft_trainer", report),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        num_train_epochs=train.epochs,
        max_length=exp.tokenize.max_length,
        packing=False,
        completion_only_loss=True,
    )
    trainer = SFTTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tok,
        callbacks=[step_timer(report, cuda)],
    )
    trainer.train()
    trainer.save_model(str(out / "sft"))
    tok.save_pretrained(str(out / "sft"))


def train_dpo(files: dict, exp, out: Path, report: dict) -> None:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    cuda = torch.cuda.is_available()
    pref = exp.preference
    train = exp.dpo_train
    rows = dpo_rows(files["pairs"])
    report.update(pairs=len(rows["prompt"]))
    tok = AutoTokenizer.from_pretrained(out / "sft")
    model = AutoModelForCausalLM.from_pretrained(out / "sft", dtype=torch.float32)
    losses = ["sigmoid"] + (["sft"] if pref.sft_weight else [])
    config = DPOConfig(
        **common_args(train, cuda, out / "dpo_trainer", report),
        per_device_train_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.global_batch_size // train.micro_batch_size,
        num_train_epochs=train.epochs,
        max_length=pref.max_length,
        beta=pref.beta,
        loss_type=losses,
        loss_weights=[1.0] + ([pref.sft_weight] if pref.sft_weight else []),
        precompute_ref_log_probs=True,
    )
    trainer = DPOTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tok,
        callbacks=[step_timer(report, cuda)],
    )
    trainer.train()
    trainer.save_model(str(out / "dpo"))
    tok.save_pretrained(str(out / "dpo"))


def evaluate_peer(files: dict, exp, cfg, out: Path) -> None:
    """The workflow's evaluate stage, as its rule calls it (workflow/rules/common_report.smk evaluate_params),
    on TRL's two models."""
    from snaketune.config.load import to_dict
    from snaketune.evaluation.evaluate import evaluate

    summary = out / "summary.json"
    summary.write_text(
        json.dumps({"seed": exp.train.seed, "precision": "bf16" if torch.cuda.is_available() else "fp32"})
    )
    evaluate(
        **to_dict(cfg.eval),
        model=to_dict(exp.model),
        seed=exp.train.seed,
        chat_template=exp.tokenize.chat_template,
        builtin_dataset=False,
        max_prompt_tokens=exp.tokenize.max_length,
        beta=exp.preference.beta,
        reference=exp.preference.reference,
        quantize="none",
        tuned_dir=out / "sft",
        dpo_dir=out / "dpo",
        pairs_dir=files["pairs_tokenized"],
        train_summary=summary,
        tokenizer_dir=files["tokenizer"],
        data_dir=files["data"],
        conversations_dir=files["conversations"],
        metrics_out=out / "metrics.json",
        generations_out=out / "generations.jsonl",
    )


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--run", type=Path, required=True, help="the workflow's working directory (finished run)"
    )
    parser.add_argument(
        "--config", type=Path, nargs="+", required=True, help="its --configfile files, in order"
    )
    parser.add_argument("--experiment", default="default")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--stages", default="sft,dpo,eval")
    args = parser.parse_args(argv)
    import trl

    # Snakemake's config: config/config.yaml, then each --configfile merged over it, key by key.
    raw = yaml.safe_load((REPO / "config/config.yaml").read_text())
    for path in args.config:
        raw = _deep_merge(raw, yaml.safe_load(path.read_text()) or {})
    os.chdir(args.run)  # relative paths of the config (dataset.source, model.base) as the workflow read them
    cfg = load_config(raw)
    exp = cfg.experiments[args.experiment]
    files = run_files(Path("."))
    args.out.mkdir(parents=True, exist_ok=True)
    reports: dict = {"trl": trl.__version__, "experiment": args.experiment, "seed": exp.train.seed}
    status = 0
    for stage, fn in (("sft", train_sft), ("dpo", train_dpo), ("eval", None)):
        if stage not in args.stages.split(","):
            continue
        report: dict = {"step_times": [], "losses": []}
        t0 = time.perf_counter()
        try:
            if fn is None:
                evaluate_peer(files, exp, cfg, args.out)
            else:
                fn(files, exp, args.out, report)
            report["status"] = "ok"
        except Exception as e:  # noqa: BLE001 - the report says what happened
            traceback.print_exc()
            report["status"] = f"failed: {type(e).__name__}: {e}"
            status = 1
        report["wall_s"] = time.perf_counter() - t0
        if torch.cuda.is_available():
            report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
            torch.cuda.reset_peak_memory_stats()
        reports[stage] = report
        print(f"trl {stage}: {report['status']}, {report['wall_s']:.1f} s", flush=True)
        if status:
            break
    (args.out / "trl.json").write_text(json.dumps(reports, indent=2))
    return status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
