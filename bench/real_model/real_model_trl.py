"""The outside peer of bench/real_model/run.sh (issue #24): TRL's SFTTrainer, then its DPOTrainer from that SFT
model, on the data of a finished workflow run of config/examples/smollm2-135m-real.yaml, scored by the workflow's
own evaluation (snaketune.evaluation.evaluate: the same held-out conversations and pairs, masking, prompts and
metrics), so that the two pipelines differ only in how they train.

What is the same as the workflow's stages, read from its run directory and its config:
- Model: the hub-format directory rule import_gguf made of the GGUF file (results/models/*).
- SFT data: the train stage's own tokenized conversations (results/tokenized/*/train), each packed row cut back into
  its conversations (position 0 starts one), with the train stage's loss tokens as TRL's `completion_mask`: the same
  tokens, the same chat template, the same assistant-only masking. `--mode padded`: one conversation per row, each
  micro-batch padded to its longest; `--mode packed`: TRL's packed padding-free mode (best-fit-decreasing packing
  into rows of tokenize.max_length with position ids restarting per conversation, the workflow's micro- and global
  batch in rows; transformers 5 turns those position ids into a block-diagonal mask for sdpa, as no FlashAttention-2
  package can be installed on the lent machine; DPO's pairs padding-free too). Same epochs, optimizer steps per
  epoch (conversations per step = conversations / the workflow's steps per epoch), max_steps where the config sets
  it, the learning-rate schedule (the workflow's own function: `with_schedule`), AdamW betas, weight decay,
  gradient clipping, bf16 mixed precision, seed; Liger's kernels (`use_liger_kernel`).
- DPO data: the preference stage's pairs (results/data/preferences/*/train.parquet) in TRL's conversational form
  (prompt messages, chosen and rejected assistant replies), tokenized by TRL with the same chat template, at most
  `preference.max_length` tokens per side (TRL keeps the start; the workflow drops old turns first). Same beta, the
  RPO term as TRL's `sft` loss weighted by `preference.sft_weight`, reference log-probs precomputed (as the
  workflow's reference stage caches them), pairs per step, epochs, schedule and seed.

Writes OUT/sft and OUT/dpo (hub-format), OUT/metrics.json and OUT/generations.jsonl (the evaluate stage's files),
and OUT/trl.json (wall time of each stage from process start to the saved model, step times, losses).

    python3 bench/real_model/real_model_trl.py --run DIR --config config/examples/smollm2-135m-real.yaml [more configs] \\
        [--experiment NAME] --out OUT [--stages sft,dpo,eval] [--mode padded|packed]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
import traceback
from pathlib import Path

# Before torch, transformers and TRL load: the first stage's wall time counts their imports (as a rule's does).
T_START = time.perf_counter()

import numpy as np  # noqa: E402
import torch  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))
# seed_recipe.step_timer: steps timed as the throughput peers time them
sys.path.insert(0, str(REPO / "bench/throughput"))

from seed_recipe import step_timer  # noqa: E402

from snaketune.config.load import load_config, merge_config_files  # noqa: E402
from snaketune.model.batching import IGNORE, load_split, steps_for_epochs  # noqa: E402

MAX_MICRO = 32
"""Padded mode: conversations per SFT micro-batch at most (on the H200 25 x 3 per step took 4.6 GiB)."""


def duration(train) -> dict:
    """TRL's length of training: the workflow's max_steps where set, else its epochs."""
    if train.max_steps:
        return {"max_steps": train.max_steps}
    return {"num_train_epochs": train.epochs}


def with_schedule(trainer_cls, train):
    """`trainer_cls` with the workflow's own learning-rate schedule (snaketune.train.engine.lr_lambda: the first
    step already at peak / warmup_steps, the last exactly at min_lr_ratio). Transformers' cosine_with_min_lr
    starts its warm-up at 0, one step behind, so the same arguments would not give the same rates."""
    from torch.optim.lr_scheduler import LambdaLR

    from snaketune.train.engine import lr_lambda

    class SameSchedule(trainer_cls):
        def create_scheduler(self, num_training_steps, optimizer=None):
            if self.lr_scheduler is None:
                optimizer = optimizer if optimizer is not None else self.optimizer
                self.lr_scheduler = LambdaLR(optimizer, lr_lambda(train, num_training_steps))
                self._created_lr_scheduler = True
            return self.lr_scheduler

    return SameSchedule


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


def common_args(train, cuda: bool, out: Path) -> dict:
    """TrainingArguments shared by both stages, from a train section of the workflow's config."""
    return dict(
        output_dir=str(out),
        learning_rate=train.learning_rate,
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


def fit(trainer_cls, model, tok, config, rows: dict, report: dict, dest: Path) -> None:
    """Train with TRL's `trainer_cls` on `rows`, timing each step into `report`; save model and tokenizer to dest."""
    from datasets import Dataset

    trainer = trainer_cls(
        model=model,
        args=config,
        train_dataset=Dataset.from_dict(rows),
        processing_class=tok,
        callbacks=[step_timer(report, torch.cuda.is_available())],
    )
    trainer.train()
    trainer.save_model(str(dest))
    tok.save_pretrained(str(dest))


def train_sft(files: dict, exp, out: Path, report: dict, mode: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    train = exp.train
    rows, packed = sft_rows(files["data"])
    steps_per_epoch = steps_for_epochs(packed, 1, train.global_batch_size)
    if (
        mode == "packed"
    ):  # TRL packs the same conversations into rows of max_length: the workflow's batch shape
        micro = train.micro_batch_size
        accumulation = train.global_batch_size // train.micro_batch_size
    else:  # one conversation per row: as many conversations per step as the workflow's packed rows hold
        per_step = int(np.ceil(len(rows["input_ids"]) / steps_per_epoch))
        accumulation = int(np.ceil(per_step / MAX_MICRO))  # micro-batches of at most MAX_MICRO conversations
        micro = int(np.ceil(per_step / accumulation))
    report.update(conversations=len(rows["input_ids"]), workflow_packed_rows=packed, steps_per_epoch=steps_per_epoch,
                  rows_per_step=micro * accumulation, micro_batch=micro,
                  tokens=int(sum(map(len, rows["input_ids"]))))  # fmt: skip
    tok = AutoTokenizer.from_pretrained(files["tokenizer"])
    model = AutoModelForCausalLM.from_pretrained(files["model"], dtype=torch.float32)
    config = SFTConfig(
        **common_args(train, cuda, out / "sft_trainer"),
        per_device_train_batch_size=micro,
        gradient_accumulation_steps=accumulation,
        **duration(train),
        max_length=exp.tokenize.max_length,
        packing=mode == "packed",
        packing_strategy="bfd",  # best-fit decreasing, padding-free rows (position ids restart per conversation)
        completion_only_loss=True,
    )
    fit(with_schedule(SFTTrainer, train), model, tok, config, rows, report, out / "sft")


def train_dpo(files: dict, exp, out: Path, report: dict, mode: str) -> None:
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
        **common_args(train, cuda, out / "dpo_trainer"),
        per_device_train_batch_size=train.micro_batch_size,
        gradient_accumulation_steps=train.global_batch_size // train.micro_batch_size,
        **duration(train),
        max_length=pref.max_length,
        padding_free=mode == "packed",  # each micro-batch's pairs concatenated into one row
        beta=pref.beta,
        loss_type=losses,
        loss_weights=[1.0] + ([pref.sft_weight] if pref.sft_weight else []),
        precompute_ref_log_probs=True,
    )
    fit(with_schedule(DPOTrainer, train), model, tok, config, rows, report, out / "dpo")


def evaluate_peer(files: dict, exp, cfg, out: Path) -> None:
    """The workflow's evaluate stage, as its rule calls it (workflow/rules/common_report.smk evaluate_params),
    on TRL's two models."""
    from snaketune.config.load import to_dict
    from snaketune.evaluation.evaluate import EvalJob, evaluate

    summary = out / "summary.json"
    summary.write_text(
        json.dumps(
            {"seed": exp.train.seed, "precision": "bfloat16" if torch.cuda.is_available() else "float32"}
        )
    )
    job = EvalJob(
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
    evaluate(job)


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
    parser.add_argument("--mode", choices=("padded", "packed"), default="padded")
    parser.add_argument("--seed", type=int, help="override train.seed of both stages (the seed runs)")
    args = parser.parse_args(argv)
    import trl

    # Snakemake's config: config/config.yaml, then each --configfile merged over it, key by key.
    raw = merge_config_files([REPO / "config/config.yaml", *args.config])
    os.chdir(args.run)  # relative paths of the config (dataset.source, model.base) as the workflow read them
    cfg = load_config(raw)
    exp = cfg.experiments[args.experiment]
    files = run_files(Path("."))
    args.out.mkdir(parents=True, exist_ok=True)
    if args.seed is not None:
        exp = dataclasses.replace(
            exp,
            train=dataclasses.replace(exp.train, seed=args.seed),
            dpo_train=dataclasses.replace(exp.dpo_train, seed=args.seed),
        )
    reports: dict = {
        "import_s": time.perf_counter() - T_START,
        "trl": trl.__version__,
        "experiment": args.experiment,
        "seed": exp.train.seed,
        "mode": args.mode,
    }
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
                fn(files, exp, args.out, report, args.mode)
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
