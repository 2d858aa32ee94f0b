"""Write a hub-format directory of the deepseek-llm-7b architecture, as a user's download looks: config.json,
safetensors shards of at most 5 GB (3 for the 7B), generation_config.json and the real tokenizer's
tokenizer.json + tokenizer_config.json (no chat template), with random bf16 weights built on the GPU.

    python3 bench/recipes/write_hub_model.py OUT_DIR TOKENIZER_DIR [--layers N]     (examples.sh runs it)
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))
from snaketune.model.architectures import DEEPSEEK_LLM_7B  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out", type=Path)
    parser.add_argument("tokenizer", type=Path)
    parser.add_argument("--layers", type=int, default=None)
    args = parser.parse_args()
    values = dict(DEEPSEEK_LLM_7B)
    if args.layers:
        values["num_hidden_layers"] = args.layers
    values.update(bos_token_id=100000, eos_token_id=100001, pad_token_id=None)
    cfg = LlamaConfig(**values)
    t0 = time.perf_counter()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(device):
        net = LlamaForCausalLM(cfg).to(torch.bfloat16)
    t1 = time.perf_counter()
    net.save_pretrained(args.out, max_shard_size="5GB", safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(args.tokenizer / name, args.out / name)
    n = sum(p.numel() for p in net.parameters())
    shards = sorted(p.name for p in args.out.glob("*.safetensors"))
    print(f"wrote {args.out}: {n:,} parameters, {len(shards)} shards {shards}, built in {t1 - t0:.1f} s, "
          f"saved in {time.perf_counter() - t1:.1f} s")  # fmt: skip


if __name__ == "__main__":
    main()
