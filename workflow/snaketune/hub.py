"""Hub revisions pinned to commits, once.

A hub model's or dataset's revision (`main`, a tag) names something that moves. Each stage that loads the model
resolving it on its own could mix weights of two commits, and a cache keyed by "main" would hold whatever main was
when it was written. So when Snakemake builds the DAG, every hub repository the config names is resolved to a commit
once; the commit is recorded in results/hub_revisions.json (the lock), and from then on it is what every stage
loads, what the caches' keys name and what provenance records. A later run reuses the lock, so a branch that moved
does not silently change a finished run's inputs; to take the branch's new head, delete its entry (or the file), or
give a commit as the revision.

Resolution, in order: the lock; the hub (unless HF_HUB_OFFLINE is set); the local hub cache's ref (what
huggingface_hub recorded when it last downloaded that revision). None of them: an error naming the key.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import re
from pathlib import Path

from snaketune.config.choices import HUB_ID, fail

log = logging.getLogger(__name__)

LOCK = Path("results/hub_revisions.json")
COMMIT = re.compile(r"^[0-9a-f]{40}$")


def is_hub_id(name: str) -> bool:
    return bool(HUB_ID.match(name)) and not Path(name).exists()


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")


def cached_commit(repo_id: str, revision: str, repo_type: str) -> str | None:
    """The commit huggingface_hub's cache recorded for `revision` (its refs/<revision> file), or None."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    ref = (
        Path(constants.HF_HUB_CACHE)
        / repo_folder_name(repo_id=repo_id, repo_type=repo_type)
        / "refs"
        / revision
    )
    try:
        commit = ref.read_text().strip()
    except OSError:
        return None
    return commit if COMMIT.match(commit) else None


def _remote_commit(repo_id: str, revision: str, repo_type: str, key: str) -> tuple[str | None, str]:
    """(commit, "") from the hub, or (None, why not) where the hub cannot be reached."""
    from huggingface_hub import HfApi
    from huggingface_hub.errors import RepositoryNotFoundError, RevisionNotFoundError

    try:
        info = HfApi().repo_info(repo_id, revision=revision, repo_type=repo_type, timeout=10)
    except RevisionNotFoundError:
        fail(key, f"{revision!r} is not a revision of the hub {repo_type} {repo_id!r}")
    except RepositoryNotFoundError:
        fail(
            key, f"{repo_id!r} is not a hub {repo_type} this machine can see (a typo, or a gated repository?)"
        )
    except Exception as e:  # noqa: BLE001 - no network, a proxy, a timeout: try the local cache next
        return None, f"the hub could not be reached ({type(e).__name__})"
    return info.sha, ""


class Pins:
    """The lock: (repo type, repo id, revision) -> commit, read once and written back when it grows."""

    def __init__(self, path: str | Path = LOCK):
        self.path = Path(path)
        self.entries: dict[str, str] = {}
        if self.path.is_file():
            self.entries = json.loads(self.path.read_text())

    def commit(self, repo_id: str, revision: str, *, repo_type: str, key: str) -> str:
        """The commit `revision` of `repo_id` is pinned to, resolved (and locked) the first time."""
        if COMMIT.match(revision):
            return revision
        name = f"{repo_type}:{repo_id}@{revision}"
        if name in self.entries:
            return self.entries[name]
        why = "HF_HUB_OFFLINE is set"
        commit = None
        if not offline():
            commit, why = _remote_commit(repo_id, revision, repo_type, key)
        commit = commit or cached_commit(repo_id, revision, repo_type)
        if commit is None:
            fail(
                key,
                f"{revision!r} of the hub {repo_type} {repo_id!r} could not be resolved to a commit: {why}, and "
                "the local hub cache has no such revision; run once with network access, or give a commit "
                "(40 hex digits) as the revision",
            )
        log.info("pinned %s to %s (%s)", name, commit, self.path)
        self.entries[name] = commit
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.entries, indent=2, sort_keys=True) + "\n")
        tmp.replace(self.path)
        return commit


def pin_config(cfg, pins: Pins):
    """`cfg` (snaketune.config.schema.Config) with every hub revision replaced by its commit: the dataset's
    (`hub:` sources), each experiment's model's and, where model.tokenizer names another hub repository, its
    tokenizer's."""
    dataset = cfg.dataset
    if dataset.source.startswith("hub:"):
        commit = pins.commit(
            dataset.source.removeprefix("hub:"), dataset.revision, repo_type="dataset", key="dataset.revision"
        )
        dataset = dataclasses.replace(dataset, revision=commit)
    experiments = {}
    for name, exp in cfg.experiments.items():
        model = exp.model
        changes = {}
        if is_hub_id(model.pretrained):
            changes["revision"] = pins.commit(
                model.pretrained, model.revision, repo_type="model", key=f"experiments.{name}.model.revision"
            )
        if model.tokenizer != "auto" and is_hub_id(model.tokenizer):
            changes["tokenizer_revision"] = pins.commit(
                model.tokenizer,
                model.tokenizer_revision or model.revision,
                repo_type="model",
                key=f"experiments.{name}.model.tokenizer_revision",
            )
        experiments[name] = dataclasses.replace(
            exp, dataset=dataset, model=dataclasses.replace(model, **changes)
        )
    return dataclasses.replace(cfg, dataset=dataset, experiments=experiments)
