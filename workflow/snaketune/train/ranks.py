"""A training rank's process (snaketune.train.trainer, snaketune.preference.dpo and .reference run it): what it
reads (`RunSpec`, written by the launcher), what it does first (die with its launcher, log with its rank, load
checkpoints without running code) and `run`: set up, execute, tear the process group down."""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

import torch
import torch.distributed as dist

from snaketune import device_memory, host_heap

log = logging.getLogger("snaketune.train")


def start() -> None:
    """Call once, first thing in a rank."""
    die_with_parent()
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
    safe_checkpoint_loading()


def die_with_parent() -> None:
    """torchrun starts ranks in sessions of their own (start_new_session=True), so a SIGKILL of Snakemake's
    process group would leave them training and writing into results/. Ask Linux to SIGKILL this rank
    when its parent (the torchrun agent) dies; if it already has, stop now."""
    if sys.platform != "linux":
        return
    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() == 1:
        os._exit(1)


def safe_checkpoint_loading() -> None:
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
    preference: dict | None = None
    """The preference stage's settings (snaketune.preference.dpo); None for supervised fine-tuning."""

    @classmethod
    def read(cls, path: str | Path) -> RunSpec:
        return cls(**json.loads(Path(path).read_text()))


@dataclass
class RankDevice:
    """Where a rank computes, and what it measures of the device's memory (snaketune.device_memory)."""

    device: torch.device
    budget: dict
    """What the allocator was capped at and what lay outside it (device_memory.cap_allocator); {} on the CPU."""
    peak: device_memory.PeakSampler
    """The process's device memory as NVML samples it while the rank runs."""


def rank_device(local_rank: int, *, in_backward: bool, verbose: bool) -> RankDevice:
    """The rank's GPU, set up before its first allocation: the allocator's settings (the step in backward frees each
    gradient as it goes), what lies outside the allocator started and measured, and the allocator capped so that
    the process stays within gpu_memory_gib, the card's memory; the CPU where there is no GPU. `verbose`: log what
    was set (rank 0)."""
    if not torch.cuda.is_available():
        host_heap.keep_freed_memory()  # every step's tensors in the heap's pages (snaketune.host_heap)
        return RankDevice(torch.device("cpu"), {}, device_memory.PeakSampler(None))
    torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank)
    card = device_memory.card_from_env()
    settings = device_memory.allocator_settings(in_backward or card is not None)
    device_memory.set_allocator(device, settings)
    nvml = device_memory.device_memory(device)
    # NCCL's buffers come with the first collective (also with one rank: the metrics are all-reduced).
    device_memory.warm_up(device, distributed=True)
    capped, budget = device_memory.cap_allocator(device, card, nvml)
    if settings:
        budget["allocator_settings"] = settings
        if verbose:
            why = (
                "the step in backward frees each gradient as it goes"
                if in_backward
                else "under gpu_memory_gib"
            )
            log.info("caching allocator: %s (%s)", settings, why)
    if capped and verbose:
        log.info("%s", capped)
    return RankDevice(device, budget, device_memory.PeakSampler(nvml))


def run(argv: list[str], trainer_cls: type) -> NoReturn:
    """One rank: set up and execute (train, save the model and summary.json); the process group is always torn
    down. A rank that succeeded leaves through `exit_unfinalized`; an exception propagates (Python prints it)."""
    spec = RunSpec.read(argv[0])
    start()
    import deepspeed

    t0 = time.perf_counter()
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if os.environ.get("WORLD_SIZE") == "1" and backend == "gloo":
        # One CPU rank: an in-process store, no TCP rendezvous. The free port the launcher picked (single_rank_env)
        # and this process bound seconds later, after its imports, was taken in between by another process once (a
        # CI run with trainings in parallel: EADDRINUSE). DeepSpeed then adopts the initialized group. Not yet for
        # NCCL: a GPU rank with this store has not been run (on a GPU the port stays, as measured so far).
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    deepspeed.init_distributed(dist_backend=backend)
    try:
        trainer = trainer_cls(spec)
        trainer.setup()
        trainer.execute(t0)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    exit_unfinalized(0)


def exit_unfinalized(code: int) -> NoReturn:
    """Leave the process as Python would (the atexit handlers: logging's flush, multiprocessing's and the compile
    workers' shutdown, filelock's release...), but without finalizing the interpreter.

    Why: destroy_process_group empties torch's registry of process groups, but other references (DeepSpeed's
    communication backend keeps its groups) hold them alive, so their gloo worker threads live on. Under ZeRO-3 one
    of them can still be finishing an all-gather when the interpreter finalizes; freeing the work's tensors (ZeRO's
    parameters carry Python attributes) then takes the GIL, which Python answers with pthread_exit in a thread whose
    frames cannot unwind: std::terminate, SIGABRT, after the outputs were written ("terminate called without an
    active exception"; core dump: the worker in ~AsyncAllgatherWork -> TensorImpl::decref_pyobject -> take_gil while
    the main thread is in Py_FinalizeEx). How often, before and after this exit, and torch's abandoned fix:
    docs/facts.md, "DeepSpeed and PyTorch on CPU ranks"."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # closed or broken: nothing more can be written anyway
            stream.flush()
    os._exit(code)
