"""The preference stage's settings (config key `preference`, per experiment; snaketune.preference)."""

from __future__ import annotations

from dataclasses import dataclass, field

from snaketune.config.choices import (
    PAIR_MODES,
    PAIRS_FROM_DATASET,
    PREFERENCE_LOSSES,
    REFERENCES,
    SOURCE_SUFFIXES,
    fail,
)


@dataclass(frozen=True)
class PreferenceConfig:
    enabled: bool = True
    """Tune the SFT model on preference pairs after SFT (stages preferences, tokenize_pairs, reference, dpo)."""
    source: str = PAIRS_FROM_DATASET
    """Where the pairs come from: `dataset` (the ranks oasst gives sibling replies) or a local .jsonl, .jsonl.gz or
    .parquet file of pairs: `prompt` (a string, or a messages list ending in a user turn), `chosen` and `rejected`
    (strings, or messages lists whose last turn is the assistant reply) (snaketune.data.pair_format)."""
    pairs: str = "best_vs_rest"
    """`best_vs_rest`: each best-ranked reply against each worse sibling; `all`: every pair of different ranks
    (source `dataset` only)."""
    max_length: int = 128
    """Tokens per side of a pair (conversation so far + reply); longer sides lose the oldest turns first."""
    loss: str = "dpo"
    """`dpo` (Rafailov et al. 2023) | `ipo` (Azar et al. 2023, on length-averaged log-probabilities)."""
    beta: float = 0.1
    """Strength of the KL penalty towards the reference (DPO's beta, IPO's tau)."""
    reference: str = "sft"
    """The model the log-ratios are taken against, its log-probabilities cached once: `sft` | `base`."""
    sft_weight: float = 1.0
    """Add this times the chosen reply's mean next-token loss to each pair's loss (RPO; TRL's rpo_alpha): keeps the
    chosen replies likely while the rejected ones fall. 0: the plain DPO/IPO loss."""
    train: dict = field(
        default_factory=lambda: {
            "learning_rate": 1.0e-3,
            "max_steps": 200,
            "global_batch_size": 24,
            "micro_batch_size": 4,
            "warmup_steps": 10,
            "eval_every": 50,
            "checkpoint_every": 50,
        }
    )
    """Overrides of the train section for the preference stage (learning_rate, max_steps, lora, ...), merged over
    `train`; a `preference.train` given replaces this default, which suits the embedded default's tiny model (a 7B
    wants ~5e-7 for full fine-tuning, ~5e-6 to 2e-5 with LoRA)."""

    def __post_init__(self) -> None:
        if not self.source or (
            self.source != PAIRS_FROM_DATASET and not self.source.endswith(SOURCE_SUFFIXES)
        ):
            fail(
                "preference.source",
                f"{self.source!r} is not allowed; allowed: {PAIRS_FROM_DATASET} | a pairs file ending in "
                f"{', '.join(SOURCE_SUFFIXES)} (prompt, chosen, rejected)",
            )
        if self.pairs not in PAIR_MODES:
            fail("preference.pairs", f"{self.pairs!r} is not allowed; allowed: {', '.join(PAIR_MODES)}")
        if self.loss not in PREFERENCE_LOSSES:
            fail("preference.loss", f"{self.loss!r} is not allowed; allowed: {', '.join(PREFERENCE_LOSSES)}")
        if self.reference not in REFERENCES:
            fail(
                "preference.reference", f"{self.reference!r} is not allowed; allowed: {', '.join(REFERENCES)}"
            )
        if not self.beta > 0:
            fail("preference.beta", f"{self.beta} must be > 0")
        if self.sft_weight < 0:
            fail("preference.sft_weight", f"{self.sft_weight} must be >= 0 (0 is the plain loss)")
        if not 16 <= self.max_length <= 131072:
            fail("preference.max_length", f"{self.max_length} must be between 16 and 131072")

    @property
    def from_file(self) -> bool:
        """Whether the pairs come from a pairs file (else from the dataset's ranks)."""
        return self.source != PAIRS_FROM_DATASET
