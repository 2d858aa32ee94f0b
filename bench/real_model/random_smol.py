"""The SmolLM2-135M-Instruct architecture with random bf16 weights (seed 0), for the cases whose figures do not
depend on the weights' values (fixed steps, no generation: the 135M step's MFU, stage wall times, start-up), so that
the 98 MB GGUF file need not travel to a machine without network. Config and tokenizer files from
SNAKETUNE_BENCH_SMOL, else from SNAKETUNE_BENCH_GGUF imported by snaketune.model.gguf (once, beside OUT_DIR).

    python3 bench/real_model/random_smol.py OUT_DIR
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))

FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def source_dir(out: Path) -> Path:
    given = os.environ.get("SNAKETUNE_BENCH_SMOL")
    if given:
        return Path(given)
    imported = out.parent / f"{out.name}-imported"
    if not (imported / "config.json").is_file():
        from snaketune.model.gguf import import_gguf

        import_gguf(os.environ["SNAKETUNE_BENCH_GGUF"], imported)
    return imported


def main(out: Path) -> None:
    src = source_dir(out)
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(src)).to(torch.bfloat16)
    model.save_pretrained(out)
    for name in FILES:
        if (src / name).is_file():
            shutil.copy(src / name, out / name)
    print(f"{out}: {sum(p.numel() for p in model.parameters()):,} parameters, random bf16 weights")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
