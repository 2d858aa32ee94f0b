"""The cases of bench/throughput/train_throughput.py: what each one trains, on which depth, with which settings, and which
TRL case it is compared with (kept apart from the runner, which imports them)."""

from __future__ import annotations

from dataclasses import dataclass, field

ZERO0 = "config/deepspeed/zero0.json"
BEST = dict(
    deepspeed=ZERO0,
    precision="bf16",
    bf16_optimizer="auto",
    optimizer_kernel="auto",
    loss_kernel="auto",
    fused_cross_entropy=False,
    attention="auto",
    kernels="torch",
    compile=False,
    micro_batch_size=8,
)
"""Train settings of (b) on one H200, chosen by bench/RESULTS.md's measurements."""
LORA_LIGER = {**BEST, "kernels": "liger", "learning_rate": 1e-4, "lora": {"enabled": True, "rank": 16}}
"""LoRA r16 on every linear layer with Liger's kernels: lora30_liger and its capped variants."""

IN_BACKWARD = {
    **BEST,
    "kernels": "liger",
    "optimizer_step": "in_backward",
    "optimizer_states": "4bit",
    "gradient_checkpointing": True,
    "micro_batch_size": 1,
    "global_batch_size": 1,
}
"""Issue #26: full fine-tuning with the step in backward and 4-bit states, one 2,048-token row per step (it cannot
accumulate), every layer checkpointed, Liger's kernels."""
OFFLOAD = {**IN_BACKWARD, "deepspeed": "config/deepspeed/zero3_offload.json", "optimizer_step": "after_backward",
           "optimizer_states": "fp32"}  # fmt: skip
"""The same training as IN_BACKWARD under ZeRO-3 with DeepSpeed's CPU optimizer offload: what a full fine-tune of a 7B
on a 24 GB card needed before."""
LONG_ROWS = {"max_length": 2048}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "seed" (a), "train" (b) or "trl" (the outside peer, bench/throughput/trl_peer.py)
    layers: int
    what: str
    train: dict = field(default_factory=dict)
    tokenize: dict = field(default_factory=dict)
    estimate_s: int = 90
    gpu_memory_gib: float | None = None
    """The plan's budget and the allocator's cap (config key gpu_memory_gib) for this case only."""
    peer: str | None = None
    """The trl case this (b) case is compared with in the table (same model, data and tokens per step)."""
    options: tuple[str, ...] = ()
    """Extra command-line options of bench/throughput/trl_peer.py (trl cases)."""


