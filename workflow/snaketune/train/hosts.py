"""Where the train stage runs inside a SLURM allocation: its nodes, its GPUs, and the torchrun rendezvous.

Pure functions of the environment SLURM gives a job (no SLURM call, nothing started), so they are tested
with made-up environments (tests/test_hosts.py). `snaketune.train.processes` uses them:

- one node: torchrun on this node as without SLURM, one rank per GPU SLURM gave (CUDA_VISIBLE_DEVICES);
- several nodes (train.nodes > 1): `srun --overlap --ntasks-per-node=1` starts `python -m snaketune.train.processes
  --nnodes N ...` once per node, which runs torchrun with `--nnodes N --node_rank R --rdzv_backend c10d
  --rdzv_endpoint <first node>:<port from the job id>`.

SLURM's variables: https://slurm.schedmd.com/sbatch.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES and
https://slurm.schedmd.com/srun.html#SECTION_OUTPUT-ENVIRONMENT-VARIABLES.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from itertools import product

# Rendezvous ports: below Linux's ephemeral range (32768-60999, /proc/sys/net/ipv4/ip_local_port_range),
# so that no outgoing connection holds the port, and above the registered services people tend to run.
PORT_BASE = 20000
PORT_SPAN = 10000

# A step inherits these from the step it was started in; an inner srun would take them as its own options
# (SLURM_NTASKS as -n, SLURM_CPUS_PER_TASK as -c, ...) and ask for one node's worth of resources.
# The inner srun keeps the job's identity and configuration only.
_KEEP_FOR_SRUN = ("SLURM_CONF", "SLURM_JOB_ID", "SLURM_JOBID", "SLURM_CLUSTER_NAME")


class HostsError(ValueError):
    pass


def _split_top_level(text: str) -> list[str]:
    """Split on commas that are not inside brackets: `a[1,3],b` -> [`a[1,3]`, `b`]."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostsError(f"unbalanced ']' in node list {text!r}")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth:
        raise HostsError(f"unbalanced '[' in node list {text!r}")
    parts.append(text[start:])
    return [p for p in (s.strip() for s in parts) if p]


