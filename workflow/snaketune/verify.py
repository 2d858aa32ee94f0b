"""Outputs checked against what their jobs recorded (snaketune.provenance), so that nothing corrupted is used unseen
and every piece of advice the workflow prints is a command that works.

- Before any job (the Snakefile, `preflight`), every output of the records of the current config's jobs
  (`current_records`) is compared with its record (`compare`, quick: a file is hashed only when its
  size or mtime says something wrote it since the record, or since it was last verified, `VERIFIED`). A changed
  output stops the workflow, naming it, the files that differ and how, and the one command that rebuilds it:
  `rm -r <output>`. That command works because a missing output is returned to the Snakefile, which makes it a
  target of rule `all`: Snakemake 9 alone does not rebuild a missing output whose consumers are up to date ("Nothing
  to be done"), so the plain run rebuilds it, and what follows because the job ran again.
- A stage, before its function runs (workflow/scripts/_stage.py, `check_inputs`), checks every input a record
  describes: by content when the input is at most CONTENT_CHECK_BYTES (the tokenized Arrow caches, conversations,
  pairs, reference log-probs: hashing them costs little next to the stage that reads them), quickly above it (a 7B
  model's 14 GB).
- `verify` (`snakemake --cores all verify`) hashes every file of every current output, `threads` files at a time,
  whatever its mtime says: what no write announced (bit rot, a copy that kept mtimes), and says what differs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from snaketune.io import hash_files, sha256_file, write_json

log = logging.getLogger(__name__)

VERIFIED = Path(".snakemake/snaketune/verified.json")
"""file -> [bytes, mtime_ns, sha256] of the output files whose content was hashed and matched their record: the
quick check trusts them while their size and mtime stay (a file Snakemake touched after its job is hashed once).
Beside Snakemake's own metadata: deleting it costs one hash of the touched files, never a rerun."""
CONTENT_CHECK_BYTES = 1 << 30
"""Inputs up to this size are hashed by the stage that reads them (about 0.7 s per GiB on one core)."""


SKIPPED_FILES = (".snakemake_timestamp",)
"""Snakemake's marker in directory outputs: written after the job, so never part of what a job made."""


# ---- one output against its record ----------------------------------------------------------------------------


def _file_entry(f: Path, st: os.stat_result | None = None) -> dict[str, Any]:
    st = st or f.stat()
    return {"sha256": sha256_file(f), "bytes": st.st_size, "mtime_ns": st.st_mtime_ns}


def describe(path: str | os.PathLike) -> dict[str, Any]:
    """sha256, size and mtime of a file; for a directory, of every file under it, and a digest over the sorted
    `relative path NUL sha256` lines, so that equal trees give equal digests wherever they lie. The mtime lets a
    later check skip hashing a file that nothing wrote since (`compare`)."""
    p = Path(path)
    if not p.exists():
        return {"type": "missing"}
    if p.is_file():
        return {"type": "file", **_file_entry(p)}
    files = {rel: _file_entry(p / rel, st) for rel, st in tree_stats(p).items()}
    digest = hashlib.sha256("".join(f"{rel}\0{e['sha256']}\n" for rel, e in files.items()).encode())
    return {
        "type": "directory",
        "sha256": digest.hexdigest(),
        "bytes": sum(e["bytes"] for e in files.values()),
        "files": files,
    }


def tree_stats(path: Path) -> dict[str, os.stat_result]:
    """relative POSIX path -> stat of every file of an output (a file: the key ""), Snakemake's marker left out."""
    if path.is_file():
        return {"": path.stat()}
    return {
        f.relative_to(path).as_posix(): f.stat()
        for f in sorted(path.rglob("*"))
        if f.is_file() and f.name not in SKIPPED_FILES
    }


