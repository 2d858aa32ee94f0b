"""The report's deployment section: the export stage's GGUF files (snaketune.export.export), per experiment and
model: what each quant costs in quality against the model it came from, what it gains in size and speed, and
llama.cpp's greedy replies beside transformers'."""

from __future__ import annotations

from snaketune.report.inputs import Experiment
from snaketune.report.render import Block, Heading, Para, Table, fmt

MODEL_NAMES = {"sft": "SFT", "dpo": "DPO"}


def export_section(experiments: list[Experiment]) -> list[Block]:
    runs = [exp for exp in experiments if exp.exports]
    if not runs:
        return []
    first = next(iter(runs[0].exports.values()))
    tools = first["toolchain"]
    blocks: list[Block] = [
        Heading(2, "Deployment (GGUF)"),
        Para(
            f"Each model as GGUF files for llama.cpp, Ollama and LM Studio: llama.cpp's converter and quantizer "
            f"(llama-cpp-python {tools['llama_cpp_python']}), measured with llama.cpp on {first['threads']} CPU "
            "threads against transformers running the exported directory (fp32), on the same held-out assistant "
            "tokens (the evaluate stage's masking). Perplexity ratio: against the unquantized file. KL: mean "
            "KL(model ‖ file) per token. Top-1: share of tokens where both rank the same token first. Replies: "
            "greedy replies to the eval prompts from the same prompt tokens whose first 16 tokens equal "
            "transformers'; ended: replies that stopped at the end-of-turn token within eval.max_new_tokens "
            "(transformers' count beside). A file fails past export.max_kl or when it lost the chat template, "
            "bos/eos or the end of turn.",
            muted=True,
        ),
    ]
    for exp in runs:
        for model, m in exp.exports.items():
            blocks.append(Heading(3, f"{exp.name}: {MODEL_NAMES.get(model, model)} model"))
            blocks += _files_blocks(m)
    return blocks


FILE_COLUMNS = [
    "quant",
    "MiB",
    "perplexity",
    "ratio",
    "KL",
    "top-1",
    "prompt tok/s",
    "gen tok/s",
    "replies agree",
    "ended",
    "verdict",
]
"""One row per GGUF file of a model."""


def _files_blocks(m: dict) -> list[Block]:
    """One exported model: each file's quality, size and speed, what the files carry, a quant's replies."""
    rows = [
        [
            f["type"],
            fmt(f["bytes"] / 2**20, 3),
            fmt(f["perplexity"]),
            fmt(f["perplexity_ratio"]),
            fmt(f["kl_mean"], 3),
            fmt(f["top1_agreement"], 3),
            fmt(f["prompt_tokens_per_s"], 3),
            fmt(f["generation_tokens_per_s"], 3),
            f"{f['replies_agreeing']}/{f['replies']}",
            f"{f['replies_ended']}/{f['replies']} ({f['replies_ended_transformers']})",
            "; ".join(f["failing"]) or "pass",
        ]
        for f in m["files"]
    ]
    ref, meta = m["reference"], m["metadata"]
    template = "equal to the tokenizer’s" if meta["chat_template_matches"] else "NOT equal to the tokenizer’s"
    eos = "equal" if meta["eos_matches"] else "NOT equal"
    blocks: list[Block] = [
        Table(FILE_COLUMNS, rows, numeric=[False, *[True] * 7, False, False, False]),
        Para(
            f"transformers (fp32) perplexity {fmt(ref['perplexity'])} on {fmt(ref['target_tokens'])} "
            f"tokens of {ref['conversations']} held-out conversations. The files carry the chat template "
            f"({template}), bos {meta['bos_token_id']}, eos {meta['eos_token_id']} ({eos} to the tokenizer’s), "
            f"pre-tokenizer `{meta['pre_tokenizer']}`. Written in "
            f"{fmt(sum(f['make_time_s'] for f in m['files']), 3)} s; the stage took {fmt(m['time_s'], 3)} s."
        ),
    ]
    quant = m["files"][1] if len(m["files"]) > 1 else m["files"][0]
    replies = [r for r in m["replies"] if r["type"] == quant["type"]]
    if replies:
        blocks.append(
            Table(
                ["prompt", f"llama.cpp ({quant['type']})", "transformers", "parts at"],
                [
                    [r["prompt"][:80], r["llama_cpp"][:160], r["transformers"][:160], _parted(r)]
                    for r in replies
                ],
                numeric=[False, False, False, True],
            )
        )
    return blocks


def _parted(reply: dict) -> str:
    """Where llama.cpp's reply parts from transformers', with transformers' gap between its first and second
    choice there (log-probability): a near-tie that the file's rounding flips."""
    if reply["parted_at"] is None:
        return "—"
    gap = reply.get("transformers_top2_gap_there")
    return f"token {reply['parted_at']}" + ("" if gap is None else f" (top-2 gap {fmt(gap, 2)})")
