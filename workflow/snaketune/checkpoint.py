"""Resumable checkpoints: complete ones are marked, incomplete ones are never picked.

Layout under a run's checkpoint directory (results/checkpoints/<experiment>/<run key>/):
    step00000040/            DeepSpeed's files for that step (model, optimizer, scheduler), rng_rank<r>.pt
    step00000040/COMPLETE.json   written last, by rank 0, after every rank has saved
A directory without COMPLETE.json was being written when the process died: it is ignored and removed.
The run key hashes every setting that changes training, so a changed config never resumes a stale run;
run_key() adds the content of the data, so changed data under unchanged settings never does either.
"""

from __future__ import annotations

import hashlib
import json
import logging
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

_TAG = re.compile(r"^step(\d{8})$")
MARKER = "COMPLETE.json"


def run_key(settings_key: str, data_dir: str | Path) -> str:
    """The name of a run's checkpoint directory: the key of its settings (hashed when Snakemake builds the
    DAG, before any data exists) and 8 hex digits of the tokenized data's stats.json, which holds the
    sha256 of the conversation and tokenizer files the data was made from. An edited local dataset or
    tokenizer reruns training under the same settings; without the data's hash that rerun would resume
    the finished run's last checkpoint and write the old model again."""
    digest = hashlib.sha256((Path(data_dir) / "stats.json").read_bytes()).hexdigest()
    return f"{settings_key}-{digest[:8]}"


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
    tmp = ckpt / (MARKER + ".tmp")
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True))
    tmp.replace(ckpt / MARKER)


def prune(root: str | Path, keep: int) -> None:
    for _, d in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(d, ignore_errors=True)


def rng_state() -> dict:
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
    name, keys, pos, has_gauss, gauss = state
    return (name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(gauss))


def save_rng(ckpt: Path, rank: int) -> None:
    torch.save(rng_state(), ckpt / f"rng_rank{rank}.pt")


def load_rng(ckpt: Path, rank: int) -> None:
    path = ckpt / f"rng_rank{rank}.pt"
    state = torch.load(path, weights_only=True)
    random.setstate(state["python"])
    name, keys, pos, has_gauss, gauss = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, gauss))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])
