"""The workflow through a real SLURM cluster: scripts/slurm_cluster.sh starts one on this machine (munged,
slurmctld, slurmd; fake GPUs as GRES), and the real `snakemake --profile workflow/profiles/slurm` runs the
embedded default (tests/configs/fast.yaml) up to training through snakemake-executor-plugin-slurm.

Where network namespaces work, the cluster has two nodes (the second slurmd in a namespace of its own)
and a second experiment trains with train.nodes: 2, one torchrun per node meeting at a c10d rendezvous.
The ranks run on CPU (no CUDA here), but the GPUs are SLURM's: the launcher logs the ids SLURM gave.

Without the SLURM binaries (apt-get install slurmctld slurmd slurm-client munge) or root, or where the two-node
cluster does not start: a failure in CI (.ci/run installs them and runs as root), a skip with the reason on a user's
machine (conftest.needs). Bounded: every command has a timeout (snakemake is SIGKILLed with its process group on overrun)
and the cluster is stopped, its jobs cancelled, whatever happens.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from conftest import (
    FAST_CONFIG,
    REPO,
    Result,
    copy_workflow,
    file_bytes,
    finish,
    kill_everything,
    needs,
    start,
)
from snaketune.train import hosts

pytestmark = pytest.mark.slow

CLUSTER_SCRIPT = REPO / "scripts" / "slurm_cluster.sh"
SLURM_BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scancel", "scontrol", "sinfo")
CLUSTER_TIMEOUT_S = 90  # start or stop; about 5 s here
RUN_TIMEOUT_S = 360  # the SLURM run; about 2.5 min here (the plugin polls at 1, 12, 33, 64, 105 s)
LOCAL_TIMEOUT_S = 240
FAKE_GPUS = 4  # per node: the one-node experiment takes 3, the two-node one 1 per node, so both run at once
EXPERIMENT = "default"
TWO_NODE = "twonode"


def _missing() -> str | None:
    missing = [b for b in SLURM_BINARIES if shutil.which(b) is None]
    if missing:
        return (
            f"SLURM is not installed (missing {', '.join(missing)}): "
            "apt-get install slurmctld slurmd slurm-client munge"
        )
    if os.geteuid() != 0:
        return "starting a SLURM cluster needs root"
    conf = Path("/etc/slurm/slurm.conf")
    if conf.exists() and not conf.is_symlink():
        return (
            f"{conf} exists: this machine has a SLURM setup of its own, which the test cluster would shadow"
        )
    return None


def _two_nodes_possible() -> str | None:
    """None when a second node can be made (a network and UTS namespace), else why not."""
    for tool in ("ip", "nsenter", "unshare"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    probe = subprocess.run(["unshare", "--net", "--uts", "true"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"no network namespaces here: {probe.stderr.strip()}"
    return None


def cluster(command: str, state: Path, nodes: int) -> subprocess.CompletedProcess:
    """scripts/slurm_cluster.sh; subprocess.run SIGKILLs it on timeout."""
    env = {**os.environ, "SLURM_CLUSTER_NODES": str(nodes), "SLURM_FAKE_GPUS": str(FAKE_GPUS)}
    return subprocess.run(
        ["bash", str(CLUSTER_SCRIPT), command, str(state)],
        capture_output=True,
        text=True,
        timeout=CLUSTER_TIMEOUT_S,
        env=env,
    )


@dataclass(frozen=True)
class SlurmRun:
    nodes: int
    two_node_skip: str | None
    slurm: Result
    slurm_dir: Path
    local_dir: Path
    restart: subprocess.CompletedProcess  # a second `start` while running


@pytest.fixture(scope="module")
def slurm_run(tmp_path_factory) -> SlurmRun:
    needs(_missing())
    state = tmp_path_factory.mktemp("slurm_state")
    two_node_skip = _two_nodes_possible()
    nodes = 1 if two_node_skip else 2
    running = []
    try:
        started = cluster("start", state, nodes)
        if started.returncode != 0 and nodes == 2:
            two_node_skip = f"the two-node cluster did not start: {started.stderr.strip()[-500:]}"
            cluster("stop", state, nodes)
            nodes = 1
            started = cluster("start", state, nodes)
        assert started.returncode == 0, started.stdout + started.stderr
        conf = started.stdout.strip().removeprefix("export SLURM_CONF=")
        assert Path(conf).is_file(), started.stdout
        restart = cluster("start", state, nodes)

        # The same configuration for both runs; a second experiment on two nodes where there are two.
        configs = tmp_path_factory.mktemp("slurm_configs")
        fast = configs / "fast.yaml"
        shutil.copy2(FAST_CONFIG, fast)
        experiments = {EXPERIMENT: {}}
        if nodes == 2:
            experiments[TWO_NODE] = {"train": {"nodes": 2, "gpus": 1, "max_steps": 8}}
        overlay = configs / "experiments.yaml"
        overlay.write_text(json.dumps({"experiments": experiments}))  # JSON is YAML
        targets = [f"results/train/{name}/summary.json" for name in experiments]

        slurm_dir = copy_workflow(tmp_path_factory.mktemp("slurm_run"))
        local_dir = copy_workflow(tmp_path_factory.mktemp("local_data"))
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("SLURM_CONF", conf)
            t0 = time.monotonic()
            on_slurm = start(
                slurm_dir,
                *targets,
                "--profile",
                "workflow/profiles/slurm",
                "--configfile",
                str(fast),
                str(overlay),
            )
            running.append(on_slurm)
            # The local run of the data stages meanwhile: the SLURM run mostly waits for status polls.
            local = start(
                local_dir,
                targets[0],
                "--until",
                "tokenize",
                "--cores",
                "2",
                "--configfile",
                str(fast),
                str(overlay),
            )
            running.append(local)
            finish(local, LOCAL_TIMEOUT_S)
            # With two experiments the one-node checks still report when the two-node one fails.
            result = finish(on_slurm, RUN_TIMEOUT_S, check=nodes == 1)
            print(f"SLURM run: {time.monotonic() - t0:.0f} s")
        yield SlurmRun(nodes, two_node_skip, result, slurm_dir, local_dir, restart)
    finally:
        for run in running:  # still running only when a check above failed
            if run.proc.poll() is None:
                kill_everything(run.proc)
        stopped = cluster("stop", state, nodes)
        assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def read(run: SlurmRun, relative: str) -> str:
    path = run.slurm_dir / relative
    assert path.is_file(), f"{relative} is missing; snakemake said:\n{run.slurm.output[-4000:]}"
    return path.read_text()


def train_log(run: SlurmRun, experiment: str) -> str:
    return read(run, f"logs/train/{experiment}.log")


def summary(run: SlurmRun, experiment: str) -> dict:
    return json.loads(read(run, f"results/train/{experiment}/summary.json"))


def slurm_job_ids(result: Result, kind: str) -> list[str]:
    """SLURM job ids the plugin reported for `rule_<name>` or `group_<name>` jobs, from their log paths
    (.snakemake/slurm_logs/rule_train/default/7.log, .../group_data_conversations_download_.../5.log)."""
    return re.findall(rf"submitted with SLURM jobid (\d+) \(log: \S*/{kind}[\w/]*/\d+\.log\)", result.output)


def test_cluster_start_is_idempotent(slurm_run):
    assert slurm_run.restart.returncode == 0, slurm_run.restart.stderr
    assert slurm_run.restart.stdout.startswith("export SLURM_CONF=")


def test_every_job_was_a_slurm_job(slurm_run):
    out = slurm_run.slurm.output
    submitted = re.findall(r"has been submitted with SLURM jobid (\d+)", out)
    # One group job for the four data stages (the profile's `groups`), one per training.
    trainings = 2 if slurm_run.nodes == 2 else 1
    assert len(submitted) == 1 + trainings, out[-4000:]
    assert len(slurm_job_ids(slurm_run.slurm, "group_data")) == 1, out[-4000:]
    assert len(slurm_job_ids(slurm_run.slurm, "rule_train")) == trainings, out[-4000:]


def test_training_got_its_gpus_from_slurm(slurm_run):
    log = train_log(slurm_run, EXPERIMENT)
    match = re.search(
        r"SLURM job (\d+): node 0 of 1 \((\S+)\), GPUs from SLURM: ([\d,]+) \(CUDA_VISIBLE_DEVICES=([\d,]*)\)",
        log,
    )
    assert match, log[-3000:]
    job_id, _host, gpus, cuda_visible = match.groups()
    assert gpus == cuda_visible and len(gpus.split(",")) == 3  # train.gpus: 3, SLURM --gpus=3
    assert job_id in slurm_job_ids(slurm_run.slurm, "rule_train"), slurm_run.slurm.output[-4000:]
    assert "--nproc_per_node=3" in log  # one rank per SLURM GPU (on CPU: no CUDA here)
    s = summary(slurm_run, EXPERIMENT)
    assert s["world_size"] == 3 and s["final_train_loss"] < 6.0


def test_data_stages_equal_a_local_run(slurm_run):
    a, b = slurm_run.slurm_dir / "results", slurm_run.local_dir / "results"
    for sub in ("data", "tokenized"):
        files_a, files_b = file_bytes(a / sub), file_bytes(b / sub)
        assert files_a, sub
        assert sorted(files_a) == sorted(files_b), sub
        differ = [name for name in files_a if files_a[name] != files_b[name]]
        assert not differ, f"{sub}: files differ between the SLURM and the local run: {differ}"


def test_two_node_training(slurm_run):
    needs(slurm_run.two_node_skip and f"one node only: {slurm_run.two_node_skip}")
    log = train_log(slurm_run, TWO_NODE)
    assert re.search(r"srun --jobid=\d+ --overlap --nodes=2 --ntasks=2 --ntasks-per-node=1", log), log[-3000:]
    nodes = {}
    for rank in (0, 1):
        node = re.search(
            rf"SLURM job (\d+): node {rank} of 2 \((\S+)\), GPUs from SLURM: (\d+): 1 rank\(s\); .*"
            rf"--nnodes 2 --node_rank {rank} --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint (\S+) ",
            log,
        )
        assert node, log[-3000:]
        job_id, host, _gpu, endpoint = node.groups()
        nodes[host] = endpoint
    # Both nodes meet at the first node, on the port the job id gives.
    assert set(nodes) == {"node1", "node2"}, nodes
    assert set(nodes.values()) == {f"node1:{hosts.rendezvous_port(job_id)}"}, nodes
    s = summary(slurm_run, TWO_NODE)
    assert s["world_size"] == 2, s  # 1 rank on each of 2 nodes
    assert s["final_train_loss"] < 6.0, s
