"""The user's path end to end on CPU ranks: a hub-format model directory (LlamaForCausalLM with DeepSeek-LLM's
102,400-row embedding, sharded safetensors written by save_pretrained, the real DeepSeek tokenizer copied in,
no chat template), real oasst rows in both official forms, and the workflow through train (ZeRO-2, ZeRO-3 with
the optimizer offloaded, QLoRA on ZeRO-0), preference tuning, evaluate, export, manifest and report. LoRA without
quantization is QLoRA's code after the 4-bit load; tests/test_training.py trains it on ZeRO-2 (the builtin model). Full fine-tuning on ZeRO-0 and plain ZeRO-3 load the hub directory as ZeRO-2 and ZeRO-3 with offload do; on
the builtin model tests/test_training.py checks that the ZeRO stages agree."""

from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import yaml

from conftest import REAL_OASST, copy_workflow, snakemake

# The fixture runs the whole workflow for three experiments (about 6 minutes on two cores beside another test):
# longer than pyproject.toml's per-test timeout, which the first test using it pays.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]

ROWS = REAL_OASST / "en_100.hf_rows.jsonl.gz"
TREES = REAL_OASST / "en_100_tree.jsonl.gz"
RUN_TIMEOUT_S = 1500
ZERO2 = "default"
EXPERIMENTS = {
    # Snakemake merges config/config.yaml's `experiments: {default: {}}` into any config file's experiments, so
    # the ZeRO-2 case is the one named `default` (ZERO2) rather than a fifth training.
    ZERO2: {"train": {"deepspeed": "config/deepspeed/zero2.json"}},
    "zero3_offload": {"train": {"deepspeed": "config/deepspeed/zero3_offload.json"}},
    # QLoRA: the hub model's linear layers in 4 bits on CPU ranks (bitsandbytes' CPU backend), then DPO on the
    # merged model (quantized again as it loads), evaluate in 4 bits.
    "qlora": {
        "train": {
            "deepspeed": "config/deepspeed/zero0.json",
            "lora": {"enabled": True, "rank": 4, "quantize": "nf4"},
        },
        "preference": {"enabled": True},
    },
}


def write_hub_model(out: Path, tokenizer: Path) -> Path:
    """A tiny model in the hub layout deepseek-llm-7b-base ships: config.json, model-0000N-of-0000M shards, the
    tokenizer's two files (no chat template, no pad)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=102_400,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
        bos_token_id=100_000,
        eos_token_id=100_001,
    )
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(
        out, max_shard_size="5MB", safe_serialization=True
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer / name, out / name)
    return out


@pytest.fixture(scope="module")
def hub_run(tmp_path_factory, deepseek_tokenizer):
    root = tmp_path_factory.mktemp("hub")
    model = write_hub_model(root / "deepseek-tiny-hub", deepseek_tokenizer)
    workdir = copy_workflow(root / "wf")
    config = {
        "dataset": {"source": str(ROWS), "paths": "all", "validation_fraction": 0.08},
        "model": {"base": str(model)},
        "tokenize": {"max_length": 256},
        "train": {
            "gpus": 2,
            "max_steps": 4,
            "global_batch_size": 4,
            "micro_batch_size": 2,
            "learning_rate": 1e-3,
            "warmup_steps": 1,
            "log_every": 1,
            "eval_every": 0,
            "checkpoint_every": 0,
        },
        "preference": {
            "enabled": False,
            # 64 tokens a side: the reference pass scores every pair against the 102,400-row head (115 s at 128)
            "max_length": 64,
            "train": {"max_steps": 3, "global_batch_size": 4, "micro_batch_size": 2, "eval_every": 0},
        },
        "eval": {"max_new_tokens": 6, "batch_size": 4},
        # GGUF out of the merged LoRA and QLoRA DPO models, with the real DeepSeek tokenizer
        "export": {"models": ["dpo"], "eval_tokens": 256},
        # The benchmark stage as the defaults run it on a user's data (tasks auto: mmlu_dev), on its first 40
        # questions: every model and the q4_k_m file, at DeepSeek's 102,400-token vocabulary.
        "benchmark": {"limit": 40},
        "experiments": EXPERIMENTS,
    }
    (workdir / "hub.yaml").write_text(yaml.safe_dump(config))
    result = snakemake(
        workdir, "--cores", "2", "--resources", "gpu=2", "--configfile", "hub.yaml", timeout=RUN_TIMEOUT_S
    )
    return workdir, model, result


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The decoder's linear layers: train.lora.targets' default."""


