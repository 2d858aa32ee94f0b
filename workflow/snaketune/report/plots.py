"""The report's PNG plots (matplotlib, Agg backend): one figure per question, every experiment overlaid."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # no display: the report is built by a batch job

import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import EngFormatter, FuncFormatter  # noqa: E402

COLORS = ("#0969da", "#cf222e", "#1a7f37", "#8250df", "#bc4c00", "#1b7c83", "#6e7781", "#bf3989")
PIXEL_RATIO = 2
"""PNG pixels per CSS pixel: sharp on 2x screens. The HTML shows each plot at its size in inches x 96 CSS pixels
(its pHYs resolution, snaketune.report.render.png_css_size), so it is never upscaled."""
STYLE = {
    "figure.dpi": 100,
    "savefig.dpi": 96 * PIXEL_RATIO,
    "font.size": 9.5,
    "axes.titlesize": 11,
    "axes.titleweight": "bold",
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "grid.linewidth": 0.6,
    "legend.frameon": False,
    "legend.fontsize": 8.5,
}
SIZE = (5.4, 3.3)
"""Inches: 518 x 317 CSS pixels, half the report's 1,056-pixel column, so two plots sit side by side."""


def series(rows: Sequence[dict], x: str, y: str) -> tuple[list[float], list[float]]:
    """(xs, ys) of the metrics rows (metrics.csv) that have both `x` and `y`: a metric logged at some steps only
    (validation) plots at those."""
    pairs = [(r[x], r[y]) for r in rows if r.get(x) is not None and r.get(y) is not None]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def save_png(fig, path: Path) -> None:
    """The figure as `path` (a PNG whose bytes depend only on the data), closed."""
    fig.tight_layout()
    # No "Software" text chunk: the bytes then depend on the data, not on the matplotlib build.
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def mark_empty(ax, text: str) -> None:
    """An axes without data: `text` in its middle, no ticks."""
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="#59636e")
    ax.set_xticks([])
    ax.set_yticks([])


def loss_plot(
    runs: dict[str, list[dict]], base_loss: dict[str, float | None], path: Path, *, x: str, xlabel: str
) -> None:
    """Train loss (lines) and validation loss (dashed, markers) against `x`; the base model's validation
    loss is drawn at x = 0 (hollow marker), where training starts from it."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=SIZE)
        for i, (name, rows) in enumerate(runs.items()):
            color = COLORS[i % len(COLORS)]
            xs, ys = series(rows, x, "train/loss")
            ax.plot(xs, ys, color=color, lw=1.6, label=f"{name}: train")
            vx, vy = series(rows, x, "val/loss")
            if base_loss.get(name) is not None:
                ax.plot([0], [base_loss[name]], "o", mfc="white", mec=color, ms=6)
                vx, vy = [0.0, *vx], [base_loss[name], *vy]
            ax.plot(vx, vy, "--o", color=color, lw=1.2, ms=4, label=f"{name}: validation")
        ax.set_yscale("log")
        # Plain numbers on the log axis (0.1, 0.2, 0.5, 1, 2, 5), not 2 x 10^-1.
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(
            FuncFormatter(
                lambda v, _: f"{v:g}" if round(v / 10 ** math.floor(math.log10(v))) in (2, 5) else ""
            )
        )
        ax.set_xlabel(xlabel)
        ax.set_ylabel("loss (nats per target token, log scale)")
        if x == "train/tokens_seen":
            ax.xaxis.set_major_formatter(EngFormatter(sep=""))
        ax.set_title(f"Loss vs {xlabel.split(' (')[0]}")
        ax.legend()
        save_png(fig, path)


def optimizer_plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Learning rate and gradient norm (before clipping) per optimizer step."""
    with plt.rc_context(STYLE):
        fig, (ax_lr, ax_gn) = plt.subplots(1, 2, figsize=(SIZE[0], SIZE[1]))
        for i, (name, rows) in enumerate(runs.items()):
            color = COLORS[i % len(COLORS)]
            ax_lr.plot(*series(rows, "step", "train/lr"), color=color, lw=1.6, label=name)
            ax_gn.plot(*series(rows, "step", "train/grad_norm"), color=color, lw=1.4, label=name)
        ax_lr.set_title("Learning rate")
        ax_lr.set_ylabel("learning rate")
        ax_lr.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))  # 0.003, not EngFormatter's 3m
        ax_gn.set_title("Gradient norm")
        ax_gn.set_ylabel("global L2 norm, before clipping")
        for ax in (ax_lr, ax_gn):
            ax.set_xlabel("optimizer step")
        if len(runs) > 1:
            ax_lr.legend()
        save_png(fig, path)


def throughput_plot(runs: dict[str, list[dict]], path: Path) -> None:
    """Tokens/s per rank (all tokens solid, loss-bearing tokens dashed) and MFU where the device has a peak."""
    has_mfu = any(r.get("perf/mfu") is not None for rows in runs.values() for r in rows)
    with plt.rc_context(STYLE):
        if has_mfu:
            fig, (ax, ax_mfu) = plt.subplots(1, 2, figsize=SIZE)
        else:
            fig, ax = plt.subplots(figsize=SIZE)
        for i, (name, rows) in enumerate(runs.items()):
            color = COLORS[i % len(COLORS)]
            ax.plot(
                *series(rows, "step", "perf/tokens_per_s_per_gpu"),
                color=color,
                lw=1.6,
                label=f"{name}: all tokens",
            )
            ax.plot(
                *series(rows, "step", "perf/loss_tokens_per_s_per_gpu"),
                "--",
                color=color,
                lw=1.2,
                label=f"{name}: loss tokens",
            )
            if has_mfu:
                ax_mfu.plot(*series(rows, "step", "perf/mfu"), color=color, lw=1.6, label=name)
        ax.set_title("Throughput per rank")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("tokens/s")
        ax.yaxis.set_major_formatter(EngFormatter(sep=""))
        ax.set_ylim(bottom=0)
        ax.legend()
        if has_mfu:
            ax_mfu.set_title("Model FLOPs utilization")
            ax_mfu.set_xlabel("optimizer step")
            ax_mfu.set_ylabel("MFU (share of peak)")
            ax_mfu.set_ylim(bottom=0)
        save_png(fig, path)


def memory_plot(per_rank: dict[str, list[float]], devices: dict[str, str], path: Path) -> None:
    """Peak memory per rank: allocated accelerator memory on GPUs, peak resident set size on CPU."""
    with plt.rc_context(STYLE):
        fig, ax = plt.subplots(figsize=SIZE)
        if not any(per_rank.values()):
            mark_empty(ax, "no memory figures recorded")
        else:
            n = len(per_rank)
            width = 0.8 / n
            for i, (name, values) in enumerate(per_rank.items()):
                xs = [r + (i - (n - 1) / 2) * width for r in range(len(values))]
                bars = ax.bar(xs, values, width=width * 0.92, color=COLORS[i % len(COLORS)], label=name)
                ax.bar_label(bars, labels=[f"{v:.3g}" for v in values], fontsize=8, padding=2)
            ranks = max(len(v) for v in per_rank.values())
            ax.set_xticks(range(ranks), [f"rank {r}" for r in range(ranks)])
            ax.set_xlabel("rank (process)")
            ax.grid(axis="x", visible=False)
            kinds = {("RSS (CPU)" if d == "cpu" else "allocated") for d in devices.values()}
            ax.set_ylabel(f"peak memory, GiB ({', '.join(sorted(kinds))})")
            ax.margins(y=0.25)
            if n > 1:
                ax.legend(loc="upper right", ncols=n)
        ax.set_title("Peak memory per rank")
        save_png(fig, path)
