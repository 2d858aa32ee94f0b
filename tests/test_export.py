"""The export stage: GGUF files through llama.cpp's converter and quantizer, measured against the model they came
from (snaketune.export). The workflow part reads the shared tiny run (conftest.tiny_run), which exports its SFT and
DPO models; the real model's round trip is in tests/test_real_model.py."""

from __future__ import annotations

import io
import json
import sys
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from snaketune.config.choices import ConfigError
from snaketune.config.export import DEFAULT_MAX_KL
from snaketune.config.load import load_config
from snaketune.data.tokenizer import EOS
from snaketune.export import export, llama_cpp, measure
from snaketune.model.batching import IGNORE, TokenizedSplit

# ---- the stage in the tiny run ------------------------------------------------------------------------------


@pytest.mark.parametrize("model", ["sft", "dpo"])
def test_the_tiny_run_exports_each_model_in_every_configured_type(tiny_run, model):
    d = tiny_run / f"results/export/default/{model}"
    m = json.loads((d / "metrics.json").read_text())
    # outtype auto: the type the model was saved in; the tiny run trains and saves in fp32 on the CPU.
    assert m["outtype"] == "f32"
    names = [f"default-{model}-{t}.gguf" for t in ("f32", "q8_0", "q4_k_m")]
    assert sorted(p.name for p in d.glob("*.gguf")) == sorted(names)
    assert [f["file"] for f in m["files"]] == names
    sizes = [f["bytes"] for f in m["files"]]
    assert sizes == sorted(sizes, reverse=True), "each quant is smaller than the type above it"
    meta = m["metadata"]
    assert meta["chat_template_matches"] and meta["bos_matches"] and meta["eos_matches"], meta
    assert meta["pre_tokenizer"] == "gpt-2"  # the builtin tokenizer's split, named for llama.cpp
    f32 = m["files"][0]
    # The f32 file holds the trained weights exactly: llama.cpp computes what transformers does, to rounding.
    assert f32["kl_mean"] < 1e-4 and f32["top1_agreement"] > 0.99, f32
    assert abs(f32["perplexity"] / m["reference"]["perplexity"] - 1) < 0.001
    for f in m["files"]:
        assert f["eos_is_end_of_generation"] and f["failing"] == [], f
        assert f["replies_ended"] == f["replies_ended_transformers"], f
    # Each file renders held-out conversations to training's tokens and stops at eos (snaketune.export.parity).
    parity = m["parity"]
    assert parity["files"] == names and parity["stop_tokens"] == [EOS], parity
    assert parity["conversations"] > 0 and parity["assistant_turns"] >= parity["conversations"], parity
    replies = [json.loads(line) for line in (d / "replies.jsonl").open()]
    assert len(replies) == 3 * m["files"][0]["replies"]
    assert all(r["llama_cpp_tokenizer_matches"] for r in replies), (
        "llama.cpp tokenizes the prompts as transformers"
    )


def test_the_report_shows_the_export_table(tiny_run):
    report = (tiny_run / "results/report/report.md").read_text()
    section = report[report.index("## Deployment (GGUF)") :]
    assert "### default: SFT model" in section and "### default: DPO model" in section
    for t in ("f32", "q8_0", "q4_k_m"):
        assert f"\n| {t} |" in section, t
    summary = json.loads((tiny_run / "results/report/summary.json").read_text())
    exported = summary["experiments"]["default"]["export"]
    assert [f["type"] for f in exported["sft"]] == ["f32", "q8_0", "q4_k_m"]


# ---- the parts ----------------------------------------------------------------------------------------------


def test_export_settings_are_checked():
    assert load_config({}).export.thresholds() == {
        t: DEFAULT_MAX_KL[t] for t in ("f32", "bf16", "f16", "q8_0", "q4_k_m")
    }
    cfg = load_config({"export": {"outtype": "f16", "quants": [], "max_kl": {"f16": 0.5}}}).export
    assert cfg.thresholds() == {"f16": 0.5}
    bad = {
        "q3_k": ({"quants": ["q3_k"]}, "export.quants': 'q3_k' is not allowed; allowed: q8_0, q6_k"),
        "twice": ({"quants": ["q8_0", "q8_0"]}, "names a type twice"),
        "outtype": (
            {"outtype": "f64"},
            "export.outtype': 'f64' is not allowed; allowed: auto, f32, bf16, f16",
        ),
        "model": ({"models": ["base"]}, "export.models': 'base' is not allowed; allowed: sft, dpo"),
        "kl key": ({"max_kl": {"q2": 1}}, "export.max_kl.q2': unknown type"),
        "kl value": ({"max_kl": {"q8_0": -1}}, "export.max_kl.q8_0': -1 must be a number >= 0"),
        "typo": ({"quant": ["q8_0"]}, "did you mean 'quants'?"),
        "not a mapping": ([1], "export': must be a mapping"),
    }
    for case, (section, message) in bad.items():
        with pytest.raises(ConfigError, match=None) as err:
            load_config({"export": section})
        assert message in str(err.value), (case, str(err.value))


