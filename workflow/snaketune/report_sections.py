"""The report's sections as blocks (snaketune.report_render): summary, data, training, evaluation,
comparison and provenance. Each function turns loaded inputs into headings, paragraphs, tables and figures;
nothing here reads files except the plots it is handed."""

from __future__ import annotations

import json
import unicodedata
from pathlib import Path
from typing import TYPE_CHECKING

from snaketune.report_render import (
    Block,
    Cards,
    Cell,
    Code,
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
    from snaketune.report import Experiment

MAX_MISSES_SHOWN = 8
"""Wrong exact-match replies listed per experiment."""


# ---- sections ----------------------------------------------------------------------------------


def _change(base: float, tuned: float) -> str:
    return fmt_pct(100.0 * (tuned - base) / base, signed=True) if base else "–"


def _acc(x: float | None) -> str:
    return fmt_pct(100.0 * x) if x is not None else "–"


def training_mode(e: dict) -> str:
    """How an experiment trained: full fine-tuning, LoRA or QLoRA, and 8-bit Adam states where used."""
    mode = "full fine-tuning"
    if e["lora"]:
        mode = "QLoRA, 4-bit NF4 base" if e.get("lora_quantize", "none") != "none" else "LoRA"
    if e.get("optimizer_states") == "8bit":
        mode += ", 8-bit Adam states"
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
                + (f" ({training_mode(e)})" if e["lora"] or e.get("optimizer_states") == "8bit" else ""),
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


def provenance_section(
    data: dict, experiments: list[Experiment], prov: dict, benchmarks: list[dict], config: dict
) -> list[Block]:
    hw = prov["hardware"]
    mem = f", {fmt(hw['memory_gib'], 3)} GiB RAM" if hw.get("memory_gib") else ""
    devices = sorted({f"{e.summary.get('world_size')} × {e.summary.get('device')}" for e in experiments})
    blocks: list[Block] = [
        Heading(2, "Provenance"),
        Table(
            ["", "value"],
            [
                ["git commit", f"`{prov['git_commit']}`"],
                ["generated", prov["generated"]],
                ["host CPU", f"{hw['cpu']} ({hw['cpu_count']} logical CPUs{mem})"],
                ["training devices", ", ".join(devices)],
                ["platform", f"{hw['platform']}, Python {hw['python']}"],
                ["remote code (`model.trust_remote_code`)", remote_code_line(experiments)],
            ]
            + [[f"`{name}`", version] for name, version in prov["versions"].items()],
            numeric=[False, False],
        ),
        Heading(3, "Seeds"),
        Table(["seed", "value"], [[k, str(v)] for k, v in prov["seeds"].items()]),
        Heading(3, "Input hashes"),
    ]
    hashes = [[f"`data/raw/{name}`", f"`{digest}`"] for name, digest in data["sha256sums"].items()]
    done = set()
    for exp in experiments:
        if exp.data_key in done:
            continue
        done.add(exp.data_key)
        tok = exp.tokenized
        hashes += [
            [f"`conversations/{s}.parquet`", f"`{d}`"]
            for s, d in sorted(tok.get("conversation_files_sha256", {}).items())
        ]
        hashes += [
            [f"tokenizer `{n}`", f"`{d}`"] for n, d in sorted(tok.get("tokenizer_files_sha256", {}).items())
        ]
        if tok.get("chat_template_sha256"):
            hashes.append(["chat template", f"`{tok['chat_template_sha256']}`"])
    blocks.append(Table(["file", "sha256"], hashes, numeric=[False, False]))
    blocks.append(
        Table(
            ["experiment", "tokenized cache", "run key (checkpoint directory)"],
            [[exp.name, f"`{exp.data_key}`", f"`{exp.summary.get('run_key')}`"] for exp in experiments],
            numeric=[False, False, False],
        )
    )
    blocks += jobs_blocks(prov)
    blocks.append(Heading(3, "Wall time per job"))
    if benchmarks:
        total = sum(b["wall_s"] or 0 for b in benchmarks)
        rows = [
            [f"`{b['job']}`", fmt_duration(b["wall_s"]), fmt(b["max_rss_mib"]), fmt_duration(b["cpu_time_s"])]
            for b in benchmarks
        ]
        rows.append(["**total**", f"**{fmt_duration(total)}**", "", ""])
        blocks.append(Table(["job (benchmarks/…)", "wall time", "max RSS (MiB)", "CPU time"], rows))
    else:
        blocks.append(Para("No benchmark files were found.", muted=True))
    blocks.append(Heading(3, "Configuration"))
    blocks.append(
        Code(
            json.dumps(config, indent=2, sort_keys=False),
            "json",
            summary="The configuration as resolved (defaults filled in, experiment overrides merged)",
        )
    )
    return blocks


def remote_code_allowed(exp: Experiment) -> bool:
    """model.trust_remote_code as the stages used it (from the resolved config, where it defaults to False)."""
    return exp.config.get("model", {}).get("trust_remote_code") is True


def remote_code_line(experiments: list[Experiment]) -> str:
    """Whether any experiment let a hub model or tokenizer run code of its own."""
    allowed = [e.name for e in experiments if remote_code_allowed(e)]
    if not allowed:
        return "not allowed (off for every experiment)"
    return "**allowed** for " + ", ".join(f"`{name}`" for name in allowed) + " (the config turned it on)"


def jobs_blocks(prov: dict) -> list[Block]:
    """The jobs of the provenance manifest: when, where and with which code each ran."""
    if not prov.get("manifest"):
        return []
    blocks: list[Block] = [
        Heading(3, "Jobs"),
        Para(
            f"From `{prov['manifest']}`; each job's record (input and output hashes, params, package versions, "
            "host, GPUs, times, commit) is the file named in the last column."
        ),
    ]
    rows = [
        [
            f"`{j['job']}`",
            j["start"].replace("T", " ").removesuffix("Z")[:19],
            fmt_duration(j["wall_s"]),
            j["host"],
            ", ".join(j["gpus"]) or "none",
            f"`{j['code']}`" if j["code"] else "–",
            j["status"] if j["status"] == "ok" else f"**{j['status']}**",
            f"`{j['record']}`",
        ]
        for j in prov["jobs"]
    ]
    blocks.append(
        Table(
            ["job", "started (UTC)", "wall time", "host", "GPUs", "code", "outputs", "record"],
            rows,
            numeric=[False, False, True, False, False, False, False, False],
        )
    )
    notes = []
    if len(prov.get("job_git", {})) > 1:
        notes.append(
            "The jobs ran at different commits: "
            + "; ".join(f"`{c}` ({', '.join(jobs)})" for c, jobs in prov["job_git"].items())
            + "."
        )
    for name, versions in prov.get("job_software", {}).items():
        notes.append(
            f"`{name}` differs between jobs: "
            + "; ".join(f"{v} ({', '.join(jobs)})" for v, jobs in versions.items())
            + "."
        )
    if any(j["status"] != "ok" for j in prov["jobs"]):
        notes.append(
            "**changed**: the job's outputs no longer have the files and sizes its record describes."
        )
    if prov.get("jobs_without_record"):
        notes.append(
            "No provenance record for "
            + ", ".join(f"`{p}`" for p in prov["jobs_without_record"])
            + " (made before records existed, or the record could not be written: see the job's log)."
        )
    blocks += [Para(n) for n in notes]
    return blocks


def short_commit(commit: str) -> str:
    head = commit.split(" ", 1)
    if len(head[0]) == 40 and all(c in "0123456789abcdef" for c in head[0]):
        return f"commit `{head[0][:12]}`" + (" (uncommitted changes)" if len(head) > 1 else "")
    return commit
