"""GPU assignment (snaketune.gpus) with fake GPU ids: concurrent jobs never share a GPU, a killed job's GPUs
are free again, an inherited CUDA_VISIBLE_DEVICES (or SLURM's list) is respected; and the real workflow
runs two experiments at once on disjoint GPUs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
from datetime import datetime
from pathlib import Path

import pytest

from conftest import copy_workflow, needs
from snaketune import gpus

REPO = Path(__file__).resolve().parent.parent
FAKE = {gpus.ENV_FAKE: "0,1,2,3"}


def holder_script(n: int, hold_s: float, out: Path) -> str:
    """A separate process that takes `n` GPUs, records which and when, and holds them for `hold_s`."""
    return textwrap.dedent(
        f"""
        import json, time
        from snaketune import gpus
        alloc = gpus.allocate({n}, label="holder")
        start = time.time()
        print("held", flush=True)
        time.sleep({hold_s})
        end = time.time()
        alloc.release()
        open({str(out)!r}, "w").write(json.dumps({{"ids": alloc.ids, "start": start, "end": end}}))
        """
    )


def spawn(code: str, lock_dir: Path, **env) -> subprocess.Popen:
    full = {
        **os.environ,
        **FAKE,
        gpus.ENV_LOCK_DIR: str(lock_dir),
        "PYTHONPATH": str(REPO / "workflow"),
        **env,
    }
    full.pop("CUDA_VISIBLE_DEVICES", None)
    return subprocess.Popen([sys.executable, "-c", code], env=full, stdout=subprocess.PIPE, text=True)


# ---- candidates ----------------------------------------------------------------------------------------------


def test_candidates_follow_the_environment():
    assert gpus.candidates(FAKE).ids == ("0", "1", "2", "3")
    # An inherited CUDA_VISIBLE_DEVICES narrows the (fake) GPUs as it would real ones; empty means none.
    assert gpus.candidates({**FAKE, "CUDA_VISIBLE_DEVICES": "2,3"}).ids == ("2", "3")
    assert gpus.candidates({**FAKE, "CUDA_VISIBLE_DEVICES": ""}).ids == ()
    # SLURM's own list when it set no CUDA_VISIBLE_DEVICES; CUDA_VISIBLE_DEVICES first when it did.
    assert gpus.candidates({**FAKE, "SLURM_STEP_GPUS": "1,3"}).ids == ("1", "3")
    assert gpus.candidates({**FAKE, "SLURM_JOB_GPUS": "0", "CUDA_VISIBLE_DEVICES": "2"}).ids == ("2",)
    # The workflow's own list (config gpu_ids / SNAKETUNE_GPUS) narrows further.
    assert gpus.candidates({**FAKE, gpus.ENV_GPUS: "3,1"}).ids == ("1", "3")
    with pytest.raises(gpus.GpuError, match="names none of the GPUs"):
        gpus.candidates({**FAKE, "CUDA_VISIBLE_DEVICES": "0,1", gpus.ENV_GPUS: "2"})
    # Real GPUs: in CUDA's order, cut to what CUDA shows; torch device index = position in the list.
    real = gpus.candidates({"CUDA_VISIBLE_DEVICES": "5,7"}, count=2)
    assert (real.ids, real.fake, real.position("7")) == (("5", "7"), False, 1)
    assert gpus.candidates({}, count=3).ids == ("0", "1", "2")
    assert gpus.candidates({}, count=0).ids == ()
    assert gpus.parse_ids("0, 1,-1,2") == ["0", "1"]
    assert gpus.parse_ids("NoDevFiles") == []


def test_lock_dir_is_per_slurm_job(tmp_path):
    assert gpus.lock_dir({}) == Path(gpus.DEFAULT_LOCK_DIR)
    assert gpus.lock_dir({"SLURM_JOB_ID": "42"}) == Path(gpus.DEFAULT_LOCK_DIR + "-slurm42")
    assert gpus.lock_dir({gpus.ENV_LOCK_DIR: str(tmp_path), "SLURM_JOB_ID": "42"}) == tmp_path


def test_existing_cuda_visible_devices_is_respected(tmp_path):
    env = {**FAKE, "CUDA_VISIBLE_DEVICES": "2,3", gpus.ENV_LOCK_DIR: str(tmp_path)}
    with gpus.allocate(2, label="job", environ=env) as alloc:
        assert alloc.ids == ("2", "3")
        # Fake GPUs: the job's processes see no CUDA device and run on CPU.
        assert alloc.env() == {"CUDA_VISIBLE_DEVICES": "", gpus.ENV_ASSIGNED: "2,3"}
    with pytest.raises(gpus.GpuError, match="needs 3 GPU"):
        gpus.allocate(3, label="job", environ=env)


# ---- locks ---------------------------------------------------------------------------------------------------


def test_concurrent_jobs_never_share_a_gpu(tmp_path):
    """Three jobs of 2 GPUs on 4: two run at once on disjoint GPUs, the third waits for one of them."""
    outs = [tmp_path / f"job{i}.json" for i in range(3)]
    procs = [spawn(holder_script(2, 1.5, out), tmp_path / "locks") for out in outs]
    for p in procs:
        assert p.wait(timeout=60) == 0
    jobs = [json.loads(out.read_text()) for out in outs]
    overlapping = 0
    for i, a in enumerate(jobs):
        for b in jobs[i + 1 :]:
            if a["start"] < b["end"] and b["start"] < a["end"]:
                overlapping += 1
                assert not set(a["ids"]) & set(b["ids"]), (a, b)
    assert overlapping >= 1, jobs  # two ran at once
    starts = sorted(j["start"] for j in jobs)
    ends = sorted(j["end"] for j in jobs)
    assert starts[2] >= ends[0] - 0.05, jobs  # the third started only when a pair was freed


def test_a_killed_jobs_gpus_are_free_again(tmp_path):
    locks = tmp_path / "locks"
    holder = spawn(holder_script(4, 600, tmp_path / "never.json"), locks)
    try:
        assert holder.stdout.readline().strip() == "held"
        pool = gpus.candidates(FAKE)
        with pytest.raises(gpus.GpuError, match=rf"only 0 of 0,1,2,3 were free .*pid {holder.pid}"):
            gpus.acquire(pool, 1, directory=locks, label="waiter", timeout_s=0.6, poll_s=0.1)
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=10)
        # The kernel released the flocks with the killed process's files.
        with gpus.acquire(pool, 4, directory=locks, label="next", timeout_s=5, poll_s=0.1) as alloc:
            assert alloc.ids == ("0", "1", "2", "3")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def test_a_waiting_job_gets_gpus_when_they_are_freed(tmp_path, caplog):
    locks = tmp_path / "locks"
    holder = spawn(holder_script(3, 1.0, tmp_path / "holder.json"), locks)
    assert holder.stdout.readline().strip() == "held"
    with caplog.at_level("INFO", logger="snaketune.gpus"):
        alloc = gpus.acquire(
            gpus.candidates(FAKE), 2, directory=locks, label="waiter", timeout_s=30, poll_s=0.1
        )
    holder.wait(timeout=30)
    with alloc:
        assert len(alloc.ids) == 2
    assert "waiting for 2 GPU(s) for waiter: 1 of 0,1,2,3 free" in caplog.text
    assert "after waiting" in caplog.text


def test_in_process_sets_cuda_visible_devices(tmp_path, monkeypatch):
    # in_process() sets variables for the rest of its process: give it a copy, so no later test sees them.
    monkeypatch.setattr(os, "environ", dict(os.environ))
    monkeypatch.setenv(gpus.ENV_FAKE, "0,1")
    monkeypatch.setenv(gpus.ENV_LOCK_DIR, str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    with gpus.in_process(1, label="evaluate x") as alloc:
        assert alloc.ids == ("0",)
        assert os.environ["CUDA_VISIBLE_DEVICES"] == ""  # fake: CPU
        assert os.environ[gpus.ENV_ASSIGNED] == "0"
    assert alloc.fds == []
    with gpus.in_process(0, label="evaluate x") as alloc:  # --resources gpu=0: no GPU at all
        assert alloc.ids == () and os.environ["CUDA_VISIBLE_DEVICES"] == ""


# ---- devices -------------------------------------------------------------------------------------------------


def test_nccl_p2p_decision():
    h200 = ["NVIDIA H200", "NVIDIA H200"]
    assert gpus.nccl_p2p_env(h200, {(0, 1): True, (1, 0): True}, {}) == ({}, None)
    assert gpus.nccl_p2p_env(["NVIDIA H200"], {}, {}) == ({}, None)  # one GPU: no NCCL peer traffic
    env, why = gpus.nccl_p2p_env(h200, {(0, 1): False, (1, 0): True}, {})
    assert env == {"NCCL_P2P_DISABLE": "1"} and "no peer access between GPUs 0->1" in why
    # GeForce RTX 40xx: disabled even where the driver reports peer access (DeepSpeed#4433).
    rtx = ["NVIDIA GeForce RTX 4090"] * 3
    env, why = gpus.nccl_p2p_env(rtx, dict.fromkeys([(0, 1), (0, 2), (1, 2)], True), {})
    assert env == {"NCCL_P2P_DISABLE": "1"} and "RTX 40xx" in why
    # A value the user set is kept, and said so.
    env, why = gpus.nccl_p2p_env(rtx, {(0, 1): False}, {"NCCL_P2P_DISABLE": "0"})
    assert env == {} and "keeping NCCL_P2P_DISABLE=0" in why


def test_gpu_memory_gib_is_a_card_and_the_allocator_gets_what_lies_outside_it_less():
    """A card's memory, by number or name; a process keeps 0.5 GiB of it for the driver; the allocator's cap leaves
    room for what was measured outside it and for the kernel modules loaded later."""
    from snaketune import device_memory as dm

    assert dm.card_gib("rtx4090") == dm.card_gib("RTX4090") == 24564 / 1024
    assert dm.card_gib(24) == 24.0 and dm.usable_gib(24) == 23.5
    for bad in ("rtx9090", 0, -1, True, 0.5):
        with pytest.raises(ValueError, match="allowed: a number of GiB > 0.5"):
            dm.card_gib(bad)
    h200 = 143771 * 2**20
    # 23.5 GiB usable, 1.2 GiB measured outside the allocator, LAZY_MODULES_GIB for modules loaded later.
    cap = dm.allocator_fraction(23.5, 1.2, h200) * h200 / 2**30
    assert cap == pytest.approx(23.5 - 1.2 - dm.LAZY_MODULES_GIB)
    assert dm.allocator_fraction(500, 1.2, h200) == 1.0 and dm.allocator_fraction(1.0, 1.2, h200) == 0.0
    assert dm.card_from_env({dm.ENV_MEMORY_CAP: "24"}) == 24.0 and dm.card_from_env({}) is None


def test_the_step_in_backward_gets_expandable_segments_unless_the_user_configured_the_allocator():
    """Only `train.optimizer_step: in_backward` changes PyTorch's allocator defaults, and a user's
    PYTORCH_CUDA_ALLOC_CONF or PYTORCH_ALLOC_CONF (even one that says nothing of segments) is left to rule."""
    from snaketune import device_memory as dm

    assert dm.allocator_settings(True, {}) == "expandable_segments:True"
    assert dm.allocator_settings(False, {}) is None
    for env in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"):
        assert dm.allocator_settings(True, {env: "max_split_size_mb:512"}) is None
    assert dm.allocator_settings(True, {"PYTORCH_CUDA_ALLOC_CONF": ""}) == "expandable_segments:True"
    # A CPU rank: nothing to set, and no error.
    dm.set_allocator(type("Cpu", (), {"type": "cpu"})(), "expandable_segments:True")


# ---- the workflow ----------------------------------------------------------------------------------------------

TWO_EXPERIMENTS = """
train: {gpus: 2, max_steps: 4, global_batch_size: 4, micro_batch_size: 2, checkpoint_every: 0, log_every: 2,
        eval_every: 0}