def test_the_quant_names_are_llama_cpps():
    import llama_cpp as lib

    for name, ftype in llama_cpp.QUANTS.items():
        assert isinstance(getattr(lib, ftype), int), name


def test_only_a_gpt2_split_gets_the_gpt2_name(tmp_path):
    cases = {
        "gpt2": ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}, "gpt-2"),
        "prefix space": ({"type": "ByteLevel", "add_prefix_space": True, "use_regex": True}, ""),
        "no regex": ({"type": "ByteLevel", "add_prefix_space": False, "use_regex": False}, ""),
        "sequence": ({"type": "Sequence", "pretokenizers": []}, ""),
        "none": (None, ""),
    }
    for case, (pre, want) in cases.items():
        (tmp_path / "tokenizer.json").write_text(json.dumps({"pre_tokenizer": pre}))
        assert llama_cpp.pre_tokenizer_fallback(tmp_path / "tokenizer.json") == want, case
    assert llama_cpp.pre_tokenizer_fallback(tmp_path / "missing.json") == ""


def test_auto_writes_the_type_the_weights_were_saved_in(tmp_path):
    import torch
    from safetensors.torch import save_file

    for dtype, want in ((torch.float32, "f32"), (torch.bfloat16, "bf16"), (torch.float16, "f16")):
        save_file(
            {"w": torch.zeros(2, dtype=dtype), "step": torch.zeros(1, dtype=torch.int64)},
            tmp_path / "model.safetensors",
        )
        assert llama_cpp.saved_type(tmp_path) == want
    save_file(
        {"a": torch.zeros(2), "b": torch.zeros(2, dtype=torch.bfloat16)}, tmp_path / "model.safetensors"
    )
    with pytest.raises(llama_cpp.ToolchainError, match=r"weights in \['BF16', 'F32'\]; set export.outtype"):
        llama_cpp.saved_type(tmp_path)
    with pytest.raises(llama_cpp.ToolchainError, match=r"no \*.safetensors"):
        llama_cpp.saved_type(tmp_path / "empty")


def test_a_missing_converter_says_how_to_install_it(tmp_path, monkeypatch):
    monkeypatch.setenv("SNAKETUNE_LLAMA_CPP_CONVERTER", str(tmp_path / "nowhere"))
    with pytest.raises(llama_cpp.ToolchainError, match="python -m snaketune.export.llama_cpp install"):
        llama_cpp.check_toolchain()
    archive = tmp_path / "other.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        info = tarfile.TarInfo("other-1.0/README")
        info.size = 2
        tar.addfile(info, io.BytesIO(b"hi"))
    with pytest.raises(llama_cpp.ToolchainError, match="no llama_cpp_python-0.3.36/vendor/llama.cpp/convert"):
        llama_cpp.install_converter(archive, tmp_path / "dest")


def test_a_failing_conversion_names_the_model_and_the_log(tmp_path):
    """The converter runs in the caller's process and leaves it as it was: its error in the log, PyPI's gguf still
    the one `import gguf` gives, the path, arguments and logging as before."""
    import logging

    import gguf

    (tmp_path / "model").mkdir()
    (tmp_path / "model/config.json").write_text(json.dumps({"architectures": ["NoSuchForCausalLM"]}))
    path, argv, handlers = list(sys.path), list(sys.argv), list(logging.getLogger().handlers)
    with pytest.raises(
        llama_cpp.ToolchainError, match=r"converter failed on .*model \(exit 1\); see .*export.log"
    ):
        llama_cpp.convert(tmp_path / "model", tmp_path / "out.gguf", "bf16", tmp_path / "export.log")
    log = (tmp_path / "export.log").read_text()
    assert "ERROR:hf-to-gguf:Model NoSuchForCausalLM is not supported" in log, log
    assert (sys.path, sys.argv, logging.getLogger().handlers) == (path, argv, handlers)
    assert sys.modules["gguf"] is gguf and "conversion" not in sys.modules
    # PyPI's gguf, not the converter's
    assert Path(gguf.__file__).parent.parent.name == "site-packages", gguf.__file__


