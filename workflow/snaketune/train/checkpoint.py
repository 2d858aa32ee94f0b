"""Resumable checkpoints: complete ones are marked, incomplete ones are never picked.

Layout under a run's checkpoint directory (results/checkpoints/<experiment>/<run key>/):
    step00000040/            DeepSpeed's files for that step (model, optimizer, scheduler), rng_rank<r>.pt
    step00000040/COMPLETE.json   written last, by rank 0, after every rank has saved
A directory without COMPLETE.json was being written when the process died: it is ignored and removed.
COMPLETE.json is written only once every rank's files of that step are flushed to disk, and is flushed itself.

The run key names the directory: it hashes every setting that changes training (when Snakemake builds the DAG)
and, through `run_key`, the content of every input of the job (when the job starts): the tokenized data, and for
DPO the SFT model it starts from and the reference log-probabilities. So a changed setting, changed data or a
changed upstream model never resumes a stale run, and a stage that adds an input is covered without an edit here.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import shutil
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from snaketune.io import fsync_tree, sha256_file, write_json

log = logging.getLogger(__name__)

_TAG = re.compile(r"^step(\d{8})$")
MARKER = "COMPLETE.json"


def input_paths(inputs: Mapping[str, object]) -> dict[str, list[Path]]:
    """{name: [paths]} of a job's named inputs (Snakemake's `input`: a path or a list of paths each)."""
    out = {}
    for name, value in inputs.items():
        values = [value] if isinstance(value, str | Path) else list(value)
        out[name] = [Path(v) for v in values]
    return out


def inputs_digest(inputs: Mapping[str, object]) -> tuple[str, int]:
    """sha256 over the content of every file of every input (directories file by file, by relative path), and
    the bytes read. Content, not timestamps: a rerun that rewrote an input byte for byte may resume."""
    h = hashlib.sha256()
    read = 0
    for name, paths in sorted(input_paths(inputs).items()):
        for path in paths:
            files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
            for f in files:
                rel = f.name if f == path else f.relative_to(path).as_posix()
                h.update(f"{name}:{path.name}/{rel}:{sha256_file(f)}\n".encode())
                read += f.stat().st_size
    return h.hexdigest(), read


def run_key(settings_key: str, inputs: Mapping[str, object]) -> str:
    """The name of a run's checkpoint directory: the key of its settings (hashed when Snakemake builds the DAG,
    before any input exists) and 8 hex digits of the content of all its inputs (`inputs_digest`). Without the
    inputs a rerun under unchanged settings would resume the previous run's checkpoints: after an edited dataset
    the old data's, after an SFT change the DPO steps trained from the old SFT model."""
    t0 = time.perf_counter()
    digest, read = inputs_digest(inputs)
    log.info(
        "run key %s-%s: settings and the content of %d input(s), %.2f GB read in %.1f s",
        settings_key,
        digest[:8],
        len(inputs),
        read / 1e9,
        time.perf_counter() - t0,
    )
    return f"{settings_key}-{digest[:8]}"


_RUN = re.compile(r"^[0-9a-f]{16}(-[0-9a-f]{8})?$")
"""A run's directory under a stage's checkpoint root (`run_key`; apply_plan's under strategy auto); other entries (the preference stages' roots under
the train stage's) are not runs."""


def remove_runs(root: str | Path, *, keep: Path | None = None) -> list[Path]:
    """Remove every run's checkpoint directory under `root` but `keep`: called once a stage's outputs are in place,
    when its own checkpoints are done with and a superseded run's can never be resumed (its settings or inputs
    differ). Returns the directories removed."""
    root = Path(root)
    removed = []
    for d in sorted(root.iterdir()) if root.is_dir() else ():
        if d.is_dir() and _RUN.match(d.name) and (keep is None or d.resolve() != Path(keep).resolve()):
            shutil.rmtree(d, ignore_errors=True)
            removed.append(d)
    return removed


def tag_for(step: int) -> str:
    return f"step{step:08d}"


