"""A process computing on the CPU reuses its large blocks from step to step instead of faulting in fresh pages
(snaketune.host_heap): counted in page faults, in fresh processes (malloc's settings are per process), through
the two places that pick the CPU: a training rank's device and the inference stages' device."""

from __future__ import annotations

import json
import statistics
import subprocess
import sys

import pytest

from conftest import REPO

STEP = """
import json, resource, sys
sys.path.insert(0, {workflow!r})
import torch
{setup}
faults = []
for _ in range(12):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    # a step's large tensors: two blocks of 100 MB allocated, written and freed, as a CPU step's logits are
    x = torch.empty(25_000_000, dtype=torch.float32).fill_(1.0)
    y = x * 2
    del x, y
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps(faults))
"""
SETUPS = {
    "as malloc comes": "",
    "a CPU rank": "from snaketune.train.ranks import rank_device\n"
    "assert rank_device(0, in_backward=False, verbose=False).device.type == 'cpu'",
    "inference on the CPU": "from snaketune.model.inference import pick_device\nassert pick_device('cpu')[0].type == 'cpu'",
}


def step_faults(setup: str) -> list[int]:
    """Page faults of each step after the first, in a fresh process."""
    code = STEP.format(workflow=str(REPO / "workflow"), setup=setup)
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
        env={"CUDA_VISIBLE_DEVICES": ""},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.splitlines()[-1])[1:]


@pytest.fixture(scope="module")
def plain() -> list[int]:
    return step_faults(SETUPS["as malloc comes"])


@pytest.mark.parametrize("where", ["a CPU rank", "inference on the CPU"])
def test_cpu_steps_reuse_their_pages(plain, where):
    # As malloc comes, every step maps its 200 MB afresh: 48,830 pages of 4 KiB (fewer where huge pages back them).
    # Kept, most steps find them in the heap; a step may still grow it while it settles (a small block left at its
    # top), so the test counts quiet steps rather than asking every one to be.
    typical = statistics.median(plain)
    assert typical >= 50, plain
    kept = step_faults(SETUPS[where])
    quiet = [f for f in kept if f * 10 < typical]
    assert len(quiet) > len(kept) / 2, (where, kept, plain)
