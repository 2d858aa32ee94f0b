"""Stage 5b, reference: the reference model's log-probabilities of every preference pair, computed once.

DPO compares the policy's log-probabilities with a frozen reference model's. Holding that second model in memory
doubles the weights of a step (12.9 GiB more for a 7B on a 24 GB card); its numbers never change, so this stage
computes the summed log-probabilities of chosen and rejected of every train and validation pair once, with the
replies' token counts (IPO averages over them), and the DPO stage reads them. It reruns only when what it computes
from changes (the reference model, the pairs, how the model is built); a new `beta` or learning rate reuses it.

The reference is the policy at step 0. So this stage runs on the trainer DPO runs on
(snaketune.preference.dpo.PairTrainer), launched the same way on the same ranks, with the same model construction
(snaketune.train.engine: the SFT model loaded as DPO loads it, 4-bit under QLoRA, with LoRA's zero-initialized
adapters, Liger's kernels, the varlen attention, precision and micro-batch size), and it calls the model through the
engine as DPO does. It never takes a step, so its engine has no optimizer: no fp32 master weights, no Adam states
(for a full-weight 7B the masters alone are 4 B x 6.9e9 parameters, 25.7 GiB), and under ZeRO-1 and -2, which only
partition what training adds, it runs at stage 0 (engine.scoring_config). DPO checks its first micro-batch against
these numbers before it trains (`start_check`). With `preference.reference: base` the model is the base model
instead, built the same way.

Run by the launcher as `python -m snaketune.preference.reference <run spec JSON>`; rank 0 writes
reference.parquet (snaketune.preference.logprobs.REFERENCE_COLUMNS) and reference.json into the output directory.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch.distributed as dist

from snaketune import device_memory
from snaketune.io import write_json, write_parquet
from snaketune.model import batching
from snaketune.preference.dpo import PairTrainer
from snaketune.preference.logprobs import REFERENCE_COLUMNS
from snaketune.train.metrics import device_name, peak_memory_gib
from snaketune.train.ranks import run

log = logging.getLogger("snaketune.train")

SPLITS = ("train", "validation")
SIDES = ("chosen", "rejected")


class ReferencePass(PairTrainer):
    """The pair trainer's setup (model, engine, data), then one pass over every pair without training."""

    trains = False

    def __init__(self, spec):
        super().__init__(spec)
        # No optimizer step is taken: one micro-batch per rank per step makes any world size valid (the rule's
        # params leave out the batch, schedule and optimizer settings that do not change the model's numbers).
        self.cfg = dataclasses.replace(
            self.cfg, global_batch_size=self.cfg.micro_batch_size * self.world, max_steps=1, epochs=None
        )

    def split_logprobs(self, split: batching.TokenizedSplit) -> tuple[np.ndarray, np.ndarray]:
        """(rows, 2) summed log-probabilities (float64) and token counts of every pair of `split` (rank 0; the
        other ranks return empty arrays), each rank scoring its share (batching.padded_shard)."""
        sums, counts = [np.zeros((0, 2))], [np.zeros((0, 2), dtype=np.int64)]
        for rows, weights in batching.padded_shard(
            len(split), self.rank, self.world, self.cfg.micro_batch_size
        ):
            lp, c = self.logprobs(split, rows)
            real = [i for i, w in enumerate(weights) if w]
            sums.append(
                lp.double().cpu().numpy()[real]
            )  # device-to-host sync per micro-batch: this stage only scores
            counts.append(c.long().cpu().numpy()[real])
        every = [None] * self.world
        dist.all_gather_object(every, (np.concatenate(sums), np.concatenate(counts)))
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
            means[name] = {side: float(lp[:, i].mean()) if len(lp) else None for i, side in enumerate(SIDES)}
        peaks = [None] * self.world
        dist.all_gather_object(peaks, peak_memory_gib(self.device))
        devices = [None] * self.world
        dist.all_gather_object(
            devices, device_memory.record(self.placed.peak, self.device, self.placed.budget)
        )
        if self.rank != 0:
            return
        types = {"split": pa.string(), "row": pa.int64(), "chosen": pa.float64(), "rejected": pa.float64()}
        schema = pa.schema([(c, types.get(c, pa.int64())) for c in REFERENCE_COLUMNS])
        out = Path(self.spec.output_dir)
        write_parquet(pa.Table.from_pydict(columns, schema=schema), out / "reference.parquet")
        record = {
            **self._record(),
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

    def _record(self) -> dict:
        """What reference.json says of how the model was built (what DPO's start check relies on)."""
        return {
            "reference": self.spec.preference.get("reference", "sft"),
            "model": self.model_cfg.base,
            "device": device_name(self.device),
            "world_size": self.world,
            "dtype": str(self.dtype).removeprefix("torch."),
            "zero_stage": self.run.stage,
            "lora": self.cfg.lora.enabled,
            "lora_quantize": self.cfg.lora.quantize,
            "kernels": self.run.built.kernels,
            "attention": self.run.attention_summary,
            "micro_batch_size": self.cfg.micro_batch_size,
        }


if __name__ == "__main__":
    run(sys.argv[1:], ReferencePass)
