"""A GGUF file run by llama.cpp in this process: its own tokenizer, the logits at the positions asked for, greedy
replies. The export stage measures its files with it (snaketune.export.measure) and the benchmark stage scores them
with it (snaketune.benchmark.llama_lm).

Why not llama-cpp-python's high-level calls: log-probabilities through `Llama(logits_all=True)` copy every position's
logits into an n_ctx x vocabulary array (838 MB at 2,048 x 102,400) and make llama.cpp compute the output layer at
every position; its OpenAI-compatible server then sorts the whole vocabulary in Python for every echoed token
(llama_cpp.Llama._create_completion), 3.5 s a multiple-choice request at DeepSeek's 102,400 tokens for a model of a
few thousand parameters (issue #49). Here a batch asks llama.cpp for the logits of the wanted positions only
(`llama_batch.logits`), numpy reads them where llama.cpp wrote them, and the KV cache keeps the longest prefix shared
with the previous call (the choices of one question share its context: only their own tokens are decoded).
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence
from pathlib import Path

import numpy as np


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class GGUFRuntime:
    """One GGUF file loaded by llama.cpp (CPU build here; llama-cpp-python's `Llama` loads it), one sequence."""

    def __init__(self, path: str | Path, *, n_ctx: int, threads: int, n_batch: int = 512) -> None:
        import llama_cpp
        from llama_cpp import Llama

        self._lib = llama_cpp
        self.path = Path(path)
        self.n_ctx = n_ctx
        self.n_batch = min(n_ctx, n_batch)
        self.llm = Llama(
            model_path=str(path),
            n_ctx=n_ctx,
            n_batch=self.n_batch,
            n_ubatch=self.n_batch,
            n_threads=threads,
            n_threads_batch=threads,
            logits_all=False,
            verbose=False,
        )
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self._batch = llama_cpp.llama_batch_init(self.n_batch, 0, 1)
        self._cached: list[int] = []
        """The tokens whose keys and values are in the cache (sequence 0), in order from position 0."""

    def close(self) -> None:
        if self._batch is not None:
            self._lib.llama_batch_free(self._batch)
            self._batch = None
        self.llm.close()

    def __enter__(self) -> GGUFRuntime:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- tokens ------------------------------------------------------------------------------------------

    @property
    def bos(self) -> int:
        return int(self.llm.token_bos())

    @property
    def adds_bos(self) -> bool:
        """Whether the file's tokenizer starts a text with bos (its add_bos_token)."""
        return bool(self._lib.llama_vocab_get_add_bos(self.vocab))

    def tokenize(self, text: str, *, add_bos: bool = True) -> list[int]:
        """The file's own tokens for `text`, special tokens parsed, bos first where the file adds it: what its
        server gives for a prompt (llama_cpp.server's completions and /extras/tokenize)."""
        return list(self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True))

    def detokenize(self, tokens: Sequence[int], prev: Sequence[int] | None = None) -> str:
        raw = self.llm.detokenize(list(tokens), prev_tokens=list(prev) if prev else None)
        return raw.decode("utf-8", errors="ignore")

    def is_eog(self, token: int) -> bool:
        """Whether `token` ends generation in this file (eos, end of turn, ...)."""
        return bool(self._lib.llama_vocab_is_eog(self.vocab, int(token)))

    # ---- logits --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        self._lib.llama_memory_clear(self._lib.llama_get_memory(self.llm.ctx), True)
        self._cached = []

    def logits(self, ids: Sequence[int], positions: Sequence[int]) -> np.ndarray:
        """float32 [len(positions), vocabulary]: at each position p (ascending), the logits of the token after
        ids[: p + 1]. Decodes only what the cache does not hold: from the longest prefix shared with the last call,
        and at most up to the last position asked for."""
        ids = [int(t) for t in ids]
        positions = [int(p) for p in positions]
        if not positions:
            return np.zeros((0, self.n_vocab), dtype=np.float32)
        if positions != sorted(positions) or positions[0] < 0 or positions[-1] >= len(ids):
            raise ValueError(f"positions must ascend within the {len(ids)} tokens: {positions[:8]}...")
        if len(ids) > self.n_ctx:
            raise ValueError(f"{len(ids)} tokens do not fit the context of {self.n_ctx} ({self.path.name})")
        last = positions[-1]
        start = min(common_prefix(self._cached, ids), positions[0])
        lib, ctx, batch = self._lib, self.llm.ctx, self._batch
        lib.llama_memory_seq_rm(lib.llama_get_memory(ctx), 0, start, -1)
        self._cached = self._cached[:start]
        row = {p: k for k, p in enumerate(positions)}
        out = np.empty((len(positions), self.n_vocab), dtype=np.float32)
        for a in range(start, last + 1, self.n_batch):
            b = min(a + self.n_batch, last + 1)
            batch.n_tokens = b - a
            for j, i in enumerate(range(a, b)):
                batch.token[j] = ids[i]
                batch.pos[j] = i
                batch.n_seq_id[j] = 1
                batch.seq_id[j][0] = 0
                batch.logits[j] = i in row
            rc = lib.llama_decode(ctx, batch)
            if rc != 0:
                self.reset()
                raise RuntimeError(f"llama_decode returned {rc} at tokens {a}..{b} of {self.path.name}")
            self._cached.extend(ids[a:b])
            for j, i in enumerate(range(a, b)):
                if i in row:
                    ptr = lib.llama_get_logits_ith(ctx, j)
                    out[row[i]] = np.ctypeslib.as_array(
                        ctypes.cast(ptr, ctypes.POINTER(ctypes.c_float)), shape=(self.n_vocab,)
                    )
        return out

    def greedy(
        self, prompt: Sequence[int], max_new_tokens: int, stop: Sequence[str] = ()
    ) -> tuple[list[int], bool]:
        """The greedy reply to the prompt tokens: its tokens, up to and not including an end-of-generation token
        or the first of `stop` in its text (the tokens up to that point are returned; the caller cuts the text),
        and whether an end-of-generation token ended it."""
        ids = [int(t) for t in prompt]
        out: list[int] = []
        while len(out) < max_new_tokens and len(ids) < self.n_ctx:
            token = int(np.argmax(self.logits(ids, [len(ids) - 1])[0]))
            if self.is_eog(token):
                return out, True
            out.append(token)
            ids.append(token)
            if stop and any(s in self.detokenize(out, prompt) for s in stop):
                break
        return out, False


def logsumexp(logits: np.ndarray) -> np.ndarray:
    """Row-wise log of the summed exponentials, in float64 (each row one vocabulary)."""
    x = logits.astype(np.float64)
    top = x.max(axis=-1, keepdims=True)
    return (top + np.log(np.exp(x - top).sum(axis=-1, keepdims=True)))[..., 0]


def log_softmax(logits: np.ndarray) -> np.ndarray:
    """Row-wise log-softmax in float64."""
    return logits.astype(np.float64) - logsumexp(logits)[..., None]