def _expand_range(spec: str, where: str) -> list[str]:
    """`01-03,07` -> [`01`, `02`, `03`, `07`]; a range keeps the zero padding of its first bound."""
    out = []
    for item in spec.split(","):
        item = item.strip()
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item)
        if not m:
            raise HostsError(f"bad range {item!r} in node list {where!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        if int(hi) < int(lo):
            raise HostsError(f"descending range {item!r} in node list {where!r}")
        width = len(lo)
        out.extend(str(n).zfill(width) for n in range(int(lo), int(hi) + 1))
    return out


def expand_nodelist(nodelist: str) -> list[str]:
    """SLURM's compressed host list as host names, in order (what `scontrol show hostnames` prints).

    `node[01-03,07],gpu-a5` -> node01 node02 node03 node07 gpu-a5; several bracket groups in one name
    (`r[1-2]n[1-2]`) expand to every combination, the last group fastest.
    """
    hosts: list[str] = []
    for part in _split_top_level(nodelist):
        pieces = re.split(r"(\[[^\]]*\])", part)
        choices = [_expand_range(p[1:-1], nodelist) if p.startswith("[") else [p] for p in pieces if p]
        hosts.extend("".join(combo) for combo in product(*choices))
    if not hosts:
        raise HostsError(f"empty node list {nodelist!r}")
    return hosts


def _ids(value: str | None) -> list[str]:
    """`0,1,2` -> [`0`, `1`, `2`]; unset or empty -> []."""
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def gpu_ids(env: Mapping[str, str]) -> list[str]:
    """The GPUs of this node's step, as the processes see them: CUDA_VISIBLE_DEVICES, which SLURM sets
    (relative ids when the cgroup hides the others), else SLURM's own lists, most specific first."""
    for name in ("CUDA_VISIBLE_DEVICES", "SLURM_STEP_GPUS", "SLURM_JOB_GPUS"):
        ids = _ids(env.get(name))
        if ids:
            return ids
    count = env.get("SLURM_GPUS_ON_NODE", "")
    return [str(i) for i in range(int(count))] if count.isdigit() else []


def rendezvous_port(job_id: str | int) -> int:
    """A port for the c10d store, the same on every node of a job and different for jobs that follow
    each other on one master node."""
    return PORT_BASE + int(job_id) % PORT_SPAN


@dataclass(frozen=True)
class Allocation:
    """The SLURM job this process runs in, as its environment describes it."""

    job_id: str
    hosts: tuple[str, ...]
    """Every node of the job, in SLURM's order; the first is the rendezvous host."""
    node_rank: int
    """This node's index in `hosts` (SLURM_NODEID)."""
    gpus: tuple[str, ...]
    """GPU ids of this node's step (CUDA_VISIBLE_DEVICES as SLURM set it); empty without GPUs."""

    @property
    def master(self) -> str:
        return self.hosts[0]

    @property
    def port(self) -> int:
        return rendezvous_port(self.job_id)

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Allocation | None:
        """None outside SLURM (no SLURM_JOB_ID)."""
        job_id = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        if not job_id:
            return None
        # The job's nodes: SLURM_JOB_NODELIST, or SLURM_NODELIST where that is longer. In the step that
        # snakemake-executor-plugin-slurm-jobstep starts (`srun -n1` with the SLURM_* variables cleared),
        # Slurm 22.05 sets SLURM_JOB_NODELIST to the step's one node and SLURM_NODELIST to the job's.
        lists = [env[k] for k in ("SLURM_JOB_NODELIST", "SLURM_NODELIST") if env.get(k)]
        if not lists:
            raise HostsError(f"SLURM job {job_id}: SLURM_JOB_NODELIST is not set")
        nodelist = max(lists, key=lambda text: len(expand_nodelist(text)))
        hosts = tuple(expand_nodelist(nodelist))
        node_rank = int(env.get("SLURM_NODEID", "0"))
        if not 0 <= node_rank < len(hosts):
            raise HostsError(f"SLURM_NODEID={node_rank} is outside the job's {len(hosts)} node(s) {nodelist}")
        return cls(job_id=job_id, hosts=hosts, node_rank=node_rank, gpus=tuple(gpu_ids(env)))

    def describe(self) -> str:
        gpus = ",".join(self.gpus) if self.gpus else "none"
        return (
            f"SLURM job {self.job_id}: node {self.node_rank} of {len(self.hosts)} ({self.hosts[self.node_rank]}), "
            f"GPUs from SLURM: {gpus}"
        )


def torchrun_args(
    *, nnodes: int, node_rank: int, master: str, port: int, nproc_per_node: int, run_id: str
) -> list[str]:
    """torchrun's options for one node of a multi-node run: c10d rendezvous at master:port.

    c10d hosts its store in the torchrun whose host matches the endpoint (the first node), so no node
    needs to be started first; --node_rank only orders the nodes in the logs, c10d assigns the ranks.
    """
    return [
        "--nnodes",
        str(nnodes),
        "--node_rank",
        str(node_rank),
        "--nproc_per_node",
        str(nproc_per_node),
        "--rdzv_backend",
        "c10d",
        "--rdzv_endpoint",
        f"{master}:{port}",
        "--rdzv_id",
        str(run_id),
    ]


def srun_command(job_id: str, nnodes: int) -> list[str]:
    """Start one launcher per node of the job, from inside a step of it.

    --overlap: the step Snakemake's job runs in keeps its CPUs and GPUs, which the new step shares.
    No GPU option: a step gets all of the job's GPUs on its nodes (SLURM's default), whatever the count.
    --kill-on-bad-exit: one node failing ends the others instead of leaving them in the rendezvous.
    """
    return [
        "srun",
        f"--jobid={job_id}",
        "--overlap",
        f"--nodes={nnodes}",
        f"--ntasks={nnodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "--export=ALL",
    ]


def srun_env(env: Mapping[str, str]) -> dict[str, str]:
    """The environment for that srun: SLURM_*/SRUN_*/SBATCH_* variables of the current step removed,
    except the job's identity and configuration (SLURM_CONF: the conf need not be at /etc/slurm)."""
    return {
        k: v
        for k, v in env.items()
        if not k.startswith(("SLURM_", "SRUN_", "SBATCH_")) or k in _KEEP_FOR_SRUN
    }
