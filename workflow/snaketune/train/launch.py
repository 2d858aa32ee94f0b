"""Launcher of the train stage: one torchrun process group, one rank per granted GPU.

Snakemake's `gpu` resource is a counter (../shared/FACTS.md): the rule learns how many GPUs it was
granted from `{resources.gpu}`, which can be less than train.gpus when the command line gives less.
Without CUDA the ranks run on CPU over gloo, so the embedded default trains with real DeepSpeed ranks.

Inside a SLURM job the allocation decides instead: one rank per GPU SLURM gave the node (its
CUDA_VISIBLE_DEVICES), and with train.nodes > 1 one torchrun per node, started by srun, meeting at a c10d
rendezvous on the first node (`snaketune.train.hosts`).

Which GPUs: on one node the launcher locks as many of the GPUs it may use as it starts ranks
(`snaketune.gpus`), gives torchrun exactly those as CUDA_VISIBLE_DEVICES and holds them until torchrun
exits, so that jobs running at once never share a GPU. Before starting it checks the memory plan against
those GPUs (`snaketune.plan.search.check_devices`), passes gpu_memory_gib on as a per-rank allocator cap, and sets
NCCL_P2P_DISABLE=1 where the GPUs cannot reach each other's memory.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

from snaketune import device_memory, gpus
from snaketune.plan.apply import apply_plan, check_devices
from snaketune.plan.budget import host_memory_gib, memory_cap_gib
from snaketune.train import hosts

log = logging.getLogger(__name__)

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
    slurm = hosts.Allocation.from_env(os.environ)
    if slurm is not None:
        log.info(
            "%s (CUDA_VISIBLE_DEVICES=%s)",
            slurm.describe(),
            os.environ.get("CUDA_VISIBLE_DEVICES", "<unset>"),
        )
        if slurm.gpus:
            granted = len(slurm.gpus)  # SLURM's allocation, not Snakemake's counter
    if nodes > 1:
        if slurm is None:
            raise LaunchError(
                f"train.nodes={nodes} needs a SLURM job of {nodes} nodes: run with --profile workflow/profiles/slurm"
            )
        if len(slurm.hosts) != nodes:
            raise LaunchError(
                f"train.nodes={nodes} but SLURM job {slurm.job_id} has {len(slurm.hosts)} node(s): {', '.join(slurm.hosts)}"
            )
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
    env = dict(os.environ)
    env["PYTHONPATH"] = rank_pythonpath(env)
    env.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    alloc, gpu_env = assign_gpus(pool, nproc, experiment=spec["experiment"], plan=plan)
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
    if nodes > 1:
        # One launcher per node (`node_main` below); each counts its own node's GPUs.
        cmd = [
            *hosts.srun_command(slurm.job_id, nodes),
            sys.executable,
            "-m",
            "snaketune.train.launch",
            f"--nnodes={nodes}",
            f"--granted={granted}",
            f"--threads={threads}",
            f"--module={module}",
            str(spec_path),
        ]
        env = hosts.srun_env(env)
    elif nproc == 1:
        cmd = [sys.executable, "-m", module, str(spec_path)]
        env.update(single_rank_env())
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            "-m",
            module,
            str(spec_path),
        ]
    log.info("launching: %s", " ".join(cmd))
    # The GPUs stay locked until torchrun exits; torchrun holds the locks too, in case this process dies first.
    with alloc, open(log_file, "a") as out:
        out.flush()
        start = out.tell()
        proc = subprocess.run(
            cmd, env=env, stdout=out, stderr=subprocess.STDOUT, check=False, pass_fds=tuple(alloc.fds)
        )
    if proc.returncode != 0:
        launcher = "torchrun" if nproc > 1 or nodes > 1 else "rank"
        with open(log_file, errors="replace") as f:
            f.seek(start)
            cause = failure_cause(f.read())
        raise LaunchError(
            f"training failed ({launcher} exit code {proc.returncode}): {cause}; see {log_file}"
        )


# A Python exception's last line, as a rank prints it (torchrun prefixes "[rankN]: "); torchrun's own
# ChildFailedError only says that a rank failed. The agent's own lines are glog's ("E1205 00:18:45.277000 32690
# .../elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 32710) of binary: ...").
_AGENT_LINE = re.compile(r"^[DIWEF]\d{4} [\d:.]+ +\d+ \S*torch/distributed/")
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# torchrun's report: "Root Cause (first observed failure):", then "[0]:", "time : ...", "host : ...", "rank : 1
# (local_rank: 1)".
_ROOT_RANK = re.compile(r"^rank\s*:\s*(\d+)\b")
# A rank's exception that only says another rank went away (gloo: "Connection closed by peer ... This is typically
# caused by a remote worker crashing"; NCCL: DistBackendError, "remote process exited"; torchrun's SIGTERM to the
# ranks still running: SignalException).
_FALLOUT = re.compile(
    r"closed by peer|reset by peer|remote (?:worker|process)|Broken pipe|DistBackendError|SignalException",
    re.I,
)
_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank(\d+)\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b.*)$"
)


def failure_cause(output: str, *, tail_lines: int = 3) -> str:
    """What the ranks' output says went wrong: the exception of the rank that failed first, as the last line of its
    traceback shows it ("rank 1: ValueError: ..."; the outer one where exceptions are chained). The rank that failed
    first is the one torchrun names as the root cause; where its report is missing, the first rank whose exception
    is not the fallout of another rank's exit (a collective's "connection closed by peer": ranks' tracebacks
    interleave in one log, so the fallout can come first); else the first rank that printed one.
    Where no rank printed one (a signal, a C++ abort), which rank torchrun saw fail and with what, and the ranks'
    last lines before torchrun's own report."""
    lines = [line.strip() for line in output.splitlines()]
    found = [
        (m.group(1), m.group(2))
        for m in map(_EXCEPTION_LINE.match, lines)
        if m and "ChildFailedError" not in m.group(2)
    ]
    if found:
        ranks = [r for r, _ in found]
        root = _root_cause_rank(lines)
        if root is None or root not in ranks:
            root = next((r for r, text in found if not _FALLOUT.search(text)), ranks[0])
        message = [text for r, text in found if r == root][-1]
        return (f"rank {root}: " if root is not None else "") + message
    agent = next((i for i, line in enumerate(lines) if _AGENT_LINE.match(line)), len(lines))
    parts = []
    failed = next(filter(None, map(_AGENT_FAILED.search, lines)), None)
    if failed:
        code = int(failed.group(1))
        name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
        parts.append(f"local rank {failed.group(2)} exited with {code}{name}")
    tail = [line for line in lines[:agent] if line][-tail_lines:]
    parts.append("last output: " + (" | ".join(tail) if tail else "<none>"))
    return "; ".join(parts)


