"""Stage 5c, dpo: preference tuning of the SFT model on oasst's ranked pairs, on the train stage's machinery.

`DPOTrainer` is snaketune.training's Trainer with another objective; everything else is shared: the launcher
and DeepSpeed ranks, the model placement and optimizer (snaketune.engine: hub-format loading, the fp32-master
fast path, LoRA), checkpoints and resume, the deterministic global order (1 rank = N ranks), metrics, and
saving a hub-format model. Each row is one pair, chosen then rejected (snaketune.pairs); the reference
model's log-probabilities come from the reference stage's cache, so only the policy is in memory.

Per pair: the DPO (or IPO) loss of snaketune.logprobs; a global batch's loss is the mean over its pairs,
whatever the world size and micro-batch size. Metrics (`metrics.csv`, TensorBoard): `dpo/loss`,
`dpo/reward_accuracy` (share of pairs whose chosen reply gets the larger implicit reward),
`dpo/margin` (chosen minus rejected reward), `dpo/chosen_reward`, `dpo/rejected_reward`, the same on the
validation pairs (`val/...`), and the train stage's tokens/s, MFU and memory.

Run by the launcher as `python -m snaketune.dpo <run spec JSON>`; the spec's `preference` holds beta, the
loss and the reference stage's parquet file.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch

from snaketune import batching
from snaketune.logprobs import PreferenceModel
from snaketune.reference import read_reference
from snaketune.training import Trainer, run

METRICS = ("loss", "reward_accuracy", "margin", "chosen_reward", "rejected_reward")


class DPOTrainer(Trainer):
    """The preference objective on the Trainer's loop (see the module docstring)."""

    def load_data(self, data_dir: Path):
        reference = read_reference(self.spec.preference["reference_logprobs"])
        splits = []
        for name in ("train", "validation"):
            split = batching.load_split(data_dir / name)
            if len(reference[name]["logprobs"]) != len(split):
                raise RuntimeError(
                    f"{self.spec.preference['reference_logprobs']} has {len(reference[name]['logprobs'])} "
                    f"{name} pairs, {data_dir / name} {len(split)}: rerun the reference stage"
                )
            split.reference = reference[name]["logprobs"].float()
            splits.append(split)
        return tuple(splits)

    def wrap(self, net, packed_attention: bool, fused_cross_entropy: bool, loss_kernel: str):
        # The preference losses come from per-token log-probabilities (snaketune.logprobs), not train.loss_kernel.
        # The chunked log-probabilities are used wherever the lm_head weight is whole (not under ZeRO-3).
        zero3 = self._zero_stage() == 3
        pref = self.spec.preference
        return PreferenceModel(
            net,
            packed_attention=packed_attention,
            fused=not zero3,
            beta=pref["beta"],
            loss=pref["loss"],
            sft_weight=pref.get("sft_weight", 0.0),
        )

    def _zero_stage(self) -> int:
        import json

        from snaketune.dsconfig import zero_stage

        return zero_stage(json.loads(Path(self.spec.deepspeed_config).read_text()))

    def step_normalizer(self, batch_ids) -> int:
        return len(batch_ids)  # pairs of the global batch

    def forward(self, split, rows, *, evaluating: bool = False):
        batch = self._batch(split, rows)
        batch["reference"] = split.reference[np.asarray(rows)].to(self.device)
        weights = self._eval_weights if evaluating else [1.0] * len(rows)
        batch["weights"] = torch.tensor(weights, device=self.device)
        loss_sum = self.engine(**batch)
        return loss_sum, dict(self.engine.module.last)

    def window_metrics(self, sums, count):
        return {f"dpo/{k}": sums[k] / max(1.0, count) for k in METRICS if k in sums}

    def eval_count(self, split, rows, weights) -> float:
        return float(sum(weights))

    def validation_metrics(self, sums, count):
        return {f"val/{'dpo_loss' if k == 'loss' else k}": sums[k] / max(1.0, count) for k in METRICS}

    @property
    def seq_len(self) -> int:
        return 2 * self.spec.preference["max_length"]  # a row holds both sides of a pair

    def summary(self, last: dict, wall: float) -> dict:
        out = super().summary(last, wall)
        out.update(
            objective=self.spec.preference["loss"],
            beta=self.spec.preference["beta"],
            final_train_loss=last.get("dpo/loss"),
            final_val_loss=last.get("val/dpo_loss"),
            final_reward_accuracy=last.get("dpo/reward_accuracy"),
            final_val_reward_accuracy=last.get("val/reward_accuracy"),
            final_val_margin=last.get("val/margin"),
            pairs={"train": len(self.train_split), "validation": len(self.val_split)},
        )
        return out


if __name__ == "__main__":
    sys.exit(run(sys.argv[1:], DPOTrainer))
