"""Stage 5b, reference: the reference model's log-probabilities of every preference pair, computed once.

DPO compares the policy's log-probabilities with a frozen reference model's. Holding that second model in memory
doubles the weights of a step (12.9 GiB more for a 7B on a 24 GB card); its numbers never change, so this stage
computes the summed log-probabilities of chosen and rejected of every train and validation pair once, with the
replies' token counts (IPO averages over them), and the DPO stage reads them. It reruns only when what it computes
from changes (the reference model, the pairs, how the model is built); a new `beta` or learning rate reuses it.

The reference is the policy at step 0. So this stage is the DPO stage's own trainer (snaketune.preference.dpo),
launched the same way on the same ranks, with the same model construction (snaketune.train.engine: the SFT model
loaded as DPO loads it, 4-bit under QLoRA, with LoRA's zero-initialized adapters, Liger's kernels, the varlen
attention, ZeRO stage, precision and micro-batch size), and it calls the model through the engine as DPO does,
without training. DPO checks its first micro-batch against these numbers before it trains (`start_check`).
With `preference.reference: base` the model is the base model instead, built the same way.

Run by the launcher as `python -m snaketune.preference.reference <run spec JSON>`; rank 0 writes
reference.parquet (snaketune.preference.logprobs.REFERENCE_COLUMNS) and reference.json into the output directory.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch
import torch.distributed as dist

from snaketune import device_memory
from snaketune.io import write_json, write_parquet
from snaketune.model import batching
from snaketune.preference.dpo import DPOTrainer
from snaketune.preference.logprobs import REFERENCE_COLUMNS
from snaketune.train.metrics import device_name, peak_memory_gib
from snaketune.train.ranks import run
from snaketune.train.trainer import Trainer

log = logging.getLogger("snaketune.train")

SPLITS = ("train", "validation")


class ReferencePass(DPOTrainer):
    """DPOTrainer's setup (model, engine, data order), then one pass over every pair without training."""

    resumable = False

    def __init__(self, spec):
        super().__init__(spec)
        # No optimizer step is taken: one micro-batch per rank per step makes any world size valid (the rule's
        # params leave out the batch, schedule and optimizer settings that do not change the model's numbers).
        self.cfg = dataclasses.replace(
            self.cfg, global_batch_size=self.cfg.micro_batch_size * self.world, max_steps=1, epochs=None
        )

    def load_data(self, data_dir: Path):
        return Trainer.load_data(self, data_dir)  # the pairs alone: the reference is what this computes

    def split_logprobs(self, split: batching.TokenizedSplit) -> tuple[np.ndarray, np.ndarray]:
        """(rows, 2) summed log-probabilities (float64) and token counts of every pair of `split` (rank 0; the
        other ranks return empty arrays). Each rank scores a contiguous share in micro-batches; every rank runs
        as many forward passes (ZeRO-3 gathers weights collectively), a short share repeating its first row."""
        n, mb = len(split), self.cfg.micro_batch_size
        per_rank = math.ceil(n / self.world)
        mine = list(range(self.rank * per_rank, min(n, (self.rank + 1) * per_rank)))
        real = len(mine)
        steps = math.ceil(per_rank / mb) if n else 0
        mine += [0] * (steps * mb - real)
        sums, counts = [], []
        for i in range(steps):
            lp, c = self.logprobs(split, mine[i * mb : (i + 1) * mb])
            sums.append(lp.double().cpu())  # device-to-host sync per micro-batch: this stage only scores
            counts.append(c.long().cpu())
        local = (
            torch.cat(sums)[:real].numpy() if sums else np.zeros((0, 2)),
            torch.cat(counts)[:real].numpy() if counts else np.zeros((0, 2), dtype=np.int64),
        )
        every = [None] * self.world
        dist.all_gather_object(every, local)
        if self.rank != 0:
            return np.zeros((0, 2)), np.zeros((0, 2), dtype=np.int64)
        return np.concatenate([e[0] for e in every]), np.concatenate([e[1] for e in every])

    def execute(self, t0: float) -> None:
        columns: dict[str, list] = {c: [] for c in REFERENCE_COLUMNS}
        means = {}
        for name, split in zip(SPLITS, (self.train_split, self.val_split), strict=True):
            lp, n = self.split_logprobs(split)
            columns["split"] += [name] * len(lp)
            columns["row"] += list(range(len(lp)))
            columns["chosen"] += lp[:, 0].tolist()
            columns["rejected"] += lp[:, 1].tolist()
            columns["chosen_tokens"] += n[:, 0].tolist()
            columns["rejected_tokens"] += n[:, 1].tolist()
            means[name] = {"chosen": float(lp[:, 0].mean()) if len(lp) else None,
                           "rejected": float(lp[:, 1].mean()) if len(lp) else None}  # fmt: skip
        peaks = [None] * self.world
        dist.all_gather_object(peaks, peak_memory_gib(self.device))
        devices = [None] * self.world
        dist.all_gather_object(
            devices, device_memory.record(self.device_peak, self.device, self.device_budget)
        )
        if self.rank != 0:
            return
        types = {"split": pa.string(), "row": pa.int64(), "chosen": pa.float64(), "rejected": pa.float64()}
        schema = pa.schema([(c, types.get(c, pa.int64())) for c in REFERENCE_COLUMNS])
        out = Path(self.spec.output_dir)
        write_parquet(pa.Table.from_pydict(columns, schema=schema), out / "reference.parquet")
        b = self.built
        record = {
            "reference": self.spec.preference.get("reference", "sft"),
            "model": self.model_cfg.base,
            "device": device_name(self.device),
            "world_size": self.world,
            "dtype": str(self.dtype).removeprefix("torch."),
            "zero_stage": self.stage,
            "lora": self.cfg.lora.enabled,
            "lora_quantize": self.cfg.lora.quantize,
            "kernels": b.kernels,
            "attention": self.attention_summary,
            "micro_batch_size": self.cfg.micro_batch_size,
            "pairs": {s: columns["split"].count(s) for s in SPLITS},
            "mean_logprob": means,
            "peak_memory_gib_per_rank": peaks,
            "device_memory_per_rank": devices,
            "time_s": time.perf_counter() - t0,
        }
        write_json(out / "reference.json", record)
        log.info(
            "reference log-probabilities of %s pairs (%s, %s, %s kernels) in %.1f s",
            record["pairs"],
            record["model"],
            record["dtype"],
            record["kernels"],
            record["time_s"],
        )


if __name__ == "__main__":
    run(sys.argv[1:], ReferencePass)
