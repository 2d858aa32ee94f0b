"""An exported GGUF file as lm-evaluation-harness scores it: llama.cpp in this process (snaketune.export.runtime), the
same requests the transformers models get, at llama.cpp's own speed.

What the file is scored on is what its server (serve.sh) would read and answer:
- The chat template is rendered as the harness renders it for a transformers model (HFLM.apply_chat_template), with
  the tokenizer the file was exported from (the export stage checks that the file carries the same template).
- Text becomes tokens by the file's own tokenizer, special tokens parsed, bos added where the file adds it, as its
  server tokenizes a prompt; a bos the template already rendered is dropped first, so that the file reads the tokens
  the transformers model read.
- A log-likelihood request is split as the harness splits one for transformers (the tokens of context +
  continuation less those of the context) and cut from the left to the context length (HFLM keeps the last
  max_length + 1 tokens); its score is the continuation's summed log-probability, and it is greedy where each of
  its tokens is the most likely one there (ties count as greedy).
- Generation is greedy (the harness's tasks here ask for do_sample false; a task that samples is refused, naming
  it), honours `max_gen_toks`, stops at an end-of-generation token of the file or at the first `until` string, and
  leaves the prompt's end for the reply where both do not fit (the context loses its start).

Before issue #49 these went through the server's /v1/completions with echoed log-probabilities, which sort the whole
vocabulary in Python for every prompt token; tests/test_benchmark_serve.py checks that both give the same scores.
"""

from __future__ import annotations

import numpy as np
from lm_eval.api.model import LM
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from snaketune.export.runtime import GGUFRuntime, logsumexp


class LlamaCppLM(LM):
    """The harness's model for one GGUF file run by llama.cpp in this process; see the module."""

    def __init__(self, runtime: GGUFRuntime, tokenizer) -> None:
        super().__init__()
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.max_length = runtime.n_ctx
        self._tokens: dict[str, list[int]] = {}

    # ---- tokens ------------------------------------------------------------------------------------------

    def _prompt(self, text: str) -> str:
        bos = self.tokenizer.bos_token
        return text[len(bos) :] if self.runtime.adds_bos and bos and text.startswith(bos) else text

    def _tokenize(self, text: str) -> list[int]:
        # A multiple-choice question's choices share the context: it is tokenized once.
        if text not in self._tokens:
            if len(self._tokens) > 1024:
                self._tokens.clear()
            self._tokens[text] = self.runtime.tokenize(text)
        return self._tokens[text]

    def _split(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        """Context and continuation tokens as the harness splits a pair for transformers (TemplateLM._encode_pair):
        trailing spaces of the context move to the continuation, then the whole is tokenized and the context's own
        tokens mark the split. An empty context is the end-of-text token (HFLM's prefix token)."""
        if not context:
            continuation_ids = self.runtime.tokenize(continuation, add_bos=False)
            if continuation_ids[:1] == [self.runtime.bos]:
                return continuation_ids[:1], continuation_ids[1:]
            return [self.runtime.bos], continuation_ids
        n_spaces = len(context) - len(context.rstrip())
        if n_spaces:
            context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
        whole = self._tokenize(self._prompt(context) + continuation)
        n_context = len(self._tokenize(self._prompt(context)))
        return whole[:n_context], whole[n_context:]

    # ---- scoring -------------------------------------------------------------------------------------------

    def _score(self, context: list[int], continuation: list[int]) -> tuple[float, bool]:
        """Summed log-probability of `continuation` after `context` and whether it is the greedy one."""
        if not continuation:
            return 0.0, True
        ids = (context + continuation)[-(self.max_length + 1) :]
        inputs = ids[:-1]
        first = len(inputs) - len(continuation) + 1
        positions = list(range(max(first - 1, 0), len(inputs)))
        logits = self.runtime.logits(inputs, positions)
        targets = np.asarray(ids[len(ids) - len(positions) :])
        rows = np.arange(len(positions))
        picked = logits[rows, targets].astype(np.float64)
        total = float((picked - logsumexp(logits)).sum())
        greedy = bool((picked >= logits.max(axis=-1)).all())
        return total, greedy

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        pairs = [self._split(*req.args) for req in requests]
        # Requests that share a context (a question's choices) are scored one after another, the context decoded
        # once. A new context starts from an empty cache: llama.cpp's quantized kernels round a batch differently
        # by its size (tests/test_benchmark_serve.py), so a question's scores depend on that question alone, not
        # on which questions came before it (a `limit` changes no score).
        order = sorted(range(len(pairs)), key=lambda i: (pairs[i][0], pairs[i][1]))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(pairs)
        previous = None
        for i in order:
            if pairs[i][0] != previous:
                self.runtime.reset()
                previous = pairs[i][0]
            out[i] = self._score(*pairs[i])
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """A whole text's log-likelihood in windows of the context length, as HFLM computes it (perplexity
        tasks)."""
        out = []
        for req in requests:
            (text,) = req.args
            windows = map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.runtime.tokenize(text),  # bos too where the file adds it, as HFLM encodes
                    prefix_token=self.runtime.bos,
                    max_seq_len=self.max_length,
                    context_len=1,
                ),
            )
            total = 0.0
            for context, continuation in windows:
                self.runtime.reset()
                total += self._score(list(context), list(continuation))[0]
            out.append(total)
        return out

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        out = []
        for req in requests:
            context, kwargs = req.args
            if kwargs.get("do_sample") and float(kwargs.get("temperature", 1.0)) > 0:
                raise ValueError(
                    "a task asks for sampled generation (do_sample true); the GGUF files are scored greedily, as "
                    "the transformers models are: set the task's generation_kwargs do_sample: false"
                )
            until = kwargs.get("until") or []
            until = [until] if isinstance(until, str) else list(until)
            max_new = int(kwargs.get("max_gen_toks", 256))
            prompt = self._tokenize(self._prompt(context))
            keep = self.max_length - max_new
            if keep < 1:
                raise ValueError(f"max_gen_toks {max_new} leaves no room in the context of {self.max_length}")
            prompt = prompt[-keep:]
            self.runtime.reset()
            tokens, _ = self.runtime.greedy(prompt, max_new, stop=until)
            text = self.runtime.detokenize(tokens, prompt)
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
