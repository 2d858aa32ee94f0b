"""snaketune.train.hosts: SLURM node lists, GPU ids and the multi-node torchrun rendezvous, from made-up environments."""

from __future__ import annotations

import os

import pytest

from snaketune.train import hosts
from snaketune.train.hosts import Allocation, HostsError, expand_nodelist


@pytest.mark.parametrize(
    ("nodelist", "expected"),
    [
        ("localhost", ["localhost"]),
        ("node1,node2", ["node1", "node2"]),
        ("node[1-2]", ["node1", "node2"]),
        ("node[01-03,07],gpu-a5", ["node01", "node02", "node03", "node07", "gpu-a5"]),
        ("gpu-a5,node[08-10]", ["gpu-a5", "node08", "node09", "node10"]),
        ("n[9-11]", ["n9", "n10", "n11"]),
        ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
        ("a[0001-0002],b[3],c", ["a0001", "a0002", "b3", "c"]),
        ("node-1.cluster.local", ["node-1.cluster.local"]),
    ],
)
def test_expand_nodelist(nodelist, expected):
    assert expand_nodelist(nodelist) == expected


@pytest.mark.parametrize("bad", ["", "node[1-2", "node1-2]", "node[a-b]", "node[3-1]", "node[]"])
def test_bad_nodelists_are_refused(bad):
    with pytest.raises(HostsError):
        expand_nodelist(bad)


def slurm_env(**extra: str) -> dict[str, str]:
    return {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NODELIST": "node[01-03,07],gpu-a5",
        "SLURM_NODEID": "0",
        **extra,
    }


def test_outside_slurm_there_is_no_allocation():
    assert Allocation.from_env({"CUDA_VISIBLE_DEVICES": "0,1"}) is None


@pytest.mark.parametrize(
    ("extra", "gpus"),
    [
        (
            {"CUDA_VISIBLE_DEVICES": "0,1,2", "SLURM_JOB_GPUS": "4,5,6"},
            ("0", "1", "2"),
        ),  # what CUDA sees wins
        ({"SLURM_STEP_GPUS": "2,3", "SLURM_JOB_GPUS": "0,1,2,3"}, ("2", "3")),
        ({"SLURM_JOB_GPUS": "5"}, ("5",)),
        ({"SLURM_GPUS_ON_NODE": "2"}, ("0", "1")),
        ({"CUDA_VISIBLE_DEVICES": ""}, ()),
        ({}, ()),
    ],
)
def test_gpu_ids_from_slurm(extra, gpus):
    assert Allocation.from_env(slurm_env(**extra)).gpus == gpus


@pytest.mark.parametrize(
    ("nodelist", "node_id", "master", "host"),
    [
        ("node[01-03,07],gpu-a5", "3", "node01", "node07"),
        ("gpu-a5,node[08-10]", "0", "gpu-a5", "gpu-a5"),
        ("node[1-2]", "1", "node1", "node2"),
        ("localhost", "0", "localhost", "localhost"),
    ],
)
def test_rendezvous_from_slurm_variables(nodelist, node_id, master, host):
    env = slurm_env(SLURM_JOB_NODELIST=nodelist, SLURM_NODEID=node_id, CUDA_VISIBLE_DEVICES="0,1,2,3")
    alloc = Allocation.from_env(env)
    n = len(expand_nodelist(nodelist))
    assert alloc.master == master and alloc.hosts[alloc.node_rank] == host
    args = hosts.torchrun_args(
        nnodes=n,
        node_rank=alloc.node_rank,
        master=alloc.master,
        port=alloc.port,
        nproc_per_node=len(alloc.gpus),
        run_id=alloc.job_id,
    )
    assert " ".join(args) == (
        f"--nnodes {n} --node_rank {node_id} --nproc_per_node 4 --rdzv_backend c10d "
        f"--rdzv_endpoint {master}:{hosts.PORT_BASE + 4242} --rdzv_id 4242"
    )


def test_every_node_of_a_job_agrees_on_the_rendezvous():
    envs = [slurm_env(SLURM_NODEID=str(i)) for i in range(5)]
    points = {(a.master, a.port) for a in map(Allocation.from_env, envs)}
    assert points == {("node01", hosts.PORT_BASE + 4242)}
    assert [Allocation.from_env(e).node_rank for e in envs] == [0, 1, 2, 3, 4]