def recorded_files(entry: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """relative path -> {sha256, bytes[, mtime_ns]} of what a record says an output held ("" for a file)."""
    if entry.get("type") == "file":
        return {"": entry}
    if entry.get("type") == "directory":
        return dict(entry["files"])
    return {}


def compare(
    out: str | os.PathLike,
    entry: Mapping[str, Any],
    *,
    full: bool = False,
    verified: dict[str, list] | None = None,
    threads: int | None = None,
) -> list[str] | None:
    """How an output differs from what its record describes: None when it is missing, [] when it matches, else one
    `file: what` line per file that differs (missing, not recorded, another size, another content).

    Quick (`full` False): a file with the recorded size whose mtime is the recorded one, or the one `verified`
    (path -> [bytes, mtime_ns, sha256], updated here) holds for the recorded content, is taken as unchanged; any
    other is hashed, so a file rewritten in place at its size (zeroed bytes) is found by its content, and a file
    Snakemake only touched is hashed once. Full: every file is hashed (`verify`: what no write announced, such as
    bit rot). Hashing runs `threads` files at a time (snaketune.io.hash_files)."""
    path = Path(out)
    if not path.exists():
        return None
    now = tree_stats(path)
    was = recorded_files(entry)
    lines, to_hash = [], {}
    for rel in sorted(set(now) | set(was)):
        where = (path / rel).as_posix() if rel else path.as_posix()
        if rel not in now:
            lines.append(f"{where}: missing, recorded {was[rel]['bytes']} bytes")
        elif rel not in was:
            lines.append(f"{where}: not in the record ({now[rel].st_size} bytes)")
        elif now[rel].st_size != was[rel]["bytes"]:
            lines.append(f"{where}: {now[rel].st_size} bytes, recorded {was[rel]['bytes']}")
        elif full or not _unchanged(where, now[rel], was[rel], verified):
            to_hash[where] = rel
    sums = hash_files(list(to_hash), threads=threads)
    for where, rel in to_hash.items():
        digest = sums[where]
        if digest != was[rel]["sha256"]:
            lines.append(
                f"{where}: content differs at the recorded size (sha256 {digest[:12]}, recorded "
                f"{was[rel]['sha256'][:12]})"
            )
        elif verified is not None:
            verified[where] = [now[rel].st_size, now[rel].st_mtime_ns, digest]
    return lines


def _unchanged(where: str, st: os.stat_result, was: Mapping[str, Any], verified: dict | None) -> bool:
    if was.get("mtime_ns") == st.st_mtime_ns:
        return True
    known = (verified or {}).get(where)
    return known == [st.st_size, st.st_mtime_ns, was["sha256"]]


# ---- records ------------------------------------------------------------------------------------


class OutputsChanged(ValueError):
    """Outputs that no longer hold what their records describe; the message says how to rebuild each."""


@dataclass(frozen=True)
class Finding:
    output: str
    rule: str
    record: str
    differences: list[str] | None
    """None: the output is missing; else a line per file that differs."""

    def line(self) -> str:
        if self.differences is None:
            return f"{self.output} (written by {self.rule}, {self.record}): missing"
        shown = "; ".join(self.differences[:3]) + (
            f"; and {len(self.differences) - 3} more" if len(self.differences) > 3 else ""
        )
        return (
            f"{self.output} (written by {self.rule}, {self.record}) no longer holds what its record describes "
            f"({shown}); remove it (rm -r {self.output}) and the next run rebuilds it and what follows"
        )


def current_records(records: Mapping[str, dict], outputs: Iterable[str]) -> dict[str, dict]:
    """The records of the jobs the current config runs: those with an output among `outputs` (the Snakefile's list of
    what the config's jobs write). A record of another config (an old cache key, a removed experiment) is left out:
    its outputs are no longer read, and removing one must not make the workflow rebuild it."""
    wanted = set(outputs)
    return {path: rec for path, rec in records.items() if wanted.intersection(rec["outputs"])}


def check(
    records: Mapping[str, dict],
    *,
    full: bool = False,
    verified: dict[str, list] | None = None,
    threads: int | None = None,
) -> list[Finding]:
    """Every output of `records` that is missing or differs from its record (`compare`)."""
    findings = []
    for path, rec in records.items():
        for out, entry in rec["outputs"].items():
            differences = compare(out, entry, full=full, verified=verified, threads=threads)
            if differences is None or differences:
                findings.append(Finding(out, rec["rule"], path, differences))
    return findings


def load_verified(path: Path = VERIFIED) -> dict[str, list]:
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def save_verified(verified: dict[str, list], before: dict[str, list], path: Path = VERIFIED) -> None:
    """Keep the entries of files that still exist; written only when something changed (a dry run writes nothing
    when nothing was hashed)."""
    kept = {k: v for k, v in verified.items() if os.path.isfile(k)}
    if kept != before:
        try:
            write_json(path, kept)
        except OSError as e:  # a read-only checkout: the next check hashes again
            log.warning("%s not written (%s): touched outputs are hashed again next time", path, e)


def preflight(
    records: Mapping[str, dict], outputs: Iterable[str], producible: Callable[[str], bool]
) -> list[str]:
    """Before any job: raises OutputsChanged naming every current output of `records` (provenance.load_records) that
    differs from its record; returns the missing current outputs a rule of the workflow makes (the Snakefile asks
    rule all for them)."""
    records = current_records(records, outputs)
    verified = load_verified()
    before = dict(verified)
    findings = check(records, verified=verified)
    save_verified(verified, before)
    changed = [f.line() for f in findings if f.differences is not None]
    if changed:
        raise OutputsChanged("Outputs changed since their jobs wrote them:\n  " + "\n  ".join(changed))
    missing = sorted({f.output for f in findings if f.differences is None and producible(f.output)})
    for out in missing:
        log.warning(
            "%s is missing (its job's provenance record remains): rebuilding it and what follows", out
        )
    return missing


def producers(records: Mapping[str, dict]) -> dict[str, tuple[str, dict]]:
    """output path -> (record path, record) of the job that wrote it last."""
    out: dict[str, tuple[str, dict]] = {}
    for path, rec in sorted(records.items(), key=lambda item: item[1]["end"]):
        for output in rec["outputs"]:
            out[output] = (path, rec)
    return out


def check_inputs(
    inputs: Iterable[str], records: Mapping[str, dict], *, limit: int = CONTENT_CHECK_BYTES
) -> None:
    """Before a stage uses its inputs: raises OutputsChanged for any input that differs from the record of the job
    that wrote it, hashed in full up to `limit` bytes, quickly above. Inputs no record describes (a user's file, a
    hub model) are not checked here (their jobs' records hold their hashes)."""
    made = producers(records)
    findings = []
    for inp in dict.fromkeys(str(i) for i in inputs):
        if inp not in made:
            continue
        path, rec = made[inp]
        entry = rec["outputs"][inp]
        size = sum(e["bytes"] for e in recorded_files(entry).values())
        differences = compare(inp, entry, full=size <= limit)
        if differences:
            findings.append(Finding(inp, rec["rule"], path, differences))
    if findings:
        raise OutputsChanged(
            "inputs changed since their jobs wrote them, so this stage would read corrupted data:\n  "
            + "\n  ".join(f.line() for f in findings)
        )


def verify(
    records: Mapping[str, dict], outputs: Iterable[str], *, threads: int | None = None
) -> dict[str, Any]:
    """Every file of every current output hashed against its record: {"checked": outputs, "files", "bytes",
    "changed": lines with the command that rebuilds each, "missing": outputs the next plain run rebuilds}."""
    records = current_records(records, outputs)
    findings = check(records, full=True, threads=threads)
    entries = [e for rec in records.values() for e in rec["outputs"].values()]
    files = [f for e in entries for f in recorded_files(e).values()]
    return {
        "checked": sum(len(rec["outputs"]) for rec in records.values()),
        "files": len(files),
        "bytes": sum(f["bytes"] for f in files),
        "changed": [f.line() for f in findings if f.differences is not None],
        "missing": [f.output for f in findings if f.differences is None],
    }
