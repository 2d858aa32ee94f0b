"""The evaluate stage's settings (config key `eval`, shared by every experiment; snaketune.evaluation.evaluate)."""

from __future__ import annotations

from dataclasses import dataclass

from snaketune.config.choices import BUILTIN_EVAL_QUESTIONS, fail


@dataclass(frozen=True)
class EvalConfig:
    prompts: tuple[str, ...] | str = "auto"
    """User messages answered greedily by every model, side by side in the report; `auto`: the builtin questions
    on the builtin data, else the first user messages of AUTO_PROMPTS validation conversations."""
    max_new_tokens: int = 32
    """Most tokens generated per prompt (greedy decoding stops earlier at the end-of-sequence token)."""
    builtin_examples: int = 64
    """Builtin dataset only: questions scored by exact match (0 turns the accuracy off; at most 320)."""
    batch_size: int = 8
    """Sequences per forward pass for the validation loss and per generate() call."""

    def __post_init__(self) -> None:
        if isinstance(self.prompts, str):
            if self.prompts != "auto":
                fail("eval.prompts", f"{self.prompts!r} is not allowed; allowed: auto or a list of prompts")
        elif not self.prompts:
            fail("eval.prompts", "must be a list of at least one prompt, or auto")
        for prompt in () if isinstance(self.prompts, str) else self.prompts:
            if not isinstance(prompt, str) or not prompt.strip():
                fail("eval.prompts", f"{prompt!r} is not a non-empty string")
        if not 1 <= self.max_new_tokens <= 4096:
            fail("eval.max_new_tokens", f"{self.max_new_tokens} must be between 1 and 4096")
        if not 0 <= self.builtin_examples <= BUILTIN_EVAL_QUESTIONS:
            fail(
                "eval.builtin_examples",
                f"{self.builtin_examples} is not allowed; allowed: 0 (off) to {BUILTIN_EVAL_QUESTIONS} (the builtin "
                "data's distinct questions with tasks in rotation)",
            )
        if self.batch_size < 1:
            fail("eval.batch_size", f"{self.batch_size} must be >= 1")
