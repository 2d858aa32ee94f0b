"""The sizes the memory plan works from: a dense Llama-family architecture (`Arch`), read from a transformers
config.json, from the builtin architectures, or from the hub cache, without torch (the plan rule runs on the
login node)."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from snaketune.config.choices import GGUF_SUFFIX, gguf_model_dir

log = logging.getLogger("snaketune.plan")


@dataclass(frozen=True)
class Arch:
    """The sizes of a dense decoder-only transformer of the Llama family (DeepSeek-LLM is one)."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied_embeddings: bool = False

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of every linear layer of one decoder layer, by module name."""
        h, i, q, kv = (
            self.hidden,
            self.intermediate,
            self.heads * self.head_dim,
            self.kv_heads * self.head_dim,
        )
        return {
            "q_proj": (h, q),
            "k_proj": (h, kv),
            "v_proj": (h, kv),
            "o_proj": (q, h),
            "gate_proj": (h, i),
            "up_proj": (h, i),
            "down_proj": (i, h),
        }

    def layer_params(self) -> int:
        return sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden

    def embedding_params(self) -> int:
        return self.vocab * self.hidden

    def params(self) -> int:
        embeddings = self.embedding_params() * (1 if self.tied_embeddings else 2)
        return self.layers * self.layer_params() + embeddings + self.hidden

    def lora_params(self, rank: int, targets: Sequence[str]) -> int:
        shapes = self.linear_shapes()
        return self.layers * sum(rank * sum(shapes[t]) for t in targets if t in shapes)


def arch_from_hf_config(cfg: dict) -> Arch:
    """An Arch from a transformers config.json of a dense Llama-family model; ValueError otherwise."""
    cfg = cfg.get("text_config") or cfg
    moe = [k for k in ("num_experts", "n_routed_experts", "num_local_experts") if cfg.get(k)]
    if moe:
        raise ValueError(f"mixture-of-experts ({moe[0]}={cfg[moe[0]]}) is not modelled")
    missing = [
        k
        for k in (
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "vocab_size",
        )
        if not cfg.get(k)
    ]
    if missing:
        raise ValueError(f"config.json lacks {', '.join(missing)}")
    heads = cfg["num_attention_heads"]
    return Arch(
        hidden=cfg["hidden_size"],
        intermediate=cfg["intermediate_size"],
        layers=cfg["num_hidden_layers"],
        heads=heads,
        kv_heads=cfg.get("num_key_value_heads") or heads,
        head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
        vocab=cfg["vocab_size"],
        tied_embeddings=bool(cfg.get("tie_word_embeddings", False)),
    )


BUILTIN_TOKENIZER_VOCAB = 1024
"""The builtin BPE's size (rule train_tokenizer); builtin-tiny rounds it up to a multiple of 64."""


def resolve_arch(model: dict, *, allow_download: bool = False) -> tuple[Arch | None, str]:
    """The architecture of `model` (config section `model`) and where it came from; (None, why) when it is
    not known here: a hub model whose config.json is neither cached nor downloadable (no network)."""
    from snaketune.model.architectures import BUILTIN_TINY, DEEPSEEK_LLM_7B

    base = model["base"]
    if base == "builtin-tiny":
        vocab = (BUILTIN_TOKENIZER_VOCAB + 63) // 64 * 64
        return arch_from_hf_config(
            {**BUILTIN_TINY, "vocab_size": vocab}
        ), "builtin-tiny (snaketune.model.build)"
    if base.startswith("arch:"):
        cfg = dict(DEEPSEEK_LLM_7B)
        if model.get("num_layers"):
            cfg["num_hidden_layers"] = model["num_layers"]
        return arch_from_hf_config(cfg), f"{base} (snaketune.model.build), {cfg['num_hidden_layers']} layers"
    # A GGUF file: the hub-format directory rule import_gguf made of it (an input of the plan rules).
    path = Path(gguf_model_dir(base) if base.lower().endswith(GGUF_SUFFIX) else base) / "config.json"
    if not path.is_file():
        found, why = _hub_config(base, model.get("revision", "main"), allow_download)
        if found is None:
            return None, f"unknown: skipped (no config.json for {base!r} in the hub cache; {why})"
        path = found
    try:
        return arch_from_hf_config(json.loads(path.read_text())), f"{path}"
    except ValueError as e:
        return None, f"unknown: skipped ({path}: {e})"


def _hub_config(repo_id: str, revision: str, allow_download: bool) -> tuple[Path | None, str]:
    """(config.json's path, "") or (None, why not): the plan says why where it has to stop for it."""
    try:
        from huggingface_hub import hf_hub_download, try_to_load_from_cache
    except ImportError:
        return None, "huggingface_hub is not installed"
    try:
        cached = try_to_load_from_cache(repo_id, "config.json", revision=revision)
        if isinstance(cached, str):
            return Path(cached), ""
        if not allow_download:
            return None, "downloads are off (HF_HUB_OFFLINE)"
        return Path(hf_hub_download(repo_id, "config.json", revision=revision)), ""
    except Exception as e:  # noqa: BLE001 - no network, bad id, gated repo: the plan is unknown, or an error (search)
        log.info("config.json of %s not available: %s", repo_id, e)
        return None, f"the download failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