CASES = [
    Case(
        "seed24",
        "seed",
        24,
        "(a) seed recipe: HF Trainer, DeepSpeed fp16 ZeRO-2, 1 x 8, padded to 512",
        estimate_s=70,
    ),
    Case(
        "b24", "train", 24, "(b) train rule: ZeRO-0, fp32 masters (Triton AdamW), varlen, 8 x 1, packed", BEST
    ),
    Case(
        "b24_fused_ce",
        "train",
        24,
        "(b) as b24 with the fused linear cross-entropy",
        {**BEST, "fused_cross_entropy": True},
    ),
    Case(
        "b24_torch_adam",
        "train",
        24,
        "(b) as b24 with torch's fused AdamW on fp32 gradient copies",
        {**BEST, "optimizer_kernel": "torch"},
    ),
    Case("b24_sdpa", "train", 24, "(b) as b24 with SDPA + block mask", {**BEST, "attention": "sdpa"}),
    Case("b24_mb4", "train", 24, "(b) as b24 at micro-batch 4 x 2", {**BEST, "micro_batch_size": 4}),
    Case(
        "b24_compile",
        "train",
        24,
        "(b) as b24 with torch.compile per layer",
        {**BEST, "compile": True},
        estimate_s=150,
    ),
    Case(
        "b24_ds_zero2",
        "train",
        24,
        "(b) before issue #7: DeepSpeed bf16 ZeRO-2, 4 x 2, logits CE, block mask",
        dict(
            deepspeed="config/deepspeed/zero2.json",
            precision="bf16",
            bf16_optimizer="deepspeed",
            fused_cross_entropy=False,
            attention="sdpa",
            micro_batch_size=4,
        ),
    ),
    Case(
        "b24_padded",
        "train",
        24,
        "(b) as b24 on unpacked rows (one conversation each)",
        BEST,
        {"packing": False},
    ),
    Case(
        "b30",
        "train",
        30,
        "(b) full 7B: as b24 at micro-batch 4 x 2",
        {**BEST, "micro_batch_size": 4},
        estimate_s=110,
    ),
    Case(
        "lora30",
        "train",
        30,
        "(b) full 7B, LoRA r16 on all linear layers, 8 x 1",
        {**BEST, "learning_rate": 1e-4, "lora": {"enabled": True, "rank": 16}},
        estimate_s=100,
    ),
    Case(
        "b24_liger",
        "train",
        24,
        "(b) as b24 with Liger's RMSNorm, RoPE and SwiGLU",
        {**BEST, "kernels": "liger"},
        peer="trl24",
    ),
    Case(
        "b24_liger_torch_loss",
        "train",
        24,
        "(b) as b24_liger with the cross-entropy of torch (fp32 upcast) instead of the Triton loss",
        {**BEST, "kernels": "liger", "loss_kernel": "torch"},
    ),
    Case(
        "b30_liger",
        "train",
        30,
        "(b) full 7B, as b24_liger (8 x 1)",
        {**BEST, "kernels": "liger"},
        estimate_s=100,
    ),
    Case(
        "lora30_liger",
        "train",
        30,
        "(b) as lora30 with Liger's RMSNorm, RoPE and SwiGLU",
        LORA_LIGER,
        estimate_s=100,
        peer="trl_lora30",
    ),
    Case(
        "lora30_cap24_liger",
        "train",
        30,
        "(b) as lora30_liger under gpu_memory_gib 24, with gradient checkpointing",
        {**LORA_LIGER, "gradient_checkpointing": True},
        estimate_s=100,
        gpu_memory_gib=24,
        peer="trl_lora30_cap24",
    ),
    Case(
        "lora30_cap24_auto",
        "train",
        30,
        "(b) as lora30_liger under gpu_memory_gib 24, train.strategy auto (the plan picks the fewest checkpointed layers)",
        {**LORA_LIGER, "strategy": "auto"},
        estimate_s=100,
        gpu_memory_gib=24,
        peer="trl_lora30_cap24",
    ),
    Case(
        "lora30_fp8_compile_cap24_auto",
        "train",
        30,
        "(b) as lora30_cap24_auto with FP8 matmuls, compiled (the plan counts what compiled layers keep)",
        {**LORA_LIGER, "strategy": "auto", "fp8": "tensorwise", "compile": True},
        estimate_s=150,
        gpu_memory_gib=24,
        peer="trl_lora30_cap24",
    ),
    Case(
        "lora30_fp8_compile_cap24_all",
        "train",
        30,
        "(b) as lora30_fp8_compile_cap24_auto with every layer checkpointed (far under the cap: is FP8 compiled slow "
        "for memory or for checkpointing?)",
        {**LORA_LIGER, "gradient_checkpointing": True, "fp8": "tensorwise", "compile": True},
        estimate_s=150,
        gpu_memory_gib=24,
        peer="trl_lora30_cap24",
    ),
    Case(
        "lora30_cap24_ckpt24",
        "train",
        30,
        "(b) as lora30_liger under gpu_memory_gib 24, checkpointing on the first 24 of 30 layers",
        {**LORA_LIGER, "gradient_checkpointing": 24},
        estimate_s=100,
        gpu_memory_gib=24,
        peer="trl_lora30_cap24",
    ),
    Case(
        "lora30_cap24_ckpt16",
        "train",
        30,
        "(b) as lora30_liger under gpu_memory_gib 24, checkpointing on the first 16 of 30 layers",
        {**LORA_LIGER, "gradient_checkpointing": 16},
        estimate_s=100,
        gpu_memory_gib=24,
        peer="trl_lora30_cap24",
    ),
    Case(
        "lora30_cap24_ckpt18",
        "train",
        30,
        "(b) as lora30_liger under gpu_memory_gib 24, checkpointing on the first 18 of 30 layers",
        {**LORA_LIGER, "gradient_checkpointing": 18},
        estimate_s=100,
        gpu_memory_gib=24,
        peer="trl_lora30_cap24",
    ),
    Case(
        "b30_8bit",
        "train",
        30,
        "(b) as b30_liger with 8-bit Adam states (bitsandbytes)",
        {**BEST, "kernels": "liger", "optimizer_states": "8bit"},
        estimate_s=100,
    ),
    Case(
        "b30_8bit_auto80",
        "train",
        30,
        "(b) as b30_liger under gpu_memory_gib 80, train.strategy auto (the plan picks 8-bit states)",
        {**BEST, "kernels": "liger", "strategy": "auto"},
        estimate_s=110,
        gpu_memory_gib=80,
    ),
    Case(
        "full30_inbwd",
        "train",
        30,
        "(b) full 7B, 1 x 2,048 packed: step in backward, 4-bit states, checkpointing, Liger; no cap",
        IN_BACKWARD,
        LONG_ROWS,
        estimate_s=150,
        peer="trl30_ckpt",
    ),
    Case(
        "full30_inbwd_cap24",
        "train",
        30,
        "(b) as full30_inbwd under gpu_memory_gib 24 (23.5 GiB of device memory)",
        IN_BACKWARD,
        LONG_ROWS,
        estimate_s=150,
        gpu_memory_gib=24,
        peer="trl30_ckpt",
    ),
    Case(
        "full30_inbwd_cap24_auto",
        "train",
        30,
        "(b) as full30_inbwd_cap24 with train.strategy auto: the plan keeps the checkpointed layers' inputs in host "
        "memory (train.offload_activations), copied on a stream of their own",
        {**IN_BACKWARD, "strategy": "auto"},
        LONG_ROWS,
        estimate_s=150,
        gpu_memory_gib=24,
        peer="trl30_ckpt",
    ),
    Case(
        "full30_inbwd_1536_cap24",
        "train",
        30,
        "(b) as full30_inbwd_cap24 with rows of 1,536 tokens (the longest the plan fits under 23.5 GiB)",
        IN_BACKWARD,
        {"max_length": 1536},
        estimate_s=140,
        gpu_memory_gib=24,
    ),
    Case(
        "full20_inbwd",
        "train",
        20,
        "(b) as full30_inbwd on 20 layers (the depth whose ZeRO-3 offload fits this machine's 128 GiB of RAM)",
        IN_BACKWARD,
        LONG_ROWS,
        estimate_s=120,
    ),
    Case(
        "full20_offload",
        "train",
        20,
        "(b) as full20_inbwd under ZeRO-3 with CPU optimizer offload (fp32 states, step after backward)",
        OFFLOAD,
        LONG_ROWS,
        estimate_s=200,
    ),
    Case(
        "trl30_ckpt",
        "trl",
        30,
        "TRL SFTTrainer + Liger: full FT 30 layers, fp32 weights + bf16 autocast, checkpointing, 8 x 1, unpacked",
        estimate_s=150,
        options=("--checkpointing",),
    ),
    Case(
        "trl24",
        "trl",
        24,
        "TRL SFTTrainer + Liger: full FT, fp32 weights + bf16 autocast, 8 x 1, unpacked",
        estimate_s=90,
    ),
    Case(
        "trl_lora30",
        "trl",
        30,
        "TRL SFTTrainer + Liger: LoRA r16 all linear, bf16 base, 8 x 1, unpacked",
        estimate_s=90,
        options=("--lora",),
    ),
    Case(
        "trl_lora30_cap24",
        "trl",
        30,
        "TRL SFTTrainer + Liger: as trl_lora30 under a 24 GiB cap, gradient checkpointing",
        estimate_s=90,
        options=("--lora", "--checkpointing", "--cap", "24"),
    ),
    Case(
        "trl_lora30_cap24_bfd",
        "trl",
        30,
        "TRL SFTTrainer + Liger: as trl_lora30_cap24 with TRL's packing (bfd, padding-free) into rows of 512",
        estimate_s=90,
        options=("--lora", "--checkpointing", "--cap", "24", "--packing", "bfd"),
    ),
    Case(
        "trl_lora30_cap24_wrapped",
        "trl",
        30,
        "TRL SFTTrainer + Liger: as trl_lora30_cap24 with TRL's wrapped packing (rows of 512 cut anywhere)",
        estimate_s=90,
        options=("--lora", "--checkpointing", "--cap", "24", "--packing", "wrapped"),
    ),
    Case(
        "trl_lora30_cap24_mb2",
        "trl",
        30,
        "TRL SFTTrainer + Liger: as trl_lora30 under a 24 GiB cap, micro-batch 2 x 4, no checkpointing",
        estimate_s=90,
        options=("--lora", "--cap", "24", "--micro", "2"),
    ),
    Case(
        "b24_fp8",
        "train",
        24,
        "(b) as b24_liger with FP8 matmuls in the decoder's linear layers (train.fp8: tensorwise, eager)",
        {**BEST, "kernels": "liger", "fp8": "tensorwise"},
        peer="trl24",
    ),
    Case(
        "lora30_fp8",
        "train",
        30,
        "(b) as lora30_liger with FP8 matmuls in the frozen base layers (train.fp8: tensorwise, eager)",
        {**LORA_LIGER, "fp8": "tensorwise"},
        estimate_s=100,
        peer="trl_lora30",
    ),
    Case(
        "b24_liger_compile",
        "train",
        24,
        "(b) as b24_liger with torch.compile per decoder layer (bf16 matmuls)",
        {**BEST, "kernels": "liger", "compile": True},
        estimate_s=150,
        peer="trl24",
    ),
    Case(
        "b24_fp8_compile",
        "train",
        24,
        "(b) as b24_fp8 with torch.compile per decoder layer (the float8 casts fused into the layer's kernels)",
        {**BEST, "kernels": "liger", "fp8": "tensorwise", "compile": True},
        estimate_s=150,
        peer="trl24",
    ),
    Case(
        "b24_compile",
        "train",
        24,
        "(b) as b24 (transformers' RMSNorm, RoPE and SwiGLU, which the compiler fuses) with torch.compile per layer",
        {**BEST, "compile": True},
        estimate_s=150,
        peer="trl24",
    ),
    Case(
        "b24_fp8_compile_torch",
        "train",
        24,
        "(b) as b24_compile with FP8 matmuls in the decoder's linear layers",
        {**BEST, "fp8": "tensorwise", "compile": True},
        estimate_s=150,
        peer="trl24",
    ),
    Case(
        "lora30_liger_compile",
        "train",
        30,
        "(b) as lora30_liger with torch.compile per decoder layer",
        {**LORA_LIGER, "compile": True},
        estimate_s=150,
        peer="trl_lora30",
    ),
    Case(
        "lora30_fp8_compile",
        "train",
        30,
        "(b) as lora30_fp8 with torch.compile per decoder layer",
        {**LORA_LIGER, "fp8": "tensorwise", "compile": True},
        estimate_s=150,
        peer="trl_lora30",
    ),
    Case(
        "seed30",
        "seed",
        30,
        "(a) seed recipe at the full 7B (an earlier harness: out of memory at step 2)",
        estimate_s=70,
    ),
]
BY_NAME = {c.name: c for c in CASES}
