"""The export stage's settings (config key `export`, shared by every experiment; snaketune.export.export)."""

from __future__ import annotations

from dataclasses import dataclass, field

from snaketune.config.choices import EXPORT_MODELS, EXPORT_QUANTS, EXPORT_TYPES, fail

DEFAULT_MAX_KL = {
    "f32": 0.0001,
    "bf16": 0.001,
    "f16": 0.001,
    "q8_0": 0.01,
    "q6_k": 0.03,
    "q5_k_m": 0.05,
    "q4_k_m": 0.1,
    "q4_0": 0.2,
}
"""Mean KL divergence per held-out assistant token above which a file is marked failing. llama.cpp's perplexity
tool on Llama-3-8B: Q8_0 0.0014, Q4_K_M 0.031, so these are about 3x the 8B's figures: small models lose more.
Measured here on SmolLM2-135M (576-wide rows: q4_k_m falls back from the k-quants to q5_0/q8_0): fine-tuned on CPU
and quantized from its f32 file, held-out assistant tokens, q8_0 0.0006 and q4_k_m 0.0023 (tests/test_real_model.py);
quantized from a bf16 file and scored on raw text, q8_0 0.0065 and q4_k_m 0.10 (the bf16 rounding counts there)."""


@dataclass(frozen=True)
class ExportConfig:
    enabled: bool = True
    """Export each experiment's fine-tuned models as GGUF files (rule export), measured in the report."""
    models: tuple[str, ...] = ("sft", "dpo")
    """Which models: `sft` (rule train's) and `dpo` (rule dpo's, where the experiment's preference stage runs)."""
    outtype: str = "auto"
    """The unquantized file: `auto` (the type the model was saved in: bf16 from GPU training, f32 from CPU
    training, whose small updates bf16 would round away), f32, bf16, or f16 (older runtimes; fp16's range)."""
    quants: tuple[str, ...] = ("q8_0", "q4_k_m")
    """llama.cpp quant types made from it: q8_0, q6_k, q5_k_m, q4_k_m, q4_0 (none: an empty list)."""
    max_kl: dict[str, float] = field(default_factory=dict)
    """Mean KL per token above which a file is marked failing, by type; unset types: DEFAULT_MAX_KL."""
    eval_tokens: int = 2048
    """Held-out assistant tokens scored per file (whole validation conversations, in order, up to this many)."""

    def __post_init__(self) -> None:
        for m in self.models:
            if m not in EXPORT_MODELS:
                fail("export.models", f"{m!r} is not allowed; allowed: {', '.join(EXPORT_MODELS)}")
        if self.outtype not in ("auto", *EXPORT_TYPES):
            fail(
                "export.outtype", f"{self.outtype!r} is not allowed; allowed: auto, {', '.join(EXPORT_TYPES)}"
            )
        for q in self.quants:
            if q not in EXPORT_QUANTS:
                fail("export.quants", f"{q!r} is not allowed; allowed: {', '.join(EXPORT_QUANTS)}")
        if len(set(self.quants)) != len(self.quants):
            fail("export.quants", f"{list(self.quants)} names a type twice")
        for k, v in self.max_kl.items():
            if k not in EXPORT_TYPES + EXPORT_QUANTS:
                fail(
                    f"export.max_kl.{k}", f"unknown type; allowed: {', '.join(EXPORT_TYPES + EXPORT_QUANTS)}"
                )
            if isinstance(v, bool) or not isinstance(v, int | float) or v < 0:
                fail(f"export.max_kl.{k}", f"{v!r} must be a number >= 0")
        if self.eval_tokens < 1:
            fail("export.eval_tokens", f"{self.eval_tokens} must be >= 1")

    def thresholds(self) -> dict[str, float]:
        """max_kl of every type this config may make (the defaults where unset; `auto` may be any unquantized
        type until the export stage reads the model)."""
        types = (*(EXPORT_TYPES if self.outtype == "auto" else (self.outtype,)), *self.quants)
        return {t: float(self.max_kl.get(t, DEFAULT_MAX_KL[t])) for t in types}
