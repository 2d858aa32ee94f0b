"""What a failed launch's output says went wrong: the exception of the rank that failed first, or where no rank
printed one, what torchrun saw (snaketune.train.processes puts it in the LaunchError, so that a CI log keeps the
cause when the rank log is gone)."""

from __future__ import annotations

import re
import signal

# A Python exception's last line, as a rank prints it (torchrun prefixes "[rankN]: "); torchrun's own
# ChildFailedError only says that a rank failed. The agent's own lines are glog's ("E1205 00:18:45.277000 32690
# .../elastic/multiprocessing/api.py:1002] failed (exitcode: -6) local_rank: 1 (pid: 32710) of binary: ...").
_AGENT_LINE = re.compile(r"^[DIWEF]\d{4} [\d:.]+ +\d+ \S*torch/distributed/")
_AGENT_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")
# torchrun's report: "Root Cause (first observed failure):", then "[0]:", "time : ...", "host : ...", "rank : 1
# (local_rank: 1)".
_ROOT_RANK = re.compile(r"^rank\s*:\s*(\d+)\b")
# A rank's exception that only says another rank went away (gloo: "Connection closed by peer ... This is typically
# caused by a remote worker crashing"; NCCL: DistBackendError, "remote process exited"; torchrun's SIGTERM to the
# ranks still running: SignalException).
_FALLOUT = re.compile(
    r"closed by peer|reset by peer|remote (?:worker|process)|Broken pipe|DistBackendError|SignalException",
    re.I,
)
_EXCEPTION_LINE = re.compile(
    r"^(?:\[rank(\d+)\]:\s*)?((?:[A-Za-z_][\w]*\.)*[A-Za-z_]\w*(?:Error|Exception|Interrupt|Exit)\b.*)$"
)


def failure_cause(output: str, *, tail_lines: int = 3) -> str:
    """What the ranks' output says went wrong: the exception of the rank that failed first, as the last line of its
    traceback shows it ("rank 1: ValueError: ..."; the outer one where exceptions are chained). The rank that failed
    first is the one torchrun names as the root cause; where its report is missing, the first rank whose exception
    is not the fallout of another rank's exit (a collective's "connection closed by peer": ranks' tracebacks
    interleave in one log, so the fallout can come first); else the first rank that printed one.
    Where no rank printed one (a signal, a C++ abort), which rank torchrun saw fail and with what, and the ranks'
    last lines before torchrun's own report."""
    lines = [line.strip() for line in output.splitlines()]
    found = [
        (m.group(1), m.group(2))
        for m in map(_EXCEPTION_LINE.match, lines)
        if m and "ChildFailedError" not in m.group(2)
    ]
    if found:
        ranks = [r for r, _ in found]
        root = _root_cause_rank(lines)
        if root is None or root not in ranks:
            root = next((r for r, text in found if not _FALLOUT.search(text)), ranks[0])
        message = [text for r, text in found if r == root][-1]
        return (f"rank {root}: " if root is not None else "") + message
    agent = next((i for i, line in enumerate(lines) if _AGENT_LINE.match(line)), len(lines))
    parts = []
    failed = next(filter(None, map(_AGENT_FAILED.search, lines)), None)
    if failed:
        code = int(failed.group(1))
        name = f" ({signal.Signals(-code).name})" if code < 0 and -code in signal.valid_signals() else ""
        parts.append(f"local rank {failed.group(2)} exited with {code}{name}")
    tail = [line for line in lines[:agent] if line][-tail_lines:]
    parts.append("last output: " + (" | ".join(tail) if tail else "<none>"))
    return "; ".join(parts)


def _root_cause_rank(lines: list[str]) -> str | None:
    """The rank under torchrun's "Root Cause (first observed failure):" heading, or None where there is none."""
    start = next((i for i, line in enumerate(lines) if line.startswith("Root Cause")), None)
    if start is None:
        return None
    return next((m.group(1) for m in map(_ROOT_RANK.match, lines[start + 1 :]) if m), None)
