"""The outside reference of bench/throughput/train_throughput.py (issue #16): TRL's SFTTrainer with Liger's kernels, on the
same conversations, 8 sequences of at most 512 tokens per optimizer step, as a user of TRL would train.

TRL's fastest settings that run without extra packages on the lent H200 (the issue's own side-by-side found
unpacked rows faster than packing with padding-free there: no FlashAttention-2 package for its varlen path):
`use_liger_kernel=True` (RMSNorm, RoPE, SwiGLU and the fused linear cross-entropy), rows padded to the longest of
each micro-batch of 8, loss on the assistant tokens (`completion_only_loss` over the train stage's labels),
torch's fused AdamW; full fine-tuning in fp32 weights with bf16 autocast (mixed precision), LoRA r16 on every
linear layer over a bf16 base. `--cap GIB` caps the allocator as gpu_memory_gib does; `--checkpointing` turns
on gradient checkpointing; `--max-length N --micro 1 --accumulation 1 --offload-activations` trains one long row
per step with TRL's activation offloading (bench/throughput/cards24.py); `--packing bfd` (padding-free: each
micro-batch one flattened row, its conversations apart by position ids, which transformers turns into a
block-causal mask for SDPA) or `--packing wrapped` (rows cut mid-conversation) packs the conversations into rows of
--max-length, TRL's other modes, tried beside the padded rows under the same cap (issue #50). Writes the report bench/throughput/seed_recipe.py writes (per-step times, CUDA-synchronized;
tokens per sample; peak memory; status), which bench/throughput/train_throughput.py reads the same way.

    python3 bench/throughput/trl_peer.py --data DIR --tokenizer DIR --layers 24 [--lora] [--cap 24 --checkpointing] --out t.json

`--tiny` runs builtin-tiny on the CPU in fp32 (no Liger) to check the script on any machine.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "workflow"))
sys.path.insert(0, str(REPO / "bench/throughput"))

from seed_recipe import SEQ, PaddedSamples, build_model, step_timer  # noqa: E402

from snaketune import device_memory  # noqa: E402
from snaketune.model.batching import IGNORE, load_split  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def dataset(data_dir: Path, max_length: int = SEQ):
    """The split's conversations as TRL's tokenized format: input_ids and completion_mask (the train stage's
    loss-bearing tokens), truncated to max_length."""
    from datasets import Dataset

    split = load_split(data_dir)
    ids = [row[:max_length].tolist() for row in split.input_ids]
    mask = [(lab[:max_length] != IGNORE).astype(int).tolist() for lab in split.labels]
    return Dataset.from_dict({"input_ids": ids, "completion_mask": mask})


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True, help="tokenized split (packing off)")
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--steps", type=int, default=14)
    parser.add_argument("--lora", action="store_true")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--cap", type=float, default=None, help="GiB the allocator may use")
    parser.add_argument(
        "--micro", type=int, default=8, help="rows per micro-batch (8 / this accumulation steps)"
    )
    parser.add_argument(
        "--accumulation", type=int, default=None, help="micro-batches per step (default 8 / micro)"
    )
    parser.add_argument(
        "--max-length", type=int, default=SEQ, help="tokens per row (longer ones are truncated)"
    )
    parser.add_argument(
        "--offload-activations", action="store_true", help="TRL's activation offloading (SFTConfig)"
    )
    parser.add_argument(
        "--packing",
        choices=("none", "bfd", "wrapped"),
        default="none",
        help="TRL's packing into rows of --max-length: bfd (best-fit decreasing, padding-free: one flattened row "
        "per micro-batch, its conversations kept apart by position ids) or wrapped (cut mid-conversation, no "
        "boundaries); none: each conversation its own row, padded to the micro-batch's longest",
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--tiny", action="store_true")
    args = parser.parse_args(argv)

    import trl
    from transformers import AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    cuda = torch.cuda.is_available()
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    # The same device budget as the train rule's (snaketune.device_memory): --cap is the card's memory, the
    # process stays 0.5 GiB under it on the device, the allocator gets what lies outside it less.
    nvml = device_memory.device_memory(device)
    budget: dict = {}
    if cuda:
        device_memory.warm_up(device)
        line, budget = device_memory.cap_allocator(device, args.cap, nvml)
        if line:
            print(line, flush=True)
    sampler = device_memory.PeakSampler(nvml)
    report: dict = {"recipe": f"trl {trl.__version__}", "layers": args.layers, "steps": args.steps,
                    "step_times": [], "losses": []}  # fmt: skip
    real, loss_tokens = PaddedSamples(args.data, 0, seq=args.max_length).token_counts()
    # No padding to 512: TRL pads each micro-batch to its longest row; positions are reported as real tokens.
    report.update(positions_per_sample=real, real_per_sample=real, loss_tokens_per_sample=loss_tokens)

    t_start = time.perf_counter()
    try:
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        data = dataset(args.data, args.max_length)
        report["samples"] = len(data)
        # LoRA: a bf16 base under the adapters, as TRL's LoRA recipes load it, built in bf16 (an fp32 build of the 7B
        # alone is 27.6 GB: over a 24 GiB cap before the first step, which is how trl_lora30_cap24 failed on
        # 2026-12-01, bench/RESULTS.md).
        dtype = torch.bfloat16 if args.lora and cuda else None
        model = build_model(args.layers, args.tiny, len(tok), device, dtype=dtype)
        report["parameters"] = sum(p.numel() for p in model.parameters())
        peft_config = None
        if args.lora:
            from peft import LoraConfig

            peft_config = LoraConfig(
                r=16, lora_alpha=32, lora_dropout=0.0, target_modules=LORA_TARGETS, task_type="CAUSAL_LM"
            )
        config = SFTConfig(
            output_dir=str(args.out.parent / f"{args.out.stem}_trainer"),
            per_device_train_batch_size=args.micro,
            gradient_accumulation_steps=args.accumulation or 8 // args.micro,
            learning_rate=1e-4 if args.lora else 1e-5,
            lr_scheduler_type="constant",
            max_steps=args.steps,
            max_length=args.max_length,
            activation_offloading=args.offload_activations,
            packing=args.packing != "none",
            packing_strategy="bfd" if args.packing == "none" else args.packing,
            completion_only_loss=True,
            bf16=cuda,
            use_liger_kernel=cuda,
            optim="adamw_torch_fused" if cuda else "adamw_torch",
            gradient_checkpointing=args.checkpointing,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            dataloader_num_workers=0,
            disable_tqdm=True,
            seed=1234,
            use_cpu=not cuda,
        )
        trainer = SFTTrainer(
            model=model,
            args=config,
            train_dataset=data,
            processing_class=tok,
            peft_config=peft_config,
            callbacks=[step_timer(report, cuda)],
        )
        if args.packing != "none":
            # A sample is now a packed row: its real and loss-bearing tokens, as TRL packed them.
            # Its loss-bearing share is the conversations' (TRL's train_dataset keeps no completion_mask column).
            rows = trainer.train_dataset
            per_row = sum(len(x) for x in rows["input_ids"]) / len(rows)
            report.update(
                samples=len(rows),
                positions_per_sample=per_row,
                real_per_sample=per_row,
                loss_tokens_per_sample=per_row * loss_tokens / real,
            )
        trainer.train()
        report["status"] = "ok"
    except torch.OutOfMemoryError as e:
        report["status"] = f"out of memory at step {len(report['step_times']) + 1}: {str(e).splitlines()[0]}"
    except Exception as e:  # noqa: BLE001 - the report says what happened; the caller prints it
        traceback.print_exc()
        report["status"] = f"failed: {type(e).__name__}: {e}"
    report["wall_s"] = time.perf_counter() - t_start
    if cuda:
        report["peak_memory_gib"] = torch.cuda.max_memory_allocated() / 2**30
        report["device"] = torch.cuda.get_device_name(0)
        report["device_memory"] = device_memory.record(sampler, device, budget)
    args.out.write_text(json.dumps(report, indent=2))
    print(json.dumps({k: v for k, v in report.items() if k not in ("step_times", "losses")}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
