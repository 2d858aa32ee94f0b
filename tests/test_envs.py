"""The conda environments of the rules (envs/*.yaml) pin what requirements*.txt pin, version for version: a rule
run with --use-conda computes with the same packages as the pip-installed .venv."""

from __future__ import annotations

import re
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent


def pins(text: str) -> dict[str, str]:
    return {
        m.group(1).lower(): m.group(2)
        for m in re.finditer(r"^\s*-?\s*([A-Za-z0-9_.-]+)==([^\s#]+)", text, re.M)
    }


def test_conda_envs_pin_what_the_requirements_pin():
    required = {}
    for path in sorted(REPO.glob("requirements*.txt")):
        required.update(pins(path.read_text()))
    # torch, installed first and alone by the Makefile
    required.update(pins((REPO / "Makefile").read_text().replace("pip install --quiet", "\n-")))
    assert "torch" in required
    envs = sorted((REPO / "envs").glob("*.yaml"))
    assert envs
    for env in envs:
        deps = yaml.safe_load(env.read_text())["dependencies"]
        pip = next(d["pip"] for d in deps if isinstance(d, dict) and "pip" in d)
        unpinned = [p for p in pip if not re.match(r"^[A-Za-z0-9_.-]+==\S+", p)]
        assert not unpinned, f"{env.name}: pip entries without an exact version: {unpinned}"
        found = pins("\n".join(f"- {p}" for p in pip))
        assert found, env
        wrong = {name: (v, required.get(name)) for name, v in found.items() if required.get(name) != v}
        assert not wrong, f"{env.name}: pins that differ from requirements*.txt (env, requirements): {wrong}"


def test_every_pinned_package_is_installed_at_its_pin():
    """The suite runs on what requirements*.txt pin (and the Makefile's torch): a pinned package that is missing or
    at another version is a broken install, which fails here once instead of turning the tests that need it into
    skips. torch's local build tag (+cpu, +cu130) is the machine's choice, not the pin's."""
    from importlib.metadata import PackageNotFoundError, version

    required = {}
    for path in sorted(REPO.glob("requirements*.txt")):
        required.update(pins(path.read_text()))
    required.update(pins((REPO / "Makefile").read_text().replace("pip install --quiet", "\n-")))
    wrong = {}
    for name, pin in sorted(required.items()):
        try:
            installed = version(name).split("+")[0]
        except PackageNotFoundError:
            installed = None
        if installed != pin:
            wrong[name] = (pin, installed)
    assert not wrong, (
        f"pinned packages not installed at their pin (pin, installed), `make` reinstalls: {wrong}"
    )
