"""The report's sections as blocks (snaketune.report.render): summary, data, training, evaluation,
comparison and provenance. Each function turns loaded inputs into headings, paragraphs, tables and figures;
nothing here reads files except the plots it is handed."""

from __future__ import annotations

import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from snaketune.report.headline import MODEL_NAMES, final_model, training_mode
from snaketune.report.render import (
    Block,
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


def data_section(data: dict, experiments: list[Experiment]) -> list[Block]:
    src, conv = data["source"], data["conversations"]
    splits = ", ".join(src.get("splits") or []) or "none (split by tree hash)"
    blocks: list[Block] = [
        Heading(2, "Data"),
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
        *_conversations_blocks(conv),
        Heading(3, "Tokenized"),
    ]
    seen: dict[str, list[str]] = {}
    for exp in experiments:
        seen.setdefault(exp.data_key, []).append(exp.name)
    for key, names in seen.items():
        blocks += _tokenized_blocks(key, names, next(e.tokenized for e in experiments if e.data_key == key))
    return blocks


def _conversations_blocks(conv: dict) -> list[Block]:
    """The conversations stage: counts, the conversations per split and language, the drops that occurred (the
    full counts are in conversations/stats.json)."""
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
        trees = fmt((conv.get("trees_by_split") or {}).get(split))
        turns = fmt((conv.get("turns_mean") or {}).get(split))
        rows.append([split, trees, fmt(n), turns] + [fmt(by_lang.get(lang, 0)) for lang in languages])
    header = ["split", "trees", "conversations", "mean turns"] + [f"`{lang}`" for lang in languages]
    if conv.get("format") == "chat":  # one conversation per record: no trees, no paths
        system = sum((conv.get("with_system_turn") or {}).values())
        summary = (
            f"{fmt(conv.get('rows'))} chat records ({fmt(conv.get('messages'))} messages), {fmt(conv.get('rows_kept'))} "
            f"kept, {fmt(system)} with a system turn; validation split by `{conv.get('split_source')}`."
        )
    else:
        summary = (
            f"{fmt(conv.get('trees'))} message trees, {fmt(conv.get('messages'))} messages, "
            f"{fmt(conv.get('messages_kept'))} kept; paths: `{conv.get('paths')}`; validation split by "
            f"`{conv.get('split_source')}`."
        )
    return [
        Heading(3, "Conversations"),
        Para(summary),
        Columns(
            [
                Table(header, rows),
                Table(["dropped (nonzero reasons)", "count"], dropped or [["nothing", "0"]]),
            ]
        ),
    ]


TOKENIZED_COLUMNS = [
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
]
"""The tokenized cache's table, one row per split."""


def _tokenized_blocks(key: str, names: list[str], stats: dict) -> list[Block]:
    """One tokenized cache (shared by the experiments `names`): its settings and its splits."""
    st = stats.get("settings", {})
    rows = []
    for split, v in stats["splits"].items():
        unpacked = v.get("pad_fraction_unpadded_to_max")
        packed = v.get("pad_fraction_packed")
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
                fmt_pct(100 * unpacked) if unpacked is not None else "–",
                fmt_pct(100 * packed) if packed is not None else "–",
            ]
        )
    return [
        Para(
            f"Cache `{key}` (experiments: {', '.join(names)}): max_length {st.get('max_length')}, "
            f"packing {'on' if st.get('packing') else 'off'}, "
            f"{'assistant-only' if st.get('assistant_only_loss') else 'all-token'} loss, "
            f"chat template `{st.get('chat_template')}`." + _template_check(stats.get("template_check"))
        ),
        Table(TOKENIZED_COLUMNS, rows),
    ]


def _template_check(check: dict | None) -> str:
    """What the tokenize stage proved of the chat template on every row (snaketune.data.template_check)."""
    if not check:
        return ""

    def code(text: str | None) -> str:  # on one line: a newline the template writes shows as \n
        return "`" + _visible(text or "").replace("\n", "\\n") + "`"

    tools = check.get("conversations_with_tools") or 0
    by = "the model's template" if check.get("tool_rendering") == "template" else "the project's format"
    return (
        f" Template check, before training: each of the {fmt(check.get('assistant_turns_checked'))} assistant turns "
        f"ends in a trained {code(check.get('end_of_turn'))}, and each reply starts on a token boundary "
        f"after the generation prompt {code(check.get('generation_prompt'))}, what inference appends"
        + (f"; {fmt(tools)} conversations call tools, rendered in {by}." if tools else ".")
    )


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
            "train stage starts from); SFT is the model the train stage saved, DPO the preference stage's, and the "
            "final model DPO where that stage ran, else SFT. Validation loss is the "
            "token-weighted mean over the validation split's loss-bearing tokens, masked as in training; "
            "replies are greedy and end at the end-of-sequence token.",
            muted=True,
        ),
    ]
    for exp in experiments:
        if len(experiments) > 1:
            blocks.append(Heading(3, f"Experiment {exp.name}"))
        blocks += _scores_blocks(exp)
        blocks += _generations_blocks(exp)
    return blocks


