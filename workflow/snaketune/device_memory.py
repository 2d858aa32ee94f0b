"""GPU memory as the card counts it: `gpu_memory_gib` is a budget for what nvidia-smi shows, not for PyTorch's
allocator.

A process's device memory (what NVML and nvidia-smi report) is the caching allocator's reserved memory plus what
lies outside it: the CUDA context and the kernel modules loaded into it (lazily, as kernels are first used),
cuBLAS/cuBLASLt handles, NCCL's communicator buffers, Triton's modules. `torch.cuda.set_per_process_memory_fraction`
binds the allocator alone (a LoRA of the 7B capped at 24 GiB reached 24.8 GiB on the device: docs/facts.md, "Device
memory"). So here:

- `gpu_memory_gib` names the card's memory, a number of GiB or a card (`CARDS`: `rtx4090` is the 24,564 MiB an RTX
  4090 shows); a process may use that less DRIVER_RESERVE_GIB (`usable_gib`: the driver, a display, the card's other
  processes), so `24` and `rtx4090` both keep a process at 23.5 GiB.
- A rank first starts what lives outside the allocator (`warm_up`: the context, a cuBLAS matmul, the NCCL
  communicator), then measures it with NVML and caps the allocator at the usable memory less that and
  LAZY_MODULES_GIB for the kernel modules its first steps load (`cap_allocator`).
- `PeakSampler` polls NVML while a stage runs; every GPU stage's summary records its device peak beside the
  allocator's, and the memory plan counts the memory outside the allocator (snaketune.plan.memory).

Nothing here imports torch or NVML at module level: the config and the plan use the card names and the budget
arithmetic on machines without either.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Mapping

log = logging.getLogger("snaketune.gpus")

GIB = 2**30
MIB = 2**20
CARDS = {
    "rtx4090": 24564 * MIB,
    "h200": 143771 * MIB,
}
"""Total memory of a card as nvidia-smi shows it (`memory.total`; docs/facts.md, "Device memory")."""
DRIVER_RESERVE_GIB = 0.5
"""Of a card's memory, what a training process leaves to the driver, a display server and other processes. A
headless card with nothing else running needs less; a desktop's display takes 100-500 MiB."""
LAZY_MODULES_GIB = 0.75
"""Device memory that kernel modules loaded after `warm_up` add outside the allocator (CUDA loads each library's
modules when a kernel of it first runs; Triton's and Liger's kernels, FlashAttention): the allocator's cap leaves
this much room for them: they added 0.45 GiB in the 7B LoRA recipe's SFT (docs/facts.md, "Device memory")."""
ENV_MEMORY_CAP = "SNAKETUNE_GPU_MEMORY_GIB"
"""Set by the launcher and the in-process stages: the card's memory in GiB (gpu_memory_gib, resolved)."""
SAMPLE_EVERY_S = 0.01


def card_gib(value: float | int | str) -> float:
    """gpu_memory_gib as GiB: a number, or a card of CARDS; ValueError naming the allowed values otherwise."""
    if isinstance(value, str):
        if value.lower() in CARDS:
            return CARDS[value.lower()] / GIB
        raise ValueError(
            f"{value!r} is not allowed; allowed: a number of GiB > {DRIVER_RESERVE_GIB:g} (e.g. 24), a card "
            f"({', '.join(CARDS)}) or null"
        )
    if isinstance(value, bool) or not isinstance(value, int | float) or value <= DRIVER_RESERVE_GIB:
        raise ValueError(
            f"{value!r} is not allowed; allowed: a number of GiB > {DRIVER_RESERVE_GIB:g} (e.g. 24), a card "
            f"({', '.join(CARDS)}) or null"
        )
    return float(value)


def usable_gib(card: float) -> float:
    """What a process may hold on a card of `card` GiB (device memory, as NVML counts it)."""
    return card - DRIVER_RESERVE_GIB


def card_from_env(environ: Mapping[str, str] | None = None) -> float | None:
    env = os.environ if environ is None else environ
    value = env.get(ENV_MEMORY_CAP)
    return float(value) if value else None


# ---- NVML ---------------------------------------------------------------------------------------------------


