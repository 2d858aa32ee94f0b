"""The eval prompts every model answers (config `eval.prompts`): the evaluate stage's generations and the export
stage's replies from llama.cpp beside transformers'. Here, apart from both stages, so that neither's code hash
covers the other's modules."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq

from snaketune.config.choices import AUTO_PROMPTS, DEFAULT_EVAL_PROMPTS
from snaketune.data.builtin import expected_answer


def resolve_prompts(prompts, *, builtin_dataset: bool, conversations_dir: str | Path | None) -> list[dict]:
    """[{"prompt", "expected"}]: the configured prompts, or for ``auto`` the builtin questions (builtin data)
    or the first user message of AUTO_PROMPTS validation conversations with their reference reply (without a system
    turn the conversation opens with: the prompts are single user turns)."""
    if prompts != "auto":
        return [{"prompt": p, "expected": expected_answer(p) if builtin_dataset else None} for p in prompts]
    if builtin_dataset:
        return [{"prompt": p, "expected": expected_answer(p)} for p in DEFAULT_EVAL_PROMPTS]
    if conversations_dir is None:
        raise ValueError("eval.prompts auto needs the validation conversations")
    table = pq.read_table(Path(conversations_dir) / "validation.parquet", columns=["messages"])
    out, seen = [], set()
    for messages in table.column("messages").to_pylist():
        # The first user turn and the reply to it (a chat-format conversation may open with a system turn).
        at = next(i for i, m in enumerate(messages) if m["role"] == "user")
        first = messages[at]["content"]
        if first in seen:
            continue
        seen.add(first)
        reply = messages[at + 1]["content"] if len(messages) > at + 1 else None
        out.append({"prompt": first, "expected": reply})
        if len(out) == AUTO_PROMPTS:
            break
    return out
