"""The report: summary.json fields from a fixture results tree of two experiments (tests/report_tree.py), the
first screen (each final model's figures with their intervals, the verdict, time and cost, how to reproduce),
self-contained HTML that a real browser renders (headless Chromium) within the first screen and without sideways
scrolling, Markdown, number formatting; and the real workflow ending in it."""

from __future__ import annotations

import base64
import html
import json
import re
import shutil
import subprocess
from dataclasses import replace
from html.parser import HTMLParser
from pathlib import Path

import pytest
import yaml

from conftest import clone_run, needs, snakemake
from report_tree import COMMIT, DPO, GPU_SECONDS, KEY, first_screen, make_results, write_json, write_text
from snaketune.report import build as report
from snaketune.report.headline import Measure, cell_text
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
    # Only the jobs of the manifest: benchmarks/train/removed.tsv is a removed experiment's leftover.
    assert prov["wall_time_s"] == {"download": 0.7, "train/default": 173.76, "eval/default": 9.5}
    assert prov["seeds"]["default: train.seed"] == 1234
    assert (d["final_model"], lora["final_model"]) == ("dpo", "tuned")
    assert d["headline"]["val_loss"]["values"] == {"base": 6.895, "tuned": 0.9322, "dpo": DPO["loss"]}
    assert (
        d["headline"]["preference_accuracy"]["ci95"]["dpo"] == d["headline"]["reward_accuracy"]["ci95"]["dpo"]
    )
    run = summary["run"]
    assert run["gpu_hours"] == pytest.approx(GPU_SECONDS / 3600)
    assert run["gpu_devices"] == ["NVIDIA H200"] and run["jobs"] == 7
    assert run["command"] == "snakemake --cores all --resources gpu=3 --configfile config/mine.yaml"
    assert (run["git_commit"], run["git_dirty"]) == (COMMIT, False)


def test_markdown_has_the_tables_and_the_improvement(built):
    out, _ = built
    md = (out / "report.md").read_text()
    assert "Validation loss fell from **6.895** (base) to **1.850** (SFT, the final model; −73.2%)" in md
    assert "train/removed" not in md  # the stage-time table lists the experiments of the config only
    assert "## Comparison" in md  # two experiments
    assert "![" in md and "(loss_vs_step.png)" in md
    assert "Tell me a joke \\| please" in md  # pipes in cells are escaped
    assert "| train | 530 | 530 |" in md


def test_html_is_self_contained(built):
    out, _ = built
    page = (out / "index.html").read_text()
    assert "<script" not in page
    assert "http://" not in page and "https://" not in page and 'src="file' not in page
    assert page.count('src="data:image/png;base64,') == 6
    assert "let let &lt;b&gt;" in page  # generated text is escaped


def test_the_first_screen_answers_for_the_final_model(built):
    """Before anything else: each experiment's final model (DPO where it ran, else SFT) against base and SFT with
    95% intervals, the verdict in words, the run's time and GPU-hours, and how to make it again."""
    out, _ = built
    top = first_screen((out / "report.md").read_text())
    assert "the final model is the **DPO** model" in top and "the final model is the **SFT** model" in top
    # Wilson's interval of 0 of 64 right reaches z² / (64 + z²) = 5.66%.
    assert (
        "| exact match (64 builtin questions) | 0.0% [0.0, 5.7] | 79.7% [68.3, 87.7] | **37.5%** [26.7, 49.7] |"
        in top
    )
    assert (
        "| held-out preference accuracy (128 pairs) | 50.0% [41.5, 58.5] | 55.5% [46.8, 63.8] | **96.1%** [91.2, 98.3] |"
        in top
    )
    assert (
        "| held-out reward accuracy (implicit reward against SFT) | 42.2% [34.0, 50.8] | – (reference) | **96.1%**"
        in top
    )
    assert "DPO raised held-out preference accuracy from 55.5% (SFT) to **96.1%** [91.2, 98.3] (DPO)" in top
    assert "DPO's part, from 79.7% (SFT): −42.2 points" in top  # DPO cost exact matches, beyond the noise
    assert "no noise verdict" in top  # the evaluate stage records no interval for the loss
    assert f"**{fmt(GPU_SECONDS / 3600, 3)} GPU-hours** (train" in top and "on NVIDIA H200" in top
    assert (
        f"git checkout {COMMIT}\nsnakemake --cores all --resources gpu=3 --configfile config/mine.yaml" in top
    )
    # The overlay config is named by its hash; outside a git checkout nothing is "clean".
    assert "**1 of the inputs below are not in the commit**" in top and "clean (" not in top
    assert f"| `config/mine.yaml` (config file) | `{'5e1f' * 4}` | not a git checkout |" in top
    # The resolved config is folded away.
    page = (out / "index.html").read_text()
    assert "<details><summary>The configuration as resolved" in page and "<details open" not in page


