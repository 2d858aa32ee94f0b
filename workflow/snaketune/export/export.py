"""Stage 9, export: a fine-tuned model (SFT or DPO; LoRA and QLoRA were merged by their stages) as GGUF files for
llama.cpp, Ollama and LM Studio: the unquantized file (bf16 by default) through llama.cpp's converter, each
configured quant through its quantizer (snaketune.export.llama_cpp), then measured against the model they came
from (snaketune.export.measure): perplexity and its ratio to the unquantized file, KL divergence and top-1
agreement against transformers, greedy replies beside transformers', prompt and generation speed, file sizes.

A file is marked failing (in metrics.json and the report; the stage itself succeeds) when its mean KL per token
exceeds export.max_kl for its type, when a reply runs past eval.max_new_tokens where transformers' ended, or when
the file lost what a runtime needs to chat: the chat template, bos, eos, or eos as an end-of-generation token. A
file that renders held-out conversations to other tokens than training, or stops elsewhere, or a Modelfile without a
stop token, fails the stage (snaketune.export.parity).
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from snaketune.export import llama_cpp, measure, modelfile, parity
from snaketune.export.runtime import GGUFRuntime
from snaketune.io import atomic_dir, write_json
from snaketune.model import batching
from snaketune.model.inference import render_prompt

log = logging.getLogger("snaketune.export")


@dataclass(frozen=True)
class ExportJob:
    """What the export stage is asked to do: the export rule's params and inputs."""

    model_dir: str | Path
    """The fine-tuned model (hub format), as its stage saved it."""
    name: str
    """The files' stem: `<name>-<type>.gguf`."""
    out_dir: str | Path
    data_dir: str | Path
    """The tokenized SFT data: its validation split is what the files are scored on."""
    conversations: str | Path
    """The validation conversations (parquet): what the parity check renders through each file."""
    prompts: list[str]
    """Prompts whose greedy replies each file gives beside transformers'."""
    outtype: str
    """export.outtype: the unquantized file's type, or `auto` (the type the model was saved in)."""
    quants: list[str]
    """export.quants: llama.cpp quant types made from the unquantized file."""
    max_kl: dict[str, float]
    """Mean KL per token above which a file is marked failing, by type (export.max_kl with its defaults)."""
    eval_tokens: int
    """export.eval_tokens: held-out assistant tokens scored per file."""
    max_new_tokens: int
    max_prompt_tokens: int
    """Longer prompts are cut, keeping their end (tokenize.max_length)."""
    threads: int
    trust_remote_code: bool
    log_file: str | Path
    """Where llama.cpp's converter and quantizer write their output."""


@dataclass
class _Reference:
    """What the files are measured against: transformers running the exported directory in fp32."""

    segments: list[measure.Segment]
    """The held-out conversations scored (measure.validation_segments)."""
    logprobs: list
    """transformers' log-probabilities of each segment (measure.reference_logprobs)."""
    nll: float
    """Summed negative log-likelihood of the segments' targets."""
    targets: int
    prompt_ids: list[list[int]]
    """The prompts rendered with the chat template and the generation prompt, cut to max_prompt_tokens."""
    replies: list
    """transformers' greedy replies and their top-2 gaps (measure.reference_replies)."""

    @property
    def perplexity(self) -> float | None:
        return _exp(self.nll, self.targets)


