"""The report's provenance: how to reproduce it (the resolved config, the input hashes, package versions, git
commit, hardware, seeds, wall time) and the record of every job behind it (snaketune.provenance's manifest)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path
from typing import Any

from snaketune import provenance
from snaketune.io import sha256_text, stable_json
from snaketune.report.inputs import Experiment
from snaketune.report.render import Block, Box, Code, Heading, Para, Table, fmt, fmt_duration

SLURM_PROFILE = "workflow/profiles/slurm"
"""The profile an experiment of several nodes runs under (config/README.md)."""


# ---- the reproduce box ---------------------------------------------------------------------------


def config_sha256(config: dict) -> str:
    """sha256 of the resolved config as stable JSON (sorted keys): equal configs, equal hashes."""
    return sha256_text(stable_json(config))


def reproduce_command(experiments: list[Experiment], invocation: dict | None) -> str:
    """The Snakemake command that makes these results again: the config files and --config values it was given,
    and as many GPUs as the largest single-node stage ranked over (train.gpus is cut to the GPUs granted, so
    the world sizes recorded are what to grant again; --cores does not change a result)."""
    stages = [exp.summary for exp in experiments] + [exp.dpo["summary"] for exp in experiments if exp.dpo]
    nodes = {exp.name: exp.config.get("train", {}).get("nodes", 1) for exp in experiments}
    single = [s.get("world_size") or 0 for s in stages if nodes.get(s.get("experiment"), 1) == 1]
    args = ["snakemake", "--cores", "all"]
    if max(single, default=0):
        args += ["--resources", f"gpu={max(single)}"]
    if any(n > 1 for n in nodes.values()):
        args += ["--profile", SLURM_PROFILE]
    invocation = invocation or {}
    if invocation.get("configfiles"):
        args += ["--configfile", *invocation["configfiles"]]
    if invocation.get("config_args"):
        args += ["--config", *invocation["config_args"]]
    return shlex.join(args)


def run_inputs(manifest: dict, invocation: dict | None, workdir: Path) -> list[dict[str, Any]]:
    """The config files the run was given and the files its jobs read from outside results/ (the data, a local
    model, the DeepSpeed files: the manifest's sources), each with its sha256 and, under `outside`, why a checkout
    of the commit would not bring it back (provenance.outside_commit; None where it would)."""
    files = {f: ("config file", h) for f, h in ((invocation or {}).get("configfile_sha256") or {}).items()}
    for path, source in manifest.get("sources", {}).items():
        files.setdefault(path, ("input", source.get("sha256")))
    outside = provenance.outside_commit(files, workdir)
    return [
        {"path": path, "kind": kind, "sha256": digest, "outside": outside.get(path)}
        for path, (kind, digest) in sorted(files.items())
    ]


def code_state(manifest: dict, report_time: dict | None) -> dict[str, Any]:
    """The commit the jobs behind the results ran at (the newest job's when they differ), and whether tracked
    files had uncommitted changes; the report's own checkout when no job recorded one."""
    jobs = [j for j in manifest.get("jobs", []) if j.get("git")]
    if jobs:
        newest = max(jobs, key=lambda j: j["start"])["git"]
        commits = {j["git"]["commit"] for j in jobs}
        dirty = any(j["git"]["dirty"] for j in jobs)
        return {"commit": newest["commit"], "dirty": dirty, "commits": len(commits), "source": "jobs"}
    if report_time:
        return {**report_time, "commits": 1, "source": "report"}
    return {"commit": None, "dirty": None, "commits": 0, "source": None}


def reproduce_blocks(run: dict) -> list[Block]:
    lines = [run["command"]]
    if run["git_commit"]:
        lines.insert(0, f"git checkout {run['git_commit']}")
    inputs = run.get("inputs") or []
    outside = [i for i in inputs if i["outside"]]
    if run["git_commit"] is None:
        state = "not a git checkout: no commit to return to"
    elif run["git_dirty"]:
        state = "**dirty**: tracked files had uncommitted changes, which the commit alone does not bring back"
    elif outside:
        state = (
            f"tracked files unchanged, but **{len(outside)} of the inputs below are not in the commit**: keep them "
            "(the sha256 says whether a file is the same)"
        )
    else:
        state = "clean (no uncommitted changes; every input below is in the commit)"
    if run["git_commits"] > 1:
        state += (
            f"; the jobs ran at {run['git_commits']} commits (see Provenance, Jobs), this is the newest job's"
        )
    blocks: list[Block] = [
        Code("\n".join(lines), "sh"),
        Para(
            f"Commit `{run['git_commit'] or '–'}`, {state}. Config sha256 `{run['config_sha256'][:16]}` "
            "(stable JSON of the resolved config under Provenance).",
            muted=True,
        ),
    ]
    if inputs:
        blocks.append(
            Table(
                ["input", "sha256", "in the commit"],
                [
                    [f"`{i['path']}` ({i['kind']})", f"`{(i['sha256'] or '–')[:16]}`", i["outside"] or "yes"]
                    for i in inputs
                ],
                numeric=[False, False, False],
            )
        )
    return [Box("Reproduce", blocks)]


def provenance_section(
    data: dict, experiments: list[Experiment], prov: dict, benchmarks: list[dict], config: dict
) -> list[Block]:
    hw = prov["hardware"]
    mem = f", {fmt(hw['memory_gib'], 3)} GiB RAM" if hw.get("memory_gib") else ""
    devices = sorted({f"{e.summary.get('world_size')} × {e.summary.get('device')}" for e in experiments})
    blocks: list[Block] = [
        Heading(2, "Provenance"),
        Table(
            ["", "value"],
            [
                ["git commit", f"`{prov['git_commit']}`"],
                ["generated", prov["generated"]],
                ["host CPU", f"{hw['cpu']} ({hw['cpu_count']} logical CPUs{mem})"],
                ["training devices", ", ".join(devices)],
                ["platform", f"{hw['platform']}, Python {hw['python']}"],
                ["remote code (`model.trust_remote_code`)", remote_code_line(experiments)],
            ]
            + [[f"`{name}`", version] for name, version in prov["versions"].items()],
            numeric=[False, False],
        ),
        Heading(3, "Seeds"),
        Table(["seed", "value"], [[k, str(v)] for k, v in prov["seeds"].items()]),
        Heading(3, "Input hashes"),
    ]
    hashes = [[f"`data/raw/{name}`", f"`{digest}`"] for name, digest in data["sha256sums"].items()]
    done = set()
    for exp in experiments:
        if exp.data_key in done:
            continue
        done.add(exp.data_key)
        tok = exp.tokenized
        hashes += [
            [f"`conversations/{s}.parquet`", f"`{d}`"]
            for s, d in sorted(tok.get("conversation_files_sha256", {}).items())
        ]
        hashes += [
            [f"tokenizer `{n}`", f"`{d}`"] for n, d in sorted(tok.get("tokenizer_files_sha256", {}).items())
        ]
        if tok.get("chat_template_sha256"):
            hashes.append(["chat template", f"`{tok['chat_template_sha256']}`"])
    blocks.append(Table(["file", "sha256"], hashes, numeric=[False, False]))
    blocks.append(
        Table(
            ["experiment", "tokenized cache", "run key (checkpoint directory)"],
            [[exp.name, f"`{exp.data_key}`", f"`{exp.summary.get('run_key')}`"] for exp in experiments],
            numeric=[False, False, False],
        )
    )
    blocks += jobs_blocks(prov)
    blocks += stage_time_blocks(benchmarks)
    blocks.append(Heading(3, "Wall time per job"))
    if benchmarks:
        total = sum(b["wall_s"] or 0 for b in benchmarks)
        rows = [
            [f"`{b['job']}`", fmt_duration(b["wall_s"]), fmt(b["max_rss_mib"]), fmt_duration(b["cpu_time_s"])]
            for b in benchmarks
        ]
        rows.append(["**total**", f"**{fmt_duration(total)}**", "", ""])
        blocks.append(Table(["job (benchmarks/…)", "wall time", "max RSS (MiB)", "CPU time"], rows))
    else:
        blocks.append(Para("No benchmark files were found.", muted=True))
    blocks.append(Heading(3, "Configuration"))
    blocks.append(
        Code(
            json.dumps(config, indent=2, sort_keys=False),
            "json",
            summary="The configuration as resolved (defaults filled in, experiment overrides merged): "
            f"sha256 `{config_sha256(config)[:16]}`",
        )
    )
    return blocks


def stage_time_blocks(benchmarks: list[dict]) -> list[Block]:
    """The wall time per stage, each stage's share of the jobs' summed time."""
    if not benchmarks:
        return []
    stages = stage_wall_times(benchmarks)
    total = sum(s["wall_s"] for s in stages.values())
    rows = [
        [
            f"`{name}`",
            str(s["jobs"]),
            fmt_duration(s["wall_s"]),
            f"{s['wall_s'] / total:.0%}" if total else "–",
        ]
        for name, s in stages.items()
    ]
    return [
        Heading(3, "Wall time per stage"),
        Table(["stage", "jobs", "wall time (jobs summed)", "share"], rows),
    ]


def stage_wall_times(benchmarks: list[dict]) -> dict[str, dict]:
    """Per stage, in the order the jobs ran: its jobs and their wall times summed (Snakemake's benchmark files,
    benchmarks/<stage>/...; jobs that ran side by side count each)."""
    out: dict[str, dict] = {}
    for b in benchmarks:
        stage = b["job"].split("/", 1)[0]
        row = out.setdefault(stage, {"jobs": 0, "wall_s": 0.0})
        row["jobs"] += 1
        row["wall_s"] += b["wall_s"] or 0.0
    return out


def remote_code_allowed(exp: Experiment) -> bool:
    """model.trust_remote_code as the stages used it (from the resolved config, where it defaults to False)."""
    return exp.config.get("model", {}).get("trust_remote_code") is True


def remote_code_line(experiments: list[Experiment]) -> str:
    """Whether any experiment let a hub model or tokenizer run code of its own."""
    allowed = [e.name for e in experiments if remote_code_allowed(e)]
    if not allowed:
        return "not allowed (off for every experiment)"
    return "**allowed** for " + ", ".join(f"`{name}`" for name in allowed) + " (the config turned it on)"


def jobs_blocks(prov: dict) -> list[Block]:
    """The jobs of the provenance manifest: when, where and with which code each ran."""
    if not prov.get("manifest"):
        return []
    blocks: list[Block] = [
        Heading(3, "Jobs"),
        Para(
            f"From `{prov['manifest']}`; each job's record (input and output hashes, params, package versions, "
            "host, GPUs, times, commit) is the file named in the last column."
        ),
    ]
    rows = [
        [
            f"`{j['job']}`",
            j["start"].replace("T", " ").removesuffix("Z")[:19],
            fmt_duration(j["wall_s"]),
            j["host"],
            ", ".join(j["gpus"]) or "none",
            f"`{j['code']}`" if j["code"] else "–",
            j["status"] if j["status"] == "ok" else f"**{j['status']}**",
            f"`{j['record']}`",
        ]
        for j in prov["jobs"]
    ]
    blocks.append(
        Table(
            ["job", "started (UTC)", "wall time", "host", "GPUs", "code", "outputs", "record"],
            rows,
            numeric=[False, False, True, False, False, False, False, False],
        )
    )
    notes = []
    if len(prov.get("job_git", {})) > 1:
        notes.append(
            "The jobs ran at different commits: "
            + "; ".join(f"`{c}` ({', '.join(jobs)})" for c, jobs in prov["job_git"].items())
            + "."
        )
    for name, versions in prov.get("job_software", {}).items():
        notes.append(
            f"`{name}` differs between jobs: "
            + "; ".join(f"{v} ({', '.join(jobs)})" for v, jobs in versions.items())
            + "."
        )
    if any(j["status"] != "ok" for j in prov["jobs"]):
        notes.append(
            "**changed**: the job's outputs no longer hold what its record describes (content checked where a file "
            "was written since; `snakemake --cores all verify` hashes every file); **missing**: an output is gone."
        )
    if prov.get("jobs_without_record"):
        notes.append(
            "No provenance record for "
            + ", ".join(f"`{p}`" for p in prov["jobs_without_record"])
            + " (made before records existed, or the record could not be written: see the job's log)."
        )
    blocks += [Para(n) for n in notes]
    return blocks


def short_commit(commit: str) -> str:
    head = commit.split(" ", 1)
    if len(head[0]) == 40 and all(c in "0123456789abcdef" for c in head[0]):
        return f"commit `{head[0][:12]}`" + (" (uncommitted changes)" if len(head) > 1 else "")
    return commit
