"""Starting a training's rank processes: one per granted GPU (or CPU rank), under torchrun, directly for one rank,
or through srun on every node of a SLURM job.

Snakemake's `gpu` resource is a counter (docs/facts.md, "Snakemake"): the rule learns how many GPUs it was granted
from `{resources.gpu}`, which can be less than train.gpus when the command line gives less. Without CUDA the ranks
run on CPU over gloo, so the embedded default trains with real DeepSpeed ranks.

Inside a SLURM job the allocation decides instead: one rank per GPU SLURM gave the node (its CUDA_VISIBLE_DEVICES),
and with train.nodes > 1 one torchrun per node, started by srun (`python -m snaketune.train.processes`, `node_main`),
meeting at a c10d rendezvous on the first node (`snaketune.train.hosts`).

Which GPUs: on one node the launcher locks as many of the GPUs it may use as it starts ranks (`snaketune.gpus`),
gives torchrun exactly those as CUDA_VISIBLE_DEVICES and holds them until torchrun exits, so that jobs running at
once never share a GPU. Before starting it checks the memory plan against those GPUs
(`snaketune.plan.apply.check_devices`), passes gpu_memory_gib on as a per-rank allocator cap, and sets
NCCL_P2P_DISABLE=1 where the GPUs cannot reach each other's memory.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import subprocess
import sys
from pathlib import Path

from snaketune import device_memory, gpus
from snaketune.plan.apply import check_devices
from snaketune.plan.budget import host_memory_gib
from snaketune.train import hosts
from snaketune.train.failures import failure_cause

log = logging.getLogger("snaketune.train.launch")

PACKAGE_ROOT = Path(__file__).resolve().parent.parent.parent
"""The directory that holds this snaketune package (workflow/): first on the ranks' PYTHONPATH, so that they run
the code of the workflow that launched them, not another copy installed in the environment."""


def rank_pythonpath(environ: dict[str, str]) -> str:
    """PYTHONPATH for the ranks: PACKAGE_ROOT, then the caller's."""
    return os.pathsep.join([str(PACKAGE_ROOT), environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)


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


def usable_cores() -> int:
    """Cores this process may run on; a SLURM node or a fake one can advertise more than exist."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _cpu_threads(env: dict, threads: int, nproc: int) -> None:
    # CPU ranks share the cores Snakemake granted; oversubscribed OpenMP threads slow gloo to a crawl.
    env["OMP_NUM_THREADS"] = str(max(1, min(threads, usable_cores()) // nproc))


def assign_gpus(
    pool: gpus.Candidates | None, nproc: int, *, experiment: str, plan: dict | None
) -> tuple[gpus.Allocation, dict[str, str]]:
    """Lock `nproc` of the pool's GPUs for the ranks (waiting while other jobs hold them) and return the
    environment the ranks get: CUDA_VISIBLE_DEVICES, the memory cap, NCCL_P2P_DISABLE where needed.
    Raises LaunchError, with the GPUs released, when the memory plan does not fit them."""
    label = f"train {experiment}"
    if pool is None or not pool.ids:
        return gpus.Allocation((), pool or gpus.Candidates((), (), "none"), label=label), {}
    try:
        alloc = gpus.allocate(nproc, label=label, pool=pool)
    except gpus.GpuError as e:
        raise LaunchError(str(e)) from None
    env = alloc.env()
    if alloc.fake:
        return alloc, env
    try:
        positions = [pool.position(i) for i in alloc.ids]
        devices = gpus.cuda_devices(positions)
        fits, line = check_devices(
            plan,
            world=nproc,
            device_gib=min(d.total_gib for d in devices),
            host_gib=host_memory_gib(),
        )
        log.info(line)
        if not fits:
            raise LaunchError(line)
        if plan and plan.get("gpu_memory_gib"):
            env[device_memory.ENV_MEMORY_CAP] = str(plan["gpu_memory_gib"])
        p2p, why = gpus.nccl_p2p_env([d.name for d in devices], gpus.peer_access(positions))
        if why:
            log.info("%s", why)
        env.update(p2p)
    except BaseException:
        alloc.release()
        raise
    return alloc, env


def single_rank_env() -> dict[str, str]:
    """What `torchrun --standalone --nproc_per_node=1` gives its one rank: rank and world, and a free local port
    for a rendezvous (a CPU rank uses an in-process store instead: snaketune.train.ranks.run; the address
    stays for libraries that read it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_WORLD_SIZE": "1",
        "GROUP_RANK": "0",
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def launch(
    spec: dict,
    spec_path: str | Path,
    *,
    granted: int,
    log_file: str | Path,
    threads: int,
    nodes: int = 1,
    plan: dict | None = None,
    module: str = "snaketune.train.trainer",
) -> None:
    """Write the run spec and run torchrun (through srun on every node when nodes > 1); rank output is
    appended to log_file. `plan` is the plan rule's results/plan/<experiment>.json, checked against the GPUs.
    `module` is what each rank runs (`python -m module <spec>`): snaketune.train.trainer, snaketune.preference.dpo or
    snaketune.preference.reference. One rank on one node runs without torchrun's agent (1.8 s less per job), with
    the environment torchrun would give it."""
    cuda_devices = gpus.cuda_device_count()
    slurm = _slurm(nodes)
    if slurm is not None and slurm.gpus:
        granted = len(slurm.gpus)  # SLURM's allocation, not Snakemake's counter
    # A job of several nodes runs on SLURM's whole nodes; on one node the GPUs are locked (snaketune.gpus).
    pool = gpus.candidates(count=cuda_devices) if nodes == 1 else None
    if pool is not None and pool.ids:
        nproc = world_size(granted, cuda_devices=len(pool.ids))
        if pool.fake:
            cuda_devices = 0  # fake GPUs (tests): the ranks run on CPU
    else:
        nproc = world_size(granted, cuda_devices=cuda_devices)
    spec_path = Path(spec_path)
    spec_path.parent.mkdir(parents=True, exist_ok=True)
    spec_path.write_text(json.dumps(spec, indent=2, sort_keys=True))
    alloc, env = _environment(pool, nproc, cuda_devices, threads, experiment=spec["experiment"], plan=plan)
    if nodes > 1:
        # One launcher per node (`node_main` below); each counts its own node's GPUs.
        node_args = [
            f"--nnodes={nodes}",
            f"--granted={granted}",
            f"--threads={threads}",
            f"--module={module}",
        ]
        node_main_module = ["-m", "snaketune.train.processes", *node_args]
        cmd = [*hosts.srun_command(slurm.job_id, nodes), sys.executable, *node_main_module]
        env = hosts.srun_env(env)
    elif nproc == 1:
        cmd = [sys.executable, "-m", module]
        env.update(single_rank_env())
    else:
        torchrun = ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        cmd = [sys.executable, *torchrun, "-m", module]
    launcher = "torchrun" if nproc > 1 or nodes > 1 else "rank"
    _run([*cmd, str(spec_path)], env, alloc, log_file, launcher)


def _environment(
    pool: gpus.Candidates | None,
    nproc: int,
    cuda_devices: int,
    threads: int,
    *,
    experiment: str,
    plan: dict | None,
) -> tuple[gpus.Allocation, dict[str, str]]:
    """The ranks' GPUs, locked (`assign_gpus`), and their environment: this process's, the package first on the
    PYTHONPATH, the GPUs and their memory cap, or on CPU ranks the OpenMP threads each may use."""
    env = dict(os.environ)
    env["PYTHONPATH"] = rank_pythonpath(env)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    alloc, gpu_env = assign_gpus(pool, nproc, experiment=experiment, plan=plan)
    env.update(gpu_env)
    if cuda_devices == 0:
        _cpu_threads(env, threads, nproc)
        log.info(
            "no CUDA device: %d CPU rank(s) over gloo, %s OpenMP thread(s) each",
            nproc,
            env["OMP_NUM_THREADS"],
        )
    else:
        log.info("%d rank(s) on %d visible CUDA device(s)", nproc, cuda_devices)
    return alloc, env


def _slurm(nodes: int) -> hosts.Allocation | None:
    """The SLURM job this runs in (None outside one); LaunchError where `nodes` > 1 and the job has not that many."""
    slurm = hosts.Allocation.from_env(os.environ)
    if slurm is not None:
        log.info(
            "%s (CUDA_VISIBLE_DEVICES=%s)",
            slurm.describe(),
            os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
        )
    if nodes > 1:
        if slurm is None:
            raise LaunchError(
                f"train.nodes={nodes} needs a SLURM job of {nodes} nodes: run with --profile workflow/profiles/slurm"
            )
        if len(slurm.hosts) != nodes:
            raise LaunchError(
                f"train.nodes={nodes} but SLURM job {slurm.job_id} has {len(slurm.hosts)} node(s): "
                f"{', '.join(slurm.hosts)}"
            )
    return slurm


def _run(cmd: list[str], env: dict, alloc: gpus.Allocation, log_file: str | Path, launcher: str) -> None:
    """Run `cmd` with its output appended to `log_file`, holding `alloc`'s GPUs until it exits; LaunchError with the
    cause its output gives where it fails."""
    log.info("launching: %s", " ".join(cmd))
    # The GPUs stay locked until torchrun exits; torchrun holds the locks too, in case this process dies first.
    with alloc, open(log_file, "a") as out:
        out.flush()
        start = out.tell()
        proc = subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False, pass_fds=tuple(alloc.fds)
        )
    if proc.returncode != 0:
        with open(log_file, errors="replace") as f:
            f.seek(start)
            cause = failure_cause(f.read())
        raise LaunchError(
            f"training failed ({launcher} exit code {proc.returncode}): {cause}; see {log_file}"
        )


def node_main(argv: list[str]) -> None:
    """One node of a multi-node run, started by srun: torchrun for this node's ranks (replaces this process)."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog="python -m snaketune.train.processes")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--granted", type=int, required=True, help="ranks per node without SLURM GPUs")
    parser.add_argument("--threads", type=int, required=True, help="CPU threads of this node's ranks")
    parser.add_argument("--module", default="snaketune.train.trainer", help="what each rank runs (python -m)")
    parser.add_argument("spec_path")
    args = parser.parse_args(argv)
    slurm = hosts.Allocation.from_env(os.environ)
    if slurm is None:
        raise LaunchError(
            "python -m snaketune.train.processes runs one node of a SLURM job (no SLURM_JOB_ID here)"
        )
    cuda_devices = torch.cuda.device_count() if torch.cuda.is_available() else 0
    nproc = world_size(len(slurm.gpus) or args.granted, cuda_devices=cuda_devices)
    env = dict(os.environ)
    if cuda_devices == 0:
        _cpu_threads(env, args.threads, nproc)
    rdzv = hosts.torchrun_args(
        nnodes=args.nnodes,
        node_rank=slurm.node_rank,
        master=slurm.master,
        port=slurm.port,
        nproc_per_node=nproc,
        run_id=slurm.job_id,
    )
    cmd = [sys.executable, "-m", "torch.distributed.run", *rdzv, "-m", args.module, args.spec_path]
    print(f"{slurm.describe()}: {nproc} rank(s); {' '.join(cmd)}", flush=True)
    os.execve(sys.executable, cmd, env)


if __name__ == "__main__":
    node_main(sys.argv[1:])
