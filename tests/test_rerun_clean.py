"""A rerun after a change produces exactly what a clean run of the changed config produces, for every kind of
change tests/test_reproducibility.py lists (which checks the stages each one reruns).

The runs are the tiny config's (.test/config.yaml: one CPU rank, four SFT and four DPO steps), real and
deterministic on CPU, so "the same" is exact: data files byte for byte, every logged loss and every weight equal,
the evaluation's and the report's figures equal. Only what records a run rather than its result may differ: times,
throughput, run keys, the experiment's name and `resumed_from_step`. Two designs share the cost:

- Kinds that change one experiment's sections (model, tokenize, train, preference): one base run from nothing
  trains a chain of experiments (CHAIN), each with the config of the one before it and one kind's change more,
  and the changed run gives each experiment the next one's config. So every kind's rerun has a clean twin that
  the base run made from nothing before the change (its outputs copied aside: the changed run remakes most of
  them), and the last experiment of the chain keeps its config and must rerun nothing. A kind's change is made to
  the tiny config plus the changes before it in the chain. An added experiment (the tiny config's, whose twin is
  the base run's `default`) is new in the changed run. preference.max_length's experiment takes the config of one
  whose tokenized pairs exist: its reference must rerun all the same (it once did not: common_preference.smk's
  reference_dir says why).
- Kinds that change what every experiment shares (dataset, eval, a rule file, a DeepSpeed file): the tiny run
  is copied, changed and rerun, and beside it a fresh copy of the workflow with the change runs from nothing,
  two Snakemake runs at a time. Each carries more kinds that need a run of their own otherwise (RIDERS): the
  export kind (export.quants) rides on eval.prompts, which reruns the export stage too; the code edits (a
  comment appended to each stage's modules and scripts, in both copies: every stage reruns under new code
  hashes) ride on dataset.languages, whose rerun is then a rerun of every stage; the edits of a rule file and a
  DeepSpeed file (FILE_KINDS: they rerun the tokenizer, the training and what follows) ride on dataset.paths,
  which keeps the rerun from the conversations on (the download's output is reused). Which stages each of them
  reruns alone is tests/test_reproducibility.py's (dry runs); here a rerun of them all must equal a clean run.
  The runs of the kinds whose rerun remakes every model and whose riders do not concern the export (NO_EXPORT)
  stop at the evaluation and the memory plans: their GGUF files and report, pure functions of the models, data
  and settings compared here, are compared for the other kinds.
"""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import yaml

from conftest import TINY_CONFIG, clone_run, copy_workflow, snakemake
from rerun_cases import CASES, edit_line

# Its fixtures run whole workflows of many experiments: above pyproject.toml's per-test timeout on a busy host.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

