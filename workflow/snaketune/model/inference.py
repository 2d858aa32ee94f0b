"""Running a trained (or base) model without gradients: loading it onto its device, the validation loss as
training computes it, greedy replies, and peak memory per phase. Used by the evaluate and reference stages.

- The base model is, for builtin models (``builtin-tiny``, ``arch:*``), the exact random init the train stage
  starts from: ``snaketune.model.build.load_model`` with the same ModelConfig, tokenizer sizes, seed, dtype and
  device gives identical weights (tests/test_evaluate.py compares it with a real training run's start).
  Hub and local models load straight onto the device (``device_map``), shard by shard.
- The validation loss goes through ``snaketune.model.build.LossModel`` with the fused loss (no [tokens, vocabulary]
  logits) and, on CUDA, varlen attention over the packed rows: the training stage's masking and weighting,
  and memory that fits where training fits (snaketune.plan.evaluation.estimate_eval).
"""

from __future__ import annotations

import contextlib
import gc
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import torch

from snaketune import host_heap
from snaketune.config.schema import ModelConfig
from snaketune.model import attention, batching
from snaketune.model.build import LossModel, keep_4bit_layout, load_model, nf4_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def pick_device(device: str | None = None) -> tuple[torch.device, torch.dtype]:
    """CUDA (bf16) when available, else CPU (fp32); `device` forces one ("cpu", "cuda", "cuda:1")."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda" and dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if dev.type == "cpu":
        host_heap.keep_freed_memory()  # the batches' logits in the heap's pages (snaketune.host_heap)
    return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32


def pad_id(tokenizer) -> int:
    """The id the training stage pads with: pad, or eos when the tokenizer has no pad."""
    return batching.pad_id(tokenizer)


def load_base_model(
    model: ModelConfig,
    tokenizer,
    *,
    seed: int,
    train_dtype: torch.dtype,
    dtype: torch.dtype,
    device: torch.device | None = None,
    quantize: str = "none",
) -> torch.nn.Module:
    """The model before fine-tuning, in `dtype`, on `device` (default: the host); `quantize` nf4: its linear
    layers in 4 bits (hub models, snaketune.model.build.nf4_config).

    Builtin models are created exactly as the train stage creates them (same config, tokenizer sizes, seed,
    device and the dtype it trained in: random init in bf16 differs from fp32 init rounded to bf16), then
    cast. Hub and local models are loaded with from_pretrained in `dtype`, onto `device`.
    """
    net = load_model(
        model,
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=train_dtype if model.is_builtin else dtype,
        seed=seed,
        device=device,
        quantize=quantize,
    )
    if quantize != "none":
        return net.eval()  # loaded onto `device` in `dtype`; transformers refuses .to() on a 4-bit model
    if device is not None:
        net.to(device)
    return net.to(dtype=dtype).eval()


def load_tuned_model(
    model_dir: str | Path,
    model: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device | None = None,
    quantize: str = "none",
) -> torch.nn.Module:
    """A model the train or preference stage saved (merged weights for LoRA), onto `device`; `quantize` nf4:
    its linear layers in 4 bits, as QLoRA's base trained."""
    from transformers import AutoModelForCausalLM

    placement = {"device_map": {"": device}} if device is not None else {}
    if quantize != "none":
        placement["quantization_config"] = nf4_config(dtype)
    net = AutoModelForCausalLM.from_pretrained(
        str(model_dir),
        dtype=dtype,
        use_safetensors=True,
        trust_remote_code=model.trust_remote_code,
        attn_implementation="sdpa",
        **placement,
    )
    return (keep_4bit_layout(net) if quantize != "none" else net).eval()


def release_memory() -> None:
    """Return a dropped model's memory before the next one loads (7B: one model at a time)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextlib.contextmanager
def peak_memory(device: torch.device, into: dict, key: str) -> Iterator[None]:
    """Record the allocator's peak (GiB) while the block runs into `into[key]` (the larger of repeats)."""
    if device.type != "cuda":
        yield
        return
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    yield
    torch.cuda.synchronize(device)
    into[key] = max(into.get(key, 0.0), torch.cuda.max_memory_allocated(device) / 2**30)


