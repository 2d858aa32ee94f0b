"""The report's sections as blocks (snaketune.report.render): summary, data, training, evaluation,
comparison and provenance. Each function turns loaded inputs into headings, paragraphs, tables and figures;
nothing here reads files except the plots it is handed."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from snaketune.report.render import (
    Block,
    Cards,
    Cell,
    Columns,
    Figure,
    FigureRow,
    Heading,
    Para,
    Table,
    fmt,
    fmt_duration,
    fmt_pct,
)

if TYPE_CHECKING:
    from snaketune.report.inputs import Experiment

MAX_MISSES_SHOWN = 8
"""Wrong exact-match replies listed per experiment."""


# ---- sections ----------------------------------------------------------------------------------


def _change(base: float, tuned: float) -> str:
    return fmt_pct(100.0 * (tuned - base) / base, signed=True) if base else "–"


def _acc(x: float | None) -> str:
    return fmt_pct(100.0 * x) if x is not None else "–"


def training_mode(e: dict) -> str:
    """How an experiment trained: full fine-tuning, LoRA or QLoRA, quantized Adam states and the in-backward step
    where used."""
    mode = "full fine-tuning"
    if e["lora"]:
        mode = "QLoRA, 4-bit NF4 base" if e.get("lora_quantize", "none") != "none" else "LoRA"
    if e.get("optimizer_states") in ("8bit", "4bit"):
        mode += f", {e['optimizer_states'][0]}-bit Adam states"
    if e.get("optimizer_step") == "in_backward":
        mode += ", step in backward"
    if e.get("fp8", "none") != "none":
        mode += f", FP8 matmuls ({e['fp8']})"
    return mode


def overview(data: dict, experiments: list[Experiment], summary: dict) -> list[Block]:
    conv = data["conversations"]["conversations"]
    blocks: list[Block] = [Heading(2, "Summary")]
    for exp in experiments:
        e = summary["experiments"][exp.name]
        mode = training_mode(e)
        device = e["device"] or "?"
        text = (
            f"**{exp.name}**: `{e['model']}` ({fmt(e['parameters'])} parameters, {mode}), "
            f"{fmt(e['steps'])} optimizer steps on {e['world_size']} × {device} "
            f"(ZeRO-{e['zero_stage']}, {e['precision']}) in {fmt_duration(e['train_wall_time_s'])}. "
            f"Validation loss fell from **{fmt(e['base_val_loss'])}** to **{fmt(e['tuned_val_loss'])}** "
            f"({fmt_pct(e['val_loss_change_pct'], signed=True)}); perplexity from {fmt(e['base_perplexity'])} "
            f"to {fmt(e['tuned_perplexity'])}."
        )
        if e["val_loss_change_pct"] >= 0:
            text = text.replace("Validation loss fell from", "Validation loss did not fall: from")
        if e["exact_match_n"]:
            text += (
                f" Exact match on {e['exact_match_n']} builtin questions: {_acc(e['base_accuracy'])} → "
                f"**{_acc(e['tuned_accuracy'])}**."
            )
        blocks.append(Para(text))
    best = min(experiments, key=lambda x: summary["experiments"][x.name]["tuned_val_loss"])
    b = summary["experiments"][best.name]
    label = "" if len(experiments) == 1 else f" ({best.name})"
    cards = [
        (
            "Validation loss" + label,
            f"{fmt(b['base_val_loss'])} → {fmt(b['tuned_val_loss'])}",
            f"{fmt_pct(b['val_loss_change_pct'], signed=True)}, base → fine-tuned",
        ),
        (
            "Perplexity" + label,
            f"{fmt(b['base_perplexity'])} → {fmt(b['tuned_perplexity'])}",
            "exp(validation loss)",
        ),
    ]
    if b["exact_match_n"]:
        cards.append(
            (
                "Exact match" + label,
                f"{_acc(b['base_accuracy'])} → {_acc(b['tuned_accuracy'])}",
                f"{b['exact_match_n']} builtin questions",
            )
        )
    cards.append(
        (
            "Throughput" + label,
            f"{fmt(b['tokens_per_s_per_gpu'], 3)} tok/s",
            f"per rank; MFU {fmt(b['mfu'], 3)}" if b["mfu"] is not None else "per rank (no MFU on CPU)",
        )
    )
    cards.append(
        ("Training conversations", fmt(conv.get("train")), f"{fmt(conv.get('validation'))} for validation")
    )
    blocks.append(Cards(cards))
    return blocks


def data_section(data: dict, experiments: list[Experiment]) -> list[Block]:
    src, conv = data["source"], data["conversations"]
    blocks: list[Block] = [Heading(2, "Data")]
    splits = ", ".join(src.get("splits") or []) or "none (split by tree hash)"
    blocks += [
        Heading(3, "Download"),
        Table(
            ["source", "messages", "splits in the source", "messages.parquet sha256"],
            [
                [
                    f"`{src.get('source')}`",
                    fmt(src.get("messages")),
                    splits,
                    f"`{(src.get('sha256') or {}).get('messages.parquet', '')[:16]}…`",
                ]
            ],
            numeric=[False, True, False, False],
        ),
        Heading(3, "Conversations"),
        Para(
            f"{fmt(conv.get('trees'))} message trees, {fmt(conv.get('messages'))} messages, "
            f"{fmt(conv.get('messages_kept'))} kept; paths: `{conv.get('paths')}`; validation split by "
            f"`{conv.get('split_source')}`."
        ),
    ]
    # Only the reasons that occurred; the full counts are in conversations/stats.json.
    dropped = [
        [f"message: {k.replace('_', ' ')}", fmt(v)]
        for k, v in sorted((conv.get("dropped") or {}).items())
        if v
    ]
    dropped += [
        [f"path: {k.replace('_', ' ')}", fmt(v)]
        for k, v in sorted((conv.get("paths_dropped") or {}).items())
        if v
    ]
    if conv.get("paths_trimmed_prompter"):
        dropped.append(["path: trailing prompter message cut", fmt(conv["paths_trimmed_prompter"])])
    languages = sorted({lang for per in (conv.get("by_language") or {}).values() for lang in per})
    rows = []
    for split, n in (conv.get("conversations") or {}).items():
        by_lang = (conv.get("by_language") or {}).get(split, {})
        rows.append(
            [
                split,
                fmt((conv.get("trees_by_split") or {}).get(split)),
                fmt(n),
                fmt((conv.get("turns_mean") or {}).get(split)),
            ]
            + [fmt(by_lang.get(lang, 0)) for lang in languages]
        )
    blocks += [
        Columns(
            [
                Table(
                    ["split", "trees", "conversations", "mean turns"] + [f"`{lang}`" for lang in languages],
                    rows,
                ),
                Table(["dropped (nonzero reasons)", "count"], dropped or [["nothing", "0"]]),
            ]
        ),
        Heading(3, "Tokenized"),
    ]
    seen: dict[str, list[str]] = {}
    for exp in experiments:
        seen.setdefault(exp.data_key, []).append(exp.name)
    for key, names in seen.items():
        stats = next(e.tokenized for e in experiments if e.data_key == key)
        st = stats.get("settings", {})
        blocks.append(
            Para(
                f"Cache `{key}` (experiments: {', '.join(names)}): max_length {st.get('max_length')}, "
                f"packing {'on' if st.get('packing') else 'off'}, "
                f"{'assistant-only' if st.get('assistant_only_loss') else 'all-token'} loss, "
                f"chat template `{st.get('chat_template')}`."
            )
        )
        rows = []
        for split, v in stats["splits"].items():
            rows.append(
                [
                    split,
                    fmt(v.get("conversations")),
                    fmt(v.get("sequences")),
                    fmt(v.get("tokens")),
                    fmt(v.get("loss_tokens")),
                    f"{fmt(v.get('truncated'))} ({fmt_pct(v.get('truncated_pct'))})",
                    fmt(v.get("mean_conversation_tokens")),
                    fmt(v.get("max_conversation_tokens")),
                    fmt_pct(100 * v["pad_fraction_unpadded_to_max"])
                    if "pad_fraction_unpadded_to_max" in v
                    else "–",
                    fmt_pct(100 * v["pad_fraction_packed"]) if "pad_fraction_packed" in v else "–",
                ]
            )
        blocks.append(
            Table(
                [
                    "split",
                    "conversations",
                    "sequences",
                    "tokens",
                    "loss tokens",
                    "truncated",
                    "mean tokens",
                    "max tokens",
                    "pad, unpacked",
                    "pad, packed",
                ],
                rows,
            )
        )
    return blocks


def training_section(
    experiments: list[Experiment], summary: dict, plot_paths: dict[str, Path]
) -> list[Block]:
    metrics = [
        ("model", lambda e, s: f"`{e['model']}`"),
        ("parameters (trainable)", lambda e, s: f"{fmt(e['parameters'])} ({fmt(e['trainable_parameters'])})"),
        ("optimizer steps", lambda e, s: fmt(e["steps"])),
        ("ranks × device", lambda e, s: f"{e['world_size']} × {e['device']}"),
        ("ZeRO stage, precision", lambda e, s: f"{e['zero_stage']}, {e['precision']}"),
        (
            "global batch (micro × ranks × accumulation)",
            lambda e, s: (
                f"{s.get('global_batch_size')} ({s.get('micro_batch_size')} × {s.get('world_size')} × "
                f"{s.get('gradient_accumulation_steps')})"
            ),
        ),
        ("final train loss", lambda e, s: fmt(e["final_train_loss"])),
        ("final validation loss", lambda e, s: fmt(e["final_val_loss"])),
        ("tokens/s per rank", lambda e, s: fmt(e["tokens_per_s_per_gpu"])),
        ("loss tokens/s per rank", lambda e, s: fmt(e["loss_tokens_per_s_per_gpu"])),
        ("MFU", lambda e, s: fmt(e["mfu"], 3)),
        ("peak memory, max over ranks (GiB)", lambda e, s: fmt(e["peak_memory_gib"], 3)),
        ("wall time", lambda e, s: fmt_duration(e["train_wall_time_s"])),
    ]
    rows = [
        [label] + [get(summary["experiments"][exp.name], exp.summary) for exp in experiments]
        for label, get in metrics
    ]
    return [
        Heading(2, "Training"),
        Para(
            "Throughput counts the tokens each rank processed (pads excluded) after two warm-up steps; "
            "loss tokens are those that carry a loss. MFU needs a known peak for the device (none on CPU); "
            "peak memory is allocated accelerator memory on GPUs and the peak resident set size on CPU.",
            muted=True,
        ),
        Table(["", *[exp.name for exp in experiments]], rows),
        FigureRow(
            [
                Figure(
                    plot_paths["loss_vs_step"],
                    "Train and validation loss per optimizer step (base model's validation loss at step 0).",
                ),
                Figure(
                    plot_paths["loss_vs_tokens"],
                    "The same against tokens seen (global batch × max_length per step).",
                ),
            ]
        ),
        FigureRow(
            [
                Figure(
                    plot_paths["learning_rate"], "Learning rate schedule and gradient norm before clipping."
                ),
                Figure(
                    plot_paths["throughput"],
                    "Tokens per second per rank: all tokens and loss-bearing tokens.",
                ),
            ]
        ),
        FigureRow([Figure(plot_paths["memory"], "Peak memory of every rank.")]),
    ]


def _visible(text: str) -> str:
    """Control characters (a random model emits them) as escapes, so a cell shows what was generated."""
    return "".join(c if c in "\n\t" or unicodedata.category(c) != "Cc" else f"\\x{ord(c):02x}" for c in text)


def _mark(text: str, expected: str | None) -> Cell:
    if expected is None:
        return Cell(_visible(text) or "(empty)", "mono")
    ok = text.strip() == expected.strip()
    return Cell(("✓ " if ok else "✗ ") + (_visible(text) or "(empty)"), "mono ok" if ok else "mono bad")


def evaluation_section(experiments: list[Experiment], summary: dict) -> list[Block]:
    blocks: list[Block] = [
        Heading(2, "Evaluation"),
        Para(
            "The base model is the starting point of training (for builtin models the exact random init the "
            "train stage starts from); the fine-tuned model is the one training saved. Validation loss is the "
            "token-weighted mean over the validation split's loss-bearing tokens, masked as in training; "
            "replies are greedy and end at the end-of-sequence token.",
            muted=True,
        ),
    ]
    several = len(experiments) > 1
    for exp in experiments:
        e, ev = summary["experiments"][exp.name], exp.eval
        if several:
            blocks.append(Heading(3, f"Experiment {exp.name}"))
        verb = "fell" if e["val_loss_change_pct"] < 0 else "rose"
        blocks.append(
            Para(
                f"Validation loss {verb} from **{fmt(e['base_val_loss'])}** to **{fmt(e['tuned_val_loss'])}** "
                f"({fmt_pct(e['val_loss_change_pct'], signed=True)}) over {fmt(ev['validation']['loss_tokens'])} "
                f"target tokens in {fmt(ev['validation']['rows'])} rows; evaluated on {ev.get('device')} in "
                f"{ev.get('dtype')}. Base model: {ev.get('base_model')}."
            )
        )
        rows = [
            [
                "validation loss",
                fmt(e["base_val_loss"]),
                fmt(e["tuned_val_loss"]),
                _change(e["base_val_loss"], e["tuned_val_loss"]),
            ],
            [
                "perplexity",
                fmt(e["base_perplexity"]),
                fmt(e["tuned_perplexity"]),
                _change(e["base_perplexity"], e["tuned_perplexity"]),
            ],
        ]
        em = ev.get("exact_match")
        if em:
            rows.append(
                [
                    f"exact match ({em['n']} questions)",
                    _acc(em["base"]["accuracy"]),
                    _acc(em["tuned"]["accuracy"]),
                    fmt_pct(100 * (em["tuned"]["accuracy"] - em["base"]["accuracy"]), signed=True).replace(
                        "%", " pts"
                    ),
                ]
            )
        dpo = ev["validation"].get("dpo")
        if dpo is not None:  # the preference-tuned model beside them
            rows[0].append(fmt(dpo["loss"]))
            rows[1].append(fmt(dpo["perplexity"]))
        if em and "dpo" in em:
            rows[2].append(_acc(em["dpo"]["accuracy"]))
        blocks.append(
            Table(["", "base", "fine-tuned", "change"] + (["DPO"] if dpo is not None else []), rows)
        )
        if em:
            tables = []
            for field, title in (("by_task", "task"), ("by_lang", "language")):
                groups = em["tuned"][field]
                tables.append(
                    Table(
                        [f"exact match by {title}", "questions", "base", "fine-tuned"],
                        [
                            [
                                f"`{k}`",
                                fmt(v["n"]),
                                _acc(em["base"][field][k]["accuracy"]),
                                _acc(v["accuracy"]),
                            ]
                            for k, v in groups.items()
                        ],
                    )
                )
            blocks.append(Columns(tables))
            misses = [x for x in em.get("examples", []) if x["tuned"].strip() != x["answer"].strip()]
            if misses:
                blocks.append(
                    Para(
                        f"Questions the fine-tuned model got wrong ({len(misses)}; first {min(len(misses), MAX_MISSES_SHOWN)} shown):"
                    )
                )
                blocks.append(
                    Table(
                        ["prompt", "expected", "fine-tuned reply"],
                        [
                            [
                                Cell(x["prompt"], "mono"),
                                Cell(x["answer"], "mono"),
                                Cell(_visible(x["tuned"]) or "(empty)", "mono"),
                            ]
                            for x in misses[:MAX_MISSES_SHOWN]
                        ],
                        numeric=[False, False, False],
                    )
                )
        blocks.append(
            Para(
                f"Sample generations (greedy, at most {ev['generation']['max_new_tokens']} new tokens; "
                "✓/✗ where the builtin dataset knows the answer):"
            )
        )
        with_dpo = any("dpo" in g for g in exp.generations)
        # Builtin answers are exact (✓/✗); the data's own replies (auto prompts) are a reference, not a key.
        checked = ev["generation"].get("expected", "exact") == "exact"
        blocks.append(
            Table(
                ["prompt", "expected", "base", "fine-tuned"] + (["DPO"] if with_dpo else []),
                [
                    [
                        Cell(_visible(g["prompt"]), "mono"),
                        Cell(_visible(g.get("expected") or "–"), "mono"),
                        *[
                            _mark(g[w], g.get("expected") if checked else None)
                            for w in ("base", "tuned", "dpo")
                            if w in g
                        ],
                    ]
                    for g in exp.generations
                ],
                numeric=[False] * (5 if with_dpo else 4),
            )
        )
    return blocks


def comparison_section(experiments: list[Experiment], summary: dict) -> list[Block]:
    if len(experiments) < 2:
        return []
    rows = []
    for exp in experiments:
        e = summary["experiments"][exp.name]
        rows.append(
            [
                f"**{exp.name}**",
                f"`{e['model']}`"
                + (f" ({training_mode(e)})" if training_mode(e) != "full fine-tuning" else ""),
                fmt(e["steps"]),
                fmt(e["tuned_val_loss"]),
                fmt_pct(e["val_loss_change_pct"], signed=True),
                fmt(e["tuned_perplexity"]),
                _acc(e["tuned_accuracy"]),
                fmt(e["tokens_per_s_per_gpu"]),
                fmt(e["mfu"], 3),
                fmt(e["peak_memory_gib"], 3),
                fmt_duration(e["train_wall_time_s"]),
            ]
        )
    return [
        Heading(2, "Comparison"),
        Table(
            [
                "experiment",
                "model",
                "steps",
                "val loss",
                "vs base",
                "perplexity",
                "exact match",
                "tok/s per rank",
                "MFU",
                "peak GiB",
                "train time",
            ],
            rows,
            numeric=[False, False] + [True] * 9,
        ),
    ]
