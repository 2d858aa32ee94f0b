"""What a GGUF file loses and gains against the model it was exported from, measured with llama.cpp itself.

Quality, on the held-out validation conversations with the evaluate stage's masking (the assistant tokens the
tokenize stage labelled): llama.cpp's perplexity, and per target token the KL divergence KL(P_model || P_gguf)
and whether both rank the same token first (top-1 agreement), against transformers running the exported
directory in fp32 (its bf16 weights exactly). The same token ids go to both, so the comparison is of the weights
and kernels alone; whether llama.cpp's own tokenizer gives those ids for the rendered prompt is checked apart.

Replies: the eval prompts answered greedily by llama.cpp and by transformers from the same prompt tokens; the
first 16 tokens should agree (a near-tie can flip a quantized argmax: where they part is recorded), and a
reply must end at a token the file marks as end of generation, the one the model learned to end its turns with.

Speed: llama.cpp's prompt tokens/s (the validation conversations, a batch each) and generation tokens/s (one
token per call) on this machine's CPU threads, from wall-clock time around its calls.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from snaketune.export.runtime import GGUFRuntime, log_softmax
from snaketune.model import batching

AGREE_TOKENS = 16
"""Leading tokens of a greedy reply that llama.cpp and transformers should share."""


@dataclass
class Segment:
    ids: np.ndarray
    targets: np.ndarray
    """Positions p whose next token ids[p + 1] carries a loss (the evaluate stage's target mask)."""


def validation_segments(split: batching.TokenizedSplit, max_targets: int, max_len: int) -> list[Segment]:
    """Held-out conversations in order (packed rows split at their position resets) until `max_targets`
    target tokens; each at most `max_len` tokens."""
    out, total = [], 0
    for ids, labels, pos in zip(split.input_ids, split.labels, split.position_ids, strict=True):
        starts = np.append(np.flatnonzero(pos == 0), len(pos))
        for a, b in zip(starts[:-1], starts[1:], strict=True):
            b = min(b, a + max_len)
            mask = batching.target_mask(labels[a:b], pos[a:b])
            if mask.any():
                out.append(Segment(np.asarray(ids[a:b], dtype=np.int64), np.flatnonzero(mask)))
                total += int(mask.sum())
            if total >= max_targets:
                return out
    return out


@torch.no_grad()
def reference_logprobs(net, segments: Sequence[Segment]) -> list[np.ndarray]:
    """transformers' log-probabilities at each segment's target positions (targets x vocab, float32)."""
    out = []
    for seg in segments:
        logits = net(input_ids=torch.from_numpy(seg.ids)[None]).logits[0].float()
        out.append(torch.log_softmax(logits[seg.targets], dim=-1).numpy())
    return out


@torch.no_grad()
def reference_replies(
    net, prompts: Sequence[list[int]], max_new_tokens: int, eos: int
) -> list[tuple[list[int], list[float]]]:
    """transformers' greedy reply tokens to each prompt (up to, not including, eos), and at each step the gap
    between the log-probabilities of its first and second choice: where llama.cpp's reply parts from this one,
    a small gap says why (a near-tie that rounding flips)."""
    out = []
    for ids in prompts:
        res = net.generate(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            num_beams=1,
            eos_token_id=eos,
            pad_token_id=eos,
            output_logits=True,
            return_dict_in_generate=True,
        )
        gen = res.sequences[0, len(ids) :].tolist()
        gaps = [
            float(g)
            for g in (
                torch.log_softmax(s[0].float(), -1).topk(2).values @ torch.tensor([1.0, -1.0])
                for s in res.logits
            )
        ]
        n = gen.index(eos) if eos in gen else len(gen)
        out.append((gen[:n], gaps))
    return out


def score_gguf(runtime: GGUFRuntime, segments: Sequence[Segment], reference: Sequence[np.ndarray]) -> dict:
    """Perplexity, KL and top-1 agreement of a loaded file over the segments, and its prompt throughput (each
    segment decoded in one pass from an empty cache, the logits taken at its target positions)."""
    nll = kl = agree = 0.0
    n = tokens = 0
    kls = []
    t_eval = 0.0
    for seg, ref in zip(segments, reference, strict=True):
        runtime.reset()
        t0 = time.perf_counter()
        logits = runtime.logits(seg.ids.tolist(), seg.targets.tolist())
        t_eval += time.perf_counter() - t0
        tokens += int(seg.targets[-1]) + 1
        lp = log_softmax(logits)
        nll -= float(lp[np.arange(len(seg.targets)), seg.ids[seg.targets + 1]].sum())
        per_token = (np.exp(ref) * (ref - lp)).sum(-1)
        kls.append(per_token)
        kl += float(per_token.sum())
        agree += float((lp.argmax(-1) == ref.argmax(-1)).sum())
        n += len(seg.targets)
    kls = np.concatenate(kls) if kls else np.zeros(0)
    return {
        "perplexity": float(np.exp(nll / n)) if n else None,
        "kl_mean": kl / n if n else None,
        "kl_p99": float(np.quantile(kls, 0.99)) if n else None,
        "top1_agreement": agree / n if n else None,
        "target_tokens": n,
        "prompt_tokens_per_s": tokens / t_eval if t_eval else None,
    }


def greedy_gguf(
    runtime: GGUFRuntime, prompt: list[int], max_new_tokens: int
) -> tuple[list[int], bool, float]:
    """llama.cpp's greedy reply to the prompt tokens: (tokens, whether it ended at an end-of-generation token,
    seconds spent generating after the prompt)."""
    runtime.reset()
    runtime.logits(prompt, [len(prompt) - 1])  # the prompt, outside the generation's time
    t0 = time.perf_counter()
    out, ended = runtime.greedy(prompt, max_new_tokens)
    return out, ended, time.perf_counter() - t0


def parted_at(a: Sequence[int], b: Sequence[int]) -> int | None:
    """First index where two token lists differ (within the shorter, or where one ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