@torch.no_grad()
def validation_loss(
    net: torch.nn.Module, split: batching.TokenizedSplit, *, pad_id: int, batch_size: int
) -> dict[str, float]:
    """Token-weighted mean next-token loss over a tokenized split and its perplexity exp(loss).

    Same masking as training (LossModel over collated rows: packed conversations kept apart, the first token
    of each never a target); the denominator is the split's loss-bearing target count, so batch size does
    not matter. The loss is the fused one: no [tokens, vocabulary] logits are ever held.
    """
    param = next(net.parameters())
    varlen = attention.kernel_available(param.device, param.dtype)
    module = LossModel(net, packed_attention=varlen, fused_cross_entropy=True)
    total = 0.0
    try:
        for start in range(0, len(split), batch_size):
            rows = np.arange(start, min(len(split), start + batch_size))
            batch = batching.device_batch(split, rows, pad_id, param.device, varlen=varlen)
            # Device-to-host sync once per batch; the sum is accumulated in float64 on the host.
            total += module(**batch).item()
    finally:
        module.restore_attention()
    tokens = int(split.loss_tokens.sum())
    if tokens == 0:
        raise ValueError("the validation split has no loss-bearing tokens")
    loss = total / tokens
    return {"loss": loss, "perplexity": math.exp(loss), "loss_tokens": tokens, "rows": len(split)}


# ---- generation ----------------------------------------------------------------------------------


def render_prompt(tokenizer, prompt: str | Sequence[dict], max_tokens: int | None = None) -> list[int]:
    """Token ids of a user message (or a conversation ending with one) with the generation prompt, as the
    chat template renders it. The template writes bos itself, so the text is encoded without added special
    tokens (as in training). With `max_tokens`, a longer prompt keeps bos and its last tokens."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[:1] + ids[len(ids) - max_tokens + 1 :]
    return ids


def decode_new_tokens(tokenizer, ids: Sequence[int]) -> str:
    """The generated text: tokens up to the first eos, special tokens dropped, outer whitespace stripped
    (the chat format's generation prompt is `Assistant:`, so replies start with a space). Token ids that
    decode to no valid UTF-8 (DeepSeek's 13 added byte-characters, a reply cut inside a character) come out as
    U+FFFD, which every writer here keeps as text."""
    ids = list(ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True).strip()


@torch.no_grad()
def generate(
    net: torch.nn.Module,
    tokenizer,
    prompts: Sequence[str],
    *,
    max_new_tokens: int,
    batch_size: int,
    max_prompt_tokens: int | None = None,
) -> list[str]:
    """Greedy replies to `prompts`, `batch_size` at a time, left-padded (generate derives the position
    ids from the attention mask, so padding does not change the result)."""
    from transformers import GenerationConfig

    device = next(net.parameters()).device
    pad = pad_id(tokenizer)
    config = GenerationConfig(
        max_new_tokens=max_new_tokens,
        do_sample=False,
        num_beams=1,
        use_cache=True,
        pad_token_id=pad,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.bos_token_id,
    )
    replies: list[str] = []
    for start in range(0, len(prompts), batch_size):
        encoded = [
            render_prompt(tokenizer, p, max_prompt_tokens) for p in prompts[start : start + batch_size]
        ]
        width = max(len(ids) for ids in encoded)
        input_ids = torch.full((len(encoded), width), pad, dtype=torch.long)
        mask = torch.zeros((len(encoded), width), dtype=torch.long)
        for row, ids in enumerate(encoded):
            input_ids[row, width - len(ids) :] = torch.tensor(ids, dtype=torch.long)
            mask[row, width - len(ids) :] = 1
        out = net.generate(
            input_ids=input_ids.to(device), attention_mask=mask.to(device), generation_config=config
        )
        replies += [decode_new_tokens(tokenizer, row[width:].tolist()) for row in out.cpu()]
    return replies


def longest_prompt(tokenizer, prompts: Sequence[str], max_prompt_tokens: int | None = None) -> int:
    """Tokens of the longest rendered prompt (what the KV cache of a generate() call is sized by)."""
    return max((len(render_prompt(tokenizer, p, max_prompt_tokens)) for p in prompts), default=0)
