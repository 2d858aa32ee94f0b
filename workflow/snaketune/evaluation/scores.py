"""What the evaluate stage's figures are made of: exact-match accuracy of replies, the preference accuracy and
margins of pairs' log-probabilities, and their 95% intervals (snaketune.evaluation.evaluate measures, these score)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from snaketune.evaluation.intervals import Z95, wilson_interval

# ---- exact match ---------------------------------------------------------------------------------


def exact_match(generated: str, answer: str) -> bool:
    """A reply is correct when its text, stripped of outer whitespace, is exactly the expected answer."""
    return generated.strip() == answer.strip()


def _share(correct: int, n: int) -> dict[str, float | int]:
    return {"n": n, "correct": correct, "accuracy": correct / n if n else None}


def score(examples: Sequence[dict[str, str]], replies: Sequence[str]) -> dict[str, Any]:
    """Exact-match accuracy overall, per task and per language."""
    if len(examples) != len(replies):
        raise ValueError(f"{len(examples)} examples but {len(replies)} replies")
    hits = [exact_match(r, e["answer"]) for e, r in zip(examples, replies, strict=True)]
    out: dict[str, Any] = _share(sum(hits), len(hits))
    for field in ("task", "lang"):
        groups: dict[str, list[bool]] = {}
        for example, hit in zip(examples, hits, strict=True):
            groups.setdefault(example[field], []).append(hit)
        out[f"by_{field}"] = {k: _share(sum(v), len(v)) for k, v in sorted(groups.items())}
    return out


# ---- preferences ----------------------------------------------------------------------------------


def preference_scores(
    logprobs: torch.Tensor, counts: torch.Tensor, reference: torch.Tensor, beta: float
) -> dict[str, float]:
    """Accuracy and mean margin of a model's summed log-probabilities of (chosen, rejected) pairs, the same per reply
    token (length-normalized: a longer chosen reply has a lower sum without being less likely per token), and
    of its implicit reward beta x (log pi - log ref)."""
    if not len(logprobs):
        return {"pairs": 0}
    margin = logprobs[:, 0] - logprobs[:, 1]
    per_token = logprobs / counts.clamp(min=1)
    rewards = beta * (logprobs - reference)
    reward_margin = rewards[:, 0] - rewards[:, 1]
    wins = {
        "accuracy": margin > 0,
        "accuracy_per_token": per_token[:, 0] > per_token[:, 1],
        "reward_accuracy": reward_margin > 0,
    }
    out: dict[str, Any] = {"pairs": len(margin)}
    for name, won in wins.items():
        out[name] = float(won.double().mean())
        out[f"{name}_ci95"] = wilson_interval(int(won.sum()), len(won))
    out["logprob_margin"] = float(margin.mean())
    out["reward_margin"] = float(reward_margin.mean())
    out["reward_margin_ci95"] = mean_interval(reward_margin)
    out["chosen_reward"] = float(rewards[:, 0].mean())
    out["rejected_reward"] = float(rewards[:, 1].mean())
    return out


def mean_interval(values: torch.Tensor, z: float = Z95) -> list[float]:
    """Normal-approximation interval of a mean (the pairs are independent draws; n >= 30 in practice)."""
    x = values.double()
    mean = float(x.mean())
    if len(x) < 2:
        return [mean, mean]
    half = z * float(x.std(unbiased=True)) / math.sqrt(len(x))
    return [mean - half, mean + half]
