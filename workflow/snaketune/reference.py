"""Stage 5b, reference: the reference model's log-probabilities of every preference pair, computed once.

DPO compares the policy's log-probabilities with a frozen reference model's. Holding that second model in
memory doubles the weights of a step (12.9 GiB more for a 7B on a 24 GB card); its numbers never change, so
this stage runs the reference (the SFT model, or the base with ``preference.reference: base``) over every
train and validation pair once and caches the summed log-probabilities of chosen and rejected, with the
replies' token counts (IPO averages over them). It reruns only when the reference model or the pairs change;
a new ``beta`` reuses it. The numbers are `snaketune.logprobs.pair_logprobs`, what the trainer would compute
on the fly (tests/test_preferences.py compares them), in the precision the trainer runs in (bf16 on CUDA,
fp32 on CPU).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import torch

from snaketune import attention, batching, gpus, inference, memory
from snaketune.config import ModelConfig, _build
from snaketune.io import atomic_files, write_json, write_parquet
from snaketune.logprobs import pair_logprobs
from snaketune.model import causal_lm
from snaketune.tokenization import SPLITS, load_tokenizer

log = logging.getLogger("snaketune.reference")

COLUMNS = ("split", "row", "chosen", "rejected", "chosen_tokens", "rejected_tokens")


def load_reference_model(
    which: str, *, model: ModelConfig, sft_dir: str | Path, tokenizer, seed: int, train_dtype, dtype, device
) -> torch.nn.Module:
    """The SFT model (what the train stage saved) or the base model, on `device` in `dtype`."""
    if which == "sft":
        return inference.load_tuned_model(sft_dir, model, dtype=dtype, device=device)
    if which == "base":
        return inference.load_base_model(
            model, tokenizer, seed=seed, train_dtype=train_dtype, dtype=dtype, device=device
        )
    raise ValueError(f"config key 'preference.reference': {which!r}; allowed: sft, base")


@torch.no_grad()
def split_logprobs(net: torch.nn.Module, split: batching.TokenizedSplit, *, pad_id: int, batch_size: int):
    """(rows, 2) summed log-probabilities and (rows, 2) token counts of chosen and rejected, float64 / int."""
    param = next(net.parameters())
    varlen = attention.kernel_available(param.device, param.dtype)
    if varlen:
        causal_lm(net).set_attn_implementation(attention.register())
    sums, counts = [], []
    try:
        for start in range(0, len(split), batch_size):
            rows = np.arange(start, min(len(split), start + batch_size))
            batch = batching.device_batch(split, rows, pad_id, param.device, varlen=varlen)
            lp, n = pair_logprobs(net, **batch, packed_attention=varlen)
            sums.append(lp.double().cpu())
            counts.append(n.long().cpu())
    finally:
        if varlen:
            causal_lm(net).set_attn_implementation("sdpa")
    if not sums:
        return torch.zeros(0, 2, dtype=torch.float64), torch.zeros(0, 2, dtype=torch.long)
    return torch.cat(sums), torch.cat(counts)


def read_reference(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """{split: {"logprobs": (rows, 2) float64, "tokens": (rows, 2) long}} from the stage's parquet file."""
    import pyarrow.parquet as pq

    table = pq.read_table(path).to_pydict()
    out = {}
    for split in SPLITS:
        idx = [i for i, s in enumerate(table["split"]) if s == split]
        rows = [table["row"][i] for i in idx]
        if rows != list(range(len(rows))):
            raise ValueError(f"{path}: the {split} rows are not 0..n-1 in order; rerun the reference stage")
        out[split] = {
            "logprobs": torch.tensor(
                [[table["chosen"][i], table["rejected"][i]] for i in idx], dtype=torch.float64
            ),
            "tokens": torch.tensor(
                [[table["chosen_tokens"][i], table["rejected_tokens"][i]] for i in idx], dtype=torch.long
            ),
        }
    return out


def compute_reference(
    *,
    model: dict,
    reference: str,
    seed: int,
    sft_dir: str | Path,
    train_summary: str | Path,
    tokenizer_dir: str | Path,
    pairs_dir: str | Path,
    batch_size: int,
    out: str | Path,
    record_out: str | Path,
    device: str | None = None,
    memory_cap_gib: float | None = None,
) -> dict[str, Any]:
    """Write out (parquet: split, row, chosen, rejected, chosen_tokens, rejected_tokens) and record_out (JSON:
    which model, device, dtype, time, peak memory against the memory model's estimate)."""
    t0 = time.perf_counter()
    model_cfg: ModelConfig = _build(ModelConfig, model, "model.")
    summary = json.loads(Path(train_summary).read_text())
    dev, dtype = inference.pick_device(device)
    capped = gpus.cap_memory(dev, memory_cap_gib)
    if capped:
        log.info("%s", capped)
    stats = json.loads((Path(pairs_dir) / "stats.json").read_text())
    tokenizer = load_tokenizer(tokenizer_dir, stats["settings"]["chat_template"])
    net = load_reference_model(
        reference,
        model=model_cfg,
        sft_dir=sft_dir,
        tokenizer=tokenizer,
        seed=seed,
        train_dtype=inference.DTYPES[summary["precision"]],
        dtype=dtype,
        device=dev,
    )
    peaks: dict[str, float] = {}
    columns: dict[str, list] = {c: [] for c in COLUMNS}
    longest = 0
    for split in SPLITS:
        data = batching.load_split(Path(pairs_dir) / split)
        longest = max(longest, int(data.lengths.max(initial=0)))
        with inference.peak_memory(dev, peaks, "logprobs"):
            lp, n = split_logprobs(net, data, pad_id=batching.pad_id(tokenizer), batch_size=batch_size)
        columns["split"] += [split] * len(data)
        columns["row"] += list(range(len(data)))
        columns["chosen"] += lp[:, 0].tolist()
        columns["rejected"] += lp[:, 1].tolist()
        columns["chosen_tokens"] += n[:, 0].tolist()
        columns["rejected_tokens"] += n[:, 1].tolist()
        log.info(
            "%s: %d pairs, mean chosen %.2f, rejected %.2f",
            split,
            len(data),
            lp[:, 0].mean(),
            lp[:, 1].mean(),
        )
    arch = memory.arch_from_hf_config(causal_lm(net).config.to_dict())
    predicted = memory.estimate_eval(
        arch,
        memory.EvalSetup(
            batch=batch_size,
            seq_len=longest,
            prompt_len=0,
            new_tokens=0,
            precision="fp32" if dtype == torch.float32 else "bf16",
            varlen=attention.kernel_available(dev, dtype),
        ),
    )
    record = {
        "reference": reference,
        "model": str(sft_dir) if reference == "sft" else model_cfg.base,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "dtype": str(dtype).removeprefix("torch."),
        "pairs": {s: columns["split"].count(s) for s in SPLITS},
        "batch_size": batch_size,
        "longest_row_tokens": longest,
        "peak_memory_gib": peaks.get("logprobs"),
        "predicted_peak_gib": round(predicted.validation_gib, 3),
        "time_s": time.perf_counter() - t0,
    }
    types = {"split": pa.string(), "row": pa.int64(), "chosen": pa.float64(), "rejected": pa.float64()}
    schema = pa.schema([(c, types.get(c, pa.int64())) for c in COLUMNS])
    with atomic_files(out, record_out) as (table_tmp, record_tmp):
        write_parquet(pa.Table.from_pydict(columns, schema=schema), table_tmp)
        write_json(record_tmp, record)
    del net
    inference.release_memory()
    return record
