"""The report: summary.json fields from a fixture results tree of two experiments (tests/report_tree.py),
self-contained HTML that a real browser renders (headless Chromium), Markdown, number formatting; and the real
workflow ending in it."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from conftest import clone_run, run_snakemake
from report_tree import KEY, make_results, write_json, write_text
from snaketune.report import build as report
from snaketune.report.render import fmt, fmt_duration, fmt_pct

REPO = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("report")
    inputs = make_results(root)
    out = root / "results/report"
    summary = report.build_report(inputs, out, workdir=root)
    return out, summary


# ---- summary.json and files ----------------------------------------------------------------------


def test_every_output_is_written(built):
    out, _ = built
    for name in report.OUTPUTS.values():
        assert (out / name).stat().st_size > 0, name
        if name.endswith(".png"):
            assert (out / name).read_bytes().startswith(PNG_MAGIC)


def test_summary_json_fields(built):
    out, summary = built
    assert json.loads((out / "summary.json").read_text()) == json.loads(json.dumps(summary))
    data = summary["data"]
    assert data["conversations"] == {"train": 530, "validation": 26}
    assert data["tokenized"][KEY]["splits"]["train"]["tokens"] == 15656
    assert data["tokenized"][KEY]["experiments"] == ["default", "lora"]
    d = summary["experiments"]["default"]
    assert d["tokens"] == {"train": 15656, "validation": 857}
    assert (d["steps"], d["world_size"], d["zero_stage"]) == (120, 3, 2)
    assert d["final_train_loss"] == 0.0583 and d["final_val_loss"] == 0.9322
    assert d["tokens_per_s_per_gpu"] == 2968.3 and d["mfu"] is None
    assert d["peak_memory_gib"] == 0.666
    assert d["base_val_loss"] == 6.895 and d["tuned_val_loss"] == 0.9322
    assert d["val_loss_change_pct"] == pytest.approx(-86.48, abs=0.01)
    assert d["base_perplexity"] == pytest.approx(987.3, rel=1e-3)
    assert d["base_accuracy"] == 0.0 and d["tuned_accuracy"] == 0.796875
    lora = summary["experiments"]["lora"]
    assert lora["lora"] and lora["mfu"] == 0.0123 and lora["world_size"] == 2
    prov = summary["provenance"]
    assert prov["git_commit"] == "not a git checkout"
    assert set(report.PACKAGES) <= set(prov["versions"])
    assert prov["versions"]["torch"] == "2.13.0+cpu"  # as the evaluate job recorded it
    assert prov["wall_time_s"] == {"download": 0.7, "train/default": 173.76, "eval/default": 9.5}
    assert prov["seeds"]["default: train.seed"] == 1234


def test_markdown_has_the_tables_and_the_improvement(built):
    out, _ = built
    md = (out / "report.md").read_text()
    assert "Validation loss fell from **6.895** to **0.9322** (−86.5%)" in md
    assert "## Comparison" in md  # two experiments
    assert "![" in md and "(loss_vs_step.png)" in md
    assert "Tell me a joke \\| please" in md  # pipes in cells are escaped
    assert "| train | 530 | 530 |" in md


def test_html_is_self_contained(built):
    out, _ = built
    page = (out / "index.html").read_text()
    assert "<script" not in page
    assert "http://" not in page and "https://" not in page and 'src="file' not in page
    assert page.count('src="data:image/png;base64,') == 5
    assert "let let &lt;b&gt;" in page  # generated text is escaped


def _export_dir(root: Path) -> Path:
    """An export stage's directory (snaketune.export.export) with an f32 file that passes and a q4_k_m file
    marked failing for two reasons."""
    d = root / "results/export/default/sft"
    files = []
    for kind, failing in (("f32", []), ("q4_k_m", ["KL 0.3 > 0.1", "eos does not end generation"])):
        files.append(
            {
                "type": kind,
                "file": f"default-sft-{kind}.gguf",
                "bytes": 2**20,
                "make_time_s": 1.0,
                "perplexity": 12.0,
                "perplexity_ratio": 1.0,
                "kl_mean": 0.3 if failing else 0.0,
                "top1_agreement": 0.9,
                "prompt_tokens_per_s": 900.0,
                "generation_tokens_per_s": 300.0,
                "replies": 2,
                "replies_agreeing": 2,
                "replies_ended": 2,
                "replies_ended_transformers": 2,
                "eos_is_end_of_generation": not failing,
                "failing": failing,
            }
        )
    write_json(
        d / "metrics.json",
        {
            "model": "default-sft",
            "toolchain": {"llama_cpp_python": "0.3.36"},
            "outtype": "f32",
            "metadata": {
                "chat_template_matches": True,
                "bos_token_id": 1,
                "eos_token_id": 2,
                "eos_matches": True,
                "pre_tokenizer": "gpt-2",
            },
            "reference": {"perplexity": 12.0, "target_tokens": 300, "conversations": 4},
            "threads": 2,
            "files": files,
            "time_s": 3.0,
        },
    )
    write_text(d / "replies.jsonl", "")
    return d


def test_a_failing_gguf_file_shows_as_failing(tmp_path):
    """The deployment section's verdict column: the reasons a file failed, "pass" for one that did not; summary.json
    keeps the reasons."""
    inputs = make_results(tmp_path)
    default = replace(inputs.experiments[0], exports={"sft": _export_dir(tmp_path)})
    inputs = replace(inputs, experiments=[default, *inputs.experiments[1:]])
    summary = report.build_report(inputs, tmp_path / "results/report", workdir=tmp_path)
    md = (tmp_path / "results/report/report.md").read_text()
    section = md[md.index("## Deployment (GGUF)") :]
    rows = {
        line.split(" | ")[0]: line
        for line in section.splitlines()
        if line.startswith(("| f32 ", "| q4_k_m "))
    }
    assert rows["| f32"].endswith(" | pass |"), rows
    assert rows["| q4_k_m"].endswith(" | KL 0.3 > 0.1; eos does not end generation |"), rows
    exported = summary["experiments"]["default"]["export"]["sft"]
    assert [f["failing"] for f in exported] == [[], ["KL 0.3 > 0.1", "eos does not end generation"]]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (1037440, "1,037,440"),
        (2968.324, "2,968"),
        (6.89502, "6.895"),
        (0.932193, "0.9322"),
        (987.347, "987.3"),
        (0.0123, "0.01230"),
        (3e-5, "3.000e−05"),
        (-86.48, "−86.48"),
        (None, "–"),
        (0, "0"),
    ],
)
def test_number_formatting(value, expected):
    assert fmt(value) == expected


def test_percent_and_duration_formatting():
    assert fmt_pct(-86.48, signed=True) == "−86.5%"
    assert fmt_duration(155.4) == "2 min 35 s" and fmt_duration(9.54) == "9.5 s"
    assert fmt_duration(7300) == "2 h 01 min"


# ---- a real browser ------------------------------------------------------------------------------


def chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome"):
        if path := shutil.which(name):
            return path
    return None


class _Dom(HTMLParser):
    def __init__(self):
        super().__init__()
        self.images: list[str] = []
        self.tables: list[list[str]] = []
        self._cell: list[str] | None = None

    def handle_starttag(self, tag, attrs):
        if tag == "img":
            self.images.append(dict(attrs).get("src", ""))
        elif tag == "table":
            self.tables.append([])
        elif tag in ("td", "th"):
            self._cell = []

    def handle_endtag(self, tag):
        if tag in ("td", "th") and self._cell is not None:
            self.tables[-1].append("".join(self._cell).strip())
            self._cell = None

    def handle_data(self, data):
        if self._cell is not None:
            self._cell.append(data)


def _chromium(args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'chromium-profile'}",
    ]
    return subprocess.run([chromium(), *flags, *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(chromium() is None, reason="chromium is not installed (apt-get install -y chromium)")
def test_html_renders_in_headless_chromium(built, tmp_path):
    out, summary = built
    url = (out / "index.html").resolve().as_uri()
    dom = _chromium(["--dump-dom", url], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Dom()
    parsed.feed(dom.stdout)
    assert len(parsed.images) == 5
    for src in parsed.images:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1]).startswith(PNG_MAGIC)
    cells = [c for table in parsed.tables for c in table]
    d = summary["experiments"]["default"]
    for figure in (
        fmt(d["base_val_loss"]),
        fmt(d["tuned_val_loss"]),
        "79.7%",
        "15,656",
        "2,968",
        "1,037,440",
    ):
        assert any(figure in cell for cell in cells), figure
    numeric = [c for c in cells if c.replace(",", "").replace(".", "").replace("%", "").isdigit()]
    assert len(numeric) > 40

    shot = tmp_path / "report.png"
    result = _chromium([f"--screenshot={shot}", "--window-size=1280,4000", url], tmp_path)
    assert result.returncode == 0 and shot.read_bytes().startswith(PNG_MAGIC), result.stderr[-2000:]
    from PIL import Image

    image = Image.open(shot).convert("L")
    assert image.size == (1280, 4000)
    # Not a blank page: the rendered text, tables and plots make many distinct grey levels.
    assert sum(1 for count in image.histogram() if count) > 50


# ---- the real workflow ---------------------------------------------------------------------------


@pytest.mark.slow
def test_workflow_ends_with_the_report_and_eval_settings_never_retrain(tiny_run, tmp_path):
    """The tiny config through the real workflow (conftest.tiny_run): the report is the default target, the tuned
    model beats the base, a changed eval prompt reruns evaluate and report only, and Snakemake's own report of the
    run builds."""
    out = tiny_run / "results/report"
    for name in report.OUTPUTS.values():
        assert (out / name).is_file(), name
    exp = json.loads((out / "summary.json").read_text())["experiments"]["default"]
    assert exp["tuned_val_loss"] < exp["base_val_loss"]
    train = yaml.safe_load((tiny_run / "tiny.yaml").read_text())["train"]
    assert exp["steps"] == train["max_steps"] and exp["world_size"] == train["gpus"]
    workdir = clone_run(tiny_run, tmp_path / "wf")
    args = ("--cores", "2", "--resources", "gpu=2", "--configfile", "tiny.yaml")
    dry = run_snakemake(workdir, *args, "-n", "--config", "eval={prompts: ['What is 2 + 2?']}")
    jobs = {line.split()[0] for line in dry.splitlines() if line[:1].isalpha() and line.split()[-1].isdigit()}
    assert jobs & {"evaluate", "report"} == {"evaluate", "report"}
    assert not jobs & {"download", "conversations", "train_tokenizer", "tokenize", "train"}, dry
    run_snakemake(workdir, *args, "--report", "results/report.zip")
    assert (workdir / "results/report.zip").stat().st_size > 0
