"""What serves the exported GGUF files: beside them, an Ollama Modelfile per file (FROM, TEMPLATE, stop tokens,
PARAMETER lines), serve.sh (llama.cpp's OpenAI-compatible server from llama-cpp-python) and a README.md with the
commands.

Ollama's TEMPLATE is a Go template, the model's chat template Jinja. The template is translated through what it
renders, not its source: rendered on conversations whose messages are marker strings, it shows what comes before
and after each role's message, what a conversation starts with (bos, which the runtime adds itself, left out), what
a first message that is not a system prompt gets before it (a default system prompt), and the assistant's opening
when a reply is asked for. `render_turns` renders a conversation the way the Go template does, and
tests/test_benchmark_serve.py checks it against the Jinja template. A template that renders a turn differently
depending on what follows (so that no fixed text surrounds each message) gets no TEMPLATE line: Ollama then reads
the chat template stored in the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

from snaketune.data.chat import TemplateError, end_of_turn

MARK = "\u241e{}\u241e"  # ␞ (symbol for record separator): no template writes it
ROLES = ("system", "user", "assistant")
MAX_NUM_CTX = 4096
"""Ollama's context per request (num_ctx) is the model's, up to this: memory grows with it."""


@dataclass(frozen=True)
class TurnFormat:
    """The fixed text around each role's message in a chat template."""

    start: str
    """Before the first message (bos removed)."""
    first_extra: str
    """Before a first message that is not a system prompt (a template's default system prompt)."""
    around: dict[str, tuple[str, str]]
    """Role -> (prefix, suffix) of its message; no system entry if the template refuses system prompts."""
    generation: str
    """The assistant's opening when a reply is asked for (add_generation_prompt)."""


BOS_MARK = MARK.format("bos")


def _render(tokenizer, messages: list[dict], generation: bool = False) -> str:
    """The template's text with bos written as BOS_MARK: a bos the template writes is told from the same text."""
    return tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, bos_token=BOS_MARK
    )


def _split(text: str, mark: str) -> tuple[str, str]:
    if text.count(mark) != 1:
        raise ValueError(f"the message appears {text.count(mark)} times in the rendered turn")
    before, after = text.split(mark)
    return before, after


def _after(longer: str, prefix: str) -> str:
    if not longer.startswith(prefix):
        raise ValueError("a turn changes how the turns before it render")
    return longer[len(prefix) :]


def turn_format(tokenizer) -> TurnFormat:
    """The tokenizer's chat template as fixed text around each message; ValueError where it is not that."""
    u1, a1, u2, s1 = (MARK.format(n) for n in ("u1", "a1", "u2", "s1"))
    one = _render(tokenizer, [{"role": "user", "content": u1}])
    two = _render(tokenizer, [{"role": "user", "content": u1}, {"role": "assistant", "content": a1}])
    three = _render(
        tokenizer,
        [
            {"role": "user", "content": u1},
            {"role": "assistant", "content": a1},
            {"role": "user", "content": u2},
        ],
    )
    user = _split(_after(three, two), u2)
    assistant = _split(_after(two, one), a1)
    head = _split(one, u1)[0]
    if not head.endswith(user[0]) or not one.endswith(u1 + user[1]):
        raise ValueError("the first user message renders differently from later ones")
    head = head[: len(head) - len(user[0])]  # start + first_extra
    around = {"user": user, "assistant": assistant}
    start = head
    try:
        with_system = _render(tokenizer, [{"role": "system", "content": s1}, {"role": "user", "content": u1}])
    except Exception:  # noqa: BLE001 - jinja's raise_exception: the template refuses system prompts
        with_system = None
    if with_system is not None and s1 in with_system:
        before, rest = _split(with_system, s1)
        tail = rest[: len(rest) - len(user[0] + u1 + user[1])]
        if not rest.endswith(user[0] + u1 + user[1]):
            raise ValueError("a system prompt changes how the user's message renders")
        # What a system message starts with is the text both conversations share before their first message.
        common = os.path.commonprefix([head, before])
        start, around["system"] = common, (before[len(common) :], tail)
    generation = _after(_render(tokenizer, [{"role": "user", "content": u1}], True), one)
    # A bos the template writes first is the one the runtime adds (llama.cpp, with the file's add_bos); anywhere
    # else it is text of the template's own.
    bos = getattr(tokenizer, "bos_token", None) or ""
    text = {
        "start": start.removeprefix(BOS_MARK),
        "first_extra": head[len(start) :],
        "generation": generation,
    }
    text = {k: v.replace(BOS_MARK, bos) for k, v in text.items()}
    around = {r: (p.replace(BOS_MARK, bos), q.replace(BOS_MARK, bos)) for r, (p, q) in around.items()}
    return TurnFormat(around=around, **text)


