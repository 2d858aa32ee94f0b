"""Export parity: each GGUF file, read back by llama.cpp, renders held-out conversations to the tokens training saw and
stops where training taught the model to stop; each Ollama Modelfile carries every stop token. A mismatch fails the
export stage, naming the file, the conversation and the first differing token.

Peers ship files whose template or stop token differs from training (Unsloth #3899 and #4534, LLaMA-Factory #8219 and
#6020; Ollama #8363: a Modelfile without `PARAMETER stop`), and the model then rambles or answers a prompt it never
saw. What a runtime does with a file, done here the same way: llama-cpp-python's OpenAI-compatible server (serve.sh)
renders a chat with the file's `tokenizer.chat_template` through its Jinja2ChatFormatter, with the file's bos and
eos as text, and tokenizes the text with specials and without an added bos; it stops at a token the file marks as
end of generation. Training's side is the tokenize stage's own encoder (snaketune.data.chat) on the exported
directory's tokenizer, which carries the template the data was rendered with. For each sampled conversation (tool
calls first, rendered as training rendered them: snaketune.data.tools):

- the whole conversation renders to training's tokens, one for one;
- each assistant turn's prompt with the generation prompt (what a client's request becomes) is training's tokens up
  to the turn's first trained token;
- the first end-of-generation token of each turn is the turn's end-of-turn token, the one training labelled.

One difference is not the file's: llama.cpp's pre-tokenizer merges some whitespace that the model's own tokenizer
(the Hugging Face one training used) splits. In SmolLM2's vocabulary, a space, a newline and a digit (`it. ` ending a
line before `7.`) are `Ġ`, `Ċ`, `7` to the tokenizer (GPT-2's split pattern leaves the space alone before a newline
that a digit follows) and `ĠĊ`, `7` to llama.cpp: every runtime that reads the file tokenizes that way, whatever the
export writes. Where the two token lists spell the same bytes with the same special tokens in the same order, the
difference is counted (`merges_differ`, the first one shown), not failed; a template, bos, eos or special token
that differs changes the bytes or the specials and fails as before.

Only the vocabulary is loaded (llama.cpp's vocab_only): a fraction of a second a file.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from snaketune.data.chat import (
    IGNORE_INDEX,
    chat_template_text,
    encode_conversations,
    end_of_turn,
    load_tokenizer,
    template_inputs,
)
from snaketune.data.tools import has_tool_parts
from snaketune.io import sha256_text

CONVERSATIONS = 16
"""Held-out conversations each file renders (those with tool calls first)."""


class ParityError(RuntimeError):
    """A GGUF file renders, or stops, differently from training; the message names the file and the token."""


def sample(conversations: str | Path, n: int = CONVERSATIONS) -> list[dict]:
    """Up to n held-out conversations ({conversation_id, messages, tools}), those that call tools first, each group
    in file order."""
    table = pq.read_table(conversations)
    rows = table.select(
        [c for c in ("conversation_id", "tools", "messages") if c in table.column_names]
    ).to_pylist()
    rows = [{"tools": None, **r} for r in rows]
    rows.sort(
        key=lambda r: not has_tool_parts(r["messages"], r["tools"])
    )  # stable: file order within each group
    return rows[:n]


class _File:
    """A GGUF file as llama.cpp reads it: its vocabulary, chat template and specials."""

    def __init__(self, path: Path):
        import llama_cpp
        from llama_cpp.llama_chat_format import Jinja2ChatFormatter

        self.path = path
        self.llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
        self.vocab = llama_cpp.llama_model_get_vocab(self.llm.model)
        self.template = self.llm.metadata.get("tokenizer.chat_template")
        if not self.template:
            raise ParityError(
                f"{path.name}: no chat template in the file (tokenizer.chat_template): a runtime would chat in a "
                "format the model never saw; allowed: a file that carries the training template"
            )
        eos, bos = self.llm.token_eos(), self.llm.token_bos()
        specials = {
            "eos_token": self.text(eos) if eos >= 0 else "",
            "bos_token": self.text(bos) if bos >= 0 else "",
        }
        # As llama-cpp-python's Llama builds its chat handler from the file (llama.py, chat_template.default).
        self.render = {
            prompt: Jinja2ChatFormatter(template=self.template, add_generation_prompt=prompt, **specials)
            for prompt in (False, True)
        }

    def text(self, token: int) -> str:
        import llama_cpp

        return llama_cpp.llama_vocab_get_text(self.vocab, token).decode("utf-8", errors="replace")

    def tokens(self, messages: list[dict], tools, prompt: bool) -> list[int]:
        text = self.render[prompt](messages=messages, tools=tools).prompt
        # The server's tokenization of a rendered chat (chat_formatter_to_chat_completion_handler): specials parsed,
        # no bos added, the template writes its own.
        return self.llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)

    def bytes(self, tokens: list[int]) -> bytes:
        return self.llm.detokenize(tokens, special=True)

    def is_special(self, token: int) -> bool:
        import llama_cpp

        attr = llama_cpp.llama_vocab_get_attr(self.vocab, token)
        return bool(attr & (llama_cpp.LLAMA_TOKEN_ATTR_CONTROL | llama_cpp.LLAMA_TOKEN_ATTR_USER_DEFINED))

    def is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))


def _first_difference(a, b) -> int | None:
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def _turns(labels: np.ndarray) -> list[tuple[int, int]]:
    """[start, end) of each run of trained labels: the assistant turns."""
    trained = np.concatenate([[False], labels != IGNORE_INDEX, [False]])
    edges = np.flatnonzero(trained[1:] != trained[:-1])
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


class _Check:
    """One file against training's tokens of the sampled conversations."""

    def __init__(self, file: _File, tokenizer, end_id: int):
        self.file, self.tokenizer, self.end_id = file, tokenizer, end_id
        self.merges: list[str] = []
        """Where the file's tokens spell training's bytes with other merges (module docstring), one line each."""

    def shown(self, token: int, theirs: bool) -> str:
        text = self.file.text(token) if theirs else self.tokenizer.convert_ids_to_tokens(token)
        return f"{text!r} (id {token})"

    def differ(self, what: str, got: list[int], want: list[int]) -> None:
        at = _first_difference(got, want)
        if at is None:
            return
        theirs = self.shown(got[at], True) if at < len(got) else "nothing (it ends)"
        ours = self.shown(want[at], False) if at < len(want) else "nothing (it ends)"
        special = self.file.is_special
        if self.file.bytes(got) == self.file.bytes(want) and [t for t in got if special(t)] == [
            t for t in want if special(t)
        ]:
            self.merges.append(
                f"{self.file.path.name}: {what}: token {at} is {theirs} in the file, {ours} in training"
            )
            return
        training = sha256_text(chat_template_text(self.tokenizer))[:12]
        raise ParityError(
            f"{self.file.path.name}: {what} renders differently in llama.cpp than in training: token {at} is {theirs} "
            f"in the file and {ours} in training (the file's chat template sha256 {sha256_text(self.file.template)[:12]}, "
            f"training's {training}); allowed: a file whose chat template, bos and eos render the training tokens"
        )

    def conversation(self, row: dict, ids: np.ndarray, labels: np.ndarray) -> int:
        """Check one conversation; the number of turns checked."""
        name = f"conversation {row['conversation_id']!r}"
        messages, tools = template_inputs(self.tokenizer, row["messages"], row["tools"])
        self.differ(name, self.file.tokens(messages, tools, False), ids.tolist())
        turns = _turns(labels)
        asked = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        for k, (i, (start, end)) in enumerate(zip(asked, turns, strict=True), 1):
            prompt = self.file.tokens(messages[:i], tools, True)
            self.differ(
                f"{name}, assistant turn {k} with the generation prompt", prompt, ids[:start].tolist()
            )
            eog = [p for p in range(start, end) if self.file.is_eog(int(ids[p]))]
            # The turn holds its end-of-turn token: the tokenize stage's check (snaketune.data.template_check).
            end_at = next(p for p in range(start, end) if ids[p] == self.end_id)
            if not eog or eog[0] != end_at:
                stops = (
                    f"stops at {self.shown(int(ids[eog[0]]), True)}, token {eog[0] - start} of the reply"
                    if eog
                    else "never stops in it"
                )
                raise ParityError(
                    f"{self.file.path.name}: {name}, assistant turn {k}: training ends the turn with "
                    f"{self.shown(self.end_id, False)}, and llama.cpp {stops}; allowed: a file whose end-of-generation "
                    "tokens hold the training end-of-turn token and no token a reply is made of"
                )
        return len(turns)


