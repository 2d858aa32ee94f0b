"""Stage 5c, dpo: preference tuning of the SFT model on oasst's ranked pairs, on the train stage's machinery.

`DPOTrainer` is snaketune.train.trainer's Trainer with another objective, on `PairTrainer` (the model as a
PreferenceModel, which the reference pass shares); everything else is the train stage's: the launcher and DeepSpeed
ranks, the model placement and optimizer (snaketune.train.engine: hub-format loading, the fp32-master
fast path, LoRA), checkpoints and resume, the deterministic global order (1 rank = N ranks), metrics, and
saving a hub-format model. Each row is one pair, chosen then rejected (snaketune.data.pairs); the reference
model's log-probabilities come from the reference stage's cache, so only the policy is in memory.

Per pair: the DPO (or IPO) loss of snaketune.preference.logprobs; a global batch's loss is the mean over its pairs,
whatever the world size and micro-batch size. Metrics (`metrics.csv`, TensorBoard): `dpo/loss`,
`dpo/reward_accuracy` (share of pairs whose chosen reply gets the larger implicit reward),
`dpo/margin` (chosen minus rejected reward), `dpo/chosen_reward`, `dpo/rejected_reward`, the same on the
validation pairs (`val/...`), and the train stage's tokens/s, MFU and memory.

Before the first step of a run (not a resumed one) with `preference.reference: sft`, the policy's log-probabilities
of its first micro-batch are compared with the reference stage's (`snaketune.preference.logprobs.start_check`):
the reference stage builds the model exactly as this trainer does (snaketune.preference.reference), so they differ
only by rounding; a larger difference (a reference from another model, in other precision or quantization, or with
other kernels) stops the run before it trains, naming the pair and the figures.

Run by the launcher as `python -m snaketune.preference.dpo <run spec JSON>`; the spec's `preference` holds beta, the
loss, which model is the reference and the reference stage's parquet file.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from snaketune.model import batching
from snaketune.preference.logprobs import START_TOLERANCE, PreferenceModel, read_reference, start_check
from snaketune.train.engine import Built, LossSetup
from snaketune.train.ranks import run
from snaketune.train.summary import TrainResult
from snaketune.train.trainer import ForwardResult, Trainer

log = logging.getLogger("snaketune.train")

METRICS = ("loss", "reward_accuracy", "margin", "chosen_reward", "rejected_reward")


class ReferenceMismatch(RuntimeError):
    """The policy at step 0 is not the model the reference log-probabilities were computed with."""


class PairTrainer(Trainer):
    """The Trainer on preference pairs (snaketune.data.pairs: a row is a pair, chosen then rejected), the model
    wrapped as a PreferenceModel: what the DPO stage and the reference pass (snaketune.preference.reference) share,
    so that both build and call the model the same way."""

    def wrap(self, net, setup: LossSetup):
        # The preference losses come from per-token log-probabilities (snaketune.preference.logprobs), not
        # train.loss_kernel; chunked wherever the lm_head weight is whole (not under ZeRO-3).
        pref = self.spec.preference
        return PreferenceModel(
            net,
            packed_attention=setup.packed_attention,
            fused=setup.zero_stage != 3,
            beta=pref.get("beta"),  # the reference pass (no loss) has none
            loss=pref.get("loss", "dpo"),
            sft_weight=pref.get("sft_weight", 0.0),
        )

    def describe_loss(self, built: Built) -> str:
        if built.stage == 3:
            return "log-probabilities: the whole logits in fp32 (ZeRO-3: the lm_head weight is partitioned)"
        return "log-probabilities: chunked over the tokens from the hidden states (snaketune.preference.logprobs)"

    @property
    def seq_len(self) -> int:
        return 2 * self.spec.preference["max_length"]  # a row holds both sides of a pair

    @torch.no_grad()
    def logprobs(self, split, rows) -> tuple[torch.Tensor, torch.Tensor]:
        """Summed log-probabilities and token counts (rows, 2) of pairs, through the engine as training calls it
        (ZeRO-3 gathers the weights there), in evaluation mode (no dropout)."""
        training = self.engine.training
        self.engine.eval()
        try:
            return self.engine(**self.device_batch(split, rows))
        finally:
            self.engine.train(training)


class DPOTrainer(PairTrainer):
    """The preference objective on the Trainer's loop (see the module docstring)."""

    def load_data(self, data_dir: Path):
        """The pairs, each split with the reference stage's log-probabilities of its rows (`split.reference`)."""
        splits = super().load_data(data_dir)
        path = self.spec.preference["reference_logprobs"]
        reference = read_reference(path)
        for name, split in zip(("train", "validation"), splits, strict=True):
            if len(reference[name]["logprobs"]) != len(split):
                raise RuntimeError(
                    f"{path} has {len(reference[name]['logprobs'])} {name} pairs, {data_dir / name} {len(split)}: "
                    "rerun the reference stage"
                )
            split.reference = reference[name]["logprobs"].float()
        return splits

    def before_training(self) -> None:
        """At the start of a run from the SFT model: the policy must be the reference (module docstring)."""
        pref = self.spec.preference
        if self.run.start_step > 0 or pref.get("reference", "sft") != "sft":
            if self.rank == 0 and self.run.start_step == 0:
                log.info(
                    "start check: skipped (preference.reference: %s, not the policy)", pref.get("reference")
                )
            return
        rows = batching.micro_batches(
            batching.rank_share(
                self.order.global_batch(0, self.cfg.global_batch_size), self.rank, self.world
            ),
            self.cfg.micro_batch_size,
        )[0]
        policy, counts = self.logprobs(self.train_split, rows)
        reference = self.train_split.reference[np.asarray(rows)]
        found = start_check(policy.cpu(), reference, counts.cpu(), dtype=self.dtype, beta=pref["beta"])
        every = [None] * self.world
        dist.all_gather_object(every, found)
        self.start, line, failed = _start_summary(every, self.dtype)
        if failed:
            raise ReferenceMismatch(
                f"{line}: the policy at step 0 is not the model the reference stage scored "
                f"({pref['reference_logprobs']}); {self.start['violations']} replies differ by more than "
                "allowed. Rerun the reference stage (snakemake --forcerun reference), and check that both load "
                "the SFT model with the same train.lora.quantize, train.kernels, train.attention and precision"
            )
        if self.rank == 0:
            log.info("%s", line)

    def step_normalizer(self, batch_ids) -> int:
        return len(batch_ids)  # pairs of the global batch

    def forward(self, split, rows, weights: list[float] | None = None) -> ForwardResult:
        batch = self.device_batch(split, rows)
        batch["reference"] = split.reference[np.asarray(rows)].to(self.device)
        batch["weights"] = torch.tensor(weights or [1.0] * len(rows), device=self.device)
        loss_sum, sums = self.engine(**batch)
        return ForwardResult(loss_sum, sums, batch["input_ids"].numel())

    def window_metrics(self, sums, count):
        return {f"dpo/{k}": sums[k] / max(1.0, count) for k in METRICS if k in sums}

    def eval_count(self, split, rows, weights) -> float:
        return float(sum(weights))

    def validation_metrics(self, sums, count):
        """None for a validation split without pairs (a small dataset can leave none)."""
        return {
            f"val/{'dpo_loss' if k == 'loss' else k}": sums[k] / count if count else None for k in METRICS
        }

    def checkpoint_meta(self) -> dict:
        return {"start_check": getattr(self, "start", None)}

    def summary(self, result: TrainResult, wall: float) -> dict:
        out = super().summary(result, wall)
        last = result.last
        # What this stage computes instead of the SFT loss (train.loss_kernel and fused_cross_entropy do not apply).
        del out["fused_cross_entropy"], out["loss_kernel"]
        out.update(
            logprobs=self.run.loss_summary.removeprefix("log-probabilities: "),
            reference=self.spec.preference.get("reference", "sft"),
            # A run resumed from a checkpoint reports the check its first attempt made (checkpoint_meta).
            start_check=getattr(self, "start", None) or self.resumed_meta.get("start_check"),
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


def _start_summary(every: list[dict], dtype: torch.dtype) -> tuple[dict, str, bool]:
    """The start check over all ranks (`every`: each rank's start_check): what summary.json records, the log line,
    and whether it failed."""
    keys = ("ratio_sum", "tokens", "replies", "violations", "dpo_loss_sum", "pairs")
    total = {k: sum(f[k] for f in every) for k in keys}
    worst = max(every, key=lambda f: f["max_abs_ratio"] / max(1, f["worst_tokens"]))
    tol = START_TOLERANCE.get(dtype, START_TOLERANCE[torch.bfloat16])
    mean = total["ratio_sum"] / max(1, total["tokens"])
    start = {
        "mean_log_ratio_per_token": mean,
        "max_abs_ratio": worst["max_abs_ratio"],
        "worst_reply_tokens": worst["worst_tokens"],
        "replies": total["replies"],
        "violations": total["violations"],
        "dpo_loss": total["dpo_loss_sum"] / max(1, total["pairs"]),
        "tolerance": tol,
    }
    line = (
        f"start check: policy vs reference log-probabilities of {total['replies']} replies "
        f"({total['tokens']:,} tokens) of step 1: mean log-ratio {mean:+.2e} per token (allowed "
        f"{tol['per_token_mean']:g}), largest |log pi - log ref| {worst['max_abs_ratio']:.3g} nats (a "
        f"{worst['worst_tokens']}-token reply; allowed {tol['per_reply'][0]:g} per token + {tol['per_reply'][1]:g}); "
        f"DPO loss of these pairs {start['dpo_loss']:.6f} (ln 2 = {np.log(2):.6f})"
    )
    return start, line, bool(total["violations"] or abs(mean) > tol["per_token_mean"])


if __name__ == "__main__":
    run(sys.argv[1:], DPOTrainer)
