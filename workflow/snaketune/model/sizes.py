"""The sizes the kernels and optimizers work in, and the bytes their states take: one place that the code which
allocates (snaketune.model.losses, snaketune.preference.logprobs, snaketune.train.optim, adam8bit, backward_step)
and the memory plan that counts it (snaketune.plan.memory) both import. No torch: the plan runs on login nodes.
"""

from __future__ import annotations

CHUNK_BYTES = 2**30
"""fp32 logits of one chunk of tokens in the fused loss and the chunked log-probabilities: 1 GiB, i.e. 2,560 tokens
at a 102,400-token vocabulary."""
CHUNK_ALIGN = 256
"""A chunk holds a multiple of this many tokens, and at least this many."""


def chunk_tokens(vocab: int) -> int:
    """Tokens per chunk of the fused loss (snaketune.model.losses) at a vocabulary of `vocab` entries."""
    return max(CHUNK_ALIGN, CHUNK_BYTES // (4 * vocab) // CHUNK_ALIGN * CHUNK_ALIGN)


MASTER_CHUNK_ELEMENTS = 2**28
"""Most parameters whose fp32 gradients exist at once in a step of snaketune.train.optim.MasterWeightAdamW (1 GiB of
fp32)."""

BNB_8BIT_BLOCK = 256
"""Elements per quantization block of bitsandbytes' block-wise 8-bit optimizer states (snaketune.train.adam8bit)."""
TORCHAO_BLOCK = {"8bit": 256, "4bit": 128}
"""Elements per quantization block of torchao's AdamW8bit and AdamW4bit states (snaketune.train.backward_step)."""

STATE_BYTES = {
    "fp32": 8.0,
    "8bit": 2 + 2 * 4 / BNB_8BIT_BLOCK,
    "4bit": 1 + 2 * 4 / TORCHAO_BLOCK["4bit"],
}
"""Adam's m and v per trained parameter (train.optimizer_states): fp32, or one byte (8bit) or half a byte (4bit)
each, plus one fp32 scale per block for each. torchao's 8-bit blocks are bitsandbytes' size, so `8bit` is both."""