class DeviceMemory:
    """NVML's view of one CUDA device of this process: the memory this process holds on it (`process_bytes`), and
    the whole device's used memory (`device_bytes`, what nvidia-smi's memory-usage column shows)."""

    def __init__(self, device) -> None:
        import pynvml
        import torch

        pynvml.nvmlInit()
        self._nvml = pynvml
        props = torch.cuda.get_device_properties(device)
        uuid = str(props.uuid)
        try:  # NVML numbers GPUs in its own order: find this one by its UUID
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except pynvml.NVMLError:
            bus = f"{props.pci_domain_id:08x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
            self.handle = pynvml.nvmlDeviceGetHandleByPciBusId(bus)
        self.pid = os.getpid()

    def device_bytes(self) -> int:
        return int(self._nvml.nvmlDeviceGetMemoryInfo(self.handle).used)

    def process_bytes(self) -> int | None:
        """This process's device memory, None where NVML lists it under another PID (a container's namespace)."""
        for proc in self._nvml.nvmlDeviceGetComputeRunningProcesses(self.handle):
            if proc.pid == self.pid and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
        return None

    def used_bytes(self) -> int:
        """This process's memory where NVML names it, else the device's (an upper bound on an exclusive GPU)."""
        own = self.process_bytes()
        return own if own is not None else self.device_bytes()


def device_memory(device) -> DeviceMemory | None:
    """NVML for a CUDA device; None on CPU or without NVML (nvidia-ml-py) or a driver that answers."""
    if getattr(device, "type", None) != "cuda":
        return None
    try:
        return DeviceMemory(device)
    except Exception as e:  # noqa: BLE001 - no pynvml, no driver: the stage runs, unmeasured
        log.warning("NVML not available (%s: %s): device memory is not measured", type(e).__name__, e)
        return None


class PeakSampler:
    """A daemon thread polling NVML every SAMPLE_EVERY_S while a stage runs: the peak of this process's device
    memory (`peak_gib`). NVML reads are a few microseconds each and never synchronize the GPU."""

    def __init__(self, mem: DeviceMemory | None) -> None:
        self.mem = mem
        self.peak = 0
        self._stop = threading.Event()
        self._thread = None
        if mem is not None:
            self.peak = mem.used_bytes()
            self._thread = threading.Thread(target=self._run, name="nvml-peak", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            with contextlib.suppress(Exception):
                self.peak = max(self.peak, self.mem.used_bytes())

    @property
    def peak_gib(self) -> float | None:
        if self.mem is None:
            return None
        with contextlib.suppress(Exception):
            self.peak = max(self.peak, self.mem.used_bytes())
        return self.peak / GIB

    def stop(self) -> float | None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=1)
        return self.peak_gib


# ---- the allocator's cap ------------------------------------------------------------------------------------


def warm_up(device, *, distributed: bool = False) -> None:
    """Start what a rank holds outside the allocator before it is measured: the CUDA context, a cuBLAS handle and
    workspace (a bf16 matmul), the NCCL communicator (a first collective). Triton's kernels and the other libraries'
    modules load at their first use, inside LAZY_MODULES_GIB."""
    import torch

    a = torch.ones(64, 64, device=device, dtype=torch.bfloat16)
    (a @ a).sum().item()  # device-to-host sync: the work above has run
    if distributed:
        import torch.distributed as dist

        t = torch.zeros(1, device=device)
        dist.all_reduce(t)
        t.item()  # sync: the communicator exists
    torch.cuda.synchronize(device)


ALLOC_CONF_ENVS = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
"""Where a user configures PyTorch's caching allocator: when either is set, the allocator is theirs."""
EXPANDABLE = "expandable_segments:True"


