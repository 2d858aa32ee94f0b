"""A GGUF file served by llama-cpp-python's OpenAI-compatible server (`python -m llama_cpp.server`), scored by
lm-evaluation-harness over HTTP.

`serve` starts the server on a free local port and stops it; `LlamaServerLM` is the harness's `gguf` model type
(lm_eval.models.gguf.GGUFLM, which posts to the server's /v1/completions with echo and log-probabilities) with
what scoring a chat model there needs, found with llama-cpp-python 0.3.36:

- The chat template is rendered as the harness renders it for a transformers model (HFLM.apply_chat_template),
  with the tokenizer the file was exported from (the export stage checks that the file carries the same template).
  The server adds bos itself when the file says so, so a rendered bos is dropped: the file reads the tokens the
  transformers model read.
- The continuation's tokens are counted with the server's own tokenizer (/extras/tokenize, the tokens of context +
  continuation less those of the context, as the harness splits a pair for transformers), not by the characters of
  `text_offset` as GGUFLM does: the server measures those offsets on text without its special tokens (bos, the
  template's markers), so they drift from the prompt's.
- The server leaves the token it generates (max_tokens 1) out of the echo when that token ends generation
  (`usage.completion_tokens` 0); GGUFLM always drops the last entry, which then is the continuation's last token.
- The server aligns the echoed prompt's log-probabilities with its tokens only when the prompt's first token is
  bos (it drops that token and shifts the rest by one); a file whose prompts do not start with bos is refused.
- Generation honours the task's `max_gen_toks` and stops at `until` (GGUFLM sends neither a length nor, for most
  tasks, a stop string, so the server's default of 16 tokens cut every reply).
"""

from __future__ import annotations

import contextlib
import logging
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import requests
from lm_eval.models.gguf import GGUFLM

log = logging.getLogger("snaketune.benchmark.served")

START_TIMEOUT_S = 120.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def server_command(gguf: str | Path, port: int, *, n_ctx: int, threads: int) -> list[str]:
    """The command that serves `gguf` (also what serve.sh beside the exported files runs)."""
    return [
        sys.executable,
        "-m",
        "llama_cpp.server",
        "--model",
        str(gguf),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        str(n_ctx),
        "--n_threads",
        str(threads),
        "--verbose",
        "False",
    ]


@contextlib.contextmanager
def serve(gguf: str | Path, *, n_ctx: int, threads: int, log_file: str | Path) -> Iterator[str]:
    """Serve `gguf` on a free local port until the block ends; yields the base URL. The server's output goes to
    `log_file` (appended)."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(log_file, "a", encoding="utf-8") as out:
        proc = subprocess.Popen(
            server_command(gguf, port, n_ctx=n_ctx, threads=threads), stdout=out, stderr=subprocess.STDOUT
        )
        try:
            _wait_ready(proc, url, gguf, log_file)
            log.info("serving %s at %s (pid %d)", gguf, url, proc.pid)
            yield url
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_ready(proc: subprocess.Popen, url: str, gguf, log_file) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(
                f"llama_cpp.server exited ({proc.returncode}) serving {gguf}; its output: {log_file}"
            )
        with contextlib.suppress(requests.RequestException):
            if requests.get(f"{url}/v1/models", timeout=5).ok:
                return
        time.sleep(0.3)
    raise RuntimeError(
        f"llama_cpp.server did not answer in {START_TIMEOUT_S:.0f} s serving {gguf}; see {log_file}"
    )


class LlamaServerLM(GGUFLM):
    """The harness's llama.cpp server model (`gguf`) for a chat model served from one GGUF file; see the module."""

    def __init__(self, base_url: str, tokenizer, *, max_length: int = 2048, timeout_s: float = 600.0) -> None:
        super().__init__(base_url=base_url, max_length=max_length)
        self.tokenizer = tokenizer
        self.timeout_s = timeout_s
        self.session = requests.Session()
        self._tokens: dict[str, list[int]] = {}
        # /extras/tokenize adds bos exactly when a completion's prompt gets it (both follow the file's add_bos).
        self.adds_bos = bool(self._tokenize(""))

    # ---- HTTP ----------------------------------------------------------------------------------------

    def _post(self, path: str, body: dict) -> dict:
        r = self.session.post(f"{self.base_url}{path}", json=body, timeout=self.timeout_s)
        if not r.ok:
            raise RuntimeError(f"{path}: HTTP {r.status_code}: {r.text[:500]}")
        return r.json()

    def _tokenize(self, text: str) -> list[int]:
        # A multiple-choice question's choices share the context: it is tokenized once.
        if text not in self._tokens:
            if len(self._tokens) > 1024:
                self._tokens.clear()
            self._tokens[text] = self._post("/extras/tokenize", {"input": text})["tokens"]
        return self._tokens[text]

    def _prompt(self, text: str) -> str:
        bos = self.tokenizer.bos_token
        return text[len(bos) :] if self.adds_bos and bos and text.startswith(bos) else text

    # ---- the harness's requests ------------------------------------------------------------------------

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return [self._loglikelihood(*req.args) for req in requests]

    def _loglikelihood(self, context: str, continuation: str) -> tuple[float, bool]:
        context = self._prompt(context)
        bos = self.tokenizer.bos_token_id
        ids = self._tokenize(context + continuation)
        if not ids or ids[0] != bos:
            raise RuntimeError(
                f"the prompt's first token is {ids[:1]}, not bos {bos}: llama-cpp-python's echoed log-probabilities "
                "are shifted by one token for such a prompt (it assumes bos first), so this file cannot be scored "
                "on log-likelihood tasks; generation tasks work"
            )
        n_context = len(self._tokenize(context))
        # The server leaves bos tokens out of the echo (llama_cpp.Llama._create_completion).
        n_cont = len(ids) - n_context - ids[n_context:].count(bos)
        out = self._post(
            "/v1/completions",
            {
                "prompt": context + continuation,
                "max_tokens": 1,
                "temperature": 0.0,
                "echo": True,
                "logprobs": 1,
            },
        )
        probs = out["choices"][0]["logprobs"]
        kept = len(probs["token_logprobs"]) - out["usage"]["completion_tokens"]
        values, tops = probs["token_logprobs"][:kept], probs["top_logprobs"][:kept]
        if kept != len(ids) - ids.count(bos):
            raise RuntimeError(
                f"the server echoed {kept} prompt tokens, its tokenizer gives {len(ids)} with bos"
            )
        if n_cont <= 0:
            return 0.0, True
        values, tops = values[-n_cont:], tops[-n_cont:]
        # Greedy: each continuation token is (one of) the most likely there; top_logprobs holds the best and it.
        greedy = all(v >= max(t.values()) - 1e-6 for v, t in zip(values, tops, strict=True))
        return float(sum(values)), greedy

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            body = {
                "prompt": self._prompt(context),
                "max_tokens": int(kwargs.get("max_gen_toks", 256)),
                "temperature": float(kwargs.get("temperature", 0.0)) if kwargs.get("do_sample") else 0.0,
                "stop": until,
            }
            text = self._post("/v1/completions", body)["choices"][0]["text"]
            for stop in until:
                text = text.split(stop)[0]
            out.append(text)
        return out

    # ---- the chat template, as HFLM applies it --------------------------------------------------------

    def apply_chat_template(
        self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        return self.tokenizer.chat_template if chat_template is not False else None