experiments: {first: {}, second: {}}
"""
ASSIGNED = re.compile(r"^(\S+ \S+) INFO snaketune\.gpus: GPUs (assigned|released): ([\w,-]+)", re.MULTILINE)


@pytest.mark.slow
def test_two_experiments_train_at_once_on_disjoint_gpus(tmp_path):
    """Two 2-GPU experiments under --resources gpu=4 (fake ids 0-3, CPU ranks): both train at the same time,
    each on GPUs of its own, as their train logs show."""
    workdir = copy_workflow(tmp_path / "wf")
    extra = tmp_path / "two.yaml"
    extra.write_text(TWO_EXPERIMENTS)
    env = {**os.environ, **FAKE, gpus.ENV_LOCK_DIR: str(tmp_path / "locks")}
    env.pop("CUDA_VISIBLE_DEVICES", None)
    cmd = [
        str(Path(sys.executable).parent / "snakemake"),
        "results/train/first/summary.json",
        "results/train/second/summary.json",
        "--cores",
        "2",
        "--resources",
        "gpu=4",
        "--configfile",
        str(REPO / "tests/configs/fast.yaml"),
        str(extra),
    ]
    proc = subprocess.run(cmd, cwd=workdir, env=env, capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    spans = {}
    for name in ("first", "second"):
        text = (workdir / f"logs/train/{name}.log").read_text()
        events = {kind: (stamp, ids) for stamp, kind, ids in ASSIGNED.findall(text)}
        assert {"assigned", "released"} <= events.keys(), text[-2000:]
        assert events["assigned"][1] == events["released"][1]
        assert "--nproc_per_node=2" in text
        spans[name] = (
            set(events["assigned"][1].split(",")),
            *(datetime.strptime(events[k][0], "%Y-%m-%d %H:%M:%S,%f") for k in ("assigned", "released")),
        )
    (ids_a, start_a, end_a), (ids_b, start_b, end_b) = spans["first"], spans["second"]
    assert len(ids_a) == len(ids_b) == 2
    assert start_a < end_b and start_b < end_a, spans  # they held their GPUs at the same time
    assert not ids_a & ids_b, spans
    # Each took half the cores (train_threads): Snakemake could run both on --cores 2.
    # Snakemake prints a job's indented attributes after its rule line, `threads:` only where it is above 1.
    train_jobs = re.findall(r"rule train:\n((?:    .*\n)+)", proc.stderr)
    assert len(train_jobs) == 2, proc.stderr[-4000:]
    assert not [job for job in train_jobs if re.search(r"threads: (?!1\n)", job)], train_jobs


FAKE_LIBCUDA = r"""
#include <stdlib.h>
#include <string.h>
#include <stdio.h>
/* The driver calls snaketune.cuda_driver makes, answering from FAKE_CUDA_DEVICES ("name:GiB,name:GiB,...");
   FAKE_CUDA_INIT is cuInit's CUresult. Peer access: between devices of the same name. */
