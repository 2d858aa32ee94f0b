"""Model resolution: `model.base` -> a causal LM ready for DeepSpeed, plus the sizes metrics need.

- `builtin-tiny`: LlamaForCausalLM with the DeepSeek-LLM architecture (RMSNorm, SiLU MLP, RoPE theta 1e4,
  plain multi-head attention, untied embeddings) at ~1M parameters, random init from the train seed.
- `arch:deepseek-llm-7b`: the exact 7B architecture (docs/facts.md), random init; optionally cut to
  `model.num_layers` for benchmarks.
- anything else: `from_pretrained` on a hub id or local directory, safetensors only, remote code only
  when `model.trust_remote_code` is set; with `quantize: nf4` (QLoRA) its linear layers load as bitsandbytes
  4-bit NormalFloat weights (the lm_head and embeddings stay in the training dtype).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from snaketune.config.schema import LoraConfig, ModelConfig, checkpointed_layers
from snaketune.model import attention
from snaketune.model.architectures import BUILTIN_TINY, DEEPSEEK_LLM_7B
from snaketune.model.batching import packed_attention_mask, token_loss_sum
from snaketune.model.losses import causal_targets, fused_linear_cross_entropy, logits_cross_entropy

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
    quantize: str = "none",
) -> PreTrainedModel:
    """Build or load the model. With `zero_init_config` (ZeRO-3) parameters are partitioned as they are
    created or loaded, so no rank ever holds the whole model; else hub models load onto `device` and
    builtin architectures are built there (builtin-tiny is built on the host: its CPU init is the one the
    evaluate stage rebuilds as the base model). `quantize: nf4` loads a hub model's linear layers in 4 bits
    (`quantization_config`, below)."""
    if quantize != "none" and (model.is_builtin or zero_init_config is not None):
        raise ValueError(
            f"config key 'train.lora.quantize': {quantize!r} needs a pretrained (hub-format) model.base and ZeRO "
            f"stage 0-2 (model.base {model.base!r}, ZeRO-3: {zero_init_config is not None})"
        )
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
    placement = {}
    if zero_init_config is not None:
        # transformers partitions weights while loading when it sees a live HfDeepSpeedConfig.
        from transformers.integrations import HfDeepSpeedConfig

        _keepalive = HfDeepSpeedConfig(zero_init_config)  # noqa: F841 - must outlive from_pretrained
    elif device is not None:
        # Straight onto the rank's device, shard by shard: no full copy in host memory, and every parameter
        # is where the optimizer will find it.
        placement["device_map"] = {"": device}
    if quantize == "nf4":
        placement["quantization_config"] = nf4_config(dtype)
    net = AutoModelForCausalLM.from_pretrained(
        model.pretrained,
        revision=model.revision,
        trust_remote_code=model.trust_remote_code,
        dtype=dtype,
        use_safetensors=True,
        attn_implementation=attn_implementation,
        **placement,
    )
    if quantize == "nf4":
        keep_4bit_layout(net)
    if net.get_input_embeddings().num_embeddings < vocab_size:
        raise ValueError(
            f"model.base {model.pretrained!r} has {net.get_input_embeddings().num_embeddings} embeddings but the "
            f"tokenizer has {vocab_size} tokens; use the model's own tokenizer (model.tokenizer: auto)"
        )
    return net


def keep_4bit_layout(net: torch.nn.Module) -> torch.nn.Module:
    """bitsandbytes repacks a 4-bit weight for its AVX512-BF16 CPU kernel at the first forward without gradients, and
    that repacking assumes shapes a small model does not have (bitsandbytes 0.50.2, functional.
    _convert_weight_packed_for_cpu: outputs a multiple of 32, and more): a QLoRA evaluation of the tiny test model
    fails on such a CPU only. The plain layout runs on every CPU; QLoRA on a CPU is for tests, so its speed there
    does not matter, and on CUDA the flag is never read."""
    for module in net.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
    return net


def nf4_config(dtype: torch.dtype):
    """QLoRA's quantization (Dettmers et al. 2023): 4-bit NormalFloat blocks of 64 weights, their absmax
    quantized again to 8 bits (double quantization: 0.516 B per weight in all), dequantized to `dtype` for
    every matmul. Stored in bf16-typed tensors, the layout FSDP and ZeRO-3 can shard (bitsandbytes'
    quant_storage); transformers keeps the lm_head unquantized."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=dtype,
        bnb_4bit_quant_storage=torch.bfloat16,
    )


