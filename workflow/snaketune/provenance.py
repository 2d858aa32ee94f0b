"""Provenance: one record per job, and a manifest that ties them together.

`record()` runs in every Snakemake script (workflow/scripts/_stage.py) after the stage's function succeeds and
writes `results/provenance/<rule>.json`, or `results/provenance/<rule>/<wildcard values>.json` for a rule with
wildcards: the sha256, size and mtime of every input and output file (snaketune.verify.describe), the params (the
stage's code hash and seeds among them), package versions, host, GPU models, start and end time, and the git commit
of the workflow's checkout. The previous record of the job is deleted before the stage starts (`forget()`) unless
the job's outputs are still there (a rule whose outputs Snakemake keeps while the job runs, snaketune.backups: a
failed job leaves them, and the record that describes them), so a record always describes the outputs in place.

Records are deliberately not declared outputs: a missing or rewritten record must never make Snakemake
rerun a job (deleting results/provenance/ must not retrain a 7B model), and a job whose record cannot be
written keeps its outputs (the failure is logged). The manifest rule collects them instead:
`build_manifest()` starts from the files the report is made from and follows each record's inputs back to
the record of the job that wrote them, so it lists exactly the jobs behind the current results, in
pipeline order, whatever rules the workflow has. snaketune.verify checks outputs against their records: before any
job, in each stage for its inputs, and in full (`snakemake verify`).

No environment variable reaches a record except the few in ENV_RECORDED, and any string that contains the
value of a secret-looking variable (HF_TOKEN, ...) is redacted, as a second line of defence.
"""

from __future__ import annotations

import datetime as dt
import importlib.metadata
import json
import logging
import os
import platform
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from snaketune.io import write_json
from snaketune.verify import compare, describe

log = logging.getLogger(__name__)

FORMAT = 1
PROVENANCE_DIR = Path("results/provenance")
MANIFEST = PROVENANCE_DIR / "manifest.json"
PACKAGES = (
    "torch",
    "deepspeed",
    "transformers",
    "tokenizers",
    "datasets",
    "peft",
    "accelerate",
    "numpy",
    "pandas",
    "pyarrow",
    "matplotlib",
    "snakemake",
)
"""Distributions whose versions every record holds (read from their metadata: nothing is imported)."""
ENV_RECORDED = (
    "CUDA_VISIBLE_DEVICES",
    "NCCL_P2P_DISABLE",
    "NCCL_IB_DISABLE",
    "OMP_NUM_THREADS",
    "PYTHONHASHSEED",
    "CUBLAS_WORKSPACE_CONFIG",
    "SLURM_JOB_ID",
)
"""The only environment variables a record holds: those that change how a job computes, none secret."""
SECRET_NAME = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|API_?KEY|ACCESS_?KEY", re.IGNORECASE)
HUB_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{20,}")
"""The shape of a Hugging Face token, redacted even when it is not in the environment."""


# ---- where records live --------------------------------------------------------------------------


def record_path(rule: str, wildcards: Mapping[str, str], root: Path = PROVENANCE_DIR) -> Path:
    if not wildcards:
        return root / f"{rule}.json"
    return root / rule / ("_".join(str(v) for v in wildcards.values()) + ".json")


def _wildcards(smk) -> dict[str, str]:
    return {k: str(v) for k, v in smk.wildcards.items()}


# ---- the environment -----------------------------------------------------------------------------


def package_versions(names: Iterable[str] = PACKAGES) -> dict[str, str]:
    out = {"python": platform.python_version()}
    for name in names:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def gpu_models() -> list[str]:
    """Names of the CUDA devices this job sees: from torch when the stage already imported it (train
    and evaluate), else from nvidia-smi (never imported here: it costs seconds), else none."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            if torch.cuda.is_available():
                return [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        except Exception:  # a broken driver must not cost the record
            pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        out = subprocess.run(
            [smi, "--query-gpu=index,name", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    names = dict(line.split(", ", 1) for line in out.strip().splitlines() if ", " in line)
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return list(names.values())
    # Indices only; UUIDs in CUDA_VISIBLE_DEVICES are rare enough to report everything instead.
    ids = [v.strip() for v in visible.split(",") if v.strip()]
    if all(i.isdigit() for i in ids):
        return [names[i] for i in ids if i in names]
    return list(names.values())


def git_state(directory: Path) -> dict[str, Any] | None:
    """HEAD of the checkout holding the workflow, and whether tracked files differ from it; None outside
    a git checkout (e.g. a copied workflow)."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=directory, capture_output=True, text=True, timeout=30
        )
        if head.returncode != 0:
            return None
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=directory,
            capture_output=True,
            text=True,
            timeout=60,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def outside_commit(paths: Iterable[str], directory: Path) -> dict[str, str]:
    """path -> why a checkout of the commit of `directory` would not bring it back, for each of `paths` that is not
    a tracked, unmodified file or directory of that checkout: `outside the checkout`, `untracked` (a user's config
    overlay or data file beside the workflow), `modified`, or `not a git checkout`."""
    paths = list(dict.fromkeys(str(p) for p in paths))
    top = _git(directory, "rev-parse", "--show-toplevel")
    if top is None:
        return {p: "not a git checkout" for p in paths}
    root = Path(top.strip()).resolve()
    why, inside = {}, {}
    for p in paths:
        full = (directory / p).resolve()
        if full == root or root in full.parents:
            inside[p] = full.relative_to(root).as_posix()
        else:
            why[p] = "outside the checkout"
    if inside:
        tracked = set((_git(root, "ls-files", "-z", "--", *inside.values()) or "").split("\0"))
        changed = (
            _git(root, "status", "--porcelain", "-z", "--untracked-files=no", "--", *inside.values()) or ""
        )
        modified = {entry[3:] for entry in changed.split("\0") if len(entry) > 3}
        for p, rel in inside.items():
            files = {t for t in tracked if t == rel or t.startswith(rel.rstrip("/") + "/")}
            if not files:
                why[p] = "untracked"
            elif files & modified or any(m.startswith(rel.rstrip("/") + "/") for m in modified):
                why[p] = "modified"
    return why


