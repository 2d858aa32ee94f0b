"""Stage 5, train: one DeepSpeed rank. `snaketune.launch` starts one process per granted GPU (or CPU rank)
with torchrun; each runs `python -m snaketune.training <run spec JSON>`.

A plain loop over `deepspeed.initialize` (not the HF Trainer, which on CPU silently trains world_size=1
on every rank: ../shared/FACTS.md): construct, setup, train, save; cleanup is guaranteed on error.
"""

from __future__ import annotations

import ctypes
import json
import logging
import math
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from snaketune import attention, batching, checkpoint, gpus
from snaketune.config import ModelConfig, TrainConfig, _build
from snaketune.dsconfig import build_ds_config, offloads, uses_master_weights, zero_stage
from snaketune.io import atomic_dir, sha256_tree, write_json
from snaketune.metrics import (
    MetricsWriter,
    Throughput,
    alloc_retries,
    device_name,
    peak_flops,
    peak_memory_gib,
)
from snaketune.model import LossModel, apply_lora, compile_layers, count_params, flops_per_token, load_model
from snaketune.optim import build_optimizer
from snaketune.tokenization import load_tokenizer

log = logging.getLogger("snaketune.train")


@dataclass(frozen=True)
class RunSpec:
    """Everything a rank needs, written by the launcher as JSON."""

    experiment: str
    model: dict
    train: dict
    data_dir: str
    tokenizer_dir: str
    deepspeed_config: str
    output_dir: str
    checkpoint_dir: str
    max_length: int
    run_key: str

    @classmethod
    def read(cls, path: str | Path) -> RunSpec:
        return cls(**json.loads(Path(path).read_text()))


