"""Training metrics you can trust: throughput, MFU from a per-device peak table, memory, CSV + TensorBoard."""

from __future__ import annotations

import csv
import os
import resource
import time
from pathlib import Path

import torch

# Dense bf16 tensor-core peak (FLOP/s, no sparsity), from the vendors' data sheets. MFU against this is
# the convention of PaLM / Megatron; the H200 also reached ~790e12 in an 8192^3 bf16 matmul (docs/facts.md,
# "Matmul rates"), so an MFU of 0.8 is about the ceiling there.
PEAK_BF16_FLOPS = {
    "H200": 989.4e12,
    "H100 SXM": 989.4e12,
    "H100 80GB HBM3": 989.4e12,
    "H100 PCIe": 756.5e12,
    "H100": 989.4e12,
    "A100": 312e12,
    "L40S": 362.1e12,
    "A6000": 154.8e12,
    "RTX 4090": 165.2e12,  # with fp32 accumulate (Ada whitepaper); 330 with fp16 accumulate
    "RTX 3090": 71e12,
    "A10": 125e12,
}


MEASURED_MATMUL_FLOPS = {"H200": 790e12, "H100": 790e12}
"""bf16 matmul rate measured on these GPUs (8192^3 products on random data, docs/facts.md "Matmul rates": 788
TFLOP/s on an H200, 769-798 on H100s): what the matmuls can reach in practice. MFU is quoted against the
datasheet peak (PEAK_BF16_FLOPS); the share of this rate is shown beside it, labelled as such."""


def measured_matmul_flops(device_name: str) -> float | None:
    for key in sorted(MEASURED_MATMUL_FLOPS, key=len, reverse=True):
        if key.lower() in device_name.lower():
            return MEASURED_MATMUL_FLOPS[key]
    return None


def peak_flops(device_name: str) -> float | None:
    """Peak for a CUDA device name like 'NVIDIA GeForce RTX 4090'; None when unknown (e.g. CPU)."""
    for key in sorted(PEAK_BF16_FLOPS, key=len, reverse=True):  # most specific first
        if key.lower() in device_name.lower():
            return PEAK_BF16_FLOPS[key]
    return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return "cpu"


def alloc_retries(device: torch.device) -> int | None:
    """How often the CUDA caching allocator had to free its cache and retry cudaMalloc (None on CPU)."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.memory_stats(device).get("num_alloc_retries", 0))


def peak_memory_gib(device: torch.device) -> float:
    """Peak allocated accelerator memory, or the process's peak resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


class MetricsWriter:
    """Rank 0's sink: one CSV row per logged step (union of keys, fixed column order) and TensorBoard."""

    def __init__(self, csv_path: str | Path, tb_dir: str | Path, *, resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.csv_path = Path(csv_path)
        self.rows: list[dict] = []
        if resume_step and self.csv_path.exists():
            # Keep the rows of the run we resume, up to its checkpoint; later rows are redone.
            with open(self.csv_path, newline="") as f:
                self.rows = [r for r in csv.DictReader(f) if int(float(r["step"])) <= resume_step]
        self.tb = SummaryWriter(str(tb_dir), purge_step=resume_step + 1 if resume_step else None)

    def log(self, step: int, values: dict[str, float]) -> None:
        row = {"step": step, "time": round(time.time(), 3), **values}
        self.rows.append(row)
        for key, value in values.items():
            if value is not None:
                self.tb.add_scalar(key, value, step)
        self._write_csv()

    def _write_csv(self) -> None:
        columns: list[str] = []
        for row in self.rows:
            columns += [k for k in row if k not in columns]
        tmp = self.csv_path.with_suffix(".csv.tmp")
        with open(tmp, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=columns)
            writer.writeheader()
            writer.writerows(self.rows)
        os.replace(tmp, self.csv_path)

    def close(self) -> None:
        self.tb.flush()
        self.tb.close()


class Throughput:
    """Tokens/s and MFU over the optimizer steps' own time (validation and checkpoint time excluded).
    The first `warmup` steps are not counted: allocator growth, kernel autotuning and the first
    collectives would make them look slow. Step times are host wall times: GPU work is asynchronous, but
    the all-reduce at every logged step bounds the queue, so the sum over a window is the true time.

    MFU is PaLM's: model FLOPs (snaketune.model.build.flop_counts: 6N per real token plus attention over each
    conversation's own length) over the time, against the datasheet's dense bf16 peak of the device
    (PEAK_BF16_FLOPS); `perf/flops_share_of_measured_matmul` is the same FLOPs against the matmul rate measured on
    that device (MEASURED_MATMUL_FLOPS), a different, labelled figure."""

    def __init__(
        self, flops_per_token: float, peak: float | None, warmup: int = 2, measured: float | None = None
    ):
        self.flops_per_token = flops_per_token
        self.peak = peak
        self.measured = measured
        self.warmup = warmup
        self.steps_seen = 0
        self.reset()

    def reset(self) -> None:
        self.seconds = 0.0
        self.tokens = 0
        self.loss_tokens = 0
        self.padded = 0
        self.flops = 0.0
        self.steps = 0

    def update(
        self,
        tokens: int,
        loss_tokens: int,
        seconds: float,
        *,
        padded: int | None = None,
        attention_flops: float = 0.0,
    ) -> None:
        """`tokens`: real tokens; `padded`: the positions computed, pads included (default: tokens);
        `attention_flops`: the step's attention FLOPs (added to flops_per_token x tokens)."""
        self.steps_seen += 1
        if self.steps_seen <= self.warmup:
            return
        self.tokens += tokens
        self.loss_tokens += loss_tokens
        self.padded += tokens if padded is None else padded
        self.flops += self.flops_per_token * tokens + attention_flops
        self.seconds += seconds
        self.steps += 1

    def read(self, reset: bool = True) -> dict[str, float | None]:
        """Per-rank figures since the last reset (tokens counted on this rank only)."""
        if self.steps == 0 or self.seconds <= 0:
            return {}
        rate = self.flops / self.seconds
        out = {
            "perf/tokens_per_s_per_gpu": self.tokens / self.seconds,
            "perf/loss_tokens_per_s_per_gpu": self.loss_tokens / self.seconds,
            "perf/padded_tokens_per_s_per_gpu": self.padded / self.seconds,
            "perf/step_time_s": self.seconds / self.steps,
            "perf/model_tflops_per_gpu": rate / 1e12,
            "perf/mfu": rate / self.peak if self.peak else None,
            "perf/flops_share_of_measured_matmul": rate / self.measured if self.measured else None,
        }
        if reset:
            self.reset()
        return out
