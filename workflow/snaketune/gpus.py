"""Which physical GPUs a job uses: one lock file per GPU, so that concurrent jobs never share one.

Snakemake's `gpu` resource is only a counter: it never says *which* GPUs a job may use, so two jobs that run
at once would both start on GPU 0 (docs/facts.md, "Snakemake"; snakemake#281). Every rule that uses GPUs (train,
evaluate) therefore takes GPUs here for its whole lifetime and hands them to its processes as
CUDA_VISIBLE_DEVICES:

- Candidates (`candidates`): the GPUs this process may use, in CUDA's order: an existing
  CUDA_VISIBLE_DEVICES (set by the user or by SLURM), else SLURM_STEP_GPUS / SLURM_JOB_GPUS, else every GPU
  of the machine; narrowed to `SNAKETUNE_GPUS` (the top-level config key `gpu_ids` sets it) when given.
- Locks (`acquire`): one file per GPU in a directory that every Snakemake process of the machine shares
  ($SNAKETUNE_GPU_LOCK_DIR, default /tmp/snaketune-gpu-locks; inside a SLURM job one directory per job, as
  SLURM already keeps jobs' GPUs apart). A GPU is taken with flock(2), which the kernel releases when the
  last process holding the file closes it, even after SIGKILL: a crashed job never leaves a GPU taken.
  The launcher passes the lock files to torchrun, so an orphaned torchrun keeps its GPUs locked.
  All of a job's GPUs are taken under one short-held allocation lock (no two jobs each holding half of what
  they need), and a job that finds too few free waits, logging who holds them, for $SNAKETUNE_GPU_WAIT_S.
- Fake GPUs for tests on machines without CUDA: SNAKETUNE_FAKE_GPUS=0,1,2,3 makes the ids above come from
  that list; they are locked and logged like real ones, and the ranks get CUDA_VISIBLE_DEVICES="" so that
  they run on CPU even where real GPUs exist.

Nothing here imports torch at module level, and `candidates` never initializes CUDA (it asks nvidia-smi),
so an in-process user (the evaluate rule) can still set CUDA_VISIBLE_DEVICES afterwards.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("snaketune.gpus")

ENV_GPUS = "SNAKETUNE_GPUS"
"""Comma-separated GPU ids the workflow may use (what the top-level config key `gpu_ids` sets)."""
ENV_FAKE = "SNAKETUNE_FAKE_GPUS"
"""Comma-separated fake GPU ids: allocate and log them, run the ranks on CPU (tests)."""
ENV_LOCK_DIR = "SNAKETUNE_GPU_LOCK_DIR"
ENV_WAIT = "SNAKETUNE_GPU_WAIT_S"
ENV_ASSIGNED = "SNAKETUNE_ASSIGNED_GPUS"
"""Set for the processes of a job: the ids it holds (the fake ones too)."""
DEFAULT_LOCK_DIR = "/tmp/snaketune-gpu-locks"
DEFAULT_WAIT_S = 24 * 3600.0
"""A job waits this long for GPUs held by another workflow's job (a training can take hours)."""
WAIT_LOG_EVERY_S = 300.0
ALLOCATION_LOCK = ".allocate.lock"


class GpuError(RuntimeError):
    """The GPUs asked for cannot be had: too few candidates, or none freed in time."""


def parse_ids(text: str | None) -> list[str]:
    """Ids of a CUDA_VISIBLE_DEVICES-style list ('0,1', 'GPU-uuid,...'); CUDA ignores everything from the
    first invalid entry on, and SLURM writes 'NoDevFiles' when a job has no GPU."""
    ids = []
    for part in (text or "").split(","):
        part = part.strip()
        if not part:
            continue
        if part in ("-1", "NoDevFiles"):
            break
        ids.append(part)
    return ids


# ---- candidates ----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Candidates:
    """The GPUs a job of this process may take, and where that list came from (for the log)."""

    ids: tuple[str, ...]
    """Ids as CUDA_VISIBLE_DEVICES takes them (physical ids, or entries of an inherited list)."""
    visible: tuple[str, ...]
    """This process's CUDA devices in order: `visible.index(id)` is the torch device index of `id`."""
    source: str
    fake: bool = False

    def position(self, gpu_id: str) -> int:
        return self.visible.index(gpu_id)