PREF_TRAIN = yaml.safe_load(TINY_CONFIG.read_text())["preference"]["train"]
OTHER_TOKENIZER = "tokenizer-512"
"""model.tokenizer's change here: a directory in the working directory holding conftest.tiny_data's tokenizer (a
builtin BPE of 512 tokens from 120 builtin trees; the workflow trains one of 1,024 from its own): other ids everywhere
downstream.
Not the real DeepSeek tokenizer of the reproducibility test's case: its 102,400-row embedding made the two
experiments with it train for twice a tiny experiment's time, and what a rerun must equal does not depend on the
vocabulary's size (tests/test_hub_workflow.py trains with the real one)."""
EXPERIMENT_KINDS = {
    "tokenize.packing": {"tokenize": {"packing": False}},
    "model.tokenizer": {"model": {"tokenizer": OTHER_TOKENIZER}},
    "train.learning_rate": {"train": {"learning_rate": 1.0e-3}},
    "train.deepspeed (ZeRO-2 -> ZeRO-3)": {"train": {"deepspeed": "config/deepspeed/zero3.json"}},
    "preference.beta": {"preference": {"beta": 0.2}},
    "preference.pairs": {"preference": {"pairs": "all"}},
    "preference.max_length": {"preference": {"max_length": 32}},
    "preference.train.learning_rate": {"preference": {"train": {**PREF_TRAIN, "learning_rate": 5.0e-4}}},
}
"""Kind -> the change, as overrides of one experiment (the reproducibility test changes the top-level section)."""
ADDED = "added experiment"
SHARED_KINDS = {
    "dataset.languages": ("config", {"dataset": {"languages": ["en"]}}),
    "dataset.paths": ("config", {"dataset": {"paths": "all"}}),
    "eval.prompts": ("config", {"eval": {"prompts": ["What is 2 + 2?"]}}),
}
FILE_KINDS = {
    kind: CASES[kind][0][1] for kind in ("tokenizer vocabulary (rule file)", "ZeRO config file contents")
}
"""Edits of shared files (path, old text, new text: the reproducibility test's) that rerun the tokenizer or the
training and what follows: riders of dataset.paths (four Snakemake runs fewer than pairs of their own)."""
STAGE_KINDS = {"export.quants": {"export": {"quants": ["q8_0"]}}}
"""Changes that rerun one stage and the report only (the reproducibility table shows it)."""
BENCHMARK_ONLY = (
    "benchmark.tasks (one added)",
    "benchmark.limit",
    "benchmark task file (builtin_choice.yaml)",
    "benchmark/llama_lm.py",
)
"""Changes that rerun only the benchmark stage: scores this test does not compare (a harness run is deterministic on
CPU; tests/test_benchmark.py checks its scores), whose reruns tests/test_reproducibility.py and
tests/test_rerun_owners.py check. The runs here leave the benchmark stage out (NO_BENCHMARK): its jobs would cost
a minute of CPU per run and compare nothing."""
NO_BENCHMARK = "nobench.yaml"
CODE_KINDS = [
    kind
    for kind, ((what, _), stages) in CASES.items()
    if what == "file" and stages and kind not in FILE_KINDS and kind not in BENCHMARK_ONLY
]
"""The code edits that rerun something (an edit that cannot change an output reruns nothing: the reproducibility
test's)."""
RIDERS = {"eval.prompts": [*STAGE_KINDS], "dataset.languages": CODE_KINDS, "dataset.paths": [*FILE_KINDS]}
"""Shared kind -> the kinds made with it, in both runs: the export kind with a change that reruns the export stage
too, the code edits (every stage reruns) with the most upstream config change, the file edits with dataset.paths
(which reruns from the conversations on, as they do from the tokenizer or the training on)."""
NO_EXPORT = ("dataset.paths",)
"""Shared kinds whose runs stop at the evaluation (every model reruns; no rider concerns the export)."""
PLANS = ("results/plan/default.json", "results/plan/dpo/default.json", "results/plan/eval/default.json")
"""The memory plans: no stage reads them (workflow/rules/common_plan.smk), so a run that stops at the evaluation
asks for them by name (the clean run would not make them, the rerun would keep stale ones)."""
CHAIN = (
    "preference.pairs",
    "preference.beta",
    "preference.max_length",
    "preference.train.learning_rate",
    "train.learning_rate",
    "tokenize.packing",
    "model.tokenizer",
    "train.deepspeed (ZeRO-2 -> ZeRO-3)",
)
"""The experiment kinds in one chain (the module's docstring says how the runs use them). One chain, not two: a
second chain's first experiment would be the tiny config again, a second training, reference and DPO of `default`'s
config in the base run. ZeRO-3 last: only the chain's last experiment trains with it in the base run, and one in the
changed run."""
ADDED_NAME = "added"
RUN = ("--cores", "2", "--resources", "gpu=2")
RECORD_FIELDS = {"experiment", "wall_time_s", "run_key", "resumed_from_step", "time_s", "tokens_per_s_per_gpu",
                 "loss_tokens_per_s_per_gpu", "padded_tokens_per_s_per_gpu", "step_time_s", "mfu",
                 "model_tflops_per_gpu", "flops_share_of_measured_matmul", "tuned_model", "dpo_model",
                 "peak_memory_gib_per_rank", "device_memory_per_rank", "cuda_alloc_retries_per_rank",
                 "model", "data_key"}  # fmt: skip
"""What a record of a run says about that run (its name, time, speed, where), not about what it computed."""