def is_quantized(net: torch.nn.Module) -> bool:
    """A model loaded with bitsandbytes quantization (transformers refuses .to() on it)."""
    return bool(getattr(causal_lm(net), "is_loaded_in_4bit", False))


def numel(p: torch.Tensor) -> int:
    """Elements a parameter stands for: ZeRO-3's full size (ds_numel), a 4-bit weight's unpacked shape."""
    if hasattr(p, "ds_numel"):
        return p.ds_numel
    quant_state = getattr(p, "quant_state", None)
    if quant_state is not None:
        return quant_state.shape.numel()
    return p.numel()


LORA_SEED_OFFSET = 0x10AA
"""The adapters' initial weights come from train.seed plus this: a stream of their own, not a replay of the one a
builtin model's weights were drawn from."""


def apply_lora(
    net: PreTrainedModel, lora: LoraConfig, *, fp32_adapters: bool = True, seed: int | None = None
) -> PreTrainedModel:
    """Wrap with peft LoRA adapters on the configured modules; only adapters stay trainable. `fp32_adapters`
    (peft's default) keeps them in fp32 when the model is bf16; else they take the model's dtype. `seed`
    (train.seed) draws the adapters' initial weights, the same on every rank (peft draws them from torch's global
    generator: unseeded, a hub model's adapters began the same whatever train.seed said)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    if seed is not None:
        torch.manual_seed(seed + LORA_SEED_OFFSET)

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
    return get_peft_model(net, cfg, autocast_adapter_dtype=fp32_adapters)


def merge_adapter(
    model: ModelConfig, trained: torch.nn.Module, lora: LoraConfig, *, dtype: torch.dtype
) -> PreTrainedModel:
    """A QLoRA training's merged model: the trained adapters added to the base weights as the checkpoint stores
    them (loaded on the host in `dtype`), as QLoRA's authors merge. Merging into the 4-bit weights instead would
    give a model that exists only in 4 bits; the unquantized one is what the evaluate stage and users load."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    base = AutoModelForCausalLM.from_pretrained(
        model.pretrained,
        revision=model.revision,
        trust_remote_code=model.trust_remote_code,
        dtype=dtype,
        use_safetensors=True,
    )
    adapters = {k: v.detach().to("cpu", dtype) for k, v in get_peft_model_state_dict(trained).items()}
    unquantized = apply_lora(base, lora, fp32_adapters=False)
    loaded = set_peft_model_state_dict(unquantized, adapters)
    if loaded.unexpected_keys:
        raise RuntimeError(f"adapter tensors the unquantized model lacks: {loaded.unexpected_keys[:5]}")
    return unquantized.merge_and_unload()


def count_params(net: torch.nn.Module) -> tuple[int, int]:
    """(total, trainable) parameter counts; ZeRO-3 partitioned and 4-bit parameters count their full size."""
    total = trainable = 0
    for p in net.parameters():
        n = numel(p)
        total += n
        if p.requires_grad:
            trainable += n
    return total, trainable


def flop_counts(net: torch.nn.Module, *, lora: bool) -> tuple[float, float]:
    """(dense FLOPs per token, attention coefficient) of training, as PaLM counts model FLOPs (Chowdhery et al.
    2022, appendix B): 6N per token for the matmuls of full fine-tuning (forward 2N, backward 4N), with N the
    non-embedding parameters (the input embedding is a lookup, not a matmul; the lm_head counts, tied or not), and
    12 x layers x (heads x head_dim) x T per token for attention over a context of T tokens. For packed
    conversations T is each conversation's own length, so a step's attention FLOPs are the coefficient times
    the sum of its conversations' squared lengths (snaketune.model.batching.TokenizedSplit.attention_units), not a
    function of max_length. With LoRA the frozen weights get no weight gradient: 4N (labelled where shown)."""
    cfg = net.config
    total, _ = count_params(net)
    emb = net.get_input_embeddings()
    out = net.get_output_embeddings()
    # Tied embeddings (SmolLM2): the lm_head is the embedding matrix, counted once among the parameters, and its
    # matmul is as real as an untied one's: nothing to take out.
    tied = out is not None and out.weight is emb.weight
    dense = total if tied else total - numel(emb.weight)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return (4 if lora else 6) * dense, 12.0 * cfg.num_hidden_layers * cfg.num_attention_heads * head_dim


