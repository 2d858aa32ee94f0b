"""A CPU step's page faults and kernel time with malloc as it comes and with snaketune.host_heap's settings.

Each side runs in a fresh process (malloc's settings are per process): --steps steps of the loss on the logits,
forward and backward, of --tokens tokens at --vocab entries (hidden size 32, one thread), the step the CPU ranks
repeat. Prints per step the minor page faults, system and user CPU seconds, and a Markdown table of the steps after
--settle (the heap's first steps grow it).

    python -m bench host_heap [--tokens 512] [--vocab 102400] [--steps 12] [--settle 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

WORKFLOW = Path(__file__).resolve().parents[2] / "workflow"
STEPS = """
import json, resource, sys
sys.path.insert(0, {workflow!r})
if {kept}:
    from snaketune import host_heap
    assert host_heap.keep_freed_memory()
import torch
torch.set_num_threads(1)
torch.manual_seed(0)
w = torch.randn({vocab}, 32, requires_grad=True)
h = torch.randn({tokens}, 32, requires_grad=True)
t = torch.randint(0, {vocab}, ({tokens},))
out = []
for _ in range({steps}):
    a = resource.getrusage(resource.RUSAGE_SELF)
    loss = torch.nn.functional.cross_entropy((h @ w.t()).float(), t, reduction="sum")
    loss.backward()
    b = resource.getrusage(resource.RUSAGE_SELF)
    out.append((b.ru_minflt - a.ru_minflt, b.ru_stime - a.ru_stime, b.ru_utime - a.ru_utime))
print(json.dumps(out))
"""


def side(kept: bool, args) -> list[tuple[int, float, float]]:
    code = STEPS.format(
        workflow=str(WORKFLOW), kept=kept, vocab=args.vocab, tokens=args.tokens, steps=args.steps
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return [tuple(step) for step in json.loads(proc.stdout.splitlines()[-1])]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=102_400)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--settle", type=int, default=6)
    args = parser.parse_args()
    rows = []
    for name, kept in (("malloc as it comes", False), ("snaketune.host_heap", True)):
        steps = side(kept, args)
        print(f"{name}: per step (faults, system s, user s): {steps}", flush=True)
        after = steps[args.settle :]
        rows.append(
            f"| {name} | {statistics.mean(s[0] for s in after):,.0f} | {statistics.mean(s[1] for s in after):.3f} | "
            f"{statistics.mean(s[2] for s in after):.3f} |"
        )
    print(
        f"\n{args.tokens} tokens x {args.vocab:,} entries, steps {args.settle + 1}-{args.steps}, mean per step:\n"
    )
    print("| malloc | minor page faults | system s | user s |\n|---|---:|---:|---:|")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