def render_turns(fmt: TurnFormat, messages: list[dict]) -> str:
    """A conversation as the Go template of `go_template` renders it (Ollama: a reply is asked for after a message
    that is not the assistant's; a last assistant message is continued, without its suffix)."""
    out = fmt.start
    for i, m in enumerate(messages):
        last = i == len(messages) - 1
        if i == 0 and m["role"] != "system":
            out += fmt.first_extra
        prefix, suffix = fmt.around[m["role"]]
        out += prefix + m["content"] + ("" if last and m["role"] == "assistant" else suffix)
        if last and m["role"] != "assistant":
            out += fmt.generation
    return out


def _lit(text: str) -> str:
    """Text as a Go template string constant (inside an action, so that no {{- trims it)."""
    return "{{ " + json.dumps(text, ensure_ascii=False) + " }}" if text else ""


def go_template(fmt: TurnFormat) -> str:
    branches = [
        f'{"if" if i == 0 else "else if"} eq .Role "{role}" }}}}{_lit(fmt.around[role][0])}{{{{ .Content }}}}'
        + (
            f"{{{{ if not $last }}}}{_lit(fmt.around[role][1])}{{{{ end }}}}"
            if role == "assistant"
            else _lit(fmt.around[role][1])
        )
        for i, role in enumerate(r for r in ROLES if r in fmt.around)
    ]
    lines = [
        _lit(fmt.start) + "{{- range $i, $_ := .Messages }}",
        "{{- $last := eq (len (slice $.Messages $i)) 1 }}",
        *(
            [f'{{{{- if and (eq $i 0) (ne .Role "system") }}}}{_lit(fmt.first_extra)}{{{{ end }}}}']
            if fmt.first_extra
            else []
        ),
        *(f"{{{{- {b}" for b in branches),
        "{{- end }}",
        f'{{{{- if and $last (ne .Role "assistant") }}}}{_lit(fmt.generation)}{{{{ end }}}}',
        "{{- end }}",
    ]
    return "\n".join(lines)


def stop_strings(tokenizer, fmt: TurnFormat | None) -> list[str]:
    """Where a reply ends: the end-of-turn token the template writes (Gemma's `<end_of_turn>` is not its eos) and
    eos, and the opening of the next user turn (in case the model writes it instead). snaketune.export.parity
    checks that every Modelfile has the first two."""
    stops = [tokenizer.eos_token] if tokenizer.eos_token else []
    # Without an end-of-turn token the tokenize stage refused the template (parity does too).
    with contextlib.suppress(TemplateError):
        stops.insert(0, tokenizer.convert_ids_to_tokens(end_of_turn(tokenizer)))
    opening = fmt.around["user"][0].strip() if fmt else ""
    return list(dict.fromkeys(stops + ([opening] if opening else [])))


def modelfile(gguf_name: str, tokenizer, num_ctx: int) -> str:
    try:
        fmt = turn_format(tokenizer)
    except ValueError as e:
        fmt, why = None, str(e)
    lines = [
        f"# Ollama: ollama create {Path(gguf_name).stem} -f {Path(gguf_name).stem}.Modelfile && ollama run {Path(gguf_name).stem}",
        f"FROM ./{gguf_name}",
    ]
    if fmt is None:
        lines.append(f"# No TEMPLATE: Ollama reads the chat template stored in the file ({why}).")
    else:
        lines.append(f'TEMPLATE """{go_template(fmt)}"""')
    lines += [f"PARAMETER stop {json.dumps(s, ensure_ascii=False)}" for s in stop_strings(tokenizer, fmt)]
    lines += [
        "# Greedy, as the report's replies and the benchmark's generation tasks.",
        "PARAMETER temperature 0",
        f"PARAMETER num_ctx {num_ctx}",
    ]
    return "\n".join(lines) + "\n"