def _adapter_parameters(model_dir: Path, rank: int) -> int:
    """LoRA's parameters for `model_dir`'s linear layers, from the shapes its files hold: r x (in + out) each."""
    from safetensors import safe_open

    total = 0
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                if name.endswith(".weight") and name.split(".")[-2] in LINEAR:
                    out_features, in_features = f.get_slice(name).get_shape()
                    total += rank * (in_features + out_features)
    return total


def _weight(model_dir: Path, name: str):
    """One tensor of a safetensors model directory, sharded (an index) or not."""
    from safetensors import safe_open

    index = model_dir / "model.safetensors.index.json"
    shard = _json(index)["weight_map"][name] if index.exists() else "model.safetensors"
    with safe_open(str(model_dir / shard), "pt") as f:
        return f.get_tensor(name)


def test_hub_model_has_the_users_layout(hub_run):
    _, model, _ = hub_run
    names = sorted(p.name for p in model.iterdir())
    assert "model.safetensors.index.json" in names and sum(n.endswith(".safetensors") for n in names) >= 2
    config = _json(model / "tokenizer_config.json")
    assert "chat_template" not in config and not (model / "chat_template.jinja").exists()


def test_every_strategy_trains_from_the_hub_directory(hub_run):
    import torch

    workdir, model, result = hub_run
    summaries = {name: _json(workdir / f"results/train/{name}/summary.json") for name in EXPERIMENTS}
    assert [summaries[n]["zero_stage"] for n in (ZERO2, "zero3_offload", "qlora")] == [2, 3, 0]
    for name, s in summaries.items():
        assert s["world_size"] == 2 and s["steps"] == 4, name
        adapters = s["trainable_parameters"] if s["lora"] else 0
        assert s["parameters"] - adapters == summaries[ZERO2]["parameters"]  # 102,400-row embeddings, untied
        # The trainer's metrics.csv (snaketune.train.metrics): one row per step (log_every: 1).
        with open(workdir / f"results/train/{name}/metrics.csv", newline="") as f:
            losses = [float(row["train/loss"]) for row in csv.DictReader(f)]
        assert len(losses) == 4 and s["final_train_loss"] == losses[-1], (name, losses)
        # Full fine-tuning lowers the loss from the first step to the last (by about 0.03; with the start weights
        # the last step's batch scores 0.005 worse than the first's). Three steps of rank-4 adapters move it less
        # than the batches differ, so for LoRA and QLoRA the merged weights show that they trained.
        if not s["lora"]:
            assert losses[-1] < losses[0], (name, losses)
        trained = _weight(workdir / f"results/train/{name}/model", Q_PROJ)
        assert not torch.equal(trained.float(), _weight(model, Q_PROJ).float()), name
    # QLoRA: rank-4 adapters (A: r x in, B: out x r) on every linear layer of the 4-bit base; the saved model is
    # merged into the unquantized base.
    assert summaries["qlora"]["lora"] and summaries["qlora"]["lora_quantize"] == "nf4"
    assert summaries["qlora"]["trainable_parameters"] == _adapter_parameters(model, rank=4)
    assert "base weights in 4-bit NF4 (QLoRA)" in (workdir / "logs/train/qlora.log").read_text()
    assert "quantization_config" not in _json(workdir / "results/train/qlora/model/config.json")
    # The plan knows the base is 4-bit (this tiny model's weights are nearly all embeddings, which stay bf16).
    assert _json(workdir / "results/plan/qlora.json")["configured"]["setup"]["quantized"]
    # ZeRO-3 partitions the parameters while they load; the decay groups follow the real shapes.
    assert (
        summaries["zero3_offload"]["weight_decay_parameters"] == summaries[ZERO2]["weight_decay_parameters"]
    )
    # With the optimizer offloaded its states live on the host, and the check says so.
    assert "optimizer tensors checked on the host" in (workdir / "logs/train/zero3_offload.log").read_text()
    # The saved models are hub directories again, with the real tokenizer and the DeepSeek chat template.
    for name in EXPERIMENTS:
        tok = _json(workdir / f"results/train/{name}/model/tokenizer_config.json")
        assert "User: " in (
            tok.get("chat_template")
            or (workdir / f"results/train/{name}/model/chat_template.jinja").read_text()
        )


