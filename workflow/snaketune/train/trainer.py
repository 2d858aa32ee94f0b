"""Stage 5, train: one DeepSpeed rank. `snaketune.train.launch` starts one process per granted GPU or CPU rank
(torchrun; one rank directly): `python -m snaketune.train.trainer <run spec JSON>`, or for the preference stages
`-m snaketune.preference.dpo` and `-m snaketune.preference.reference`, whose trainers are subclasses of this one.

A plain loop over `deepspeed.initialize` (not the HF Trainer, which on CPU silently trains world_size=1 on every
rank: docs/facts.md): construct, setup, train, save; cleanup is guaranteed on error. The model, its placement,
optimizer and engine come from snaketune.train.engine. What a subclass changes is the objective, through these
methods and nothing else: the data it reads (`load_data`), the loss module (`wrap`, told how the loss computes and
the ZeRO stage: engine.LossSetup), what one optimizer step's loss is normalized by (`step_normalizer`), the forward of
a micro-batch (`forward`, which returns a `ForwardResult`: the loss, the metrics' sums and the positions computed),
the metrics of a window and of the validation split (`window_metrics`, `eval_count`, `validation_metrics`), how the
log names its loss (`describe_loss`), and whether it trains at all (`trains`: a pass without steps builds no optimizer
and writes no checkpoint). What the rank logs and writes to summary.json (snaketune.train.summary) comes from two
values: the run as set up (`Trainer.run`, a RunSetup) and what `train` returns (a TrainResult).
"""

from __future__ import annotations

import gc
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from snaketune.config.load import from_dict
from snaketune.config.schema import ModelConfig, TrainConfig
from snaketune.data.tokenization import load_tokenizer
from snaketune.io import sha256_tree, write_json
from snaketune.model import batching
from snaketune.model.build import LossModel
from snaketune.train import checkpoint, engine, profiling, ranks, saving
from snaketune.train.metrics import (
    MetricsWriter,
    Throughput,
    alloc_retries,
    device_name,
    measured_matmul_flops,
    peak_flops,
    peak_memory_gib,
)
from snaketune.train.summary import RunSetup, TrainResult, log_progress, log_start, run_summary

log = logging.getLogger("snaketune.train")


@dataclass
class ForwardResult:
    """What the forward pass of one micro-batch gives the step (`Trainer.forward`)."""

    loss: torch.Tensor
    """The summed loss of the micro-batch's rows (0-d, with its graph): what backward scales."""
    sums: dict[str, torch.Tensor]
    """Detached float64 sums the metrics are made of (`window_metrics`, `validation_metrics`), per key."""
    positions: int
    """Positions the forward computed, padding included (perf/padded_tokens_per_s_per_gpu)."""


@dataclass
class _Window:
    """The sums of the steps since the last logged one, and what they are normalized by."""

    sums: dict[str, torch.Tensor] = field(default_factory=dict)
    count: float = 0.0

    def add(self, sums: dict[str, torch.Tensor]) -> None:
        for key, value in sums.items():
            self.sums[key] = self.sums[key] + value if key in self.sums else value