def test_every_change_kind_is_covered():
    no_op = [kind for kind, (_, stages) in CASES.items() if not stages]
    covered = [*EXPERIMENT_KINDS, ADDED, *SHARED_KINDS, *FILE_KINDS, *STAGE_KINDS, *CODE_KINDS, *no_op]
    assert sorted([*covered, *BENCHMARK_ONLY]) == sorted(CASES)
    assert sorted(CHAIN) == sorted(EXPERIMENT_KINDS)
    assert sorted(kind for riders in RIDERS.values() for kind in riders) == sorted(
        [*STAGE_KINDS, *CODE_KINDS, *FILE_KINDS]
    )


# ---- what a run produced, for comparison ---------------------------------------------------------------------


def _metrics(path: Path) -> list[dict]:
    """metrics.csv without the wall-clock and throughput columns."""
    with open(path, newline="") as f:
        return [
            {k: v for k, v in row.items() if k != "time" and not k.startswith(("perf/", "memory/"))}
            for row in csv.DictReader(f)
        ]


def _weights(model_dir: Path) -> dict:
    from safetensors.torch import load_file

    return {name: t for f in sorted(model_dir.glob("*.safetensors")) for name, t in load_file(f).items()}


def _strip(obj):
    """A JSON record without RECORD_FIELDS and time or memory figures, at any depth."""
    if isinstance(obj, dict):
        return {
            k: _strip(v)
            for k, v in obj.items()
            if k not in RECORD_FIELDS and not any(w in k for w in ("time", "memory", "per_s"))
        }
    if isinstance(obj, list):
        return [_strip(v) for v in obj]
    return obj


def outputs(workdir: Path, experiment: str, *, evaluated: bool = True, exported: bool = True) -> dict:
    """Everything an experiment's run produced, as compared: losses, weights, reference log-probs by bytes, the
    evaluation's figures (`evaluated`), the GGUF files and the report's figures (`exported`, with `evaluated`)."""
    res = workdir / "results"
    out = {"train/metrics": _metrics(res / f"train/{experiment}/metrics.csv"),
           "train/summary": _strip(json.loads((res / f"train/{experiment}/summary.json").read_text())),
           "train/weights": _weights(res / f"train/{experiment}/model")}  # fmt: skip
    if evaluated:
        out["eval/metrics"] = _strip(json.loads((res / f"eval/{experiment}/metrics.json").read_text()))
        out["eval/generations"] = (res / f"eval/{experiment}/generations.jsonl").read_text()
    if evaluated and exported:
        out["report"] = _strip(
            json.loads((res / "report/summary.json").read_text())["experiments"][experiment]
        )
    pref = res / f"preference/{experiment}"
    if pref.exists():
        # The reference DPO read: the newest of the experiment's (named by their run keys; a change leaves the old).
        newest = max(pref.glob("reference-*/reference.parquet"), key=lambda p: p.stat().st_mtime_ns)
        out["reference"] = (newest.parent.name, newest.read_bytes())
        out["dpo/metrics"] = _metrics(res / f"dpo/{experiment}/metrics.csv")
        out["dpo/summary"] = _strip(json.loads((res / f"dpo/{experiment}/summary.json").read_text()))
        out["dpo/weights"] = _weights(res / f"dpo/{experiment}/model")
    # The GGUF files by bytes, their measurements.
    for d in sorted((res / f"export/{experiment}").glob("*") if exported else ()):
        out[f"export/{d.name}"] = {
            f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(d.glob("*.gguf"))
        }
        out[f"export/{d.name}/metrics"] = _strip(json.loads((d / "metrics.json").read_text()))
    return out


def data_files(workdir: Path) -> dict[str, bytes]:
    """Every file of the data stages (download to tokenized pairs) and the memory plans, by bytes: of the caches,
    the ones the last training and DPO read (a change of code or settings leaves the old key's directory beside the
    new one), under the name KEY."""
    res = workdir / "results"
    used = {}
    for rule, top in (("train", "tokenized"), ("dpo", "tokenized_pairs")):
        inputs = json.loads((res / f"provenance/{rule}/default.json").read_text())["inputs"]
        (used[top],) = [Path(p).name for p in inputs if Path(p).parent.name == top]
    files = {}
    for top in ("data", "tokenizer", "plan", *used):
        root = res / top / used.get(top, "")
        for p in sorted(root.rglob("*")):
            if p.is_file() and p.name != ".snakemake_timestamp":
                files[f"{top}/{'KEY/' if top in used else ''}{p.relative_to(root)}"] = p.read_bytes()
    return files