def test_validation_segments_are_conversations_with_their_targets():
    # Two packed conversations in one row (positions restart), labels on the replies only; a second row.
    ids = [np.arange(10, 20), np.arange(30, 36)]
    labels = [
        np.array([IGNORE, IGNORE, 12, 13, IGNORE, IGNORE, IGNORE, 17, 18, 19]),
        np.array([IGNORE, 31, 32, 33, 34, 35]),
    ]
    pos = [np.array([0, 1, 2, 3, 4, 0, 1, 2, 3, 4]), np.arange(6)]
    split = TokenizedSplit(ids, labels, pos, np.zeros(2, dtype=np.int64))
    segs = measure.validation_segments(split, max_targets=100, max_len=100)
    assert [s.ids.tolist() for s in segs] == [
        [10, 11, 12, 13, 14],
        [15, 16, 17, 18, 19],
        [30, 31, 32, 33, 34, 35],
    ]
    # target position p predicts ids[p + 1]: the labelled tokens, never a conversation's first token
    assert [s.targets.tolist() for s in segs] == [[1, 2], [1, 2, 3], [0, 1, 2, 3, 4]]
    assert len(measure.validation_segments(split, max_targets=3, max_len=100)) == 2
    assert [s.ids.tolist() for s in measure.validation_segments(split, 100, max_len=3)][0] == [10, 11, 12]


def test_where_replies_part():
    assert measure.parted_at([1, 2, 3], [1, 2, 3]) is None
    assert measure.parted_at([1, 2, 3], [1, 5, 3]) == 1
    assert measure.parted_at([1, 2], [1, 2, 3]) == 2
    assert measure.parted_at([], [7]) == 0


# A file that keeps everything a runtime needs and whose KL is within its bound: the row, the bound, the GGUF
# metadata and the tokenizer that _failures compares.
TEMPLATE = "{% for m in messages %}User: {{ m['content'] }}{% endfor %}"
GOOD_ROW = {
    "kl_mean": 0.04,
    "replies_ended": 3,
    "replies_ended_transformers": 3,
    "eos_is_end_of_generation": True,
}
GOOD_META = {"chat_template": TEMPLATE, "bos_token_id": 1, "eos_token_id": 2}
TOKENIZER = SimpleNamespace(bos_token_id=1, eos_token_id=2)


def failures(row=None, max_kl=0.05, meta=None, template=TEMPLATE):
    return export._failures(GOOD_ROW | (row or {}), max_kl, GOOD_META | (meta or {}), TOKENIZER, template)


def test_a_file_fails_for_each_reason_and_only_then():
    """Each reason a GGUF file is marked failing is reported, with its figures; a good file, a KL at the bound, a
    type with no bound, a file whose replies end more often than transformers' and a tokenizer without a chat
    template give none."""
    assert failures() == []
    assert failures({"kl_mean": 0.05}) == []  # at the bound: only past it fails
    assert failures({"kl_mean": 9.0}, max_kl=None) == []
    assert failures({"kl_mean": None}) == []
    assert failures({"replies_ended": 3, "replies_ended_transformers": 1}) == []
    assert failures(meta={"chat_template": None}, template=None) == []
    assert failures({"kl_mean": 0.0812345}) == ["KL 0.08123 > 0.05"]
    assert failures({"replies_ended": 1}) == ["2 replies ran past the end of turn"]
    assert failures(meta={"chat_template": None}) == ["chat template lost"]
    assert failures(meta={"chat_template": "{{ messages }}"}) == ["chat template lost"]
    assert failures(meta={"eos_token_id": 5}) == ["eos 5 != 2"]
    assert failures(meta={"eos_token_id": None}) == ["eos None != 2"]
    assert failures({"eos_is_end_of_generation": False}) == ["eos does not end generation"]
    assert failures(
        {"kl_mean": 0.5, "replies_ended": 0, "eos_is_end_of_generation": False},
        meta={"chat_template": None, "eos_token_id": 7},
    ) == [
        "KL 0.5 > 0.05",
        "3 replies ran past the end of turn",
        "chat template lost",
        "eos 7 != 2",
        "eos does not end generation",
    ]


def test_a_file_that_lost_bos_fails():
    """The module docstring: a file is marked failing when it lost the bos a runtime needs (the check was missing;
    found by the test above's audit)."""
    assert failures(meta={"bos_token_id": None}) == ["bos None != 1"]
    assert failures(meta={"bos_token_id": 7}) == ["bos 7 != 1"]