def allocator_settings(expandable: bool, environ: Mapping[str, str] | None = None) -> str | None:
    """The caching allocator's settings a rank sets for itself, None for PyTorch's defaults.

    `expandable`: the optimizer step in the backward (`train.optimizer_step: in_backward`), or any training under
    `gpu_memory_gib`: expandable segments. The step in backward frees each gradient as it is applied, so blocks of
    many sizes come and go and fixed segments keep holes; on one H200, the 7B's full fine-tune at 1 x 2,048 tokens:
    device peak 23.18 GiB with them against 23.46-23.59 GiB without (allocator peak 21.46-21.51 GiB in all four
    runs; bench/RESULTS.md, issue #26). Under a memory cap the plan sizes the training to the budget (train.strategy
    auto picks the fewest checkpointed layers that fit), so what fixed segments reserve beyond the allocated peak
    (0.65 GiB for LoRA of the 7B under 24 GiB, 1.4 GiB where the QLoRA example ran out of memory: bench/RESULTS.md,
    issue #16) is what it cannot plan; with expandable segments free pages go back before an allocation over the cap
    fails. Uncapped setups keep the defaults their figures were measured with. A user's PYTORCH_CUDA_ALLOC_CONF (or
    PYTORCH_ALLOC_CONF) wins."""
    env = os.environ if environ is None else environ
    if not expandable or any(env.get(name) for name in ALLOC_CONF_ENVS):
        return None
    return EXPANDABLE


def set_allocator(device, settings: str | None) -> None:
    """Apply `allocator_settings` before the rank's first allocation on `device`."""
    if settings is None or getattr(device, "type", None) != "cuda":
        return
    import torch

    torch.cuda.memory._set_allocator_settings(settings)


def allocator_fraction(usable: float, outside_gib: float, total_bytes: int) -> float:
    """The share of a card's memory the allocator may reserve so that it, what lies outside it (`outside_gib`) and
    LAZY_MODULES_GIB stay within `usable` GiB; 1.0 where the card has less."""
    return max(0.0, min(1.0, (usable - outside_gib - LAZY_MODULES_GIB) * GIB / total_bytes))


def cap_allocator(device, card: float | None, mem: DeviceMemory | None) -> tuple[str | None, dict]:
    """Cap this process's caching allocator on `device` so that its device memory stays under usable_gib(card):
    measures the memory outside the allocator now (after `warm_up`). Returns the log line (None when nothing is
    capped) and what it measured: {"outside_allocator_gib", "allocator_cap_gib", "usable_gib"}."""
    if card is None or device.type != "cuda":
        return None, {}
    if mem is None:
        # Without NVML the cap would bind the allocator alone, which the memory outside it overshoots (24.8 GiB under
        # a 24 GiB cap: docs/facts.md, "Device memory"): refused rather than a budget the run cannot keep.
        raise RuntimeError(
            f"config key 'gpu_memory_gib': {card:g} GiB cannot be enforced on {device}: NVML is not available, so the "
            "memory outside PyTorch's allocator cannot be measured (see the warning above); allowed: install "
            "nvidia-ml-py==13.615.71 (requirements.txt) on a machine with an NVIDIA driver, or gpu_memory_gib: null"
        )
    import torch

    total = torch.cuda.get_device_properties(device).total_memory
    usable = usable_gib(card)
    torch.cuda.synchronize(device)
    outside = max(0.0, (mem.used_bytes() - torch.cuda.memory_reserved(device)) / GIB)
    fraction = allocator_fraction(usable, outside, total)
    torch.cuda.set_per_process_memory_fraction(fraction, device)
    measured = {
        "usable_gib": round(usable, 3),
        "outside_allocator_gib": round(outside, 3),
        "allocator_cap_gib": round(fraction * total / GIB, 3),
    }
    line = (
        f"device memory budget {usable:.2f} GiB (gpu_memory_gib {card:.2f} less {DRIVER_RESERVE_GIB:g} for the "
        f"driver): outside the allocator {outside:.2f} GiB measured"
        f" + {LAZY_MODULES_GIB:g} for kernel modules loaded later; allocator capped at "
        f"{measured['allocator_cap_gib']:.2f} GiB of {total / GIB:.1f}"
    )
    return line, measured


def record(sampler: PeakSampler, device, measured: dict) -> dict:
    """What a GPU stage's summary records of its memory: the allocator's peak, the device peak NVML saw, what
    lay outside the allocator at the start and the budget."""
    import torch

    if getattr(device, "type", None) != "cuda":
        return {}
    return {
        "allocator_peak_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 3),
        "reserved_peak_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 3),
        "device_peak_gib": None if sampler.mem is None else round(sampler.peak_gib, 3),
        **measured,
    }
