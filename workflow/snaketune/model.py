"""Model resolution: `model.base` -> a causal LM ready for DeepSpeed, plus the sizes metrics need.

- `builtin-tiny`: LlamaForCausalLM with the DeepSeek-LLM architecture (RMSNorm, SiLU MLP, RoPE theta 1e4,
  plain multi-head attention, untied embeddings) at ~1M parameters, random init from the train seed.
- `arch:deepseek-llm-7b`: the exact 7B architecture (../shared/FACTS.md), random init; optionally cut to
  `model.num_layers` for benchmarks.
- anything else: `from_pretrained` on a hub id or local directory, safetensors only, remote code only
  when `model.trust_remote_code` is set.
"""

from __future__ import annotations

import contextlib
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from snaketune.architectures import BUILTIN_TINY, DEEPSEEK_LLM_7B
from snaketune.config import LoraConfig, ModelConfig

log = logging.getLogger(__name__)


def builtin_config(
    model: ModelConfig, *, vocab_size: int, bos_token_id: int, eos_token_id: int
) -> LlamaConfig:
    """Config of a builtin model; vocab follows the tokenizer for builtin-tiny."""
    if model.base == "builtin-tiny":
        # Round the embedding up to a multiple of 64, as the field does for matmul-friendly shapes.
        vocab = (vocab_size + 63) // 64 * 64
        values = {
            **BUILTIN_TINY,
            "vocab_size": vocab,
            "bos_token_id": bos_token_id,
            "eos_token_id": eos_token_id,
        }
    elif model.base == "arch:deepseek-llm-7b":
        values = dict(DEEPSEEK_LLM_7B)
        if model.num_layers is not None:
            values["num_hidden_layers"] = model.num_layers
        if vocab_size > values["vocab_size"]:
            raise ValueError(
                f"tokenizer has {vocab_size} tokens, more than the model's {values['vocab_size']}"
            )
    else:
        raise ValueError(f"model.base {model.base!r} is not a builtin model")
    # No pad_token_id, as in deepseek-llm-7b-base's config: LlamaModel would make it the embedding's
    # padding_idx, and with pad = eos that freezes the eos embedding at zero. Pads carry no loss (label
    # -100) and are never attended to, so they need no special row. (It also broke ZeRO-3's partitioned
    # init, which indexes the padding row of an empty shard.)
    values["pad_token_id"] = None
    return LlamaConfig(**values)


def load_model(
    model: ModelConfig,
    *,
    vocab_size: int,
    bos_token_id: int,
    eos_token_id: int,
    dtype: torch.dtype,
    seed: int,
    zero_init_config: dict | None = None,
    attn_implementation: str = "sdpa",
    device: torch.device | None = None,
) -> PreTrainedModel:
    """Build or load the model. With `zero_init_config` (ZeRO-3) parameters are partitioned as they are
    created, so no rank ever holds the whole fp32 model in CPU memory."""
    if zero_init_config is not None:
        import deepspeed

        init_ctx = deepspeed.zero.Init(config_dict_or_path=zero_init_config, dtype=dtype)
    elif device is not None and device.type == "cuda" and model.base != "builtin-tiny":
        # Random init of a 7B architecture takes minutes on one CPU core (27M parameters/s measured on the
        # H200 host) and seconds on the GPU.
        init_ctx = torch.device(device)
    else:
        init_ctx = contextlib.nullcontext()
    if model.is_builtin:
        cfg = builtin_config(
            model, vocab_size=vocab_size, bos_token_id=bos_token_id, eos_token_id=eos_token_id
        )
        cfg._attn_implementation = attn_implementation
        torch.manual_seed(seed)  # same init on every rank and every run (CUDA generators are seeded too)
        with init_ctx:
            net = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attn_implementation)
        return net
    if zero_init_config is not None:
        # transformers partitions weights while loading when it sees a live HfDeepSpeedConfig.
        from transformers.integrations import HfDeepSpeedConfig

        _keepalive = HfDeepSpeedConfig(zero_init_config)  # noqa: F841 - must outlive from_pretrained
    net = AutoModelForCausalLM.from_pretrained(
        model.base,
        revision=model.revision,
        trust_remote_code=model.trust_remote_code,
        dtype=dtype,
        use_safetensors=True,
        attn_implementation=attn_implementation,
    )
    if net.get_input_embeddings().num_embeddings < vocab_size:
        raise ValueError(
            f"model.base {model.base!r} has {net.get_input_embeddings().num_embeddings} embeddings but the "
            f"tokenizer has {vocab_size} tokens; use the model's own tokenizer (model.tokenizer: auto)"
        )
    return net


def apply_lora(net: PreTrainedModel, lora: LoraConfig) -> PreTrainedModel:
    """Wrap with peft LoRA adapters on the configured modules; only adapters stay trainable."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    present = {name.rsplit(".", 1)[-1] for name, _ in net.named_modules()}
    missing = [t for t in lora.targets if t not in present]
    if missing:
        raise ValueError(
            f"config key 'train.lora.targets': {missing} not in the model; modules: {sorted(present)[:20]}"
        )
    cfg = PeftLoraConfig(
        r=lora.rank,
        lora_alpha=lora.alpha,
        lora_dropout=lora.dropout,
        target_modules=list(lora.targets),
        task_type="CAUSAL_LM",
    )
    return get_peft_model(net, cfg)


def count_params(net: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; ZeRO-3 partitioned parameters report their full size (ds_numel)."""
    total = trainable = 0
    for p in net.parameters():
        n = getattr(p, "ds_numel", p.numel())
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def flops_per_token(net: torch.nn.Module, seq_len: int, *, lora: bool) -> float:
    """Training FLOPs per token: 6N for full fine-tuning (forward 2N, backward 4N), 4N with frozen base
    weights (no weight gradients), plus attention 12 * layers * hidden * seq (PaLM, Chowdhery et al. 2022,
    appendix B). N excludes the input embedding, which is a lookup, not a matmul."""
    cfg = net.config
    total, _ = count_params(net)
    emb = net.get_input_embeddings()
    emb_n = getattr(emb.weight, "ds_numel", emb.weight.numel())
    dense = total - emb_n
    per_param = 4 if lora else 6
    return per_param * dense + 12 * cfg.num_hidden_layers * cfg.hidden_size * seq_len


def save_pretrained(net: PreTrainedModel, out_dir: str | Path, state_dict: dict | None = None) -> None:
    """HF layout: config.json, generation_config.json, model*.safetensors."""
    net.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
