"""Hub revisions pinned to commits once (snaketune.hub): offline from the local hub cache, reused from the lock by
later runs, an error naming the key where neither knows the revision; and the workflow's DAG built on a hub id that
only the local cache holds, with the commit in every stage's params."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, copy_workflow
from snaketune import hub
from snaketune.config.choices import ConfigError
from snaketune.config.load import load_config

COMMIT = "0123456789abcdef0123456789abcdef01234567"
MOVED = "fedcba9876543210fedcba9876543210fedcba98"


def fake_cache(root: Path, repo: str, refs: dict[str, str], repo_type: str = "model") -> Path:
    """A huggingface_hub cache holding `repo` with refs/<name> -> commit (what a download leaves)."""
    folder = root / f"{repo_type}s--{repo.replace('/', '--')}"
    for name, commit in refs.items():
        (folder / "refs").mkdir(parents=True, exist_ok=True)
        (folder / "refs" / name).write_text(commit)
        (folder / "snapshots" / commit).mkdir(parents=True, exist_ok=True)
    return folder


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    from huggingface_hub import constants

    cache = tmp_path / "hub"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return cache


def test_a_branch_is_pinned_once_and_reused(offline_cache, tmp_path):
    folder = fake_cache(offline_cache, "acme/tiny", {"main": COMMIT})
    pins = hub.Pins(tmp_path / "lock.json")
    assert pins.commit("acme/tiny", "main", repo_type="model", key="model.revision") == COMMIT
    assert json.loads((tmp_path / "lock.json").read_text()) == {"model:acme/tiny@main": COMMIT}
    # The branch moves in the cache (a later download): a new run keeps the pinned commit until its entry goes.
    (folder / "refs" / "main").write_text(MOVED)
    assert hub.Pins(tmp_path / "lock.json").commit("acme/tiny", "main", repo_type="model", key="k") == COMMIT
    (tmp_path / "lock.json").unlink()
    assert hub.Pins(tmp_path / "lock.json").commit("acme/tiny", "main", repo_type="model", key="k") == MOVED
    # A commit is its own pin, resolved by nothing.
    assert hub.Pins(tmp_path / "other.json").commit("x/y", MOVED, repo_type="model", key="k") == MOVED
    assert not (tmp_path / "other.json").exists()


def test_an_unknown_revision_names_the_key(offline_cache, tmp_path):
    fake_cache(offline_cache, "acme/tiny", {"main": COMMIT})
    with pytest.raises(
        ConfigError, match=r"'model.revision': 'v2' of the hub model 'acme/tiny' could not be resolved"
    ):
        hub.Pins(tmp_path / "lock.json").commit("acme/tiny", "v2", repo_type="model", key="model.revision")


def test_pin_config_pins_model_tokenizer_and_dataset(offline_cache, tmp_path):
    fake_cache(offline_cache, "acme/tiny", {"main": COMMIT})
    fake_cache(offline_cache, "acme/tok", {"v1": MOVED})
    fake_cache(offline_cache, "acme/chats", {"main": MOVED}, repo_type="dataset")
    cfg = load_config(
        {
            "dataset": {"source": "hub:acme/chats"},
            "model": {"base": "acme/tiny", "tokenizer": "acme/tok", "tokenizer_revision": "v1"},
        }
    )
    pinned = hub.pin_config(cfg, hub.Pins(tmp_path / "lock.json"))
    exp = pinned.experiments["default"]
    assert (exp.model.revision, exp.model.tokenizer_hub_revision, pinned.dataset.revision) == (
        COMMIT,
        MOVED,
        MOVED,
    )
    assert exp.dataset.revision == MOVED


@pytest.mark.slow
def test_the_workflow_pins_a_hub_model_offline(tmp_path):
    """The DAG of a run on a hub id that only the local cache holds: built offline, the commit locked in
    results/hub_revisions.json and in the params of the stages that load the model."""
    cache = tmp_path / "hub"
    fake_cache(cache, "acme/tiny-llama", {"main": COMMIT})
    workdir = copy_workflow(tmp_path / "wf")
    (workdir / "tiny.yaml").write_text(TINY_CONFIG.read_text())
    (workdir / "hub.yaml").write_text(json.dumps({"model": {"base": "acme/tiny-llama"}}))
    # A fresh process: huggingface_hub reads HF_HUB_CACHE when it is imported.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    snakemake = Path(sys.executable).parent / "snakemake"
    args = [str(snakemake), "-n", "-p", "--cores", "2", "--configfile", "tiny.yaml", "hub.yaml"]
    proc = subprocess.run(args, cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    code, output = proc.returncode, proc.stdout + proc.stderr
    assert code == 0, output[-3000:]
    assert json.loads((workdir / "results/hub_revisions.json").read_text()) == {
        "model:acme/tiny-llama@main": COMMIT
    }
    assert "rule fetch_tokenizer" in output and "rule train" in output