def _reference(job: ExportJob) -> tuple[object, _Reference]:
    """The exported directory's tokenizer, and transformers' figures of its model in fp32 (freed afterwards)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir, trust_remote_code = Path(job.model_dir), job.trust_remote_code
    max_new, max_prompt = job.max_new_tokens, job.max_prompt_tokens
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir), trust_remote_code=trust_remote_code)
    net = AutoModelForCausalLM.from_pretrained(
        str(model_dir), dtype=torch.float32, use_safetensors=True, trust_remote_code=trust_remote_code
    ).eval()
    split = batching.load_split(Path(job.data_dir) / "validation")
    segments = measure.validation_segments(split, job.eval_tokens, max_prompt + max_new)
    logprobs = measure.reference_logprobs(net, segments)
    nll = sum(
        -float(r[range(len(s.targets)), s.ids[s.targets + 1]].sum())
        for s, r in zip(segments, logprobs, strict=True)
    )
    prompt_ids = [render_prompt(tokenizer, p, max_prompt) for p in job.prompts]
    replies = measure.reference_replies(net, prompt_ids, max_new, tokenizer.eos_token_id)
    targets = sum(len(s.targets) for s in segments)
    return tokenizer, _Reference(segments, logprobs, nll, targets, prompt_ids, replies)


def export(job: ExportJob) -> dict:
    """Write `<name>-<type>.gguf` for the unquantized type and each quant, metrics.json and replies.jsonl into
    `out_dir` (atomically); returns metrics.json's content. ParityError (snaketune.export.parity): nothing written."""
    tools = llama_cpp.check_toolchain()
    t0 = time.perf_counter()
    model_dir, name, prompts, threads = Path(job.model_dir), job.name, job.prompts, job.threads
    max_new_tokens, max_kl = job.max_new_tokens, job.max_kl
    tokenizer, ref = _reference(job)
    log.info(
        "reference (transformers, fp32): %d held-out conversations, %d target tokens, perplexity %s; %d prompts",
        len(ref.segments),
        ref.targets,
        ref.perplexity,
        len(prompts),
    )
    template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else None
    lengths = [len(s.ids) for s in ref.segments] + [len(p) + max_new_tokens for p in ref.prompt_ids]
    n_ctx = max([job.max_prompt_tokens + max_new_tokens, *lengths])
    outtype = llama_cpp.saved_type(model_dir) if job.outtype == "auto" else job.outtype
    with atomic_dir(job.out_dir) as tmp:
        made = _make_files(model_dir, tmp, name, outtype, job.quants, threads, job.log_file)
        meta = llama_cpp.gguf_metadata(made[outtype][0])
        files, replies = _measure(
            made, ref, prompts, tokenizer, n_ctx=n_ctx, threads=threads, max_new=max_new_tokens
        )
        _judge(files, max_kl, meta, tokenizer, template)
        metrics = {
            "model": name,
            "source": str(model_dir),
            "toolchain": tools,
            "outtype": outtype,
            "metadata": meta | _metadata_matches(meta, tokenizer, template),
            "reference": {
                "perplexity": ref.perplexity,
                "target_tokens": ref.targets,
                "conversations": len(ref.segments),
            },
            "max_kl": {t: max_kl.get(t) for t in made},
            "threads": threads,
            "files": files,
            "time_s": time.perf_counter() - t0,
        }
        # Ollama Modelfiles, serve.sh and README.md: how to serve each file and talk to it (snaketune.export.modelfile).
        served = modelfile.write_serving_files(
            tmp, name, list(made), tokenizer, model_dir=model_dir, version=tools["llama_cpp_python"]
        )
        metrics["parity"] = parity.check_export(
            [p for p, _ in made.values()], model_dir, job.conversations, served
        )
        write_json(tmp / "metrics.json", metrics)
        (tmp / "replies.jsonl").write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in replies))
    for row in files:
        _log_file(row)
    return metrics


def _make_files(
    model_dir: Path, tmp: Path, name: str, outtype: str, quants: list[str], threads: int, log_file
) -> dict[str, tuple[Path, float]]:
    """{type: (file, seconds to make it)}: the unquantized file first, then each quant made from it."""
    base = tmp / f"{name}-{outtype}.gguf"
    t = time.perf_counter()
    llama_cpp.convert(model_dir, base, outtype, log_file)
    made = {outtype: (base, time.perf_counter() - t)}
    for q in quants:
        t = time.perf_counter()
        llama_cpp.quantize(base, tmp / f"{name}-{q}.gguf", q, threads, log_file)
        made[q] = (tmp / f"{name}-{q}.gguf", time.perf_counter() - t)
    return made


def _measure(
    made: dict[str, tuple[Path, float]],
    ref: _Reference,
    prompts: list[str],
    tokenizer,
    *,
    n_ctx: int,
    threads: int,
    max_new: int,
) -> tuple[list[dict], list[dict]]:
    """metrics.json's row of each file (its size, quality and speed) and replies.jsonl's rows (its replies)."""
    files, replies = [], []
    for kind, (path, made_s) in made.items():
        row = {"type": kind, "file": path.name, "bytes": path.stat().st_size, "make_time_s": made_s}
        with GGUFRuntime(path, n_ctx=n_ctx, threads=threads) as runtime:
            row |= measure.score_gguf(runtime, ref.segments, ref.logprobs)
            row |= _replies(runtime, kind, prompts, ref, tokenizer, max_new, replies)
        files.append(row)
    return files, replies


