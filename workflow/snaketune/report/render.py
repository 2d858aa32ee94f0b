"""The report as a list of blocks, rendered twice: self-contained HTML (inline CSS, PNGs as data URIs, no
JavaScript) and Markdown (images referenced beside it). One structure for both keeps them in step.

Also the number formatting every table uses: thousands separators, 4 significant digits, a real minus sign.
"""

from __future__ import annotations

import base64
import html
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

# ---- numbers -------------------------------------------------------------------------------------

MISSING = "–"
"""What a table shows for a value that does not exist (e.g. MFU on CPU)."""
MINUS = "\u2212"


def fmt(x: float | int | None, sig: int = 4) -> str:
    """A number for a table: ints with thousands separators, floats to `sig` significant digits."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return MISSING
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int):
        return f"{x:,}".replace("-", MINUS)
    if x == 0:
        return "0"
    magnitude = math.floor(math.log10(abs(x)))
    if magnitude >= sig - 1:
        text = f"{round(x):,}"
    elif magnitude < -3:
        text = f"{x:.{sig - 1}e}"
    else:
        text = f"{x:,.{sig - 1 - magnitude}f}"
    return text.replace("-", MINUS)


def fmt_pct(x: float | None, digits: int = 1, signed: bool = False) -> str:
    """A percentage from a fraction or a percent value already scaled (pass the percent)."""
    if x is None:
        return MISSING
    text = f"{x:+.{digits}f}%" if signed else f"{x:.{digits}f}%"
    return text.replace("-", MINUS)


def fmt_duration(seconds: float | None) -> str:
    if seconds is None:
        return MISSING
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


# ---- blocks --------------------------------------------------------------------------------------


@dataclass
class Heading:
    level: int
    text: str
    anchor: str = ""


@dataclass
class Para:
    """A paragraph; `**bold**` and `` `code` `` are the only markup."""

    text: str
    muted: bool = False


@dataclass
class Cell:
    """A table cell with CSS classes: `num` (right-aligned figures), `mono` (generated text), `ok`/`bad`
    (a green or red bar: the reply is right or wrong)."""

    text: str
    style: str = ""


@dataclass
class Table:
    header: list[str]
    rows: list[list[str | Cell]]
    numeric: list[bool] = field(default_factory=list)
    """Which columns hold figures (right-aligned, tabular digits); default: all but the first."""

    def is_numeric(self, column: int) -> bool:
        return self.numeric[column] if self.numeric else column > 0


@dataclass
class Figure:
    path: Path
    caption: str


@dataclass
class FigureRow:
    figures: list[Figure]


@dataclass
class Code:
    text: str
    language: str = ""
    summary: str = ""
    """When set, the block is folded under this line (<details>, closed, in HTML)."""


@dataclass
class Columns:
    """Blocks side by side (stacked in Markdown and on narrow screens)."""

    blocks: list


@dataclass
class Bullets:
    """A list of short paragraphs (same markup as Para)."""

    items: list[str]


@dataclass
class Box:
    """Blocks in a framed box under a title (a bold line in Markdown)."""

    title: str
    blocks: list


Block = Heading | Para | Bullets | Table | Figure | FigureRow | Code | Columns | Box


# ---- Markdown ------------------------------------------------------------------------------------


def _md_cell(value: str | Cell) -> str:
    text = value.text if isinstance(value, Cell) else value
    return text.replace("|", "\\|").replace("\n", "<br>") or " "


def to_markdown(title: str, blocks: list[Block]) -> str:
    out = [f"# {title}", ""]
    flat: list[Block] = []
    for block in blocks:
        if isinstance(block, Box):
            flat += [Para(f"**{block.title}**"), *block.blocks]
        else:
            flat += block.blocks if isinstance(block, Columns) else [block]
    for block in flat:
        if isinstance(block, Heading):
            out += ["#" * block.level + " " + block.text, ""]
        elif isinstance(block, Para):
            out += [f"_{block.text}_" if block.muted else block.text, ""]
        elif isinstance(block, Bullets):
            out += [f"- {item}" for item in block.items] + [""]
        elif isinstance(block, Table):
            aligns = ["---:" if block.is_numeric(i) else "---" for i in range(len(block.header))]
            out.append("| " + " | ".join(_md_cell(h) for h in block.header) + " |")
            out.append("|" + "|".join(aligns) + "|")
            out += ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in block.rows]
            out.append("")
        elif isinstance(block, Figure | FigureRow):
            figures = block.figures if isinstance(block, FigureRow) else [block]
            for fig in figures:
                out += [f"![{fig.caption}]({fig.path.name})", "", f"_{fig.caption}_", ""]
        elif isinstance(block, Code):
            if block.summary:
                out += [f"{block.summary}:", ""]
            out += [f"```{block.language}", block.text.rstrip("\n"), "```", ""]
    return "\n".join(out).rstrip("\n") + "\n"


# ---- HTML ----------------------------------------------------------------------------------------

CSS = """
:root { --fg: #1f2328; --muted: #59636e; --line: #d8dee4; --alt: #f6f8fa; --accent: #0969da;
        --good: #1a7f37; --bad: #cf222e; }
* { box-sizing: border-box; }
body { margin: 0; color: var(--fg); background: #fff;
       font: 15px/1.55 -apple-system, BlinkMacSystemFont, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif; }
main { max-width: 1120px; margin: 0 auto; padding: 28px 32px 72px; }
h1 { font-size: 30px; margin: 0 0 2px; letter-spacing: -0.01em; }
h2 { font-size: 22px; margin: 44px 0 12px; padding-bottom: 6px; border-bottom: 1px solid var(--line); }
h3 { font-size: 16.5px; margin: 26px 0 8px; }
p { margin: 8px 0 12px; }
ul { margin: 6px 0 12px; padding-left: 22px; } li { margin: 2px 0; }
p.muted, .subtitle { color: var(--muted); font-size: 13.5px; }
nav.toc { margin: 14px 0 6px; font-size: 14px; }
nav.toc a { color: var(--accent); text-decoration: none; margin-right: 16px; white-space: nowrap; }
nav.toc a:hover { text-decoration: underline; }
nav.toc + h2 { margin-top: 22px; }  /* the first screen answers the question: no gap above it */
/* A table wider than the page scrolls inside its own box; the page never scrolls sideways. */
.table-wrap { max-width: 100%; overflow-x: auto; margin: 8px 0 18px; }
table { border-collapse: collapse; font-size: 13.5px; }
th, td { padding: 5px 12px; border-bottom: 1px solid var(--line); text-align: left; vertical-align: top; }
th { background: var(--alt); font-weight: 600; border-bottom: 2px solid var(--line); }
tbody tr:nth-child(even) td { background: #fbfcfd; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
td.mono { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 12.5px;
          white-space: pre-wrap; word-break: break-word; max-width: 360px; }
td.ok { box-shadow: inset 3px 0 0 var(--good); } td.bad { box-shadow: inset 3px 0 0 var(--bad); }
.figrow { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 18px; }
.cols { display: flex; flex-wrap: wrap; gap: 0 28px; align-items: flex-start; }
.cols > div { min-width: 0; max-width: 100%; }
@media (max-width: 800px) { .figrow { grid-template-columns: 1fr; } }
figure { margin: 10px 0 20px; }
/* Plots keep the size they were drawn for (width and height attributes), shrunk only to fit: never upscaled. */
figure img { max-width: 100%; height: auto; border: 1px solid var(--line); border-radius: 8px; }
figcaption { font-size: 13px; color: var(--muted); margin-top: 4px; }
code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; font-size: 0.9em;
       background: var(--alt); padding: 1px 4px; border-radius: 4px; overflow-wrap: anywhere; }
pre { background: var(--alt); border: 1px solid var(--line); border-radius: 8px; padding: 12px 14px;
      font-size: 12.5px; line-height: 1.45; overflow: auto; }
pre code { background: none; padding: 0; }
details summary { cursor: pointer; color: var(--accent); margin: 8px 0; }
.box { border: 1px solid var(--line); border-left: 4px solid var(--accent); border-radius: 8px;
       padding: 8px 16px 4px; margin: 14px 0 8px; }
.box .title { font-weight: 600; }
.box pre { margin: 6px 0; white-space: pre-wrap; overflow-wrap: anywhere; }
@media print { main { max-width: none; } .figrow { grid-template-columns: 1fr 1fr; } }
"""


def _inline(text: str) -> str:
    """Escape, then turn `**bold**` and `` `code` `` into tags."""
    out = html.escape(text, quote=False)
    out = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", out)
    return re.sub(r"`(.+?)`", r"<code>\1</code>", out)


def slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def data_uri(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode("ascii")


def _html_table(table: Table) -> str:
    head = "".join(
        f'<th class="num">{_inline(h)}</th>' if table.is_numeric(i) else f"<th>{_inline(h)}</th>"
        for i, h in enumerate(table.header)
    )
    body = []
    for row in table.rows:
        cells = []
        for i, value in enumerate(row):
            if isinstance(value, Cell):
                style, text = value.style, value.text
            else:
                style, text = ("num" if table.is_numeric(i) else ""), value
            attr = f' class="{style}"' if style else ""
            cells.append(f"<td{attr}>{_inline(text)}</td>")
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (
        f'<div class="table-wrap"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody>'
        "</table></div>"
    )


CSS_PX_PER_INCH = 96
"""CSS's reference pixel: 96 per inch (CSS Values and Units, 'px')."""


def png_css_size(path: Path) -> tuple[int, int]:
    """The size a PNG was drawn for, in CSS pixels: its pixels at the resolution its pHYs chunk records
    (matplotlib writes the savefig dpi there), so a plot drawn at 2 pixels per CSS pixel is shown at half
    its pixel width, sharp on 2x screens; its pixel size when the file records no resolution."""
    data = Path(path).read_bytes()
    width, height = struct.unpack(">II", data[16:24])  # IHDR, the first chunk
    at = data.find(b"pHYs", 8)
    if at < 0:
        return width, height
    per_metre, _, unit = struct.unpack(">IIB", data[at + 4 : at + 13])
    if unit != 1 or not per_metre:  # 1: pixels per metre; 0: an aspect ratio only
        return width, height
    dpi = per_metre * 0.0254
    return round(width * CSS_PX_PER_INCH / dpi), round(height * CSS_PX_PER_INCH / dpi)


def _html_figure(fig: Figure) -> str:
    width, height = png_css_size(fig.path)
    return (
        f'<figure><img src="{data_uri(fig.path)}" width="{width}" height="{height}" '
        f'alt="{html.escape(fig.caption)}"><figcaption>{_inline(fig.caption)}</figcaption></figure>'
    )


def to_html(title: str, subtitle: str, blocks: list[Block]) -> str:
    sections = [b for b in blocks if isinstance(b, Heading) and b.level == 2]
    toc = "".join(f'<a href="#{b.anchor or slug(b.text)}">{html.escape(b.text)}</a>' for b in sections)
    return (
        '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
        '<meta name="viewport" content="width=device-width, initial-scale=1">\n'
        f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n</head>\n<body>\n<main>\n"
        f'<h1>{html.escape(title)}</h1>\n<div class="subtitle">{_inline(subtitle)}</div>\n'
        f'<nav class="toc">{toc}</nav>\n' + _html_blocks(blocks) + "\n</main>\n</body>\n</html>\n"
    )


def _html_blocks(blocks: list[Block]) -> str:
    parts = []
    for block in blocks:
        if isinstance(block, Columns):
            parts.append(
                '<div class="cols">'
                + "".join(f"<div>{_html_blocks([b])}</div>" for b in block.blocks)
                + "</div>"
            )
        elif isinstance(block, Heading):
            anchor = block.anchor or slug(block.text)
            parts.append(f'<h{block.level} id="{anchor}">{_inline(block.text)}</h{block.level}>')
        elif isinstance(block, Para):
            parts.append(
                f'<p class="muted">{_inline(block.text)}</p>'
                if block.muted
                else f"<p>{_inline(block.text)}</p>"
            )
        elif isinstance(block, Bullets):
            parts.append("<ul>" + "".join(f"<li>{_inline(item)}</li>" for item in block.items) + "</ul>")
        elif isinstance(block, Table):
            parts.append(_html_table(block))
        elif isinstance(block, Figure):
            parts.append(_html_figure(block))
        elif isinstance(block, FigureRow):
            parts.append('<div class="figrow">' + "".join(_html_figure(f) for f in block.figures) + "</div>")
        elif isinstance(block, Code):
            pre = f"<pre><code>{html.escape(block.text)}</code></pre>"
            if block.summary:
                pre = f"<details><summary>{_inline(block.summary)}</summary>{pre}</details>"
            parts.append(pre)
        elif isinstance(block, Box):
            parts.append(
                f'<section class="box"><div class="title">{_inline(block.title)}</div>'
                f"{_html_blocks(block.blocks)}</section>"
            )
    return "\n".join(parts)