def assert_same(got: dict, want: dict, what: str) -> None:
    import torch

    assert got.keys() == want.keys(), what
    for key in want:
        if key.endswith("weights"):
            assert got[key].keys() == want[key].keys(), f"{what}: {key}"
            differ = [n for n in want[key] if not torch.equal(got[key][n], want[key][n])]
            assert not differ, f"{what}: {key} differ: {differ[:5]}"
        else:
            assert got[key] == want[key], f"{what}: {key} differs from the clean run's"


def written_since(workdir: Path, before: dict[str, float]) -> set[str]:
    """The results/ files rewritten since `before` (path -> mtime_ns)."""
    now = {str(p): p.stat().st_mtime_ns for p in (workdir / "results").rglob("*") if p.is_file()}
    return {p for p, t in now.items() if before.get(p) != t}


def mtimes(workdir: Path) -> dict[str, float]:
    return {str(p): p.stat().st_mtime_ns for p in (workdir / "results").rglob("*") if p.is_file()}


# ---- kinds that change one experiment: one base run of a chain of experiments, one run of the changes ------


def _merge(base: dict, change: dict) -> dict:
    """`change` over `base`, key by key at any depth."""
    out = dict(base)
    for key, value in change.items():
        both = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merge(out[key], value) if both else value
    return out


def _chain() -> tuple[dict, dict, dict]:
    """The base run's experiments and the changed run's (name -> overrides), and for each kind its experiment and
    the one with the config it is changed to (its clean twin: the base run's, or one the changed run adds)."""
    base, changed, twins = {}, {}, {}
    configs = [{}]
    for kind in CHAIN:
        configs.append(_merge(configs[-1], EXPERIMENT_KINDS[kind]))
    # config/config.yaml always brings `default`: the tiny config, the first of the chain.
    names = ["default" if j == 0 else f"a{j}" for j in range(len(configs))]
    for j, name in enumerate(names):
        base[name] = configs[j]
        changed[name] = configs[min(j + 1, len(CHAIN))]
    for j, kind in enumerate(CHAIN):
        twins[kind] = (names[j], names[j + 1])
    changed[ADDED_NAME] = {}
    twins[ADDED] = (ADDED_NAME, "default")
    return base, changed, twins


BASE, CHANGED, TWINS = _chain()


def _dpo_targets(names) -> list[str]:
    """Each experiment's preference-tuned model, and with it everything it starts from (not the evaluation and the
    report: pure functions of the models, compared for the shared kinds and the code edits below)."""
    return [f"results/dpo/{name}/summary.json" for name in names]


@pytest.fixture(scope="module")
def experiments(tmp_path_factory, tiny_data) -> dict:
    root = tmp_path_factory.mktemp("rerun_experiments")
    workdir = copy_workflow(root / "wf")
    shutil.copytree(tiny_data.tokenizer_dir, workdir / OTHER_TOKENIZER)  # the model.tokenizer experiment's
    shutil.copy2(TINY_CONFIG, workdir / "tiny.yaml")
    (workdir / "base.yaml").write_text(json.dumps({"experiments": BASE}))
    snakemake(workdir, *_dpo_targets(BASE), *RUN, "--configfile", "tiny.yaml", "base.yaml", timeout=1500)
    # The clean twins' outputs as the base run left them (the changed run remakes most of them), in the layout of
    # a run.
    base = root / "base"
    for top in ("train", "preference", "dpo"):
        shutil.copytree(workdir / "results" / top, base / "results" / top)
    before = mtimes(workdir)
    (workdir / "changed.yaml").write_text(json.dumps({"experiments": CHANGED}))
    targets = _dpo_targets(CHANGED)
    log = snakemake(workdir, *targets, *RUN, "--configfile", "tiny.yaml", "changed.yaml", timeout=1500).output
    return {"workdir": workdir, "base": base, "written": written_since(workdir, before), "log": log}


