"""The C heap of a process that computes on the CPU: large blocks reused from step to step, not mapped afresh.

Each forward and backward pass on the CPU allocates and frees the same large tensors: the logits alone are tokens x
vocabulary x 4 bytes, 210 MB for 512 tokens at DeepSeek's 102,400 entries, and their log-softmax and gradient as
much again. glibc's malloc serves a block above its mmap threshold (128 KiB, raised as blocks are freed, to at
most 32 MiB) with a fresh mmap and unmaps it on free, so every step faults in new pages the kernel has to zero: the
CPU ranks of the user's-scale tests spent a third of their CPU time in the kernel. `keep_freed_memory` raises the
mmap and trim thresholds (mallopt), so that large blocks come from the heap and what is freed stays there for the
next step. Measured on a 2-core VM (bench/RESULTS.md, "CPU ranks that keep their freed memory"): the loss of 512
tokens at 102,400 entries, forward and backward, faulted 205,873 pages and spent 0.351 s in the kernel a step before,
and none from the seventh step on (`python -m bench host_heap`); tests/test_hub_workflow.py's run (CPU ranks,
102,400-row model) took 200 s instead of 221, with 57 s of kernel time instead of 112.

The cost: a process's resident memory stays at its peak rather than shrinking between steps. So only processes
whose compute runs on the CPU ask for it (a CPU rank, evaluation or benchmark on the CPU); a GPU process's host
memory (weights read before they move to the device) is handed back as usual. Elsewhere than glibc it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging

log = logging.getLogger("snaketune.host_heap")

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
"""mallopt's parameter numbers (glibc's malloc.h)."""
THRESHOLD = 2**31 - 1
"""Both thresholds: mallopt takes a C int, so blocks under 2 GiB come from the heap and the heap is never trimmed."""


@functools.cache
def keep_freed_memory() -> bool:
    """Ask glibc's malloc to keep freed memory in the heap (the module's docstring says why); True where it did.
    Once per process."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False  # not glibc: its own allocator's policy stands
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    done = bool(mallopt(M_MMAP_THRESHOLD, THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, THRESHOLD))
    if not done:
        log.info("malloc kept its mmap and trim thresholds (mallopt refused %d)", THRESHOLD)
    return done