SERVE_SH = """#!/bin/sh
# Serve one of this directory's GGUF files with llama.cpp's OpenAI-compatible server (llama-cpp-python {version}, the
# runtime the export stage measured the files with):
#   ./serve.sh [type] [port]     e.g. ./serve.sh {default} 8000
# Its /v1/chat/completions applies the chat template stored in the file; README.md shows a client.
# The Python it runs: $PYTHON when set, else the one the export stage ran (recorded below, so no environment has to
# be active), else python3 from PATH; it needs `pip install 'llama-cpp-python[server]=={version}'`.
set -eu
type=${{1:-{default}}}
port=${{2:-8000}}
dir=$(cd "$(dirname "$0")" && pwd)
recorded={python}
model="$dir/{name}-$type.gguf"
if [ ! -f "$model" ]; then
  echo "serve.sh: no file {name}-$type.gguf in $dir; types here: {types}" >&2
  exit 2
fi
python=${{PYTHON:-}}
if [ -z "$python" ]; then
  if [ -x "$recorded" ]; then python=$recorded; else python=$(command -v python3 || true); fi
fi
if [ -z "$python" ]; then
  echo "serve.sh: no Python: the export stage's ($recorded) is gone and python3 is not on PATH." >&2
elif ! "$python" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("llama_cpp") is None)' 2>/dev/null; then
  echo "serve.sh: $python has no llama-cpp-python (the export stage ran $recorded)." >&2
  python=
fi
if [ -z "$python" ]; then
  echo "Set PYTHON=/path/to/python, or install the server: pip install 'llama-cpp-python[server]=={version}'" >&2
  exit 2
fi
exec "$python" -m llama_cpp.server --model "$model" --host "${{HOST:-127.0.0.1}}" --port "$port" --n_ctx {num_ctx}
"""

README = """# {name}: GGUF files

{files}

Serve one with llama.cpp's OpenAI-compatible server and talk to it with any OpenAI client:

```sh
./serve.sh {default} 8000                                   # llama-cpp-python {version} (the runtime measured here)
llama-server -m {name}-{default}.gguf --jinja --port 8000   # or llama.cpp's own server
```

```python
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
reply = client.chat.completions.create(
    model="{name}", messages=[{{"role": "user", "content": "Hello!"}}], temperature=0
)
print(reply.choices[0].message.content)
```

With Ollama: `ollama create {name}-{default} -f {name}-{default}.Modelfile && ollama run {name}-{default}` (each file
has its Modelfile: the chat template as Ollama's TEMPLATE, the stop strings, greedy decoding).
"""


def write_serving_files(
    out_dir: str | Path,
    name: str,
    types: list[str],
    tokenizer,
    *,
    model_dir: str | Path,
    version: str,
    python: str | None = None,
) -> list[Path]:
    """`<name>-<type>.Modelfile` for each type, serve.sh and README.md in `out_dir`; the default type served is the
    last (the smallest quant). The context is the model's (config.json's max_position_embeddings), up to
    MAX_NUM_CTX. serve.sh runs `python` (default: this process's interpreter, which has llama-cpp-python: the export
    measured the files with it) by its absolute path, so it serves from a plain shell."""
    out_dir = Path(out_dir)
    config = json.loads((Path(model_dir) / "config.json").read_text())
    num_ctx = min(int(config.get("max_position_embeddings") or MAX_NUM_CTX), MAX_NUM_CTX)
    written = []
    for kind in types:
        path = out_dir / f"{name}-{kind}.Modelfile"
        path.write_text(modelfile(f"{name}-{kind}.gguf", tokenizer, num_ctx), encoding="utf-8")
        written.append(path)
    fields = {"name": name, "default": types[-1], "version": version, "num_ctx": num_ctx}
    serve = out_dir / "serve.sh"
    interpreter = shlex.quote(str(Path(python or sys.executable).absolute()))
    serve.write_text(SERVE_SH.format(**fields, python=interpreter, types=" ".join(types)), encoding="utf-8")
    serve.chmod(serve.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    files = "\n".join(f"- `{name}-{k}.gguf` (Ollama: `{name}-{k}.Modelfile`)" for k in types)
    (out_dir / "README.md").write_text(README.format(files=files, **fields), encoding="utf-8")
    return [*written, serve, out_dir / "README.md"]
