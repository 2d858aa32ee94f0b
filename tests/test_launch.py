"""snaketune.train.processes and .failures without a training run: how many ranks a grant gives, what a failed
launch says went wrong (from the ranks' output, real torchrun's included), and how a finished rank exits."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from snaketune.train.failures import failure_cause
from snaketune.train.processes import PACKAGE_ROOT, LaunchError, world_size


def test_world_size_checks_the_granted_gpus():
    with pytest.raises(LaunchError, match="--resources gpu"):
        world_size(0, cuda_devices=2)
    with pytest.raises(LaunchError, match="3 GPUs were granted but only 2 are visible"):
        world_size(3, cuda_devices=2)
    assert world_size(2, cuda_devices=2) == 2
    # Without CUDA: as many CPU ranks as granted, and at least one.
    assert world_size(3, cuda_devices=0) == 3
    assert world_size(0, cuda_devices=0) == 1


def test_a_failed_launch_names_the_first_failing_rank_and_its_exception():
    torchrun = """[rank1]: Traceback (most recent call last):
[rank1]:   File "trainer.py", line 9, in <module>
[rank1]: KeyError: 'input_ids'
[rank1]:
[rank1]: During handling of the above exception, another exception occurred:
[rank1]: ValueError: /data/train: no column 'input_ids'
[rank0]: Traceback (most recent call last):
[rank0]: torch.distributed.DistBackendError: [Rank 0]: connection closed by peer
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================"""
    assert failure_cause(torchrun) == "rank 1: ValueError: /data/train: no column 'input_ids'"
    # No exception: rank 1 aborted in C++ at its exit (seen with ZeRO-3 on CPU ranks, before the fix in ranks.py).
    aborted = """2026-12-05 00:23:59,693 rank0 INFO done: {"final_train_loss": 5.56}
terminate called without an active exception
W1205 00:23:59.826000 2820 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1028] Sending process 2826 closing signal SIGTERM
E1205 00:23:59.897000 2820 .venv/lib/python3.11/site-packages/torch/distributed/elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 2827) of binary: /venv/bin/python
Traceback (most recent call last):
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
  exitcode  : -6 (pid: 2827)  (SIGABRT)"""
    assert failure_cause(aborted, tail_lines=2) == (
        "local rank 1 exited with -6 (SIGABRT); last output: "
        '2026-12-05 00:23:59,693 rank0 INFO done: {"final_train_loss": 5.56} | terminate called without an active exception'
    )
    assert failure_cause("") == "last output: <none>"


@pytest.mark.slow
def test_a_failed_launch_names_the_rank_torchrun_saw_fail_first_not_the_ranks_it_took_down(tmp_path):
    """Real torchrun, two CPU ranks: rank 1 raises while rank 0 waits in a collective, so rank 0 fails too, with
    gloo's "connection closed by peer". Ranks write to one log, so their tracebacks can come in either order: the
    cause is rank 1's exception in both, from torchrun's report or, without it, by what rank 0's says."""
    script = tmp_path / "ranks.py"
    script.write_text(
        textwrap.dedent("""
        import time, torch, torch.distributed as dist
        dist.init_process_group("gloo")
        t = torch.ones(1)
        dist.all_reduce(t)
        if dist.get_rank() == 1:
            time.sleep(0.5)
            raise ValueError("/data/train: no column 'input_ids'")
        dist.all_reduce(t)
        """)
    )
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
        capture_output=True,
        text=True,
        timeout=120,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "[rank0]: RuntimeError" in output and "closed by peer" in output, output
    expected = "rank 1: ValueError: /data/train: no column 'input_ids'"
    assert failure_cause(output) == expected
    # Rank 0's traceback first, as it can land when tracebacks interleave: torchrun's report still names rank 1 ...
    lines = output.splitlines()
    reordered = [line for line in lines if line.startswith("[rank0]")] + [
        line for line in lines if not line.startswith("[rank0]")
    ]
    assert failure_cause("\n".join(reordered)) == expected
    # ... and where that report is cut off, rank 0's exception says it is the fallout of another rank's exit.
    cut = "\n".join(reordered).split("Root Cause")[0]
    assert failure_cause(cut) == expected


def test_a_rank_that_succeeded_runs_the_exit_handlers_but_does_not_finalize_the_interpreter():
    """snaketune.train.ranks.exit_unfinalized: a ZeRO-3 rank's gloo threads can outlive the process group and abort
    the interpreter's finalization (SIGABRT after a finished run); the handlers and the output must survive."""
    script = f"""
import atexit, sys
sys.path.insert(0, {str(PACKAGE_ROOT)!r})
from snaketune.train.ranks import exit_unfinalized
class Late:
    def __del__(self):
        print("finalized", flush=True)
keep = Late()  # a module global: freed only by the interpreter's finalization
atexit.register(print, "atexit handler", flush=True)
sys.stdout.write("no newline, still in the buffer | ")
exit_unfinalized(3)
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "no newline, still in the buffer | atexit handler\n"), (
        proc.stderr
    )