def test_real_tokenizer_tokenizes_real_oasst_rows(hub_run):
    workdir, _, _ = hub_run
    tokenized = [d for d in (workdir / "results/tokenized").iterdir() if d.is_dir()]
    assert len(tokenized) == 1  # every experiment shares the cache
    stats = _json(tokenized[0] / "stats.json")
    assert stats["splits"]["train"]["conversations"] > 400  # en_100 with paths: all
    assert stats["splits"]["train"]["loss_tokens"] > 50_000
    tok = _json(next((workdir / "results/tokenizer").iterdir()) / "tokenizer_config.json")
    assert tok.get("bos_token") == "<｜begin▁of▁sentence｜>"


def test_preference_stage_runs_on_the_hub_path(hub_run):
    workdir, _, _ = hub_run
    stats = _json(workdir / "results/data/preferences/best_vs_rest/stats.json")
    assert stats["pairs"]["train"] > 100
    dpo = _json(workdir / "results/dpo/qlora/summary.json")
    assert dpo["steps"] == 3 and dpo["lora"] and dpo["objective"] == "dpo"
    assert dpo["lora_quantize"] == "nf4"
    metrics = _json(workdir / "results/eval/qlora/metrics.json")
    assert metrics["models"] == ["base", "tuned", "dpo"]
    assert set(metrics["preference"]) == {"beta", "reference", "base", "tuned", "dpo"}
    for name in (ZERO2, "zero3_offload"):  # only where preference.enabled
        assert not (workdir / f"results/dpo/{name}").exists()


def test_evaluation_and_report_on_the_hub_path(hub_run):
    import pyarrow.parquet as pq

    workdir, _, _ = hub_run
    conversations = pq.read_table(workdir / "results/data/conversations/validation.parquet").to_pylist()
    first_messages = list(dict.fromkeys(c["messages"][0]["content"] for c in conversations))
    assert len(first_messages) >= 4
    for name in EXPERIMENTS:
        metrics = _json(workdir / f"results/eval/{name}/metrics.json")
        assert metrics["base_model"].startswith("from_pretrained(")
        assert metrics["generation"]["prompt_source"] == "auto"
        rows = [
            json.loads(line)
            for line in (workdir / f"results/eval/{name}/generations.jsonl").read_text().splitlines()
        ]
        # auto prompts on real data: the validation conversations' distinct first user messages (8 at most), their
        # reply as expected
        assert len(rows) == min(8, len(first_messages)) and all(r["expected"] for r in rows)
        assert [r["prompt"] for r in rows] == first_messages[: len(rows)]
        val = metrics["validation"]
        assert val["tuned"]["loss"] < val["base"]["loss"]
    summary = _json(workdir / "results/report/summary.json")
    assert set(summary["experiments"]) == set(EXPERIMENTS)
    assert "Preference tuning" in (workdir / "results/report/index.html").read_text(encoding="utf-8")
    manifest = _json(workdir / "results/provenance/manifest.json")
    assert {j["rule"] for j in manifest["jobs"]} >= {
        "train",
        "dpo",
        "reference",
        "evaluate",
        "tokenize_pairs",
    }


