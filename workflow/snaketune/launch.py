"""Launcher of the train stage: one torchrun process group, one rank per granted GPU.

Snakemake's `gpu` resource is a counter (../shared/FACTS.md): the rule learns how many GPUs it was
granted from `{resources.gpu}`, which can be less than train.gpus when the command line gives less.
Without CUDA the ranks run on CPU over gloo, so the embedded default trains with real DeepSpeed ranks.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

log = logging.getLogger(__name__)

PACKAGE_ROOT = Path(__file__).resolve().parent.parent


class LaunchError(RuntimeError):
    pass


def world_size(granted: int, *, cuda_devices: int) -> int:
    """Ranks to start: the granted GPUs on a CUDA machine; on a CPU-only machine as many CPU ranks."""
    if cuda_devices > 0:
        if granted < 1:
            raise LaunchError(
                f"0 GPUs were granted to the train rule on a machine with {cuda_devices} CUDA device(s); "
                "run with --resources gpu=N (N >= 1), or set train.gpus"
            )
        if granted > cuda_devices:
            raise LaunchError(
                f"{granted} GPUs were granted but only {cuda_devices} are visible "
                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', '<unset>')}); "
                f"lower train.gpus or --resources gpu= to at most {cuda_devices}"
            )
        return granted
    return max(1, granted)


def launch(spec: dict, spec_path: str | Path, *, granted: int, log_file: str | Path, threads: int) -> None:
    """Write the run spec and run torchrun; rank output is appended to log_file."""
    import torch

    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = world_size(granted, cuda_devices=cuda_devices)
    spec_path = Path(spec_path)
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=2, sort_keys=True))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    if cuda_devices == 0:
        # CPU ranks share the cores Snakemake granted; oversubscribed OpenMP threads slow gloo to a crawl.
        env["OMP_NUM_THREADS"] = str(max(1, threads // nproc))
        log.info(
            "no CUDA device: %d CPU rank(s) over gloo, %s OpenMP thread(s) each",
            nproc,
            env["OMP_NUM_THREADS"],
        )
    else:
        log.info("%d rank(s) on %d visible CUDA device(s)", nproc, cuda_devices)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        "-m",
        "snaketune.training",
        str(spec_path),
    ]
    log.info("launching: %s", " ".join(cmd))
    with open(log_file, "a") as out:
        out.flush()
        proc = subprocess.run(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False)
    if proc.returncode != 0:
        raise LaunchError(f"training failed (torchrun exit code {proc.returncode}); see {log_file}")