def test_the_reproduce_box_names_what_a_checkout_would_not_bring_back(tmp_path):
    """A run on the user's own overlay config and data file (untracked), a tracked file edited, a file outside the
    checkout: each named with its sha256 and why the commit lacks it, and the box does not call the run clean;
    tracked, unmodified inputs are in the commit."""
    from snaketune.report.render import to_markdown
    from snaketune.report.reproducibility import reproduce_blocks, run_inputs

    repo = tmp_path / "repo"
    for name in ("config/deepspeed/zero2.json", "data/edited.jsonl"):
        write_text(repo / name, "{}\n")
    git = ["git", "-C", str(repo), "-c", "user.name=t", "-c", "user.email=t@t"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-qm", "x"], check=True)
    write_text(repo / "data/edited.jsonl", "{}\n{}\n")
    write_text(repo / "my.yaml", "dataset: {source: my_chats.jsonl}\n")
    write_text(repo / "my_chats.jsonl", "{}\n")
    write_text(tmp_path / "elsewhere.jsonl", "{}\n")
    sources = {p: {"sha256": f"{i}" * 64} for i, p in enumerate(
        ["config/deepspeed/zero2.json", "data/edited.jsonl", "my_chats.jsonl", str(tmp_path / "elsewhere.jsonl")]
    )}  # fmt: skip
    inputs = run_inputs(
        {"sources": sources}, {"configfiles": ["my.yaml"], "configfile_sha256": {"my.yaml": "f" * 64}}, repo
    )
    assert {i["path"]: i["outside"] for i in inputs} == {
        "config/deepspeed/zero2.json": None,
        "data/edited.jsonl": "modified",
        "my.yaml": "untracked",
        "my_chats.jsonl": "untracked",
        str(tmp_path / "elsewhere.jsonl"): "outside the checkout",
    }
    run = {"command": "snakemake", "git_commit": COMMIT, "git_dirty": False, "git_commits": 1,
           "config_sha256": "c" * 64, "inputs": inputs}  # fmt: skip
    box = to_markdown("r", reproduce_blocks(run))
    assert "clean (" not in box and "**4 of the inputs below are not in the commit**" in box, box
    assert f"| `my.yaml` (config file) | `{'f' * 16}` | untracked |" in box
    assert f"| `config/deepspeed/zero2.json` (input) | `{'0' * 16}` | yes |" in box
    clean = to_markdown("r", reproduce_blocks({**run, "inputs": [i for i in inputs if not i["outside"]]}))
    assert "clean (no uncommitted changes; every input below is in the commit)" in clean


def test_the_misses_listed_are_the_final_models(built):
    """ "Got wrong" lists the final model's misses: DPO's for default (it answers the question SFT missed and
    misses one SFT got), SFT's for lora."""
    out, _ = built
    md = (out / "report.md").read_text()
    evaluation = md[md.index("## Evaluation") : md.index("## Preference tuning")]
    default, lora = (
        part[part.index("got wrong") : part.index("Sample generations")]
        for part in evaluation.split("### Experiment lora")
    )
    assert "| What is 5 + 5? | 5 + 5 = 10. | 5 + 5 = 11. |" in default and "What is 3 + 4?" not in default
    assert "| What is 3 + 4? | 3 + 4 = 7. | 3 + 4 = 8. |" in lora and "What is 5 + 5?" not in lora
    assert (
        "final (DPO) model got wrong (1 of 2" in evaluation
        and "final (SFT) model got wrong (1 of 2" in evaluation
    )


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


def test_html_renders_in_headless_chromium(built, tmp_path):
    needs(chromium() is None and "chromium is not installed (apt-get install -y chromium)")
    out, summary = built
    url = (out / "index.html").resolve().as_uri()
    dom = _chromium(["--dump-dom", url], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    parsed = _Dom()
    parsed.feed(dom.stdout)
    assert len(parsed.images) == 6
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


LAYOUT_JS = """<script>
// After load (images decoded): where each needle's first occurrence ends, whether the page scrolls sideways, and
// how wide each image is drawn against its natural width. Written into the DOM for --dump-dom to carry out.
window.addEventListener("load", () => {
  const innermost = (el, needle) => {
    for (const child of el.children) if (child.textContent.includes(needle)) return innermost(child, needle);
    return el;
  };
  const bottoms = {};
  for (const needle of NEEDLES) {
    bottoms[needle] = document.body.textContent.includes(needle)
      ? innermost(document.body, needle).getBoundingClientRect().bottom + window.scrollY : null;
  }
  const root = document.documentElement;
  const pre = document.createElement("pre");
  pre.id = "layout";
  pre.textContent = JSON.stringify({
    viewport: [window.innerWidth, window.innerHeight], scrollWidth: root.scrollWidth, clientWidth: root.clientWidth,
    images: [...document.images].map(img => [img.getBoundingClientRect().width, img.naturalWidth,
                                             Number(img.getAttribute("width"))]), bottoms,
  });
  document.body.appendChild(pre);
});
</script>"""


def _layout(page: Path, width: int, height: int, needles: list[str], tmp_path: Path) -> dict:
    """The report laid out by headless Chromium in a window of width x height (LAYOUT_JS's measurements)."""
    probe = tmp_path / f"layout-{width}.html"
    script = LAYOUT_JS.replace("NEEDLES", json.dumps(needles))
    probe.write_text(
        page.read_text(encoding="utf-8").replace("</body>", script + "</body>"), encoding="utf-8"
    )
    dom = _chromium(["--dump-dom", f"--window-size={width},{height}", probe.as_uri()], tmp_path)
    assert dom.returncode == 0, dom.stderr[-2000:]
    match = re.search(r'<pre id="layout">(.*?)</pre>', dom.stdout, re.DOTALL)
    assert match, dom.stdout[-2000:]
    layout = json.loads(html.unescape(match.group(1)))
    # The width lays the page out; heights are measured from the top of the document, whatever part of the
    # window headless Chromium keeps for itself.
    assert layout["viewport"][0] == width
    return layout


def _final_figures(summary: dict) -> list[str]:
    """Each experiment's final model's headline figures as the first screen shows them, intervals included."""
    texts = []
    for e in summary["experiments"].values():
        for key, h in e["headline"].items():
            m = Measure(key, h["label"], key != "val_loss", h["values"], h["ci95"], h.get("reference"))
            texts.append(cell_text(m, e["final_model"], e["final_model"]).replace("**", ""))
    return texts


def test_the_first_screen_holds_the_answer_and_nothing_scrolls_sideways(built, tmp_path):
    needs(chromium() is None and "chromium is not installed (apt-get install -y chromium)")
    """At 1,280 x 800 every final model's headline figure, with its interval, ends within the first 800 px; at 1,024
    and 1,280 px the page is no wider than the window; no plot is drawn wider than 1.1x its pixels."""
    out, summary = built
    needles = _final_figures(summary)
    assert len(needles) == 6 and sum("[" in n for n in needles) == 4  # two losses without intervals
    for width in (1024, 1280):
        layout = _layout(out / "index.html", width, 800, needles, tmp_path)
        assert layout["scrollWidth"] <= layout["clientWidth"], width
        assert len(layout["images"]) == 6
        for drawn, natural, intended in layout["images"]:
            # Never upscaled: neither past the PNG's pixels nor past the size it was drawn for (2 pixels each).
            assert 0 < drawn <= 1.1 * natural and drawn <= 1.1 * intended, (width, drawn, natural, intended)
        if width == 1280:
            for needle, bottom in layout["bottoms"].items():
                assert bottom is not None and bottom <= 800, (needle, bottom)


# ---- the real workflow ---------------------------------------------------------------------------


@pytest.mark.slow
def test_workflow_ends_with_the_report_and_eval_settings_never_retrain(tiny_run, tmp_path):
    """The tiny config through the real workflow (conftest.tiny_run): the report is the default target, the tuned
    model beats the base, a changed eval prompt reruns evaluate and report only, and Snakemake's own report of the
    run builds."""
    out = tiny_run / "results/report"
    for name in report.OUTPUTS.values():
        assert (out / name).is_file(), name
    summary = json.loads((out / "summary.json").read_text())
    exp = summary["experiments"]["default"]
    assert exp["tuned_val_loss"] < exp["base_val_loss"]
    # The first screen: the DPO model is the final one; CPU ranks held no GPU; the command names the config file.
    assert exp["final_model"] == "dpo" and summary["run"]["gpu_hours"] == 0
    assert summary["run"]["command"] == "snakemake --cores all --resources gpu=1 --configfile tiny.yaml"
    assert "**CPU run**: no job held a GPU." in (out / "report.md").read_text()
    train = yaml.safe_load((tiny_run / "tiny.yaml").read_text())["train"]
    assert exp["steps"] == train["max_steps"] and exp["world_size"] == train["gpus"]
    workdir = clone_run(tiny_run, tmp_path / "wf")
    args = ("--cores", "2", "--resources", "gpu=2", "--configfile", "tiny.yaml")
    dry = snakemake(workdir, *args, "-n", "--config", "eval={prompts: ['What is 2 + 2?']}").output
    jobs = {line.split()[0] for line in dry.splitlines() if line[:1].isalpha() and line.split()[-1].isdigit()}
    assert jobs & {"evaluate", "report"} == {"evaluate", "report"}
    assert not jobs & {"download", "conversations", "train_tokenizer", "tokenize", "train"}, dry
    snakemake(workdir, *args, "--report", "results/report.zip", timeout=900)
    assert (workdir / "results/report.zip").stat().st_size > 0