def _root_cause_rank(lines: list[str]) -> str | None:
    """The rank under torchrun's "Root Cause (first observed failure):" heading, or None where there is none."""
    start = next((i for i, line in enumerate(lines) if line.startswith("Root Cause")), None)
    if start is None:
        return None
    return next((m.group(1) for m in map(_ROOT_RANK.match, lines[start + 1 :]) if m), None)


def node_main(argv: list[str]) -> None:
    """One node of a multi-node run, started by srun: torchrun for this node's ranks (replaces this process)."""
    import argparse

    import torch

    parser = argparse.ArgumentParser(prog="python -m snaketune.train.launch")
    parser.add_argument("--nnodes", type=int, required=True)
    parser.add_argument("--granted", type=int, required=True, help="ranks per node without SLURM GPUs")
    parser.add_argument("--threads", type=int, required=True, help="CPU threads of this node's ranks")
    parser.add_argument("--module", default="snaketune.train.trainer", help="what each rank runs (python -m)")
    parser.add_argument("spec_path")
    args = parser.parse_args(argv)
    slurm = hosts.Allocation.from_env(os.environ)
    if slurm is None:
        raise LaunchError(
            "python -m snaketune.train.launch runs one node of a SLURM job (no SLURM_JOB_ID here)"
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


def train_job(
    run_spec: dict,
    *,
    checkpoints: str | Path,
    outputs: tuple[str, ...],
    plan: dict,
    granted: int,
    log_file: str | Path,
    threads: int,
    nodes: int,
    module: str = "snaketune.train.trainer",
) -> None:
    """What the train and dpo rules run: the plan's strategy applied (train.strategy auto), the checkpoint
    directory named by the run key, and the ranks writing model/, metrics.csv, tb/ and summary.json into a
    staging directory that is renamed into place once training has ended (checkpoints are not outputs).
    `plan`: the stage's memory plan (results/plan/<experiment>.json; results/plan/dpo/ for the dpo rule)."""
    from snaketune.io import atomic_files
    from snaketune.train.checkpoint import remove_runs

    run_spec = apply_plan(run_spec, plan)
    ckpt_dir = Path(checkpoints) / run_spec["run_key"]
    run_spec["checkpoint_dir"] = str(ckpt_dir)
    with atomic_files(*outputs) as staged:
        run_spec = {**run_spec, "output_dir": str(staged[0].parent)}
        launch(
            run_spec,
            ckpt_dir / "run-spec.json",
            granted=granted,
            log_file=log_file,
            threads=threads,
            nodes=nodes,
            plan=plan,
            module=module,
        )
    # The outputs are in place: the stage's checkpoints have done their work, a superseded run's and (unless kept)
    # this one's.
    keep = ckpt_dir if run_spec["train"].get("keep_final_checkpoint") else None
    for removed in remove_runs(checkpoints, keep=keep):
        log.info("removed checkpoint directory %s", removed)


def train_rule_job(
    smk,
    *,
    model: dict,
    module: str = "snaketune.train.trainer",
    outputs: tuple | None = None,
    train: dict | None = None,
    **extra,
) -> None:
    """The train, reference and dpo rules' scripts: the run spec from the rule's params (spec) and inputs (data,
    tokenizer, deepspeed, plan), `extra` keys added, then train_job with the rule's outputs (default: model,
    metrics, tb, summary; all in one directory) and resources."""
    from snaketune.config.owners import full_train
    from snaketune.plan.search import candidate_files, stage_plan
    from snaketune.train.checkpoint import run_key  # torch: imported only where a training is launched

    spec = smk.params.spec
    resources = smk.resources
    gres = getattr(resources, "gres", None)  # gpu:N per node, for a job of several nodes (gpu is then 0)
    gpus = int(resources.gpu) or (int(str(gres).split(":")[-1]) if gres else 1)
    train = full_train(train or spec["train"], resources, {"gpus": gpus, "nodes": int(resources.nodes)})
    run_spec = {
        "experiment": smk.wildcards.experiment,
        "model": model,
        # The settings the params hold, with the bookkeeping the resources hold (snaketune.config.owners).
        "train": train,
        "data_dir": smk.input.data,
        "tokenizer_dir": str(Path(smk.input.tokenizer).parent),
        "deepspeed_config": smk.input.deepspeed,
        "max_length": spec["max_length"],
        # Every input's content: a job that starts from other data or another model never resumes this one.
        "run_key": run_key(spec["run_key"], dict(smk.input.items())),
        **extra,
    }
    # The stage's memory plan, made here as its plan rule makes it (stage_plan says why it is not an input).
    # The preference stages' rows hold both sides of a pair.
    sft = smk.rule == "train"
    plan = stage_plan(
        experiment=smk.wildcards.experiment,
        model=spec["model"],
        train=train,
        max_length=spec["max_length"] * (1 if sft else 2),
        deepspeed_config=smk.input.deepspeed,
        gpu_memory_gib=memory_cap_gib(resources),
        candidate_files=candidate_files(),
        objective="sft" if sft else "preference",
        allow_download=not os.environ.get("HF_HUB_OFFLINE"),
    )
    train_job(
        run_spec,
        checkpoints=smk.params.checkpoints,
        outputs=outputs or (smk.output.model, smk.output.metrics, smk.output.tb, smk.output.summary),
        plan=plan,
        granted=int(smk.resources.gpu),
        log_file=smk.log[0],
        threads=smk.threads,
        nodes=int(smk.resources.nodes),
        module=module,
    )