def test_port_differs_between_jobs_and_stays_unprivileged_and_below_the_ephemeral_range():
    ports = [hosts.rendezvous_port(job) for job in range(1, 30001)]
    assert min(ports) >= 1024 and max(ports) < 32768
    assert hosts.rendezvous_port(101) != hosts.rendezvous_port(102)


def test_inside_the_jobstep_step_the_longer_node_list_is_the_jobs():
    # Seen with Slurm 22.05 in the step snakemake-executor-plugin-slurm-jobstep starts (`srun -n1` with
    # SLURM_* cleared): SLURM_JOB_NODELIST names the step's node, SLURM_NODELIST the job's.
    env = slurm_env(SLURM_JOB_NODELIST="node1", SLURM_NODELIST="node[1-2]")
    assert Allocation.from_env(env).hosts == ("node1", "node2")


def test_node_id_outside_the_job_is_refused():
    with pytest.raises(HostsError, match="SLURM_NODEID=9"):
        Allocation.from_env(slurm_env(SLURM_JOB_NODELIST="node[1-2]", SLURM_NODEID="9"))


def test_srun_starts_one_launcher_per_node_sharing_the_step():
    cmd = hosts.srun_command("4242", 3)
    assert cmd[0] == "srun"
    assert {"--jobid=4242", "--overlap", "--nodes=3", "--ntasks=3", "--ntasks-per-node=1"} <= set(cmd)


def test_srun_env_drops_the_steps_variables_and_keeps_the_jobs():
    env = {
        "SLURM_JOB_ID": "7",
        "SLURM_CONF": "/x/slurm.conf",
        "SLURM_NTASKS": "1",
        "SLURM_CPUS_PER_TASK": "16",
        "SLURM_STEP_GPUS": "0",
        "SRUN_CPUS_PER_TASK": "16",
        "SBATCH_GRES": "gpu:1",
        "CUDA_VISIBLE_DEVICES": "0",
        "PATH": "/bin",
    }
    assert hosts.srun_env(env) == {
        "SLURM_JOB_ID": "7",
        "SLURM_CONF": "/x/slurm.conf",
        "CUDA_VISIBLE_DEVICES": "0",
        "PATH": "/bin",
    }


@pytest.mark.parametrize(
    ("slurm", "expected"),
    [
        ({}, "train.nodes=2 needs a SLURM job of 2 nodes"),
        ({"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "gpu-a5"}, "SLURM job 7 has 1 node"),
    ],
    ids=["outside-slurm", "too-few-nodes"],
)
def test_launcher_refuses_several_nodes_without_them(tmp_path, monkeypatch, slurm, expected):
    from snaketune.train.launch import LaunchError, launch

    for name in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(name)
    for name, value in slurm.items():
        monkeypatch.setenv(name, value)
    spec = tmp_path / "run-spec.json"
    with pytest.raises(LaunchError, match=expected):
        launch({"experiment": "x"}, spec, granted=1, log_file=tmp_path / "log", threads=1, nodes=2)
    assert not spec.exists()  # refused before anything was written or started


def test_ranks_run_the_launching_workflows_own_package(tmp_path):
    """A workflow copied elsewhere (tests do it; so does a user with two checkouts) launches ranks that import its
    own snaketune, not the one installed in the environment (`pip install -e .` points at the checkout)."""
    import subprocess
    import sys

    from conftest import copy_workflow

    copy = copy_workflow(tmp_path / "copy")
    ask = "import sys; sys.path.insert(0, sys.argv[1]); from snaketune.train.processes import rank_pythonpath as r; print(r({}))"
    pythonpath = subprocess.run(
        [sys.executable, "-c", ask, str(copy / "workflow")], capture_output=True, text=True, check=True
    ).stdout.strip()
    where = subprocess.run(
        [sys.executable, "-c", "import snaketune; print(snaketune.__file__)"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    assert os.path.realpath(where) == os.path.realpath(copy / "workflow/snaketune/__init__.py"), (
        pythonpath,
        where,
    )
