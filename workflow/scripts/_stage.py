"""Shared shell of every Snakemake script: put the snaketune package on sys.path, log to the rule's log.

Snakemake adds this directory to sys.path before running a script, so scripts `import _stage` first.
"""

from __future__ import annotations

import logging
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def run(snakemake, main: Callable[[object], None], *, record: bool = True) -> None:
    """Send stderr and logging to the rule's log, run main(snakemake), log a clean error on failure.

    Before main, the inputs that provenance records describe are checked against them (snaketune.verify): a
    changed cache stops the job before anything reads it, with the command that rebuilds it.

    With `record`, the job's provenance record (snaketune.provenance) replaces the previous one once main
    succeeds; a record that cannot be written is logged (and the old one removed), never a reason to fail the job
    and lose its outputs. The previous record is removed at the start unless every output is still there: a rule
    whose outputs Snakemake keeps while its job runs (update(): data and export stages) keeps the old outputs when
    the job fails, and the record that describes them.
    """
    log_path = snakemake.log[0] if snakemake.log else None
    stream = open(log_path, "a", buffering=1, encoding="utf-8") if log_path else sys.stderr  # noqa: SIM115
    sys.stderr = stream
    logging.basicConfig(
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=stream,
        force=True,
    )
    from snaketune import provenance, verify

    if record and not all(Path(p).exists() for p in snakemake.output):
        provenance.forget(snakemake)
    start = time.time()
    try:
        verify.check_inputs(snakemake.input, provenance.load_records())
        main(snakemake)
    except Exception as e:
        traceback.print_exc(file=stream)
        # The one-line reason also reaches the terminal through Snakemake's error report, with the notes
        # that name what failed (snaketune.io: the output being written, the cause, what was kept).
        notes = "".join(f"; {n}" for n in getattr(e, "__notes__", ()))
        print(f"ERROR in rule {snakemake.rule}: {type(e).__name__}: {e}{notes}", file=sys.__stderr__)
        raise SystemExit(1) from None
    if record:
        try:
            provenance.record(snakemake, start, time.time())
        except Exception:
            logging.getLogger("snaketune.provenance").exception("provenance record not written")
            provenance.forget(snakemake)  # the old one describes the outputs this job replaced