def _replies(
    runtime: GGUFRuntime, kind: str, prompts: list[str], ref: _Reference, tokenizer, max_new: int, out: list
) -> dict:
    """llama.cpp's greedy replies to the prompts beside transformers' (one row each appended to `out`), and what
    the file's metrics.json row says of them."""
    gen_tokens, gen_s, agree, ended, ended_hf = 0, 0.0, 0, 0, 0
    for prompt, ids, (want, gaps) in zip(prompts, ref.prompt_ids, ref.replies, strict=True):
        got, ended_here, secs = measure.greedy_gguf(runtime, ids, max_new)
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        own = runtime.tokenize(text, add_bos=False)
        theirs = tokenizer(text, add_special_tokens=False)["input_ids"]  # before any prompt truncation
        part = measure.parted_at(got[: measure.AGREE_TOKENS], want[: measure.AGREE_TOKENS])
        gen_tokens += len(got)
        gen_s += secs
        agree += part is None
        ended += ended_here
        ended_hf += len(want) < len(gaps)  # it generated eos
        out.append(
            {
                "type": kind,
                "prompt": prompt,
                "llama_cpp": tokenizer.decode(got, skip_special_tokens=True).strip(),
                "transformers": tokenizer.decode(want, skip_special_tokens=True).strip(),
                "parted_at": part,
                "transformers_top2_gap_there": gaps[part] if part is not None and part < len(gaps) else None,
                "llama_cpp_tokens": len(got),
                "transformers_tokens": len(want),
                "ended_at_end_of_turn": ended_here,
                "llama_cpp_tokenizer_matches": own == theirs,
            }
        )
    return {
        "generation_tokens_per_s": gen_tokens / gen_s if gen_tokens else None,
        "replies": len(prompts),
        "replies_agreeing": agree,
        "replies_ended": ended,
        "replies_ended_transformers": ended_hf,
        "eos_is_end_of_generation": runtime.is_eog(tokenizer.eos_token_id),
    }


def _metadata_matches(meta: dict, tokenizer, template: str | None) -> dict[str, bool]:
    return {
        "chat_template_matches": meta["chat_template"] == template,
        "bos_matches": meta["bos_token_id"] == tokenizer.bos_token_id,
        "eos_matches": meta["eos_token_id"] == tokenizer.eos_token_id,
    }


def _log_file(row: dict) -> None:
    keys = ("perplexity", "perplexity_ratio", "kl_mean", "top1_agreement", "prompt_tokens_per_s")
    figures = ", ".join(f"{k} {row[k]:.5g}" for k in (*keys, "generation_tokens_per_s") if row[k] is not None)
    failing = f"; FAILING: {', '.join(row['failing'])}" if row["failing"] else ""
    log.info(
        "%s: %.1f MiB, %s; %d/%d replies agree, %d ended%s",
        row["file"],
        row["bytes"] / 2**20,
        figures,
        row["replies_agreeing"],
        row["replies"],
        row["replies_ended"],
        failing,
    )


def _exp(nll: float, n: int) -> float | None:
    import math

    return math.exp(nll / n) if n else None


def _judge(files: list[dict], max_kl: dict[str, float], meta: dict, tokenizer, template: str | None) -> None:
    """Each file's perplexity against the unquantized file's (the first), and why it fails, if it does."""
    unquantized_ppl = files[0]["perplexity"]
    for row in files:
        row["perplexity_ratio"] = row["perplexity"] / unquantized_ppl if unquantized_ppl else None
        row["failing"] = _failures(row, max_kl.get(row["type"]), meta, tokenizer, template)


def _failures(row: dict, max_kl: float | None, meta: dict, tokenizer, template: str | None) -> list[str]:
    """Why a file is marked failing (empty: it passes)."""
    out = []
    if max_kl is not None and row["kl_mean"] is not None and row["kl_mean"] > max_kl:
        out.append(f"KL {row['kl_mean']:.4g} > {max_kl:g}")
    if row["replies_ended"] < row["replies_ended_transformers"]:
        out.append(
            f"{row['replies_ended_transformers'] - row['replies_ended']} replies ran past the end of turn"
        )
    if template and meta["chat_template"] != template:
        out.append("chat template lost")
    if meta["bos_token_id"] != tokenizer.bos_token_id:
        out.append(f"bos {meta['bos_token_id']} != {tokenizer.bos_token_id}")
    if meta["eos_token_id"] != tokenizer.eos_token_id:
        out.append(f"eos {meta['eos_token_id']} != {tokenizer.eos_token_id}")
    if not row["eos_is_end_of_generation"]:
        out.append("eos does not end generation")
    return out