def _scores_blocks(exp: Experiment) -> list[Block]:
    """Validation loss, perplexity and exact match of each model, the final one against the base."""
    ev = exp.eval
    val, em = ev["validation"], ev.get("exact_match")
    final = final_model(exp)
    models = [m for m in MODEL_NAMES if m in val]
    change = 100.0 * (val[final]["loss"] - val["base"]["loss"]) / val["base"]["loss"]
    rows = [
        [
            "validation loss",
            *[fmt(val[m]["loss"]) for m in models],
            _change(val["base"]["loss"], val[final]["loss"]),
        ],
        [
            "perplexity",
            *[fmt(val[m]["perplexity"]) for m in models],
            _change(val["base"]["perplexity"], val[final]["perplexity"]),
        ],
    ]
    if em:
        points = fmt_pct(100 * (em[final]["accuracy"] - em["base"]["accuracy"]), signed=True).replace(
            "%", " pts"
        )
        rows.append(
            [
                f"exact match ({em['n']} questions)",
                *[_acc(em[m]["accuracy"]) if m in em else "–" for m in models],
                points,
            ]
        )
    blocks: list[Block] = [
        Para(
            f"Validation loss {'fell' if change < 0 else 'rose'} from **{fmt(val['base']['loss'])}** (base) to "
            f"**{fmt(val[final]['loss'])}** ({MODEL_NAMES[final]}, the final model; "
            f"{fmt_pct(change, signed=True)}) over {fmt(val['loss_tokens'])} target tokens in "
            f"{fmt(val['rows'])} rows; evaluated on {ev.get('device')} in {ev.get('dtype')}. Base model: "
            f"{ev.get('base_model')}."
        ),
        Table(["", *[MODEL_NAMES[m] for m in models], "change, final vs base"], rows),
    ]
    if em:
        scored = [m for m in models if m in em]
        tables = [
            Table(
                [f"exact match by {title}", "questions", *[MODEL_NAMES[m] for m in scored]],
                [
                    [f"`{k}`", fmt(v["n"]), *[_acc(em[m][field][k]["accuracy"]) for m in scored]]
                    for k, v in em[final][field].items()
                ],
            )
            for field, title in (("by_task", "task"), ("by_lang", "language"))
        ]
        blocks += [Columns(tables), *misses_blocks(em, final)]
    return blocks


def _generations_blocks(exp: Experiment) -> list[Block]:
    """Each model's greedy reply to each prompt, marked where the builtin data knows the answer."""
    ev = exp.eval
    with_dpo = any("dpo" in g for g in exp.generations)
    # Builtin answers are exact (✓/✗); the data's own replies (auto prompts) are a reference, not a key.
    checked = ev["generation"].get("expected", "exact") == "exact"
    rows = [
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
    ]
    return [
        Para(
            f"Sample generations (greedy, at most {ev['generation']['max_new_tokens']} new tokens; "
            "✓/✗ where the builtin dataset knows the answer):"
        ),
        Table(
            ["prompt", "expected", "base", "SFT"] + (["DPO"] if with_dpo else []),
            rows,
            numeric=[False] * (5 if with_dpo else 4),
        ),
    ]


def misses_blocks(em: dict, final: str) -> list[Block]:
    """The builtin questions the final model (DPO where it ran, else SFT) answered wrongly."""
    misses = [x for x in em.get("examples", []) if x.get(final, "").strip() != x["answer"].strip()]
    if not misses:
        return []
    name = MODEL_NAMES[final]
    return [
        Para(
            f"Questions the final ({name}) model got wrong ({len(misses)} of {len(em.get('examples', []))}; first "
            f"{min(len(misses), MAX_MISSES_SHOWN)} shown):"
        ),
        Table(
            ["prompt", "expected", f"{name} reply"],
            [
                [
                    Cell(x["prompt"], "mono"),
                    Cell(x["answer"], "mono"),
                    Cell(_visible(x.get(final, "")) or "(empty)", "mono"),
                ]
                for x in misses[:MAX_MISSES_SHOWN]
            ],
            numeric=[False, False, False],
        ),
    ]


def _final_figure(e: dict, key: str) -> float | None:
    """A headline figure of an experiment's final model (summary.json's entry), None where it has none."""
    return e["headline"].get(key, {}).get("values", {}).get(e["final_model"])


def comparison_section(experiments: list[Experiment], summary: dict) -> list[Block]:
    """The experiments side by side: each final model's figures (as on the first screen), then SFT's costs."""
    if len(experiments) < 2:
        return []
    rows = []
    for exp in experiments:
        e = summary["experiments"][exp.name]
        final = e["final_model"]
        rows.append(
            [
                f"**{exp.name}**",
                f"`{e['model']}`"
                + (f" ({training_mode(e)})" if training_mode(e) != "full fine-tuning" else ""),
                MODEL_NAMES[final],
                fmt(e["steps"]),
                fmt(_final_figure(e, "val_loss")),
                _change(e["base_val_loss"], e["headline"]["val_loss"]["values"][final]),
                _acc(_final_figure(e, "exact_match")),
                _acc(_final_figure(e, "preference_accuracy")),
                fmt(e["tokens_per_s_per_gpu"]),
                fmt(e["mfu"], 3),
                fmt(e["peak_memory_gib"], 3),
                fmt_duration(e["train_wall_time_s"]),
            ]
        )
    return [
        Heading(2, "Comparison"),
        Para(
            "Each experiment's final model (DPO where the preference stage ran, else SFT); throughput, memory and "
            "time are the SFT stage's.",
            muted=True,
        ),
        Table(
            [
                "experiment",
                "model",
                "final",
                "SFT steps",
                "val loss",
                "vs base",
                "exact match",
                "preference accuracy",
                "tok/s per rank",
                "MFU",
                "peak GiB",
                "train time",
            ],
            rows,
            numeric=[False, False, False] + [True] * 9,
        ),
    ]