@pytest.mark.parametrize("kind", [*EXPERIMENT_KINDS, ADDED])
def test_rerun_of_an_experiment_equals_its_clean_twin(experiments, kind):
    workdir = experiments["workdir"]
    name, twin = TWINS[kind]
    # The base run's twin (copied aside before the changed run), or one the changed run added.
    clean = experiments["base"] if twin in BASE else workdir
    assert CHANGED[name] == (BASE[twin] if twin in BASE else CHANGED[twin]), kind
    got = outputs(workdir, name, evaluated=False, exported=False)
    want = outputs(clean, twin, evaluated=False, exported=False)
    assert_same(got, want, f"{kind}: experiment {name} against {twin} of {clean.name}")
    written = {Path(p).relative_to(workdir / "results").parts[:2] for p in experiments["written"]}
    # The stages tests/test_reproducibility.py expects for this kind rewrote this experiment's outputs.
    expected = set(CASES[kind][1])
    for rule, top in (("train", "train"), ("dpo", "dpo"), ("reference", "preference")):
        assert ((top, name) in written) == (rule in expected or kind == ADDED), f"{kind}: {rule} of {name}"
    dpo_log = (workdir / f"logs/dpo/{name}.log").read_text()
    if "dpo" in expected:
        # Its DPO started from the new SFT model and reference: no stale checkpoint of the base run was resumed.
        assert "resuming from checkpoint" not in dpo_log, dpo_log[-2000:]


def test_an_unchanged_experiment_reruns_nothing(experiments):
    """The last experiment of the chain keeps its config: the changed run rewrote none of its files."""
    res = experiments["workdir"] / "results"
    unchanged = [name for name in BASE if CHANGED[name] == BASE[name]]
    assert len(unchanged) == 1  # the chain's last
    for name in unchanged:
        rewritten = [
            p
            for p in map(Path, experiments["written"])
            if name in p.relative_to(res).parts or p.name == f"{name}.json"
        ]
        assert not rewritten, f"{name}: {rewritten}"


def test_sft_learning_rate_rerun_retrains_dpo_from_scratch(experiments):
    """The issue's case: only the SFT learning rate changes; DPO reruns from the new SFT model, its losses are the
    clean run's exactly (the comparison above), and nothing of the old DPO run is resumed."""
    workdir = experiments["workdir"]
    name, _ = TWINS["train.learning_rate"]
    dpo = json.loads((workdir / f"results/dpo/{name}/summary.json").read_text())
    assert dpo["resumed_from_step"] == 0 and dpo["start_check"]["violations"] == 0
    # The base run's and the rerun's DPO ran under two run keys (another key, not a resume), and once the rerun's
    # model was in place both runs' checkpoints were removed (train.keep_final_checkpoint is false).
    base = json.loads((experiments["base"] / f"results/dpo/{name}/summary.json").read_text())
    assert dpo["run_key"] != base["run_key"], dpo["run_key"]
    assert not list((workdir / f"results/checkpoints/{name}/dpo").iterdir())


# ---- kinds that change what every experiment shares, and their riders --------------------------------------


def _apply(workdir: Path, kind: str) -> tuple[str, ...]:
    """Apply a shared change and its riders in `workdir`; the extra --configfile they need."""
    what, config = SHARED_KINDS[kind]
    assert what == "config", kind
    for rider in RIDERS.get(kind, ()):
        if rider in STAGE_KINDS:
            config = _merge(config, STAGE_KINDS[rider])
            continue
        if rider in FILE_KINDS:
            path, old, new = FILE_KINDS[rider]
            text = (workdir / path).read_text()
            assert text.count(old) == 1, (path, old)
            (workdir / path).write_text(text.replace(old, new))
            continue
        (_, (path, old, _)), _ = CASES[rider]
        assert old is None, rider  # a code edit: a comment appended
        with open(workdir / path, "a") as f:
            f.write(edit_line(path, "tests/test_rerun_clean.py"))
    if not config:
        return ()
    (workdir / "change.yaml").write_text(json.dumps(config))
    return ("change.yaml",)


