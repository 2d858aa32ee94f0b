"""What a GPU process holds outside PyTorch's caching allocator (NVML's device memory less the allocator's reserved
memory), step by step as a training rank starts its libraries: the CUDA context; snaketune.device_memory's warm-up
(cuBLAS, a first NCCL collective); a bf16 matmul, SiLU and backward; the Triton loss; SDPA. This is what
`gpu_memory_gib` must leave beside the allocator's cap (snaketune.device_memory, the plan's CUDA_OVERHEAD_GIB).

    python -m bench outside_allocator        (one CUDA GPU; one process, NCCL over one rank)
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "workflow"))

from snaketune import device_memory as dm  # noqa: E402
from snaketune.model.losses import logits_cross_entropy  # noqa: E402


def main() -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    mem = dm.device_memory(dev)

    def show(what: str) -> None:
        torch.cuda.synchronize()  # so that NVML sees every kernel's and library's memory of the step before
        used, reserved = mem.used_bytes(), torch.cuda.memory_reserved()
        print(f"{what}: device {used / 2**30:.3f} GiB (process {mem.process_bytes()}), reserved "
              f"{reserved / 2**30:.3f}, outside the allocator {(used - reserved) / 2**30:.3f}", flush=True)  # fmt: skip

    torch.zeros(1, device=dev)
    show("context")
    dist.init_process_group("nccl", rank=0, world_size=1)
    dm.warm_up(dev, distributed=True)
    show("after warm_up (cuBLAS, NCCL)")
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
    torch.nn.functional.silu(x @ w).float().sum().backward()
    show("after a matmul, SiLU and backward")
    logits = torch.randn(2048, 32000, device=dev, dtype=torch.bfloat16, requires_grad=True)
    logits_cross_entropy(logits, torch.randint(0, 32000, (2048,), device=dev)).backward()
    show("after the Triton loss")
    q = torch.randn(1, 8, 1024, 128, device=dev, dtype=torch.bfloat16)
    torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True)
    show("after SDPA")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
