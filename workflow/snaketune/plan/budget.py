"""What a memory plan is checked against: the GPUs' memory (the top-level config key `gpu_memory_gib`, else the
smallest GPU this machine offers the workflow) and the host's RAM."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from snaketune.device_memory import DRIVER_RESERVE_GIB, usable_gib
from snaketune.plan.memory import ENV_HOST_MEMORY, GIB, HOST_USABLE, Estimate


def host_memory_gib(environ=None) -> float | None:
    env = os.environ if environ is None else environ
    if env.get(ENV_HOST_MEMORY):
        return float(env[ENV_HOST_MEMORY])
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024 / GIB
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Budget:
    """What a plan is checked against."""

    gpu_gib: float | None
    """Device memory a process may hold on each GPU (the card's memory less the driver's share,
    snaketune.device_memory.usable_gib); None: no GPU to check against (CPU ranks), nothing is refused."""
    source: str
    host_gib: float | None = None

    def fits(self, est: Estimate) -> bool | None:
        if self.gpu_gib is None:
            return None
        host_checked = est.offload or est.activations_host_gib > 0
        host_ok = not host_checked or self.host_gib is None or est.host_gib <= HOST_USABLE * self.host_gib
        return est.gpu_gib <= self.gpu_gib and host_ok


def detect_budget(gpu_memory_gib: float | None, *, devices=None, host_gib: float | None = None) -> Budget:
    """The budget of the plan rule: the usable part of `gpu_memory_gib` when set (capped at the GPUs' own memory),
    else of the smallest of the GPUs this machine offers the workflow (snaketune.gpus), else none (CPU)."""
    from snaketune import gpus

    if devices is None:
        pool = gpus.candidates()
        devices = [] if pool.fake or not pool.ids else gpus.nvidia_smi_devices(pool.ids)
    host_gib = host_memory_gib() if host_gib is None else host_gib
    real = min((d.total_gib for d in devices), default=None)
    names = ", ".join(sorted({d.name for d in devices}))
    less = f"less {DRIVER_RESERVE_GIB:g} GiB for the driver"
    if gpu_memory_gib is not None:
        if real is not None and real < gpu_memory_gib:
            return Budget(
                usable_gib(real),
                f"{names} ({real:.1f} GiB, less than gpu_memory_gib {gpu_memory_gib:g}; {less})",
                host_gib,
            )
        return Budget(
            usable_gib(float(gpu_memory_gib)), f"gpu_memory_gib: {gpu_memory_gib:g} ({less})", host_gib
        )
    if real is not None:
        return Budget(
            usable_gib(real),
            f"{names} ({real:.1f} GiB, the smallest of {len(devices)} GPU(s); {less})",
            host_gib,
        )
    return Budget(None, "no GPU: CPU ranks, nothing to check", host_gib)


def memory_cap_gib(resources) -> float | None:
    """gpu_memory_gib as a stage gets it: the Snakemake resource gpu_memory_mib (0: none). Where a stage runs is no
    param of it, so a new cap reruns the plan rules (the preflight check), never a finished stage."""
    mib = int(getattr(resources, "gpu_memory_mib", 0) or 0)
    return mib / 1024 if mib else None