static char names[8][64]; static long long mem[8]; static int n = 0;
int cuInit(unsigned flags) {
    const char *rc = getenv("FAKE_CUDA_INIT"), *spec = getenv("FAKE_CUDA_DEVICES");
    if (rc && atoi(rc)) return atoi(rc);
    char buf[512]; strncpy(buf, spec ? spec : "", sizeof buf - 1); buf[sizeof buf - 1] = 0;
    for (char *tok = strtok(buf, ","); tok && n < 8; tok = strtok(NULL, ",")) {
        char *colon = strchr(tok, ':'); *colon = 0;
        strncpy(names[n], tok, 63); mem[n] = atoll(colon + 1) << 30; n++;
    }
    return n ? 0 : 100;
}
int cuDeviceGetCount(int *count) { *count = n; return 0; }
int cuDeviceGet(int *dev, int ordinal) { if (ordinal < 0 || ordinal >= n) return 101; *dev = ordinal; return 0; }
int cuDeviceGetName(char *out, int len, int dev) { strncpy(out, names[dev], len); return 0; }
int cuDeviceTotalMem_v2(size_t *bytes, int dev) { *bytes = (size_t)mem[dev]; return 0; }
int cuDeviceCanAccessPeer(int *can, int a, int b) { *can = strcmp(names[a], names[b]) == 0; return 0; }
int cuGetErrorName(int rc, const char **s) { *s = rc == 999 ? "CUDA_ERROR_UNKNOWN" : "OTHER"; return 0; }
"""


def test_the_launcher_asks_the_cuda_driver_without_importing_torch(tmp_path):
    """The rule's process counts, names and sizes the GPUs through libcuda (snaketune.cuda_driver), never torch:
    a fake driver built here answers, and torch stays unimported; no driver or a failing cuInit means no GPU."""
    needs(shutil.which("gcc") is None and "gcc is not installed: it builds the fake CUDA driver")
    src = tmp_path / "fake_cuda.c"
    src.write_text(FAKE_LIBCUDA)
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True)
    (tmp_path / "nvidia-smi").write_text("#!/bin/sh\necho 'GPU 0: fake'\n")
    (tmp_path / "nvidia-smi").chmod(0o755)
    probe = textwrap.dedent(
        """
        import json, sys
        from snaketune import cuda_driver, gpus
        cuda_driver.LIBRARY = sys.argv[1]
        n = gpus.cuda_device_count()
        devices = gpus.cuda_devices(range(n)) if n else []
        peer = gpus.peer_access(list(range(n))) if n else {}
        print(json.dumps({"n": n, "devices": [[d.name, d.total_gib] for d in devices],
                          "peer": sorted(f"{a}{b}" for (a, b), ok in peer.items() if ok),
                          "torch": "torch" in sys.modules}))
        """
    )

    def ask(library: Path, **env) -> dict:
        proc = subprocess.run(
            [sys.executable, "-c", probe, str(library)],
            env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", **env},
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(proc.stdout)

    got = ask(lib, FAKE_CUDA_DEVICES="RTX 4090:24,RTX 4090:24,RTX 3090:24")
    assert got == {
        "n": 3,
        "devices": [["RTX 4090", 24.0], ["RTX 4090", 24.0], ["RTX 3090", 24.0]],
        "peer": ["01", "10"],
        "torch": False,
    }
    assert ask(lib, FAKE_CUDA_DEVICES="")["n"] == 0  # cuInit: CUDA_ERROR_NO_DEVICE
    assert ask(lib, FAKE_CUDA_DEVICES="H200:139", FAKE_CUDA_INIT="999")["n"] == 0
    assert ask(tmp_path / "absent.so")["n"] == 0


def test_a_memory_cap_the_run_cannot_enforce_is_refused(caplog):
    """gpu_memory_gib on a GPU where NVML does not answer: the memory outside PyTorch's allocator cannot be measured,
    and a cap on the allocator alone overshoots the card (docs/facts.md), so the rank stops, naming the key and what
    would make it work, instead of warning and running over budget."""
    import torch

    from snaketune import device_memory

    with pytest.raises(RuntimeError) as e:
        device_memory.cap_allocator(torch.device("cuda", 0), 24.0, None)
    assert str(e.value).startswith(
        "config key 'gpu_memory_gib': 24 GiB cannot be enforced on cuda:0: NVML is not"
    )
    assert "nvidia-ml-py==13.615.71" in str(e.value) and "gpu_memory_gib: null" in str(e.value)
    assert device_memory.cap_allocator(torch.device("cuda", 0), None, None) == (
        None,
        {},
    )  # no cap asked: runs