@pytest.fixture(scope="module")
def shared(tiny_run, tmp_path_factory) -> dict:
    """For each shared kind: the tiny run changed and rerun, and a clean run of the changed workflow, side by side
    (two Snakemake runs at a time)."""
    root = tmp_path_factory.mktemp("rerun_shared")
    pairs, runs = {}, []
    for i, kind in enumerate(SHARED_KINDS):
        incremental = clone_run(tiny_run, root / f"incremental{i}")
        clean = copy_workflow(root / f"clean{i}")
        shutil.copy2(tiny_run / "tiny.yaml", clean / "tiny.yaml")
        extra = _apply(incremental, kind)
        assert _apply(clean, kind) == extra
        for w in (incremental, clean):
            (w / NO_BENCHMARK).write_text(json.dumps({"benchmark": {"enabled": False}}))
        pairs[kind] = (incremental, clean)
        targets = ("results/eval/default/metrics.json", *PLANS) if kind in NO_EXPORT else ()
        configs = ("tiny.yaml", *extra, NO_BENCHMARK)
        args = (*targets, "--cores", "1", "--resources", "gpu=1", "--configfile", *configs)
        # The longest runs first, so that the last two end together: those of every stage (clean runs, the code
        # edits' rerun), then those without the export stage, and eval.prompts' rerun (evaluation, export) last.
        length = 1 if kind in NO_EXPORT else 0
        runs += [(length, clean, args), (2 if kind == "eval.prompts" else length, incremental, args)]
    runs.sort(key=lambda run: run[0])
    # Two Snakemake runs at a time (most of a job's time is one process importing torch).
    with ThreadPoolExecutor(2) as pool:
        for future in [pool.submit(snakemake, w, *args, timeout=900) for _, w, args in runs]:
            future.result()
    return pairs


@pytest.mark.parametrize("kind", [*SHARED_KINDS, *FILE_KINDS])
def test_rerun_after_a_shared_change_equals_a_clean_run(shared, kind):
    carrier = kind if kind in SHARED_KINDS else _carrier(kind)
    incremental, clean = shared[carrier]
    assert data_files(incremental) == data_files(clean), f"{kind}: data files differ from the clean run's"
    exported = carrier not in NO_EXPORT
    assert_same(
        outputs(incremental, "default", exported=exported), outputs(clean, "default", exported=exported), kind
    )


def _carrier(kind: str) -> str:
    (carrier,) = [shared_kind for shared_kind, riders in RIDERS.items() if kind in riders]
    return carrier


@pytest.mark.parametrize("kind", list(STAGE_KINDS))
def test_rerun_after_a_stage_change_equals_a_clean_run(shared, kind):
    incremental, clean = shared[_carrier(kind)]
    assert data_files(incremental) == data_files(clean)
    got, want = outputs(incremental, "default"), outputs(clean, "default")
    assert sorted(got["export/sft"]) == ["default-sft-f32.gguf", "default-sft-q8_0.gguf"], got["export/sft"]
    assert_same(got, want, kind)


@pytest.mark.parametrize("kind", CODE_KINDS)
def test_rerun_after_a_code_edit_equals_the_clean_run(shared, tiny_run, kind):
    """Every stage this edit reruns (tests/test_reproducibility.py's CASES) ran again under a new code hash (the
    report's record of each job says so), and the rerun computed what the clean run of the edited workflow computed.
    (The code edits share one rerun, so a stage counts as rerun when any edit of the run changed its hash; which
    edit reruns which stages, each alone, is the reproducibility test's.)"""
    incremental, clean = shared[_carrier(kind)]
    assert data_files(incremental) == data_files(clean)
    assert_same(outputs(incremental, "default"), outputs(clean, "default"), kind)
    codes = {j["record"]: j.get("code") for j in job_records(tiny_run)}
    stages = set(CASES[kind][1]) - {"all", "manifest"}  # jobs without a record of their own
    checked = [
        j for j in job_records(incremental) if j["rule"] in stages and codes.get(j["record"]) is not None
    ]
    assert checked, f"{kind}: none of {sorted(stages)} in the rerun's records"
    stale = [j["record"] for j in checked if j.get("code") == codes[j["record"]]]
    assert not stale, f"{kind}: not rerun under a new code hash: {stale}"


def job_records(workdir: Path) -> list[dict]:
    """The provenance records of a run's jobs: the manifest's (every job behind the report) and the report's own."""
    jobs = json.loads((workdir / "results/provenance/manifest.json").read_text())["jobs"]
    report = "results/provenance/report.json"
    return [*jobs, {"record": report, **json.loads((workdir / report).read_text())}]