def save_pretrained(net: PreTrainedModel, out_dir: str | Path, state_dict: dict | None = None) -> None:
    """HF layout: config.json, generation_config.json, model*.safetensors."""
    net.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)


def causal_lm(net: torch.nn.Module) -> PreTrainedModel:
    """The transformers causal LM inside a peft wrapper (or `net` itself)."""
    return net.get_base_model() if hasattr(net, "get_base_model") else net


def lm_inputs(
    net: torch.nn.Module,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cu_seqlens: torch.Tensor | None = None,
    *,
    packed_attention: bool,
) -> dict:
    """The causal LM's keyword inputs for packed rows: with `packed_attention` the rows' boundaries for
    snaketune.model.attention's kernel (`cu_seqlens` required), else SDPA's explicit block-diagonal mask
    (snaketune.model.batching.packed_attention_mask), so that each conversation attends only to itself."""
    kwargs: dict = {"input_ids": input_ids, "position_ids": position_ids, "use_cache": False}
    if packed_attention:
        kwargs.update(cu_seqlens=cu_seqlens, max_seqlen=input_ids.shape[1])
    else:
        kwargs["attention_mask"] = packed_attention_mask(
            position_ids, net.get_input_embeddings().weight.dtype
        )
    return kwargs


class PackedLM(torch.nn.Module):
    """A causal LM run on packed rows, the base of the modules DeepSpeed runs (LossModel here, the preference
    stages' snaketune.preference.logprobs.PreferenceModel): `packed_attention` registers snaketune.model.attention
    as the model's attention for as long as it trains."""

    def __init__(self, net: torch.nn.Module, *, packed_attention: bool):
        super().__init__()
        self.net = net
        self.packed_attention = packed_attention
        if packed_attention:
            causal_lm(net).set_attn_implementation(attention.register())

    def restore_attention(self) -> None:
        """Back to SDPA before saving, so the saved model loads anywhere without snaketune's registration."""
        if self.packed_attention:
            causal_lm(self.net).set_attn_implementation("sdpa")


