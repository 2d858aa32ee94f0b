"""Where a training step's time goes: a torch.profiler trace of a few steps, on request.

    SNAKETUNE_PROFILE=DIR snakemake ...   (or bench/train_throughput.sh, which passes its environment on)

Each rank profiles optimizer steps WAIT + WARMUP + 1 .. WAIT + WARMUP + ACTIVE (after the first steps' warm-up:
allocator growth, Triton autotuning) and writes to DIR: trace_rank<R>.json.gz (chrome://tracing, Perfetto) and
top_rank<R>.md, the kernels by GPU time with each kernel family's share of the profiled time (matmuls,
attention, fused Triton kernels, the optimizer, elementwise ops, communication). Off unless the variable is
set; nothing else changes.
"""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
from pathlib import Path

import torch

ENV = "SNAKETUNE_PROFILE"
WAIT, WARMUP, ACTIVE = 2, 1, 3
FAMILIES = (
    ("matmul (cuBLAS/CUTLASS)", re.compile(r"gemm|xmma|nvjet|cublas", re.I)),
    ("attention (FlashAttention/SDPA)", re.compile(r"flash|fmha|attention", re.I)),
    # The gradient norm is torch's vector_norm, a reduce kernel with NormTwoOps (the only 2-norm in a step).
    ("optimizer step (AdamW, gradient norm)", re.compile(r"adam|multi_tensor|optimizer|NormTwoOps", re.I)),
    (
        "fused Triton (Liger RMSNorm/RoPE/SwiGLU, losses)",
        re.compile(r"liger|rms|rope|swiglu|silu_mul|triton_|cross_entropy", re.I),
    ),
    ("communication (NCCL)", re.compile(r"nccl", re.I)),
    (
        "elementwise / reductions / copies",
        re.compile(r"elementwise|vectorized|reduce|copy|memcpy|memset|fill|cat", re.I),
    ),
)


class StepProfiler:
    """torch.profiler over steps WAIT+WARMUP+1 .. +ACTIVE of this process; `step()` after every optimizer step."""

    def __init__(self, out_dir: str | Path, rank: int, device: torch.device):
        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        self.rank = rank
        activities = [torch.profiler.ProfilerActivity.CPU]
        if device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self.prof = torch.profiler.profile(
            activities=activities,
            schedule=torch.profiler.schedule(wait=WAIT, warmup=WARMUP, active=ACTIVE, repeat=1),
            on_trace_ready=self._write,
            record_shapes=False,
        )
        self.prof.__enter__()

    def step(self) -> None:
        self.prof.step()

    def close(self) -> None:
        self.prof.__exit__(None, None, None)

    def _write(self, prof) -> None:
        raw = self.out / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(raw))
        events = json.loads(raw.read_text())
        with open(raw, "rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        times = kernel_times(events)
        host = {e.key: (e.count, e.self_cpu_time_total) for e in prof.key_averages() if e.self_cpu_time_total}
        if not times:  # CPU ranks: the operators' own host time
            table = top_table(host, "host operator")
        else:  # GPU ranks: the kernels, whether the GPU waited on the host, and where the host's time went
            table = (
                top_table(times)
                + "\n"
                + gpu_busy_line(events)
                + "\n\n"
                + top_table(host, "host operator", 15)
            )
        (self.out / f"top_rank{self.rank}.md").write_text(table)


def kernel_times(trace: dict | list) -> dict[str, tuple[int, float]]:
    """{kernel name: (launches, microseconds)} of a chrome trace's GPU kernels (events of category "kernel")."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    out: dict[str, list] = {}
    for e in events:
        if e.get("cat") == "kernel":
            entry = out.setdefault(e["name"], [0, 0.0])
            entry[0] += 1
            entry[1] += float(e.get("dur", 0))
    return {name: (n, us) for name, (n, us) in out.items()}


def gpu_busy_line(trace: dict | list) -> str:
    """How much of the profiled steps' wall time the GPU ran kernels (the union of their intervals): well under
    100% means the GPU waited for the host (launch overhead, Python in hooks, synchronizations)."""
    events = trace.get("traceEvents", []) if isinstance(trace, dict) else trace
    # The host's step markers (the trace repeats them on the GPU's timeline as gpu_user_annotation).
    steps = [
        e
        for e in events
        if str(e.get("name", "")).startswith("ProfilerStep#")
        and "dur" in e
        and e.get("cat") != "gpu_user_annotation"
    ]
    wall = sum(float(e["dur"]) for e in steps)
    spans = sorted(
        (float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0)))
        for e in events
        if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
    )
    busy, end = 0.0, float("-inf")
    for start, stop in spans:
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    if not wall:
        return f"GPU busy {busy / 1e3 / ACTIVE:,.1f} ms per step (no step markers in the trace)"
    return (
        f"GPU busy (kernels, copies) {busy / 1e3 / len(steps):,.1f} of {wall / 1e3 / len(steps):,.1f} ms of wall "
        f"time per step: {busy / wall:.0%}"
    )


def top_table(times: dict[str, tuple[int, float]], where: str = "GPU kernel", rows: int = 25) -> str:
    """Markdown: the kernels by time per profiled step, then each family's share (FAMILIES)."""
    total = sum(us for _, us in times.values()) or 1.0
    lines = [
        f"{where} time over {ACTIVE} profiled steps: {total / 1e3:,.1f} ms ({total / 1e3 / ACTIVE:,.1f} ms per step)",
        "",
        f"| {where} | calls per step | ms per step | share |",
        "|---|---:|---:|---:|",
    ]
    ranked = sorted(times.items(), key=lambda kv: -kv[1][1])
    for name, (n, us) in ranked[:rows]:
        shown = name if len(name) <= 90 else name[:87] + "..."
        lines.append(f"| `{shown}` | {n // ACTIVE} | {us / 1e3 / ACTIVE:.2f} | {us / total:.1%} |")
    shares: dict[str, float] = {}
    for name, (_, us) in ranked:
        family = next((f for f, pattern in FAMILIES if pattern.search(name)), "other")
        shares[family] = shares.get(family, 0.0) + us
    lines += ["", "| family | ms per step | share |", "|---|---:|---:|"]
    for family, us in sorted(shares.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {family} | {us / 1e3 / ACTIVE:.2f} | {us / total:.1%} |")
    return "\n".join(lines) + "\n"


def from_env(rank: int, device: torch.device) -> StepProfiler | None:
    """A StepProfiler writing to $SNAKETUNE_PROFILE, or None when it is not set."""
    out = os.environ.get(ENV)
    return StepProfiler(out, rank, device) if out else None