def test_the_merged_qlora_model_goes_out_as_gguf_with_the_deepseek_tokenizer(hub_run):
    workdir, _, _ = hub_run
    assert [
        p.relative_to(workdir / "results/export").as_posix() for p in (workdir / "results/export").glob("*/*")
    ] == ["qlora/dpo"]
    m = _json(workdir / "results/export/qlora/dpo/metrics.json")
    # llama.cpp's converter knows DeepSeek-LLM's pre-tokenizer by its hash; its tokenizer gives the prompt
    # tokens transformers' does.
    assert m["metadata"]["pre_tokenizer"] == "deepseek-llm" and m["metadata"]["eos_matches"], m["metadata"]
    replies = [json.loads(line) for line in (workdir / "results/export/qlora/dpo/replies.jsonl").open()]
    assert replies and all(r["llama_cpp_tokenizer_matches"] for r in replies)
    unquantized = m["files"][0]
    assert unquantized["kl_mean"] < 1e-3 and unquantized["failing"] == [], unquantized


def _wall_s(tsv: Path) -> float:
    """A job's wall time from Snakemake's benchmark file."""
    return float(next(csv.DictReader(tsv.open(), delimiter="\t"))["s"])


def test_the_benchmark_stage_fits_the_data_and_scores_the_file_at_the_models_cost(hub_run):
    """On a user's data the stage asks general questions (mmlu_dev, the report says why); at DeepSeek's vocabulary
    the q4_k_m file is scored on the same 40 questions as its model, in at most twice its model's job time (the
    server's echoed log-probabilities took 3.5 s a request here: 4 x 40 requests would be 9 minutes)."""
    workdir, _, _ = hub_run
    results = {
        p.relative_to(workdir / "results/benchmark").as_posix(): _json(p)
        for p in (workdir / "results/benchmark").rglob("*.json")
    }
    assert {Path(k).name for k in results} == {"mmlu_dev.json"}
    assert {"qlora/dpo/mmlu_dev.json", "qlora/dpo-q4_k_m/mmlu_dev.json", "default/sft/mmlu_dev.json"} <= set(
        results
    )
    assert all(r["n"] == 40 and 0 <= r["metrics"]["acc,none"]["value"] <= 1 for r in results.values())
    gguf = _wall_s(workdir / "benchmarks/benchmark/qlora/dpo-q4_k_m/mmlu_dev.tsv")
    model = _wall_s(workdir / "benchmarks/benchmark/qlora/dpo/mmlu_dev.tsv")
    assert gguf <= 2 * model, (gguf, model)
    report = (workdir / "results/report/report.md").read_text()
    assert "Why these tasks: benchmark.tasks auto, for your own data: general knowledge (mmlu_dev" in report


def test_trees_form_gives_the_same_tokens(hub_run, tmp_path):
    """The nested-tree export of the same 100 trees gives byte-identical tokenized data."""
    workdir, model, _ = hub_run
    other = copy_workflow(tmp_path / "wf")
    config = yaml.safe_load((workdir / "hub.yaml").read_text())
    config["dataset"]["source"] = str(TREES)
    config["experiments"] = {"zero0": {}}
    (other / "hub.yaml").write_text(yaml.safe_dump(config))
    snakemake(other, "--cores", "2", "--configfile", "hub.yaml", "--until", "tokenize", timeout=RUN_TIMEOUT_S)
    [mine] = [d for d in (other / "results/tokenized").iterdir() if d.is_dir()]
    [theirs] = [d for d in (workdir / "results/tokenized").iterdir() if d.is_dir()]
    for name in ("train/data-00000-of-00001.arrow", "validation/data-00000-of-00001.arrow"):
        assert (mine / name).read_bytes() == (theirs / name).read_bytes(), name
