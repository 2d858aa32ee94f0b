"""Adam's m and v in 8 bits (`train.optimizer_states: 8bit`): bitsandbytes' block-wise quantized states.

Dettmers et al. 2022 ("8-bit Optimizers via Block-wise Quantization"): m and v are stored as one byte per
element, quantized per block of BLOCK elements against the block's absmax on a dynamic (signed for m, unsigned
for v) 256-entry code; each step dequantizes a block, updates it in fp32 and quantizes it again inside one
kernel. 2 B + 8 B / BLOCK per trained parameter instead of 8 B. The master weights stay fp32 (this project's
MasterWeightAdamW) or are DeepSpeed's fp32 partitions (bitsandbytes' AdamW8bit as ZeRO's client optimizer).
Tensors under MIN_8BIT elements keep fp32 states, as bitsandbytes does (their quantization error is not worth
the bytes they save). The update is AdamW's (decoupled weight decay, bias correction); bitsandbytes runs it on
CUDA and, with its CPU backend, on the CPU ranks the tests use.
"""

from __future__ import annotations

import torch

from snaketune.model import sizes

BLOCK = sizes.BNB_8BIT_BLOCK
"""Elements per quantization block (bitsandbytes' block-wise optimizers)."""
MIN_8BIT = 4096
"""bitsandbytes' min_8bit_size: smaller tensors keep fp32 m and v."""
BYTES_PER_PARAM = sizes.STATE_BYTES["8bit"]
"""m and v in one byte each, plus one fp32 absmax per block for each (the memory plan counts it)."""
STATE_KEYS = ("state1", "state2")
"""The state tensors that are uint8 (m, v) for tensors of MIN_8BIT elements or more."""


def require(where: str = "train.optimizer_states") -> None:
    """ValueError naming the key unless bitsandbytes imports."""
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"config key '{where}': '8bit' needs bitsandbytes (pip install -r requirements.txt): {e}"
        ) from e


def init_state(master: torch.Tensor) -> dict:
    """Fresh states for one fp32 master tensor (step 0)."""
    import bitsandbytes.functional as F

    state: dict = {"step": torch.zeros((), dtype=torch.float32)}  # on the host: no device sync per tensor
    if master.numel() < MIN_8BIT:
        state["state1"] = torch.zeros_like(master)
        state["state2"] = torch.zeros_like(master)
        return state
    blocks = (master.numel() + BLOCK - 1) // BLOCK
    state["state1"] = torch.zeros_like(master, dtype=torch.uint8)
    state["state2"] = torch.zeros_like(master, dtype=torch.uint8)
    state["qmap1"] = F.create_dynamic_map(signed=True).to(master.device)
    state["qmap2"] = F.create_dynamic_map(signed=False).to(master.device)
    state["absmax1"] = torch.zeros(blocks, dtype=torch.float32, device=master.device)
    state["absmax2"] = torch.zeros(blocks, dtype=torch.float32, device=master.device)
    return state


def restore_dtypes(state: dict) -> None:
    """torch's Optimizer.load_state_dict casts every state tensor to its parameter's dtype: m and v of a
    quantized state (those with an absmax) go back to uint8 (the values are 0..255, exact in fp32)."""
    if "absmax1" in state:
        for key in STATE_KEYS:
            state[key] = state[key].to(torch.uint8)


@torch.no_grad()
def update(
    master: torch.Tensor,
    grad: torch.Tensor,
    state: dict,
    *,
    lr: float,
    betas: tuple[float, float],
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step of `master` (fp32) with `grad` (fp32, already clipped), in place."""
    import bitsandbytes.functional as F

    state["step"] += 1
    step = int(state["step"])
    beta1, beta2 = betas
    if state["state1"].dtype == torch.uint8:
        F.optimizer_update_8bit_blockwise(
            "adam",
            grad,
            master,
            state["state1"],
            state["state2"],
            beta1,
            beta2,
            0.0,
            0.0,
            eps,
            step,
            lr,
            state["qmap1"],
            state["qmap2"],
            state["absmax1"],
            state["absmax2"],
            weight_decay,
        )
    else:
        F.optimizer_update_32bit(
            "adam",
            grad,
            master,
            state["state1"],
            beta1,
            eps,
            step,
            lr,
            state["state2"],
            beta2,
            0.0,
            0.0,
            weight_decay,
        )


def client_optimizer(groups: list[dict], *, lr: float, betas: tuple[float, float], eps: float):
    """bitsandbytes' AdamW8bit over `groups` (each with its weight_decay): the optimizer DeepSpeed's ZeRO and
    fp32 paths wrap."""
    require()
    import bitsandbytes as bnb

    return bnb.optim.AdamW8bit(groups, lr=lr, betas=betas, eps=eps, min_8bit_size=MIN_8BIT)