class Trainer:
    """Supervised fine-tuning: the summed next-token loss over the loss-bearing tokens of a global batch."""

    trains = True
    """Whether this rank takes optimizer steps: with an optimizer, resuming from and writing checkpoints. A pass that
    only runs the model (snaketune.preference.reference) builds the same model without an optimizer."""

    def __init__(self, spec: ranks.RunSpec):
        self.spec = spec
        self.model_cfg: ModelConfig = from_dict(ModelConfig, spec.model, "model.")
        self.cfg: TrainConfig = from_dict(TrainConfig, spec.train, "train.")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.placed = ranks.rank_device(
            int(os.environ.get("LOCAL_RANK", 0)),
            in_backward=self.cfg.optimizer_step == "in_backward",
            verbose=self.rank == 0,
        )
        self.device = self.placed.device
        precision = self.cfg.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.out = Path(spec.output_dir)
        self.ckpt_root = Path(spec.checkpoint_dir)
        self.resumed_meta: dict = {}
        """The marker of the checkpoint this run resumed from (snaketune.train.checkpoint.mark_complete)."""

    # ---- the objective (what a subclass changes) ------------------------------------------------

    def load_data(self, data_dir: Path) -> tuple[batching.TokenizedSplit, batching.TokenizedSplit]:
        return batching.load_split(data_dir / "train"), batching.load_split(data_dir / "validation")

    def wrap(self, net: torch.nn.Module, setup: engine.LossSetup) -> torch.nn.Module:
        return LossModel(
            net,
            packed_attention=setup.packed_attention,
            fused_cross_entropy=setup.fused_cross_entropy,
            loss_kernel=setup.loss_kernel,
        )

    def step_normalizer(self, batch_ids) -> int:
        """What the summed loss of a global batch is divided by: its loss-bearing tokens."""
        return max(1, int(self.train_split.loss_tokens[batch_ids].sum()))

    def forward(self, split, rows, weights: list[float] | None = None) -> ForwardResult:
        """The summed loss of a micro-batch and the sums the metrics are made of. `weights`: one per row, 0 for a
        row that only keeps the ranks' forward passes in step (batching.padded_shard); None: every row counts."""
        batch = self.device_batch(split, rows)
        for row, weight in enumerate(weights or ()):
            if weight == 0.0:
                batch["labels"][row] = batching.IGNORE
        loss_sum = self.engine(**batch)
        return ForwardResult(loss_sum, {"loss": loss_sum.detach().double()}, batch["input_ids"].numel())

    def window_metrics(self, sums: dict[str, float], count: float) -> dict[str, float]:
        return {"train/loss": sums["loss"] / max(1.0, count)}

    def eval_count(self, split, rows, weights) -> float:
        """What an evaluation batch's sums are normalized by: its loss-bearing targets."""
        return float(sum(int(split.loss_tokens[r]) for r, w in zip(rows, weights, strict=True) if w))

    def validation_metrics(self, sums: dict[str, float], count: float) -> dict[str, float | None]:
        """None for a validation split without loss-bearing rows (a small dataset can leave none)."""
        return {"val/loss": sums["loss"] / count if count else None}

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        spec, cfg = self.spec, self.cfg
        stats = self._check_data_fingerprint()
        # With the chat template the data was rendered with (tokenize.chat_template), so that the saved
        # model prompts the way it was trained, whatever template the tokenizer directory carries.
        self.tokenizer = load_tokenizer(spec.tokenizer_dir, stats["settings"]["chat_template"])
        self.train_split, self.val_split = self.load_data(Path(spec.data_dir))
        if cfg.max_steps is not None:
            total_steps = cfg.max_steps
        else:
            total_steps = batching.steps_for_epochs(len(self.train_split), cfg.epochs, cfg.global_batch_size)
        built = engine.build(
            model_cfg=self.model_cfg,
            cfg=cfg,
            file_cfg=json.loads(Path(spec.deepspeed_config).read_text()),
            source=spec.deepspeed_config,
            world=self.world,
            device=self.device,
            dtype=self.dtype,
            tokenizer=self.tokenizer,
            total_steps=total_steps,
            rank=self.rank,
            wrap=self.wrap,
            optimizer=self.trains,
        )
        self.engine = built.engine
        # DeepSpeed's fp32 stage-0 path clips without keeping the norm (engine.clip_fp32_gradients): there
        # get_global_grad_norm() stays None and the trainer computes the norm itself.
        self.ds_grad_norm = hasattr(self.engine.optimizer, "_global_grad_norm")
        start_step = 0
        if self.trains:
            start_step, self.resumed_meta = checkpoint.resume(
                self.engine, self.ckpt_root, rank=self.rank, world=self.world, lora=self.cfg.lora.enabled
            )
        self.order = batching.GlobalOrder(len(self.train_split), cfg.seed)
        name = device_name(self.device)
        self.run = RunSetup(
            spec=spec,
            cfg=cfg,
            rank=self.rank,
            world=self.world,
            placed=self.placed,
            dtype=self.dtype,
            built=built,
            gas=cfg.accumulation_steps(self.world),
            total_steps=total_steps,
            start_step=start_step,
            train_rows=len(self.train_split),
            val_rows=len(self.val_split),
            seq_len=self.seq_len,
            loss_summary=self.describe_loss(built),
            peak_flops=peak_flops(name),
            measured_peak=measured_matmul_flops(name),
        )
        log_start(self.run)

    @property
    def seq_len(self) -> int:
        """Positions of one row (the attention term of the FLOPs per token)."""
        return self.spec.max_length

    def _check_data_fingerprint(self) -> dict:
        """Refuse tokenized data made with other tokenizer files than the ones we load (Axolotl #1265);
        return the data's stats.json."""
        stats = json.loads((Path(self.spec.data_dir) / "stats.json").read_text())
        recorded = stats.get("tokenizer_files_sha256", {})
        actual = {k: v for k, v in sha256_tree(self.spec.tokenizer_dir).items() if k in recorded}
        if recorded and actual != recorded:
            raise RuntimeError(
                f"{self.spec.data_dir} was tokenized with different tokenizer files than {self.spec.tokenizer_dir} "
                f"(recorded {recorded}, found {actual}); delete the tokenized directory and rerun"
            )
        return stats

    # ---- train ---------------------------------------------------------------------------------

    def execute(self, t0: float) -> None:
        """What the rank does once set up: train, save the model, write summary.json."""
        result = self.train()
        saving.save_model(
            self.run, self.engine, self.model_cfg, self.tokenizer, ckpt_root=self.ckpt_root, out=self.out
        )
        summary = self.summary(result, time.perf_counter() - t0)
        if self.rank == 0:
            write_json(Path(self.spec.output_dir) / "summary.json", summary)
            shown = {k: summary.get(k) for k in ("final_train_loss", "final_val_loss", "mfu")}
            log.info("done: %s", json.dumps(shown))

    def before_training(self) -> None:
        """Called once set up, before the first step this process runs (a subclass checks its start)."""

    def train(self) -> TrainResult:
        """Every step from the start (or the resumed) step to the last: the metrics of the last logged step and the
        throughput over the run."""
        run = self.run
        self.before_training()
        self.engine.train()
        # Live metrics go to the run directory, which survives a crash (Snakemake deletes a failed job's
        # outputs); they are copied into the outputs when training ends.
        writer = None
        if self.rank == 0:
            writer = MetricsWriter(
                self.ckpt_root / "metrics.csv", self.ckpt_root / "tb", resume_step=run.start_step
            )
        # The window's meter, and the whole run's after warm-up (for the summary).
        meters = [
            Throughput(run.built.flops_per_token, run.peak_flops, measured=run.measured_peak)
            for _ in range(2)
        ]
        window = _Window()
        self.tokens_seen = self._tokens_before(run.start_step)
        # Resumed from the final checkpoint (a save or merge failed after it): nothing to train, the metrics
        # of the last logged step come from its marker.
        last = dict(self.resumed_meta.get("metrics") or {})
        profiler = profiling.from_env(self.rank, self.device)  # SNAKETUNE_PROFILE=DIR: a trace of a few steps
        gc.collect()  # then freeze: a full collection never walks the imports and model objects again (torchtitan
        gc.freeze()  # does so too): the host bounds the step in backward of the 7B (bench/RESULTS.md)
        t_start = time.perf_counter()
        for step in range(run.start_step, run.total_steps):
            lr, grad_norm = self._step(step, window, meters)
            if profiler:
                profiler.step()
            done = step + 1
            evaluate_now = (
                bool(self.cfg.eval_every and done % self.cfg.eval_every == 0) or done == run.total_steps
            )
            if evaluate_now or done % self.cfg.log_every == 0:
                last = self._log_window(window, meters[0], lr, grad_norm, evaluate=evaluate_now)
                if writer:
                    writer.log(done, last)
                    log_progress(run, done, t_start, last)
            # The last step too: the final weights (adapters) are durable before the model is saved or merged, and
            # a rerun after a failure there resumes at the end instead of retraining since the last checkpoint.
            every = self.cfg.checkpoint_every
            if every and (done % every == 0 or done == run.total_steps):
                self.save_checkpoint(done, {"metrics": last, "perf": meters[1].read(reset=False)})
        if profiler:
            profiler.close()
        if writer:
            writer.close()
            self.out.mkdir(parents=True, exist_ok=True)  # Snakemake makes it; a direct launch may not
            shutil.copyfile(self.ckpt_root / "metrics.csv", self.out / "metrics.csv")
            shutil.copytree(self.ckpt_root / "tb", self.out / "tb", dirs_exist_ok=True)
        perf = meters[1].read(reset=False)
        if run.start_step == run.total_steps:
            perf = dict(self.resumed_meta.get("perf") or perf)
        return TrainResult(last, perf)

    def _step(
        self, step: int, window: _Window, meters: list[Throughput]
    ) -> tuple[float, torch.Tensor | None]:
        """One optimizer step: forward and backward of this rank's micro-batches of global batch `step`, the engine's
        step, the window and the meters updated. Returns the learning rate the step used and, where DeepSpeed keeps
        no gradient norm, the norm."""
        eng = self.engine
        batch_ids = self.order.global_batch(step, self.cfg.global_batch_size)
        normalizer = self.step_normalizer(batch_ids)
        mine = batching.rank_share(batch_ids, self.rank, self.world)
        lr = eng.get_lr()[0]  # the rate this step uses; after engine.step() it is the next step's
        tokens = positions = 0
        grad_norm = None
        t_step = time.perf_counter()
        micros = batching.micro_batches(mine, self.cfg.micro_batch_size)
        for i, micro in enumerate(micros):
            out = self.forward(self.train_split, micro)
            # DeepSpeed divides by the accumulation steps in backward and averages gradients over ranks; this scale
            # makes the net gradient that of (summed loss) / (normalizer of the global batch), whatever the world
            # size and micro-batch size.
            eng.backward(out.loss * (self.run.gas * self.world / normalizer))
            if i == len(micros) - 1 and not self.ds_grad_norm:
                grad_norm = _grad_norm(eng.module)  # averaged over ranks by backward at the boundary
            eng.step()
            window.add(out.sums)
            # Real tokens, pads excluded (a packed row holds several position-0 tokens: count lengths).
            tokens += int(self.train_split.lengths_of(micro).sum())
            positions += out.positions
        if step == self.run.start_step:
            engine.check_optimizer(self.run.built, self.device)  # the states exist from the first step on
        window.count += normalizer
        # Every rank knows the whole global batch: the real tokens of all ranks without a collective.
        self.tokens_seen += int(self.train_split.lengths_of(batch_ids).sum())
        seconds = time.perf_counter() - t_step
        # PaLM's attention term over each conversation's own length (snaketune.model.build.flop_counts).
        attention_flops = self.run.built.attention_coefficient * self.train_split.attention_units(mine)
        for m in meters:
            m.update(
                tokens,
                self.local_loss_units(mine),
                seconds,
                padded=positions,
                attention_flops=attention_flops,
            )
        return lr, grad_norm

    def _tokens_before(self, step: int) -> int:
        """Real tokens of global batches 0 .. step-1 (train/tokens_seen where a resumed run starts)."""
        size = self.cfg.global_batch_size
        return sum(
            int(self.train_split.lengths_of(self.order.global_batch(s, size)).sum()) for s in range(step)
        )

    def _log_window(
        self, window: _Window, meter: Throughput, lr: float, grad_norm, *, evaluate: bool
    ) -> dict[str, float | None]:
        """The metrics of a logged step: the window's (summed over the ranks), then a new window."""
        sums = self._all_reduce(window.sums)
        grad_norm = self.engine.get_global_grad_norm() if self.ds_grad_norm else grad_norm
        retries = alloc_retries(self.device)
        # One collective and one device-to-host sync for the three maxima over the ranks, not one each.
        peak, device_peak, most_retries = self._max_over_ranks(
            peak_memory_gib(self.device), self.placed.peak.peak_gib or 0.0, retries or 0
        )
        last = {
            **self.window_metrics(sums, window.count),
            "train/lr": lr,
            "train/grad_norm": _float(grad_norm),
            "train/tokens_seen": self.tokens_seen,
            **meter.read(),
            "memory/max_allocated_gib": peak,
            # What nvidia-smi shows for the process (NVML, sampled), the figure gpu_memory_gib bounds.
            "memory/device_peak_gib": device_peak or None,
            # The caching allocator's retries so far, the most of any rank (each frees its cache after a device-wide
            # synchronization: the steps where it grows stall); none on CPU.
            "memory/alloc_retries": None if retries is None else int(most_retries),
        }
        window.sums, window.count = {}, 0.0
        if evaluate:
            last.update(self.evaluate())
        return last

    def local_loss_units(self, rows) -> int:
        """Loss-bearing tokens of this rank's rows (perf/loss_tokens_per_s_per_gpu)."""
        return int(self.train_split.loss_tokens[rows].sum())

    def _all_reduce(self, sums: dict[str, torch.Tensor]) -> dict[str, float]:
        """Sum per-rank sums over the ranks: one device-to-host sync per logged step."""
        keys = sorted(sums)
        if not keys:
            return {}
        flat = torch.stack([sums[k].to(self.device, torch.float64) for k in keys])
        dist.all_reduce(flat)
        return dict(zip(keys, flat.tolist(), strict=True))

    def device_batch(self, split, rows) -> dict[str, torch.Tensor]:
        """The rows as the model's inputs on this rank's device (varlen: the packed rows' boundaries too)."""
        return batching.device_batch(
            split, rows, self.pad_id, self.device, varlen=self.run.built.attention == "varlen"
        )

    def describe_loss(self, built: engine.Built) -> str:
        """What computes the objective, as the start of the log and summary.json say it (RunSetup.loss_summary)."""
        if built.loss.fused_cross_entropy:
            return "loss: fused linear cross-entropy"
        kernel = "Triton, gradient in place" if built.loss.loss_kernel == "triton" else "torch"
        return f"loss: logits + cross-entropy ({kernel})"

    @property
    def pad_id(self) -> int:
        return batching.pad_id(self.tokenizer)

    def _max_over_ranks(self, *values: float) -> list[float]:
        """Each value's maximum over the ranks, in one all-reduce."""
        t = torch.tensor(values, device=self.device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.tolist()

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Metrics on the validation split, from every rank's share of it (batching.padded_shard)."""
        self.engine.eval()
        sums = _Window()
        for rows, weights in batching.padded_shard(
            len(self.val_split), self.rank, self.world, self.cfg.micro_batch_size
        ):
            sums.add(self.forward(self.val_split, rows, weights).sums)
            sums.count += self.eval_count(self.val_split, rows, weights)
        total = self._all_reduce({**sums.sums, "_count": torch.tensor(sums.count, dtype=torch.float64)})
        self.engine.train()
        return self.validation_metrics(total, total.pop("_count"))

    # ---- checkpoints and the model ---------------------------------------------------------------

    def checkpoint_meta(self) -> dict:
        """What a run resumed from a checkpoint reports and cannot recompute (DPO: the start check of step 0)."""
        return {}

    def save_checkpoint(self, step: int, state: dict | None = None) -> None:
        """DeepSpeed's checkpoint of this step and the marker with `state`: the metrics of the last logged step and
        the run's throughput so far, what a run resumed at its end reports (snaketune.train.checkpoint.save)."""
        meta = {
            "step": step,
            "world_size": self.world,
            "zero_stage": self.run.stage,
            "run_key": self.spec.run_key,
            "experiment": self.spec.experiment,
            "time": time.time(),
            **self.checkpoint_meta(),
            **(state or {}),
        }
        checkpoint.save(
            self.engine,
            self.ckpt_root,
            step,
            meta,
            rank=self.rank,
            lora=self.cfg.lora.enabled,
            keep=self.cfg.keep_checkpoints,
        )

    def summary(self, result: TrainResult, wall: float) -> dict:
        """summary.json (snaketune.train.summary); a subclass adds what its objective ran."""
        return run_summary(self.run, result, wall)


def _grad_norm(net: torch.nn.Module) -> torch.Tensor:
    """Global L2 norm of the gradients, before clipping (as DeepSpeed's ZeRO optimizers report it)."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in net.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _float(x) -> float | None:
    if x is None:
        return None
    return float(x.item() if torch.is_tensor(x) else x)


if __name__ == "__main__":
    import sys

    ranks.run(sys.argv[1:], Trainer)