class LossModel(PackedLM):
    """What DeepSpeed trains: the causal LM plus its loss. forward(input_ids, labels, position_ids[, cu_seqlens])
    returns the sum of the next-token losses of the batch (the trainer normalizes by the loss tokens of the
    whole global batch, snaketune.train.trainer).

    - `packed_attention`: conversations in a packed row attend only to themselves through
      snaketune.model.attention (FlashAttention varlen on CUDA; `cu_seqlens` required); otherwise SDPA with an
      explicit block-diagonal mask (`lm_inputs`).
    - `fused_cross_entropy`: snaketune.model.losses.fused_linear_cross_entropy on the final hidden states and the
      lm_head weight, never materializing the logits; otherwise the logits and their cross-entropy by
      `loss_kernel`: `triton` (snaketune.model.losses.logits_cross_entropy, the gradient over the logits) or `torch`
      (snaketune.model.batching.token_loss_sum).
    The switches change memory and speed, not the result (tests/test_kernels.py, tests/test_fast_path.py).
    """

    def __init__(
        self,
        net: torch.nn.Module,
        *,
        packed_attention: bool,
        fused_cross_entropy: bool,
        loss_kernel: str = "torch",
    ):
        super().__init__(net, packed_attention=packed_attention)
        self.fused_cross_entropy = fused_cross_entropy
        self.loss_kernel = loss_kernel

    def forward(
        self,
        input_ids: torch.Tensor,
        labels: torch.Tensor,
        position_ids: torch.Tensor,
        cu_seqlens: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = lm_inputs(
            self.net, input_ids, position_ids, cu_seqlens, packed_attention=self.packed_attention
        )
        if not self.fused_cross_entropy:
            logits = self.net(**kwargs).logits
            if self.loss_kernel == "triton":
                targets = causal_targets(labels, position_ids)
                return logits_cross_entropy(logits.flatten(0, 1), targets.flatten())
            return token_loss_sum(logits, labels, position_ids)
        lm = causal_lm(self.net)
        hidden = lm.model(**kwargs).last_hidden_state
        targets = causal_targets(labels, position_ids)
        return fused_linear_cross_entropy(hidden.flatten(0, 1), lm.lm_head.weight, targets.flatten())


def compile_layers(net: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each decoder layer (torchtitan's per-block compile: every layer reuses one compiled
    graph, so compile time does not grow with depth); returns how many layers were compiled.

    The packed rows' `cu_seqlens` has one entry per conversation plus one, a length that changes every step: it is
    marked dynamic before each forward, so the layers compile once for every count. Left to torch.compile, the
    second step's new length recompiled every layer (3.9 s on an H200, in the first timed step: it read as
    7,257 tokens/s for the 24-layer 7B whose other steps ran at 15,860)."""
    body = causal_lm(net).model
    layers = body.layers
    inside: dict[type, object] = {}  # one compiled forward per layer class, shared by its checkpointed layers
    for layer in layers:
        if getattr(layer, "gradient_checkpointing", False):
            _compile_inside_checkpoint(layer, inside, backend)
        else:
            layer.compile(backend=backend)

    def dynamic_segments(_module, args, kwargs):
        segments = kwargs.get("cu_seqlens")
        if segments is not None:
            torch._dynamo.mark_dynamic(segments, 0)
        return args, kwargs

    body.register_forward_pre_hook(dynamic_segments, with_kwargs=True)
    return len(layers)


def _compile_inside_checkpoint(layer: torch.nn.Module, inside: dict, backend: str) -> None:
    """A checkpointed layer compiled inside its checkpoint rather than around it: its own forward (transformers'
    checkpointing wrapper unwrapped) compiled once per layer class and called with the layer as an argument, under
    the layer's checkpoint function (torch's non-reentrant checkpoint, or snaketune.model.offload's), which now
    runs in eager code around it. Compiled the other way, as the other layers are, Dynamo compiled nothing of a
    checkpointed layer (torch 2.11-2.13): it ran eagerly, and with FP8 its casts as separate kernels. LoRA of the 7B
    on an H100, FP8 compiled with every layer checkpointed: 3,271 tokens/s, where eager bf16 with 18 of 30 ran 11,423
    in the same call (bench/RESULTS.md, issue #50). tests/test_offload.py counts the compiled graphs' runs."""
    cls = type(layer)
    compiled = inside.get(cls)
    if compiled is None:
        forward = getattr(cls.forward, "__wrapped__", cls.forward)  # the layer's own forward
        compiled = inside[cls] = torch.compile(forward, backend=backend)
    checkpoint = layer._gradient_checkpointing_func
    layer.gradient_checkpointing = False  # the wrapper below checkpoints; transformers' must not again

    def forward(*args, **kwargs):
        if not (layer.training and torch.is_grad_enabled()):
            return compiled(layer, *args, **kwargs)
        return checkpoint(functools.partial(compiled, layer, **kwargs), *args)

    layer.forward = forward


def checkpoint_layers(net: torch.nn.Module, setting: bool | int, *, offload: bool = False) -> int:
    """Gradient checkpointing (train.gradient_checkpointing) on the first N decoder layers, N from the setting
    (true: every layer); the other layers keep their activations for backward, which then recomputes only N
    layers' forward passes. Non-reentrant torch.utils.checkpoint, as transformers enables it; its per-layer
    switch is the `gradient_checkpointing` flag of each decoder layer (transformers' GradientCheckpointingLayer).
    `offload` (train.offload_activations): the N layers' inputs wait in host memory (snaketune.model.offload).
    Returns N."""
    layers = causal_lm(net).model.layers
    n = checkpointed_layers(setting, len(layers))
    if not n:
        return 0
    net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    net.config.use_cache = False
    for index, layer in enumerate(layers):
        layer.gradient_checkpointing = index < n
    if offload:
        from snaketune.model.offload import offload_inputs

        offload_inputs(layers)
    return n