def complete_checkpoints(root: str | Path) -> list[tuple[int, Path]]:
    """(step, dir) of every complete checkpoint, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for d in root.iterdir():
        m = _TAG.match(d.name)
        if m and d.is_dir() and (d / MARKER).is_file():
            found.append((int(m.group(1)), d))
    return sorted(found)


def latest(root: str | Path) -> tuple[int, Path] | None:
    ckpts = complete_checkpoints(root)
    return ckpts[-1] if ckpts else None


def read_marker(ckpt: Path) -> dict:
    try:
        return json.loads((ckpt / MARKER).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RuntimeError(
            f"checkpoint {ckpt}: unreadable {MARKER} ({e}); delete the directory to discard it"
        ) from e


def remove_incomplete(root: str | Path) -> list[Path]:
    root = Path(root)
    removed = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and _TAG.match(d.name) and not (d / MARKER).exists():
                shutil.rmtree(d, ignore_errors=True)
                removed.append(d)
    return removed


def mark_complete(ckpt: Path, meta: dict) -> None:
    """Flush every file of the checkpoint to disk, then write the marker (itself flushed, atomically): after a
    crash of the machine a marked checkpoint is whole."""
    fsync_tree(ckpt)
    write_json(ckpt / MARKER, meta)


def prune(root: str | Path, keep: int) -> None:
    for _, d in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def rng_state() -> dict:
    import torch  # here, not at the top: the launcher computes run keys without importing torch

    state = {
        "python": random.getstate(),
        # numpy's state as plain tensors and numbers, so torch.load(weights_only=True) can read it back.
        "numpy": _np_state_to_plain(np.random.get_state()),
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def _np_state_to_plain(state: tuple) -> tuple:
    import torch

    name, keys, pos, has_gauss, gauss = state
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))


def save_rng(ckpt: Path, rank: int) -> None:
    import torch

    torch.save(rng_state(), ckpt / f"rng_rank{rank}.pt")


def load_rng(ckpt: Path, rank: int) -> None:
    import torch

    path = ckpt / f"rng_rank{rank}.pt"
    state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


# ---- what a rank does with them ------------------------------------------------------------------------------


def resume(engine, root: Path, *, rank: int, world: int, lora: bool) -> tuple[int, dict]:
    """Load the latest complete checkpoint under `root` into the DeepSpeed `engine` and this rank's RNG state:
    (its step, its marker), or (0, {}) where there is none. Collective: rank 0 first removes incomplete ones.
    RuntimeError, naming what to delete or rerun, for a checkpoint of another world size or one that fails to load."""
    import torch.distributed as dist

    removed = remove_incomplete(root) if rank == 0 else []
    for d in removed:
        log.warning("discarding incomplete checkpoint %s (the process died while writing it)", d)
    dist.barrier()
    found = latest(root)
    if found is None:
        return 0, {}
    step, path = found
    meta = read_marker(path)
    if meta.get("world_size") != world:
        raise RuntimeError(
            f"checkpoint {path} was written by {meta.get('world_size')} ranks but {world} were granted; "
            f"rerun with --resources gpu={meta.get('world_size')} to resume, or delete {root} to restart"
        )
    try:
        # LoRA: the checkpoint holds the adapters alone; the frozen base loads as the run started (`save`).
        load_path, _ = engine.load_checkpoint(str(root), tag=path.name, load_module_strict=not lora)
        load_rng(path, rank)
    except Exception as e:  # a truncated file, a foreign pickle refused by weights_only, a shape mismatch
        raise RuntimeError(
            f"checkpoint {path} could not be loaded ({type(e).__name__}: {str(e).splitlines()[0]}); "
            f"delete {path} to resume from an older checkpoint, or {root} to restart"
        ) from e
    if load_path is None:
        raise RuntimeError(f"checkpoint {path} could not be loaded; delete it to fall back to an older one")
    if rank == 0:
        log.info("resuming from checkpoint %s at step %d", path, step)
    return step, meta


def save(engine, root: Path, step: int, meta: dict, *, rank: int, lora: bool, keep: int) -> None:
    """DeepSpeed's checkpoint of `step` under `root`, every rank's RNG state, then (rank 0, once every rank has
    written) the marker with `meta` and the pruning to the newest `keep`. Collective."""
    import torch.distributed as dist

    tag = tag_for(step)
    # LoRA: the adapters and their optimizer, not the frozen base (13 GB for a 7B, a copy per checkpoint): a resume
    # loads the base as the run started, then these.
    engine.save_checkpoint(
        str(root), tag=tag, client_state={"step": step}, save_latest=False, exclude_frozen_parameters=lora
    )
    save_rng(root / tag, rank)
    dist.barrier()
    if rank == 0:
        mark_complete(root / tag, meta)
        prune(root, keep)
        log.info("checkpoint %s complete", root / tag)
    dist.barrier()