_STOP = re.compile(r"^PARAMETER stop (.+)$", re.MULTILINE)


def check_modelfiles(modelfiles: list[Path], stops: list[str]) -> None:
    """Each Modelfile has a `PARAMETER stop` line for each stop token (Ollama stops at no token it is not told of)."""
    for path in modelfiles:
        have = {json.loads(s) for s in _STOP.findall(path.read_text(encoding="utf-8"))}
        missing = [s for s in stops if s not in have]
        if missing:
            raise ParityError(
                f"{path.name}: no PARAMETER stop for {', '.join(map(repr, missing))}, which training ends assistant "
                f"turns with (it has: {', '.join(map(repr, sorted(have))) or 'none'}); Ollama would run past it"
            )


def check_export(
    files: list[Path], model_dir: str | Path, conversations: str | Path, served: list[Path]
) -> dict:
    """ParityError unless every file renders and stops as training on the sampled held-out conversations (of the
    `conversations` file) and every Modelfile among the `served` files stops at each stop token; what was checked
    (metrics.json's `parity`)."""
    modelfiles = [Path(p) for p in served if Path(p).suffix == ".Modelfile"]
    # The tokenize stage's loader, on the directory's tokenizer: it carries the template training rendered with.
    tokenizer = load_tokenizer(model_dir, "model")
    rows = sample(conversations)
    end_id = end_of_turn(tokenizer)
    encoded = list(
        encode_conversations(
            tokenizer,
            [r["messages"] for r in rows],
            tools=[r["tools"] for r in rows],
            assistant_only_loss=True,
        )
    )
    turns, merges = 0, []
    for path in files:
        check = _Check(_File(Path(path)), tokenizer, end_id)
        turns = sum(
            check.conversation(r, ids, labels) for r, (ids, labels) in zip(rows, encoded, strict=True)
        )
        merges += check.merges
    stops = list(dict.fromkeys([tokenizer.convert_ids_to_tokens(end_id), tokenizer.eos_token]))
    check_modelfiles(modelfiles, stops)
    return {
        "files": [Path(p).name for p in files],
        "conversations": len(rows),
        "conversations_with_tools": sum(has_tool_parts(r["messages"], r["tools"]) for r in rows),
        "tokens": int(sum(len(ids) for ids, _ in encoded)),
        "assistant_turns": turns,
        "stop_tokens": stops,
        "modelfiles": [p.name for p in modelfiles],
        "merges_differ": len(merges),
        "first_merge_difference": merges[0] if merges else None,
    }
