"""The evaluate stage's settings (config key `eval`, shared by every experiment; snaketune.evaluation.evaluate)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from snaketune.config.choices import BUILTIN_EVAL_QUESTIONS, fail
from snaketune.config.fields import check, setting


@dataclass(frozen=True)
class EvalConfig:
    """Evaluation of every experiment (rule evaluate): validation loss, greedy replies, builtin exact match."""

    SECTION: ClassVar[str] = "eval"

    prompts: tuple[str, ...] | str = setting("auto", keywords=("auto",), allowed="auto or a list of prompts")
    """User messages answered greedily by every model, side by side in the report; `auto`: the builtin questions
    on the builtin data, else the first user messages of AUTO_PROMPTS validation conversations."""
    max_new_tokens: int = setting(32, minimum=1, maximum=4096)
    """Most tokens generated per prompt (greedy decoding stops earlier at the end-of-sequence token)."""
    builtin_examples: int = setting(
        64,
        minimum=0,
        maximum=BUILTIN_EVAL_QUESTIONS,
        allowed=f"0 (off) to {BUILTIN_EVAL_QUESTIONS} (the builtin data's distinct questions with tasks in rotation)",
    )
    """Builtin dataset only: questions scored by exact match (0 turns the accuracy off; at most 320)."""
    batch_size: int = setting(8, minimum=1)
    """Sequences per forward pass for the validation loss and per generate() call."""

    def __post_init__(self) -> None:
        check(self)
        if not self.prompts:
            fail("eval.prompts", "must be a list of at least one prompt, or auto")
        for prompt in () if isinstance(self.prompts, str) else self.prompts:
            if not prompt.strip():
                fail("eval.prompts", f"{prompt!r} is not a non-empty string")
