"""The preference stage's settings (config key `preference`, per experiment; snaketune.preference)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import ClassVar

from snaketune.config.choices import (
    PAIR_MODES,
    PAIRS_FROM_DATASET,
    PREFERENCE_LOSSES,
    REFERENCES,
    SOURCE_SUFFIXES,
)
from snaketune.config.fields import check, setting


@dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning (DPO) of the SFT model on oasst's ranked replies or a pairs file."""

    SECTION: ClassVar[str] = "preference"

    enabled: bool = True
    """Tune the SFT model on preference pairs after SFT (stages preferences, tokenize_pairs, reference, dpo)."""
    source: str = setting(
        PAIRS_FROM_DATASET,
        pattern=rf"^({PAIRS_FROM_DATASET}|.+({'|'.join(re.escape(x) for x in SOURCE_SUFFIXES)}))$",
        allowed=f"{PAIRS_FROM_DATASET} | a pairs file ending in {', '.join(SOURCE_SUFFIXES)} (prompt, chosen, rejected)",
    )
    """Where the pairs come from: `dataset` (the ranks oasst gives sibling replies) or a local .jsonl, .jsonl.gz or
    .parquet file of pairs: `prompt` (a string, or a messages list ending in a user turn), `chosen` and `rejected`
    (strings, or messages lists whose last turn is the assistant reply) (snaketune.data.pair_format)."""
    pairs: str = setting("best_vs_rest", choices=PAIR_MODES)
    """`best_vs_rest`: each best-ranked reply against each worse sibling; `all`: every pair of different ranks
    (source `dataset` only)."""
    max_length: int = setting(128, minimum=16, maximum=131072)
    """Tokens per side of a pair (conversation so far + reply); longer sides lose the oldest turns first."""
    loss: str = setting("dpo", choices=PREFERENCE_LOSSES)
    """`dpo` (Rafailov et al. 2023) | `ipo` (Azar et al. 2023, on length-averaged log-probabilities)."""
    beta: float = setting(0.1, exclusive_minimum=0)
    """Strength of the KL penalty towards the reference (DPO's beta, IPO's tau)."""
    reference: str = setting("sft", choices=REFERENCES)
    """The model the log-ratios are taken against, its log-probabilities cached once: `sft` | `base`."""
    sft_weight: float = setting(1.0, minimum=0, hint="0 is the plain loss")
    """Add this times the chosen reply's mean next-token loss to each pair's loss (RPO; TRL's rpo_alpha): keeps the
    chosen replies likely while the rejected ones fall. 0: the plain DPO/IPO loss."""
    train: dict = setting(
        schema={"$ref": "#/$defs/train"},
        default_factory=lambda: {
            "learning_rate": 1.0e-3,
            "max_steps": 100,
            "global_batch_size": 24,
            "micro_batch_size": 4,
            "warmup_steps": 10,
            "eval_every": 50,
            "checkpoint_every": 50,
        },
    )
    """Overrides of the train section for the preference stage (learning_rate, max_steps, lora, ...), merged over
    `train`; a `preference.train` given replaces this default, which suits the embedded default's tiny model (a 7B
    wants ~5e-7 for full fine-tuning, ~5e-6 to 2e-5 with LoRA)."""

    def __post_init__(self) -> None:
        check(self)

    @property
    def from_file(self) -> bool:
        """Whether the pairs come from a pairs file (else from the dataset's ranks)."""
        return self.source != PAIRS_FROM_DATASET