def lr_lambda(train: TrainConfig, total_steps: int):
    """Linear warmup to the peak, then cosine to min_lr_ratio of it at the last step."""

    def factor(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / train.warmup_steps
        span = max(1, total_steps - train.warmup_steps)
        progress = min(1.0, (step - train.warmup_steps) / span)
        return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


class Trainer:
    def __init__(self, spec: RunSpec):
        self.spec = spec
        self.model_cfg: ModelConfig = _build(ModelConfig, spec.model, "model.")
        self.cfg: TrainConfig = _build(TrainConfig, spec.train, "train.")
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.local_rank = int(os.environ.get("LOCAL_RANK", 0))
        if torch.cuda.is_available():
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
            # gpu_memory_gib: this rank's allocator may use no more, so a large GPU behaves like a smaller one.
            capped = gpus.cap_memory(self.device, gpus.memory_cap_from_env())
            if capped and self.rank == 0:
                log.info("%s", capped)
        else:
            self.device = torch.device("cpu")
        precision = self.cfg.precision
        if precision == "auto":
            precision = "bf16" if self.device.type == "cuda" else "fp32"
        self.dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        self.out = Path(spec.output_dir)
        self.ckpt_root = Path(spec.checkpoint_dir)

    # ---- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        import deepspeed

        spec, cfg = self.spec, self.cfg
        stats = self._check_data_fingerprint()
        # With the chat template the data was rendered with (tokenize.chat_template), so that the saved
        # model prompts the way it was trained, whatever template the tokenizer directory carries.
        self.tokenizer = load_tokenizer(spec.tokenizer_dir, stats["settings"]["chat_template"])
        self.train_split = batching.load_split(Path(spec.data_dir) / "train")
        self.val_split = batching.load_split(Path(spec.data_dir) / "validation")
        self.gas = cfg.accumulation_steps(self.world)
        if cfg.max_steps is not None:
            self.total_steps = cfg.max_steps
        else:
            self.total_steps = batching.steps_for_epochs(
                len(self.train_split), cfg.epochs, cfg.global_batch_size
            )

        file_cfg = json.loads(Path(spec.deepspeed_config).read_text())
        self.master_weights = uses_master_weights(
            file_cfg, cfg.bf16_optimizer, bf16=self.dtype == torch.bfloat16
        )
        self.ds_config = build_ds_config(
            file_cfg,
            cfg,
            world_size=self.world,
            bf16=self.dtype == torch.bfloat16,
            source=spec.deepspeed_config,
            master_weights=self.master_weights,
        )
        self.stage = zero_stage(self.ds_config)
        self.fused_ce = cfg.fused_cross_entropy and self.stage != 3
        self.attention = attention.resolve(cfg.attention, self.device, self.dtype)
        if cfg.lora.enabled and self.stage == 3:
            raise ValueError(
                f"train.lora.enabled with ZeRO stage 3 ({spec.deepspeed_config}) is not supported yet: "
                "use config/deepspeed/zero2.json or zero0.json for LoRA"
            )
        net = load_model(
            self.model_cfg,
            vocab_size=len(self.tokenizer),
            bos_token_id=self.tokenizer.bos_token_id,
            eos_token_id=self.tokenizer.eos_token_id,
            dtype=self.dtype,
            seed=cfg.seed,
            device=self.device,
            # ZeRO-3 partitions big models while they are built (the tiny one is cheaper to build whole).
            zero_init_config=self.ds_config
            if self.stage == 3 and self.model_cfg.base != "builtin-tiny"
            else None,
        )
        if cfg.gradient_checkpointing:
            net.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            net.config.use_cache = False
        if cfg.lora.enabled:
            if cfg.gradient_checkpointing:
                net.enable_input_require_grads()
            # With fp32 masters in the optimizer the adapters compute in bf16 like the rest of the model;
            # peft's default fp32 adapters would cast every adapted layer's input to fp32 (measured: +13 GiB
            # of activations and 5% slower for LoRA r16 on all linear layers of the 7B, 8 x 512).
            net = apply_lora(net, cfg.lora, fp32_adapters=not self.master_weights)
        self.n_params, self.n_trainable = count_params(net)
        self.flops_per_token = flops_per_token(net, spec.max_length, lora=cfg.lora.enabled)
        if cfg.compile:
            compile_layers(net)
        torch.manual_seed(cfg.seed + self.rank)  # dropout differs per rank, deterministic per run

        model = LossModel(net, packed_attention=self.attention == "varlen", fused_cross_entropy=self.fused_ce)
        optimizer = build_optimizer(
            model,
            lr=cfg.learning_rate,
            betas=cfg.adam_betas,
            weight_decay=cfg.weight_decay,
            device=self.device,
            master_weights=self.master_weights,
            grad_clip=cfg.grad_clip,
            kernel=cfg.optimizer_kernel,
            offload=offloads(self.ds_config),
        )
        schedule = lr_lambda(cfg, self.total_steps)
        self.engine, _, _, _ = deepspeed.initialize(
            model=model,
            optimizer=optimizer,
            lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, schedule),
            config=self.ds_config,
        )
        if self.world == 1 and self.stage == 0:
            # One rank has nothing to all-reduce; DeepSpeed would still flatten every gradient into buckets
            # and copy it back after a one-rank all-reduce (two passes over the gradients per step).
            self.engine.enable_backward_allreduce = False
        # DeepSpeed's fp32 stage-0 path clips without keeping the norm (engine.clip_fp32_gradients): there
        # get_global_grad_norm() stays None and the trainer computes the norm itself.
        self.ds_grad_norm = hasattr(self.engine.optimizer, "_global_grad_norm")
        self.start_step = self._resume()
        self.order = batching.GlobalOrder(len(self.train_split), cfg.seed)
        self.peak = peak_flops(device_name(self.device))
        self._print_plan()

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

    def _resume(self) -> int:
        removed = checkpoint.remove_incomplete(self.ckpt_root) if self.rank == 0 else []
        for d in removed:
            log.warning("discarding incomplete checkpoint %s (the process died while writing it)", d)
        dist.barrier()
        found = checkpoint.latest(self.ckpt_root)
        if found is None:
            return 0
        step, path = found
        meta = checkpoint.read_marker(path)
        if meta.get("world_size") != self.world:
            raise RuntimeError(
                f"checkpoint {path} was written by {meta.get('world_size')} ranks but {self.world} were granted; "
                f"rerun with --resources gpu={meta.get('world_size')} to resume, or delete {self.ckpt_root} to restart"
            )
        try:
            load_path, _ = self.engine.load_checkpoint(str(self.ckpt_root), tag=path.name)
            checkpoint.load_rng(path, self.rank)
        except Exception as e:  # a truncated file, a foreign pickle refused by weights_only, a shape mismatch
            raise RuntimeError(
                f"checkpoint {path} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0]}); "
                f"delete {path} to resume from an older checkpoint, or {self.ckpt_root} to restart"
            ) from e
        if load_path is None:
            raise RuntimeError(
                f"checkpoint {path} could not be loaded; delete it to fall back to an older one"
            )
        if self.rank == 0:
            log.info("resuming from checkpoint %s at step %d of %d", path, step, self.total_steps)
        return step

    def _print_plan(self) -> None:
        if self.rank != 0:
            return
        cfg = self.cfg
        tokens_per_step = cfg.global_batch_size * self.spec.max_length
        log.info(
            "device: %s x %d (%s), precision %s, ZeRO stage %d",
            device_name(self.device),
            self.world,
            self.device.type,
            self.dtype,
            self.stage,
        )
        log.info("parameters: %s total, %s trainable", f"{self.n_params:,}", f"{self.n_trainable:,}")
        log.info(
            "fp32 master weights: %s; loss: %s; attention: %s; torch.compile: %s",
            self.precision_summary,
            "fused linear cross-entropy" if self.fused_ce else "logits + cross-entropy",
            self.attention_summary,
            "every decoder layer" if cfg.compile else "off",
        )
        if cfg.fused_cross_entropy and not self.fused_ce:
            log.info("train.fused_cross_entropy is not used under ZeRO-3 (its lm_head weight is partitioned)")
        log.info(
            "global batch %d = micro-batch %d x %d ranks x %d accumulation",
            cfg.global_batch_size,
            cfg.micro_batch_size,
            self.world,
            self.gas,
        )
        log.info(
            "tokens per optimizer step (at most): %s; steps: %d; train rows: %d; validation rows: %d",
            f"{tokens_per_step:,}",
            self.total_steps,
            len(self.train_split),
            len(self.val_split),
        )

    # ---- train ---------------------------------------------------------------------------------

    def train(self) -> dict:
        cfg, engine = self.cfg, self.engine
        # Live metrics go to the run directory, which survives a crash (Snakemake deletes a failed job's
        # outputs); they are copied into the outputs when training ends.
        writer = None
        if self.rank == 0:
            writer = MetricsWriter(
                self.ckpt_root / "metrics.csv", self.ckpt_root / "tb", resume_step=self.start_step
            )
        meter = Throughput(self.flops_per_token, self.peak)
        run_meter = Throughput(self.flops_per_token, self.peak)  # whole run after warm-up, for the summary
        window_loss = torch.zeros((), device=self.device, dtype=torch.float64)
        window_tokens = 0
        t_start = time.perf_counter()
        last = {}
        for step in range(self.start_step, self.total_steps):
            batch_ids = self.order.global_batch(step, cfg.global_batch_size)
            global_tokens = max(1, int(self.train_split.loss_tokens[batch_ids].sum()))
            mine = batching.rank_share(batch_ids, self.rank, self.world)
            lr = engine.get_lr()[0]  # the rate this step uses; after engine.step() it is the next step's
            tokens = padded = 0
            t_step = time.perf_counter()
            micros = batching.micro_batches(mine, cfg.micro_batch_size)
            for i, micro in enumerate(micros):
                batch = self._batch(self.train_split, micro)
                loss_sum = self._loss_sum(batch)
                # DeepSpeed divides by the accumulation steps in backward and averages gradients over ranks;
                # this scale makes the net gradient that of (sum of token losses) / (loss tokens in the
                # global batch), whatever the world size and micro-batch size.
                engine.backward(loss_sum * (self.gas * self.world / global_tokens))
                if i == len(micros) - 1 and not self.ds_grad_norm:
                    grad_norm = _grad_norm(engine.module)  # averaged over ranks by backward at the boundary
                engine.step()
                window_loss += loss_sum.detach().double()
                # Real tokens, pads excluded (a packed row holds several position-0 tokens: count lengths).
                tokens += sum(len(self.train_split.input_ids[row]) for row in micro)
                padded += batch["input_ids"].numel()
            window_tokens += global_tokens
            local_loss_tokens = int(self.train_split.loss_tokens[mine].sum())
            step_seconds = time.perf_counter() - t_step
            meter.update(tokens, local_loss_tokens, step_seconds, padded=padded)
            run_meter.update(tokens, local_loss_tokens, step_seconds, padded=padded)
            done = step + 1
            evaluate_now = bool(cfg.eval_every and done % cfg.eval_every == 0) or done == self.total_steps
            if evaluate_now or done % cfg.log_every == 0:
                # Device-to-host sync: one all-reduce per logged step, not per micro-batch.
                dist.all_reduce(window_loss)
                last = {
                    "train/loss": window_loss.item() / max(1, window_tokens),
                    "train/lr": lr,
                    "train/grad_norm": _float(
                        engine.get_global_grad_norm() if self.ds_grad_norm else grad_norm
                    ),
                    "train/tokens_seen": done * cfg.global_batch_size * self.spec.max_length,
                    **meter.read(),
                    "memory/max_allocated_gib": self._max_over_ranks(peak_memory_gib(self.device)),
                }
                window_loss.zero_()
                window_tokens = 0
                if evaluate_now:
                    last["val/loss"] = self.evaluate()
                if writer:
                    writer.log(done, last)
                    self._progress(done, t_start, last)
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0 and done < self.total_steps:
                self.save_checkpoint(done)
        if writer:
            writer.close()
            self.out.mkdir(parents=True, exist_ok=True)  # Snakemake makes it; a direct launch may not
            shutil.copyfile(self.ckpt_root / "metrics.csv", self.out / "metrics.csv")
            shutil.copytree(self.ckpt_root / "tb", self.out / "tb", dirs_exist_ok=True)
        self.run_perf = run_meter.read(reset=False)
        return last

    def _batch(self, split: batching.TokenizedSplit, rows) -> dict[str, torch.Tensor]:
        """A micro-batch on the device; with varlen attention also the conversations' boundaries."""
        cpu = batching.collate(split, rows, self.pad_id)
        batch = {k: v.to(self.device, non_blocking=True) for k, v in cpu.items()}
        if self.attention == "varlen":
            lengths = [len(split.input_ids[r]) for r in rows]
            batch["cu_seqlens"] = attention.segments(cpu["position_ids"], lengths).to(self.device)
        return batch

    def _loss_sum(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return self.engine(**batch)

    @property
    def precision_summary(self) -> str:
        if self.dtype != torch.bfloat16:
            return "none (fp32 weights)"
        if not self.master_weights:
            return "DeepSpeed"
        return f"snaketune.optim.MasterWeightAdamW ({self.engine.optimizer.kernel} kernel)"

    @property
    def attention_summary(self) -> str:
        if self.attention == "sdpa":
            return "SDPA with a block-diagonal mask"
        if attention.kernel_available(self.device, self.dtype):
            return "FlashAttention varlen (torch.nn.attention.varlen)"
        return "varlen boundaries, block-masked SDPA (no varlen kernel on this device)"

    @property
    def pad_id(self) -> int:
        return (
            self.tokenizer.pad_token_id
            if self.tokenizer.pad_token_id is not None
            else self.tokenizer.eos_token_id
        )

    def _max_over_ranks(self, value: float) -> float:
        t = torch.tensor([value], device=self.device, dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return t.item()

    def _progress(self, done: int, t_start: float, m: dict) -> None:
        elapsed = time.perf_counter() - t_start
        eta = elapsed / max(1, done - self.start_step) * (self.total_steps - done)
        parts = [f"step {done}/{self.total_steps}", f"loss {m['train/loss']:.4f}"]
        if "val/loss" in m:
            parts.append(f"val {m['val/loss']:.4f}")
        parts.append(f"lr {m['train/lr']:.2e}")
        if m.get("perf/tokens_per_s_per_gpu"):
            parts.append(f"{m['perf/tokens_per_s_per_gpu']:,.0f} tok/s/rank")
        if m.get("perf/mfu"):
            parts.append(f"MFU {m['perf/mfu']:.3f}")
        parts.append(f"ETA {eta:,.0f}s")
        log.info(" | ".join(parts))

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-weighted mean loss on the validation split. Every rank runs the same number of forward
        passes (ZeRO-3 gathers parameters collectively): ranks with fewer rows repeat row 0 at weight 0."""
        self.engine.eval()
        n = len(self.val_split)
        per_rank = math.ceil(n / self.world)
        ids = list(range(self.rank * per_rank, min(n, (self.rank + 1) * per_rank)))
        weights = [1.0] * len(ids) + [0.0] * (per_rank - len(ids))
        ids += [0] * (per_rank - len(ids))
        total = torch.zeros(2, device=self.device, dtype=torch.float64)
        mb = self.cfg.micro_batch_size
        for i in range(0, per_rank, mb):
            chunk = ids[i : i + mb]
            batch = self._batch(self.val_split, chunk)
            for row, w in enumerate(weights[i : i + mb]):
                if w == 0.0:
                    batch["labels"][row] = batching.IGNORE
            loss_sum = self._loss_sum(batch)
            targets = batch["labels"][:, 1:].ne(batching.IGNORE) & batch["position_ids"][:, 1:].ne(0)
            total += torch.stack([loss_sum.double(), targets.sum().double()])
        dist.all_reduce(total)
        self.engine.train()
        return (total[0] / total[1].clamp(min=1)).item()

    def save_checkpoint(self, step: int) -> None:
        tag = checkpoint.tag_for(step)
        self.engine.save_checkpoint(
            str(self.ckpt_root), tag=tag, client_state={"step": step}, save_latest=False
        )
        checkpoint.save_rng(self.ckpt_root / tag, self.rank)
        dist.barrier()
        if self.rank == 0:
            checkpoint.mark_complete(
                self.ckpt_root / tag,
                {
                    "step": step,
                    "world_size": self.world,
                    "zero_stage": self.stage,
                    "run_key": self.spec.run_key,
                    "experiment": self.spec.experiment,
                    "time": time.time(),
                },
            )
            checkpoint.prune(self.ckpt_root, self.cfg.keep_checkpoints)
            log.info("checkpoint %s complete", self.ckpt_root / tag)
        dist.barrier()

    # ---- save ----------------------------------------------------------------------------------

    def save_model(self) -> None:
        """HF layout in output_dir/model: safetensors, config, tokenizer with chat template; for LoRA the
        merged model there and the adapter in model/adapter/."""
        self.engine.module.restore_attention()
        module = self.engine.module.net
        # Collective under ZeRO-3: every rank takes part in gathering the partitioned weights.
        state = self.engine._zero3_consolidated_16bit_state_dict() if self.stage == 3 else None
        if state is not None:  # keys of the LossModel wrapper: "net.<the model's own key>"
            state = {k.removeprefix("net."): v for k, v in state.items()}
        if self.rank == 0:
            with atomic_dir(self.out / "model") as tmp:
                if self.cfg.lora.enabled:
                    module.save_pretrained(tmp / "adapter", safe_serialization=True)
                    merged = module.merge_and_unload()
                    merged.save_pretrained(tmp, safe_serialization=True)
                else:
                    module.save_pretrained(tmp, state_dict=state, safe_serialization=True)
                self.tokenizer.save_pretrained(tmp)
        dist.barrier()

    def summary(self, last: dict, wall: float) -> dict:
        mem = [None] * self.world
        dist.all_gather_object(mem, peak_memory_gib(self.device))
        retries = [None] * self.world
        dist.all_gather_object(retries, alloc_retries(self.device))
        return {
            "experiment": self.spec.experiment,
            "steps": self.total_steps,
            "resumed_from_step": self.start_step,
            "world_size": self.world,
            "device": device_name(self.device),
            "precision": str(self.dtype).removeprefix("torch."),
            "zero_stage": self.stage,
            "deepspeed_config": self.spec.deepspeed_config,
            "global_batch_size": self.cfg.global_batch_size,
            "micro_batch_size": self.cfg.micro_batch_size,
            "gradient_accumulation_steps": self.gas,
            "parameters": self.n_params,
            "trainable_parameters": self.n_trainable,
            "lora": self.cfg.lora.enabled,
            "fp32_master_weights": self.precision_summary,
            "fused_cross_entropy": self.fused_ce,
            "attention": self.attention_summary,
            "compile": self.cfg.compile,
            "final_train_loss": last.get("train/loss"),
            "final_val_loss": last.get("val/loss"),
            # Over every step after the first two of this process (warm-up), not just the last window.
            "tokens_per_s_per_gpu": self.run_perf.get("perf/tokens_per_s_per_gpu"),
            "loss_tokens_per_s_per_gpu": self.run_perf.get("perf/loss_tokens_per_s_per_gpu"),
            "padded_tokens_per_s_per_gpu": self.run_perf.get("perf/padded_tokens_per_s_per_gpu"),
            "step_time_s": self.run_perf.get("perf/step_time_s"),
            "mfu": self.run_perf.get("perf/mfu"),
            "peak_memory_gib_per_rank": mem,
            # cudaMalloc retries after freeing the allocator's cache: each one stalls a step (a full card).
            "cuda_alloc_retries_per_rank": retries,
            "wall_time_s": wall,
            "seed": self.cfg.seed,
            "run_key": self.spec.run_key,
        }


def _grad_norm(net: torch.nn.Module) -> torch.Tensor:
    """Global L2 norm of the gradients, before clipping (as DeepSpeed's ZeRO optimizers report it)."""
    norms = [torch.linalg.vector_norm(p.grad.float()) for p in net.parameters() if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def _float(x) -> float | None:
    if x is None:
        return None
    return float(x.item() if torch.is_tensor(x) else x)


def _die_with_parent() -> None:
    """torchrun starts ranks in sessions of their own (start_new_session=True), so a SIGKILL of Snakemake's
    process group would leave them training and writing into results/. Ask Linux to SIGKILL this rank
    when its parent (the torchrun agent) dies; if it already has, stop now."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def _safe_checkpoint_loading() -> None:
    """DeepSpeed's resume calls torch.load(weights_only=False): a file planted in results/checkpoints/ could run
    code. Force weights_only for every torch.load of this rank and allow the only non-tensor classes that
    DeepSpeed's checkpoints hold (found by loading every file of ZeRO-0, -2, -3 and LoRA checkpoints with
    weights_only=True; tests/test_security.py resumes from a planted pickle)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    torch.serialization.add_safe_globals([LossScaler, ZeroStageEnum, fragment_address])


def main(argv: list[str]) -> int:
    _die_with_parent()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s rank%(rank)s %(levelname)s %(message)s", stream=sys.stdout
    )
    rank = os.environ.get("RANK", "0")
    old_factory = logging.getLogRecordFactory()

    def factory(*args, **kwargs):
        record = old_factory(*args, **kwargs)
        record.rank = rank
        return record

    logging.setLogRecordFactory(factory)
    spec = RunSpec.read(argv[0])
    import deepspeed

    _safe_checkpoint_loading()
    t0 = time.perf_counter()
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo")
    try:
        trainer = Trainer(spec)
        trainer.setup()
        last = trainer.train()
        trainer.save_model()
        summary = trainer.summary(last, time.perf_counter() - t0)
        if trainer.rank == 0:
            write_json(Path(spec.output_dir) / "summary.json", summary)
            log.info(
                "done: %s", json.dumps({k: summary[k] for k in ("final_train_loss", "final_val_loss", "mfu")})
            )
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