def _git(directory: Path, *args: str) -> str | None:
    try:
        proc = subprocess.run(["git", *args], cwd=directory, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    return proc.stdout if proc.returncode == 0 else None


def host() -> dict[str, Any]:
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
    }


# ---- secrets -------------------------------------------------------------------------------------


def secret_values(environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """value -> variable name of every secret-looking environment variable (long enough to be one)."""
    environ = os.environ if environ is None else environ
    return {v: k for k, v in environ.items() if SECRET_NAME.search(k) and len(v) >= 8}


def redact(obj: Any, secrets: Mapping[str, str]) -> Any:
    """`obj` with every secret value, and anything shaped like a hub token, replaced by a marker."""
    if isinstance(obj, str):
        for value, name in secrets.items():
            obj = obj.replace(value, f"<redacted {name}>")
        return HUB_TOKEN.sub("<redacted token>", obj)
    if isinstance(obj, Mapping):
        return {redact(k, secrets): redact(v, secrets) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [redact(v, secrets) for v in obj]
    return obj


# ---- one job's record ----------------------------------------------------------------------------


def _plain(obj: Any) -> Any:
    """Params as JSON data (Snakemake hands lists and mappings of its own types)."""
    return json.loads(json.dumps(obj, default=str))


def _flatten(obj: Any, prefix: str = "") -> Iterable[tuple[str, Any]]:
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}.{k}" if prefix else str(k))
    else:
        yield prefix, obj


def seeds(params: Mapping[str, Any]) -> dict[str, Any]:
    """Every param whose name holds 'seed' (train.seed, builtin_seed, ...), by its dotted path."""
    return {k: v for k, v in _flatten(params) if "seed" in k.rsplit(".", 1)[-1]}


def code_hash(params: Mapping[str, Any]) -> str | None:
    """The stage's code hash (snaketune.keys.code_hash), wherever in the params the rule put it."""
    found = [v for k, v in _flatten(params) if k.rsplit(".", 1)[-1] == "code"]
    return found[0] if found else None


def _iso(t: float) -> str:
    return dt.datetime.fromtimestamp(t, dt.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _paths(files) -> list[str]:
    return list(dict.fromkeys(str(f) for f in files))


def make_record(smk, start: float, end: float, *, workflow_dir: Path | None = None) -> dict[str, Any]:
    """The record of a finished job, from the `snakemake` object of its script."""
    params = _plain(dict(smk.params.items()))
    resources = {
        k: v for k, v in smk.resources.items() if isinstance(v, (int, float)) and not k.startswith("_")
    }
    record = {
        "format": FORMAT,
        "rule": smk.rule,
        "wildcards": _wildcards(smk),
        "start": _iso(start),
        "end": _iso(end),
        "wall_s": round(end - start, 3),
        "code": code_hash(params),
        "params": params,
        "seeds": seeds(params),
        "inputs": {p: describe(p) for p in _paths(smk.input)},
        "outputs": {p: describe(p) for p in _paths(smk.output)},
        "log": _paths(smk.log),
        "threads": smk.threads,
        "resources": resources,
        "host": host(),
        "gpus": gpu_models(),
        "env": {k: os.environ[k] for k in ENV_RECORDED if k in os.environ},
        "software": package_versions(),
        # Whether the job's process imported torch: the config, data, plan and report stages never do (they run in
        # the Snakefile's process and on login nodes; tests/test_reproducibility.py checks every record).
        "imported_torch": "torch" in sys.modules,
        "git": git_state(workflow_dir or Path(__file__).resolve().parent.parent),
    }
    return redact(record, secret_values())


def record(smk, start: float, end: float, *, root: Path = PROVENANCE_DIR) -> Path:
    """Write the record of a finished job; returns its path."""
    path = record_path(smk.rule, _wildcards(smk), root)
    write_json(path, make_record(smk, start, end))
    return path


def forget(smk, *, root: Path = PROVENANCE_DIR) -> None:
    """Delete the job's previous record, so that a failed run never leaves one describing old outputs."""
    record_path(smk.rule, _wildcards(smk), root).unlink(missing_ok=True)


# ---- the manifest --------------------------------------------------------------------------------


def load_records(root: Path = PROVENANCE_DIR) -> dict[str, dict]:
    """record path -> record, for every record under root (the manifest itself excluded)."""
    out = {}
    for path in sorted(Path(root).rglob("*.json")):
        if path.name == MANIFEST.name and path.parent == Path(root):
            continue
        try:
            rec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            log.warning("unreadable provenance record %s: skipped", path)
            continue
        if isinstance(rec, dict) and rec.get("format") == FORMAT:
            out[path.as_posix()] = rec
    return out


def status(rec: Mapping[str, Any]) -> str:
    """`ok` when every output still holds what the record describes (`compare`'s quick check: a file is hashed
    only when its mtime says something wrote it since), `missing` when an output is gone, else `changed`."""
    results = [compare(path, entry) for path, entry in rec["outputs"].items()]
    if any(r is None for r in results):
        return "missing"
    return "changed" if any(results) else "ok"


def build_manifest(targets: Iterable[str], root: Path = PROVENANCE_DIR) -> dict[str, Any]:
    """The records of the jobs behind `targets`, found by following inputs back to the jobs that wrote them."""
    records = load_records(root)
    producer: dict[str, str] = {}
    for path, rec in sorted(records.items(), key=lambda item: item[1]["end"]):
        for out in rec["outputs"]:
            producer[out] = path  # the newest record wins when two claim a file
    jobs: dict[str, dict] = {}
    sources: dict[str, dict] = {}
    missing: list[str] = []
    todo = list(dict.fromkeys(str(t) for t in targets))
    seen: set[str] = set()
    while todo:
        target = todo.pop()
        if target in seen:
            continue
        seen.add(target)
        path = producer.get(target)
        if path is None:
            # Files under results/ are made by jobs; anything else (configs, a local dataset) is a source,
            # whose hash the consuming job recorded.
            if target.startswith("results/"):
                missing.append(target)
            continue
        if path not in jobs:
            jobs[path] = records[path]
            for inp, entry in records[path]["inputs"].items():
                todo.append(inp)
                if not inp.startswith("results/"):
                    sources[inp] = {k: entry.get(k) for k in ("type", "sha256", "bytes")}
    ordered = sorted(jobs.items(), key=lambda item: (item[1]["start"], item[0]))
    entries = [{"record": path, "status": status(rec), **rec} for path, rec in ordered]
    return {
        "format": FORMAT,
        "targets": sorted({str(t) for t in targets}),
        "jobs": entries,
        "sources": dict(sorted(sources.items())),
        "missing": sorted(missing),
        "summary": summarize(entries),
    }


def summarize(jobs: list[dict]) -> dict[str, Any]:
    """What a reader checks first: each host, GPU set, commit and package version seen, with the jobs that
    saw it (one entry each when all jobs agree), the seeds, and the time span."""

    def values(get) -> dict[str, list[str]]:
        seen: dict[str, list[str]] = {}
        for job in jobs:
            seen.setdefault(get(job), []).append(job_name(job))
        return seen

    packages = sorted({name for job in jobs for name in job.get("software", {})})
    return {
        "jobs": len(jobs),
        "changed": [job_name(j) for j in jobs if j["status"] != "ok"],
        "hosts": values(lambda j: j["host"]["hostname"]),
        "gpus": values(lambda j: ", ".join(j["gpus"]) or "none"),
        "git": values(git_label),
        "software": {
            name: values(lambda j, n=name: j["software"].get(n, "not recorded")) for name in packages
        },
        "seeds": {f"{job_name(j)}: {k}": v for j in jobs for k, v in j["seeds"].items()},
        "start": min((j["start"] for j in jobs), default=None),
        "end": max((j["end"] for j in jobs), default=None),
    }


def git_label(job: Mapping[str, Any]) -> str:
    git = job.get("git")
    if not git:
        return "not a git checkout"
    return git["commit"] + (" (with uncommitted changes)" if git["dirty"] else "")


def job_name(job: Mapping[str, Any]) -> str:
    wildcards = ",".join(f"{v}" for v in job["wildcards"].values())
    return f"{job['rule']}[{wildcards}]" if wildcards else job["rule"]


def write_manifest(targets: Iterable[str], out: str | os.PathLike, root: Path = PROVENANCE_DIR) -> dict:
    manifest = build_manifest(targets, root)
    write_json(out, manifest)
    log.info(
        "manifest: %d jobs, %d changed since recorded, %d without a record",
        len(manifest["jobs"]),
        len(manifest["summary"]["changed"]),
        len(manifest["missing"]),
    )
    return manifest