def count_gpus() -> int:
    """GPUs of the machine, without initializing CUDA in this process: nvidia-smi, else none."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return 0
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def cuda_device_count() -> int:
    """CUDA devices this process sees (CUDA_VISIBLE_DEVICES applies), asked of the CUDA driver (snaketune.cuda_driver:
    no torch import in a rule's process), and only on a machine where nvidia-smi exists."""
    if shutil.which("nvidia-smi") is None:
        return 0
    from snaketune import cuda_driver

    return cuda_driver.device_count()


def candidates(environ: Mapping[str, str] | None = None, *, count: int | None = None) -> Candidates:
    """The GPUs this process may hand out. `count` is the number of CUDA devices this process sees (the
    launcher passes torch's); None asks nvidia-smi. Raises GpuError when SNAKETUNE_GPUS names none of them.
    """
    env = os.environ if environ is None else environ
    fake = parse_ids(env.get(ENV_FAKE))
    if "CUDA_VISIBLE_DEVICES" in env:
        visible, source = parse_ids(env["CUDA_VISIBLE_DEVICES"]), "CUDA_VISIBLE_DEVICES"
    elif parse_ids(env.get("SLURM_STEP_GPUS")):
        visible, source = parse_ids(env["SLURM_STEP_GPUS"]), "SLURM_STEP_GPUS"
    elif parse_ids(env.get("SLURM_JOB_GPUS")):
        visible, source = parse_ids(env["SLURM_JOB_GPUS"]), "SLURM_JOB_GPUS"
    else:
        visible, source = None, "all GPUs of the machine"
    if fake:
        # Fake GPUs stand in for the machine's: an inherited list narrows them as it would real ones.
        ids = fake if visible is None else [i for i in fake if i in visible]
        visible = ids
        source = f"{ENV_FAKE}={','.join(fake)}" + ("" if source.startswith("all") else f", {source}")
    else:
        n = count_gpus() if count is None else count
        if visible is None:
            visible = [str(i) for i in range(n)]
        visible = visible[:n]  # what CUDA really shows (an invalid or absent id shows nothing)
        ids = list(visible)
    allowed = parse_ids(env.get(ENV_GPUS))
    if allowed:
        kept = [i for i in ids if i in allowed]
        if ids and not kept:
            raise GpuError(
                f"{ENV_GPUS}={','.join(allowed)} (config key gpu_ids) names none of the GPUs this job can "
                f"see ({','.join(ids)}, from {source})"
            )
        ids = kept
        source += f", narrowed by {ENV_GPUS}={','.join(allowed)}"
    return Candidates(tuple(ids), tuple(visible), source, fake=bool(fake))


# ---- locks ---------------------------------------------------------------------------------------------


def lock_dir(environ: Mapping[str, str] | None = None) -> Path:
    """Where the lock files live: shared by every process of the machine. Inside a SLURM job, one directory
    per job: SLURM already keeps different jobs' GPUs apart (and numbers each job's from 0)."""
    env = os.environ if environ is None else environ
    if env.get(ENV_LOCK_DIR):
        return Path(env[ENV_LOCK_DIR])
    if env.get("SLURM_JOB_ID"):
        return Path(f"{DEFAULT_LOCK_DIR}-slurm{env['SLURM_JOB_ID']}")
    return Path(DEFAULT_LOCK_DIR)


def wait_seconds(environ: Mapping[str, str] | None = None) -> float:
    env = os.environ if environ is None else environ
    return float(env.get(ENV_WAIT) or DEFAULT_WAIT_S)


def _safe_name(gpu_id: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in gpu_id)


def _open_lock(path: Path) -> int:
    """Open (creating) a lock file that other users can lock too; flock works on a read-only descriptor."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except PermissionError:
        return os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    with contextlib.suppress(OSError):
        os.fchmod(fd, 0o666)
    return fd


def _try_lock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


def _holder(path: Path) -> str:
    """Who holds a GPU, from what its holder wrote into the lock file."""
    try:
        info = json.loads(path.read_text() or "{}")
    except (OSError, ValueError):
        return "unknown holder"
    if not info:
        return "unknown holder"
    return f"pid {info.get('pid')} on {info.get('host')} ({info.get('label')}, since {info.get('since')})"


@dataclass
class Allocation:
    """GPUs held by this process until `release` (or process exit). `fds` are the locked files: pass them to
    child processes (subprocess pass_fds) that must keep the GPUs locked as long as they live."""

    ids: tuple[str, ...]
    candidates: Candidates
    directory: Path | None = None
    fds: list[int] = field(default_factory=list)
    label: str = ""

    @property
    def fake(self) -> bool:
        return self.candidates.fake

    def env(self) -> dict[str, str]:
        """CUDA_VISIBLE_DEVICES for the job's processes ("" for fake ids: CPU ranks) and the assigned ids."""
        ids = ",".join(self.ids)
        return {"CUDA_VISIBLE_DEVICES": "" if self.fake else ids, ENV_ASSIGNED: ids}

    def release(self) -> None:
        if not self.fds:
            return
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the last descriptor of the file releases the flock
        self.fds = []
        log.info("GPUs released: %s (%s)", ",".join(self.ids), self.label)

    def __enter__(self) -> Allocation:
        return self

    def __exit__(self, *exc) -> None:
        self.release()


@contextlib.contextmanager
def _allocation_lock(directory: Path) -> Iterator[None]:
    fd = _open_lock(directory / ALLOCATION_LOCK)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held for a few system calls only
        yield
    finally:
        os.close(fd)


def _make_dir(directory: Path) -> None:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GpuError(f"cannot create the GPU lock directory {directory} ({e}); set {ENV_LOCK_DIR}") from e
    # Every user's workflows share the directory; sticky, so that nobody can delete another's lock file.
    with contextlib.suppress(OSError):
        if directory.stat().st_uid == os.getuid():
            directory.chmod(0o1777)


def acquire(
    pool: Candidates,
    n: int,
    *,
    directory: Path,
    label: str,
    timeout_s: float,
    poll_s: float = 0.5,
) -> Allocation:
    """Lock `n` of the pool's GPUs (the first free ones, in the pool's order), waiting up to `timeout_s`."""
    if n > len(pool.ids):
        raise GpuError(
            f"{label} needs {n} GPU(s) but only {len(pool.ids)} can be used here "
            f"({','.join(pool.ids) or 'none'}, from {pool.source})"
        )
    _make_dir(directory)
    paths = {i: directory / f"gpu-{_safe_name(i)}.lock" for i in pool.ids}
    t0 = time.monotonic()
    next_log = t0
    while True:
        busy: list[str] = []
        with _allocation_lock(directory):
            got: list[tuple[str, int]] = []
            for gpu_id in pool.ids:
                if len(got) == n:
                    break
                fd = _open_lock(paths[gpu_id])
                if _try_lock(fd):
                    got.append((gpu_id, fd))
                else:
                    os.close(fd)
                    busy.append(gpu_id)
            if len(got) == n:
                info = {
                    "pid": os.getpid(),
                    "host": socket.gethostname(),
                    "label": label,
                    "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                }
                for _, fd in got:
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                        os.pwrite(fd, json.dumps(info).encode(), 0)
                alloc = Allocation(tuple(i for i, _ in got), pool, directory, [fd for _, fd in got], label)
                waited = time.monotonic() - t0
                log.info(
                    "GPUs assigned: %s (%s; from %s%s%s)",
                    ",".join(alloc.ids),
                    label,
                    pool.source,
                    "; fake: the ranks run on CPU" if pool.fake else "",
                    f"; after waiting {waited:.0f} s" if waited >= 1 else "",
                )
                return alloc
            for _, fd in got:
                os.close(fd)
        now = time.monotonic()
        held = "; ".join(f"GPU {i}: {_holder(paths[i])}" for i in busy)
        if now - t0 >= timeout_s:
            raise GpuError(
                f"{label}: {n} GPU(s) needed but only {len(pool.ids) - len(busy)} of {','.join(pool.ids)} were "
                f"free for {timeout_s:.0f} s ({held}); wait for those jobs, or raise {ENV_WAIT}"
            )
        if now >= next_log:
            log.info(
                "waiting for %d GPU(s) for %s: %d of %s free; %s; giving up after %.0f s (%s)",
                n,
                label,
                len(pool.ids) - len(busy),
                ",".join(pool.ids),
                held,
                timeout_s,
                ENV_WAIT,
            )
            next_log = now + WAIT_LOG_EVERY_S
        time.sleep(poll_s)


def allocate(
    n: int,
    *,
    label: str,
    count: int | None = None,
    environ: Mapping[str, str] | None = None,
    pool: Candidates | None = None,
) -> Allocation:
    """Take `n` GPUs for this job (an empty allocation when n is 0 or there are no GPUs: CPU work)."""
    pool = candidates(environ, count=count) if pool is None else pool
    if n == 0 or not pool.ids:
        return Allocation((), pool, label=label)
    return acquire(pool, n, directory=lock_dir(environ), label=label, timeout_s=wait_seconds(environ))


@contextlib.contextmanager
def in_process(n: int, *, label: str) -> Iterator[Allocation]:
    """Hold GPUs for work done in this process (the evaluate rule): CUDA_VISIBLE_DEVICES is set before
    CUDA starts here, so torch sees exactly the assigned GPUs. n = 0 (or no GPU) means CPU: none are
    visible then either."""
    alloc = allocate(n, label=label)
    os.environ.update(alloc.env() if alloc.ids else {"CUDA_VISIBLE_DEVICES": ""})
    try:
        yield alloc
    finally:
        alloc.release()


# ---- devices ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Device:
    name: str
    total_gib: float


def nvidia_smi_devices(ids: Sequence[str] | None = None) -> list[Device]:
    """Name and memory of the machine's GPUs from nvidia-smi (no CUDA context), narrowed to `ids` (indices
    or UUIDs; nvidia-smi numbers GPUs in PCI order, which is CUDA's order on a machine of one GPU model)."""
    exe = shutil.which("nvidia-smi")
    if exe is None:
        return []
    cmd = [exe, "--query-gpu=index,uuid,name,memory.total", "--format=csv,noheader,nounits"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    devices = []
    for line in out.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        index, uuid, name, mib = parts[:4]
        if ids is not None and index not in ids and uuid not in ids:
            continue
        with contextlib.suppress(ValueError):
            devices.append(Device(name, float(mib) / 1024))
    return devices


def cuda_devices(positions: Sequence[int]) -> list[Device]:
    """Name and memory of this process's CUDA devices at `positions` (torch's cuda:<position>), from the driver."""
    from snaketune import cuda_driver

    infos = [cuda_driver.device_info(p) for p in positions]
    return [Device(i.name, i.total_bytes / 2**30) for i in infos]


def peer_access(positions: Sequence[int]) -> dict[tuple[int, int], bool]:
    """Whether each ordered pair of this process's CUDA devices can access the other's memory directly."""
    from snaketune import cuda_driver

    return {
        (a, b): cuda_driver.can_access_peer(pa, pb)
        for a, pa in enumerate(positions)
        for b, pb in enumerate(positions)
        if a != b
    }


def nccl_p2p_env(
    names: Sequence[str], peer: Mapping[tuple[int, int], bool], environ: Mapping[str, str] | None = None
) -> tuple[dict[str, str], str | None]:
    """NCCL settings for a multi-GPU launch and the log line that explains them.

    NCCL's peer-to-peer transport on GPUs that cannot reach each other's memory can hang a job (multi-RTX
    4090: peer-to-peer is blocked on GeForce cards, DeepSpeed#4433; accelerate sets NCCL_P2P_DISABLE=1 for
    RTX 40xx). So where any pair lacks peer access, or any GPU is a GeForce RTX 40xx, set NCCL_P2P_DISABLE=1
    (NCCL then goes through host memory). A value the user set is kept.
    """
    env = os.environ if environ is None else environ
    if len(names) < 2:
        return {}, None
    blocked = sorted(pair for pair, ok in peer.items() if not ok)
    geforce_40 = sorted({n for n in names if "RTX 40" in n})
    if not blocked and not geforce_40:
        return {}, None
    reasons = []
    if blocked:
        reasons.append("no peer access between GPUs " + ", ".join(f"{a}->{b}" for a, b in blocked))
    if geforce_40:
        reasons.append(f"{', '.join(geforce_40)} (peer-to-peer is blocked on GeForce RTX 40xx)")
    why = "; ".join(reasons)
    if "NCCL_P2P_DISABLE" in env:
        return {}, f"{why}: keeping NCCL_P2P_DISABLE={env['NCCL_P2P_DISABLE']} as set"
    return {"NCCL_P2P_DISABLE": "1"}, f"{why}: setting NCCL_P2P_DISABLE=1 (NCCL goes through host memory)"
