#!/usr/bin/env bash
# Run ON THE LENT H200 MACHINE from the repo root, with .whl/ and .realdata/ carried (bench/device_realpath.sh says
# what they hold): the device-memory and reference checks of issue #22 in one call.
#   1. NVML beside the allocator: what a process holds outside PyTorch's allocator once CUDA, cuBLAS, NCCL and
#      Triton have started, and after a first training-like step (the kernel modules CUDA loads lazily).
#   2. bench/train_throughput.py's capped cases (gpu_memory_gib 24) and TRL's capped run, with their NVML peaks.
#   3. config/examples as written (bench/device_realpath.sh): RUNS, with DPO's start check in each dpo log.
#   CASES=lora30_cap24_auto,trl_lora30_cap24 RUNS="lora" SFT_STEPS=4 DPO_STEPS=4 bash bench/device_trust.sh
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/device.log") 2>&1
source bench/device_env.sh
stamp() { echo "=== [$(date -u +%H:%M:%S) +${SECONDS}s] $*"; }
stamp "NVML: memory outside the allocator"
python3 - <<'PY'
import os, torch
os.environ.setdefault("MASTER_ADDR", "127.0.0.1"); os.environ.setdefault("MASTER_PORT", "29511")
import torch.distributed as dist
from snaketune import device_memory as dm
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
mem = dm.device_memory(dev)
gib = lambda b: b / 2**30
def show(what):
    torch.cuda.synchronize()
    used, res = mem.used_bytes(), torch.cuda.memory_reserved()
    print(f"{what}: device {gib(used):.3f} GiB (process {mem.process_bytes()}), reserved {gib(res):.3f}, "
          f"outside the allocator {gib(used - res):.3f}", flush=True)
torch.zeros(1, device=dev); show("context")
dist.init_process_group("nccl", rank=0, world_size=1)
dm.warm_up(dev, distributed=True); show("after warm_up (cuBLAS, NCCL)")
from snaketune.model.losses import logits_cross_entropy
x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
w = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16, requires_grad=True)
y = torch.nn.functional.silu(x @ w); y.float().sum().backward(); show("after a matmul, SiLU and backward")
logits = torch.randn(2048, 32000, device=dev, dtype=torch.bfloat16, requires_grad=True)
logits_cross_entropy(logits, torch.randint(0, 32000, (2048,), device=dev)).backward(); show("after the Triton loss")
q = torch.randn(1, 8, 1024, 128, device=dev, dtype=torch.bfloat16)
torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True); show("after SDPA")
dist.destroy_process_group()
PY
if [ -n "${CASES:-}" ]; then
  stamp "bench/train_throughput.py $CASES"
  python3 bench/train_throughput.py --out "$OUT" --only "$CASES" --budget-s "${CASE_BUDGET_S:-300}"
fi
if [ -n "${RUNS:-}" ]; then
  stamp "bench/device_realpath.sh $RUNS"
  RUNS="$RUNS" SFT_STEPS=${SFT_STEPS:-4} DPO_STEPS=${DPO_STEPS:-4} BUDGET_S=${RUN_BUDGET_S:-400} \
    bash bench/device_realpath.sh
fi
stamp done
