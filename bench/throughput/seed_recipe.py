"""The seed recipe, reimplemented as the baseline of bench/throughput/train_throughput.py (issue #7).

The recipe this project answers: the HF Trainer with a DeepSpeed config of fp16 and ZeRO stage 2 (allgather and
reduce buckets 2e8, overlap_comm), AdamW lr 2e-5 with betas 0.9/0.999, eps 1e-8, weight decay 0.01, WarmupLR
over 500 steps, micro-batch 1 with gradient accumulation 8, every sample padded to 512 tokens. Two
deviations, both in the baseline's favour: DeepSpeed's AdamW runs as torch's (`torch_adam: true`) so that no
FusedAdam is JIT-compiled on a machine without network, and the model is built on the GPU (a 7B random init
takes minutes on one CPU core).

Runs one rank under torchrun, on the samples of a tokenized split made with packing off (each a whole
conversation, truncated to 512), with the labels the train stage uses (assistant tokens). Writes a JSON
report: per-step times (CUDA-synchronized), tokens per step (positions, real, loss-bearing), peak memory,
fp16 steps skipped for overflow, or the out-of-memory error and the step it happened at.

    torchrun --standalone --nproc_per_node 1 bench/throughput/seed_recipe.py --data DIR --layers 24 --steps 14 --out a.json

`--tiny` runs the builtin-tiny model in fp32 (no fp16 on CPU) to check the script on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))

from snaketune.model.architectures import BUILTIN_TINY, DEEPSEEK_LLM_7B  # noqa: E402
from snaketune.model.batching import IGNORE, load_split, target_mask  # noqa: E402

SEQ = 512


def ds_config(fp16: bool) -> dict:
    return {
        "fp16": {
            "enabled": "auto" if fp16 else False,
            "loss_scale": 0,
            "loss_scale_window": 1000,
            "initial_scale_power": 16,
            "hysteresis": 2,
            "min_loss_scale": 1,
        },
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": "auto",
                "betas": "auto",
                "eps": "auto",
                "weight_decay": "auto",
                "torch_adam": True,
            },
        },
        "scheduler": {
            "type": "WarmupLR",
            "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": 500},
        },
        "zero_optimization": {
            "stage": 2,
            "allgather_partitions": True,
            "allgather_bucket_size": 2e8,
            "overlap_comm": True,
            "reduce_scatter": True,
            "reduce_bucket_size": 2e8,
            "contiguous_gradients": True,
        },
        "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto",
        "train_batch_size": "auto",
        "train_micro_batch_size_per_gpu": "auto",
        "steps_per_print": 10**9,
    }


class PaddedSamples(torch.utils.data.Dataset):
    """Each tokenized conversation padded to SEQ tokens (the seed recipe's padding="max_length")."""

    def __init__(self, data_dir: Path, pad_id: int, seq: int = SEQ):
        self.split = load_split(data_dir)
        self.pad_id, self.seq = pad_id, seq

    def __len__(self) -> int:
        return len(self.split)

    def __getitem__(self, i: int) -> dict:
        ids = self.split.input_ids[i][: self.seq].astype(np.int64)
        labels = self.split.labels[i][: self.seq].astype(np.int64)
        n = len(ids)
        out = {
            "input_ids": torch.full((self.seq,), self.pad_id, dtype=torch.long),
            "attention_mask": torch.zeros(self.seq, dtype=torch.long),
            "labels": torch.full((self.seq,), IGNORE, dtype=torch.long),
        }
        out["input_ids"][:n] = torch.from_numpy(ids)
        out["attention_mask"][:n] = 1
        out["labels"][:n] = torch.from_numpy(labels)
        return out

    def token_counts(self) -> tuple[float, float]:
        """Mean real tokens and mean loss-bearing targets per padded sample."""
        real = np.mean([min(self.seq, len(x)) for x in self.split.input_ids])
        loss = np.mean(
            [
                target_mask(lab[: self.seq], pos[: self.seq]).sum()
                for lab, pos in zip(self.split.labels, self.split.position_ids, strict=True)
            ]
        )
        return float(real), float(loss)


def build_model(layers: int, tiny: bool, vocab: int, device: torch.device, dtype: torch.dtype | None = None):
    from transformers import AutoModelForCausalLM, LlamaConfig

    values = dict(BUILTIN_TINY, vocab_size=(vocab + 63) // 64 * 64) if tiny else dict(DEEPSEEK_LLM_7B)
    values.update(num_hidden_layers=layers, pad_token_id=None)
    torch.manual_seed(1234)
    with torch.device(device):
        return AutoModelForCausalLM.from_config(
            LlamaConfig(**values), attn_implementation="sdpa", dtype=dtype
        )


def step_timer(report: dict, cuda: bool):
    """A Trainer callback that appends each optimizer step's CUDA-synchronized time to report["step_times"] and
    each logged loss to report["losses"] (this script's and bench/throughput/trl_peer.py's report)."""
    from transformers import TrainerCallback

    class Timer(TrainerCallback):
        def on_step_begin(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, *a, **k):
            if cuda:
                torch.cuda.synchronize()
            report["step_times"].append(time.perf_counter() - self.t0)

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                report["losses"].append(logs["loss"])

    return Timer()


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True, help="tokenized split (packing off)")
    parser.add_argument("--pad-id", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True, help="tokenizer size (builtin-tiny's embedding)")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)

    from transformers import Trainer, TrainingArguments

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    report: dict = {
        "recipe": "seed",
        "layers": args.layers,
        "steps": args.steps,
        "step_times": [],
        "losses": [],
    }
    data = PaddedSamples(args.data, args.pad_id)
    real, loss_tokens = data.token_counts()
    report.update(
        samples=len(data), positions_per_sample=SEQ, real_per_sample=real, loss_tokens_per_sample=loss_tokens
    )

    t_start = time.perf_counter()
    try:
        model = build_model(args.layers, args.tiny, args.vocab, device)
        report["parameters"] = sum(p.numel() for p in model.parameters())
        training_args = TrainingArguments(
            output_dir=str(args.out.parent / "seed_recipe_trainer"),
            per_device_train_batch_size=1,
            gradient_accumulation_steps=8,
            learning_rate=2e-5,
            adam_beta1=0.9,
            adam_beta2=0.999,
            adam_epsilon=1e-8,
            weight_decay=0.01,
            warmup_steps=500,  # WarmupLR's warmup_num_steps: the HF integration checks they agree
            max_steps=args.steps,
            fp16=cuda,
            deepspeed=ds_config(fp16=cuda),
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            remove_unused_columns=False,
            disable_tqdm=True,
            seed=1234,
            use_cpu=not cuda,
        )
        trainer = Trainer(
            model=model, args=training_args, train_dataset=data, callbacks=[step_timer(report, cuda)]
        )
        trainer.train()
        engine = trainer.model_wrapped
        report["skipped_steps"] = int(getattr(engine, "skipped_steps", 0))
        report["status"] = "ok"
    except torch.OutOfMemoryError as e:
        report["status"] = f"out of memory at step {len(report['step_times']) + 1}: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - the report says what happened; the caller prints it
        traceback.print_exc()
        report["status"] = f"failed: {type(e).__name__}: {e}"
    report["wall_s"] = time.perf_counter() - t_start
    if cuda:
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report["peak_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
        report["device"] = torch.cuda.get_device_name(0)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("step_times", "losses")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
