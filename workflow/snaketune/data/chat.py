"""Chat formatting shared by every stage that turns conversations into tokens (SFT rows, preference pairs,
evaluation prompts): the chat template, which characters are the assistant's, and fast batched encoding.

Each conversation is rendered with the chat template once, and once per assistant turn for the prefix up to
it, with and without the turn: a token is trained on when its first character lies in an assistant turn's
span, the reply text and its end-of-turn token, never the ``Assistant:`` prompt or anything the user wrote.
That works for any template that renders earlier turns the same whatever follows (others are refused). Every row is
checked as it is encoded (snaketune.data.template_check): its turns end in a trained end-of-turn token and its
replies start on a token boundary after the generation prompt. Tool calling (snaketune.data.tools): a template that
renders tools gets them as they are, any other the project's plain turns, decided once per tokenizer
(`handles_tools`).

Speed (bench/tokenize_throughput.py): the template is compiled once and rendered directly with jinja (what
``apply_chat_template`` does, without its per-call conversions; checked against it when the renderer is
made), and the texts are encoded in batches by the Rust tokenizer, which spreads a batch over
``RAYON_NUM_THREADS`` threads while the next batch is rendered. Labels come from the token offsets with
numpy. The ids do not depend on the number of threads.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from snaketune.config.choices import CHAT_TEMPLATES
from snaketune.data import template_check
from snaketune.data import tools as tool_calling
from snaketune.data.tokenizer import DEEPSEEK_CHAT_TEMPLATE, check_tokenizer_dir, load_fast_tokenizer
from snaketune.io import sha256_text

IGNORE_INDEX = -100
"""Label of tokens without loss (torch's cross-entropy ignore_index, which transformers' losses use)."""
ENCODE_BATCH = 256
"""Conversations per batch handed to the Rust tokenizer (large enough to keep its threads busy)."""

Message = dict[str, str]


class TemplateError(ValueError):
    """The chat template is missing or cannot mark assistant tokens; the message says what to change."""


def load_tokenizer(path: str | Path, chat_template: str):
    """A fast tokenizer from a local directory, with the chat template that ``tokenize.chat_template`` names.

    ``deepseek`` installs DEEPSEEK_CHAT_TEMPLATE, which renders the tokenizer's own bos/eos tokens (a foreign
    tokenizer keeps its specials: ``<s>``/``</s>`` stay as they are); ``model`` keeps the tokenizer's template.
    A tokenizer without pad gets pad = eos, as DeepSeek's: padded positions carry no loss.
    """
    if chat_template not in CHAT_TEMPLATES:
        raise TemplateError(
            f"tokenize.chat_template {chat_template!r} is not allowed; allowed: {', '.join(CHAT_TEMPLATES)}"
        )
    check_tokenizer_dir(path, "tokenizer directory")
    tokenizer = load_fast_tokenizer(path, "tokenizer directory")
    if tokenizer.eos_token is None:
        raise TemplateError(
            f"tokenizer {str(path)!r} has no eos token, so assistant turns have no end-of-turn token"
        )
    if chat_template == "deepseek":
        known = _file_vocabulary(Path(path) / "tokenizer.json")
        for name in ("bos_token", "eos_token"):
            token = getattr(tokenizer, name)
            # The template writes the special as text: it must come back as the one id the model knows. transformers
            # adds a special that tokenizer.json lacks as a new id past the vocabulary, one no model has learnt.
            if token is not None and (
                token not in known or tokenizer.convert_tokens_to_ids(token) in (None, tokenizer.unk_token_id)
            ):
                raise TemplateError(f"tokenizer {str(path)!r}: {name} {token!r} is not in its vocabulary")
        tokenizer.chat_template = DEEPSEEK_CHAT_TEMPLATE
    elif not tokenizer.chat_template:
        raise TemplateError(
            f"tokenizer {str(path)!r} has no chat template of its own (tokenize.chat_template: model needs "
            "one in tokenizer_config.json or chat_template.jinja); set tokenize.chat_template to one of: "
            f"{', '.join(CHAT_TEMPLATES)} (deepseek uses the DeepSeek-LLM chat format)"
        )
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _file_vocabulary(tokenizer_json: Path) -> set[str]:
    """The tokens a tokenizer.json defines: its model's vocabulary (BPE and WordPiece: a dict; Unigram: [token,
    score] pairs) and its added tokens."""
    spec = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab = spec.get("model", {}).get("vocab") or {}
    tokens = set(vocab) if isinstance(vocab, dict) else {entry[0] for entry in vocab}
    return tokens | {added["content"] for added in spec.get("added_tokens") or ()}


def chat_template_text(tokenizer) -> str:
    """The tokenizer's chat template as one string (a dict of named templates as sorted JSON)."""
    template = tokenizer.chat_template
    return template if isinstance(template, str) else json.dumps(template, sort_keys=True)


def _render(tokenizer, messages: Sequence[Message], add_generation_prompt: bool = False, tools=None) -> str:
    return tokenizer.apply_chat_template(
        list(messages), tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
    )


def assistant_spans(tokenizer, messages: Sequence[Message], tools=None) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans [start, end) of its assistant turns (of the messages as
    the template gets them: `template_inputs`).

    A span runs from the end of the generation prompt to the end of the turn, so it holds the reply and the
    end-of-turn token: what the model must produce after the prompt at inference. Spans are found by
    rendering prefixes of the conversation, which works only if the template renders each turn the same
    way whatever follows it; templates that rewrite history (e.g. drop earlier replies' reasoning) raise.
    """
    return _spans(
        lambda m, prompt=False, t=None: _render(tokenizer, m, prompt, t), tokenizer, messages, tools
    )


# Two exchanges: the second assistant turn is rendered after an earlier one, which is where templates that
# rewrite history (or ignore a role) show it.
_PROBE = (
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And 3 + 3?"},
    {"role": "assistant", "content": "It is 6."},
)


# A call, its result and the reply to it, with the names and values no template writes of itself: a template that
# renders tools shows all four markers, the call inside the assistant's turn.
_TOOLS_PROBE = [
    {
        "type": "function",
        "function": {
            "name": "probe_lookup",
            "description": "Probe tool description.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string"}},
                "required": ["query"],
            },
        },
    }
]
_TOOL_PROBE = (
    {"role": "user", "content": "Look it up."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "probe_lookup", "arguments": '{"query": "probe query"}'},
            }
        ],
        "tool_call_id": None,
    },
    {"role": "tool", "content": "probe result", "tool_calls": None, "tool_call_id": "call_1"},
    {"role": "assistant", "content": "It is sunny.", "tool_calls": None, "tool_call_id": None},
)


_HANDLES_TOOLS: dict[str, bool] = {}
"""handles_tools by template text: a stage asks once per conversation."""


def handles_tools(tokenizer) -> bool:
    """Whether the chat template renders tool calling itself: the probe's tools, call and result all appear, the
    call inside the assistant's trained turn (else the project's plain turns render them)."""
    template = chat_template_text(tokenizer)
    cached = _HANDLES_TOOLS.get(template)
    if cached is None:
        try:
            text, spans = assistant_spans(tokenizer, tool_calling.native_messages(_TOOL_PROBE), _TOOLS_PROBE)
            at = text.find("probe query")
            cached = all(
                m in text for m in ("Probe tool description.", "probe_lookup", "probe result")
            ) and any(a <= at < b for a, b in spans)
        except Exception:  # noqa: BLE001 - the template cannot render them: jinja errors, `+ None`, raise_exception
            cached = False
        _HANDLES_TOOLS[template] = cached
    return cached


def template_inputs(tokenizer, messages: Sequence[dict], tools=None) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) as the chat template gets them: the common form where it renders tools, else plain
    turns with the tool parts written in (snaketune.data.tools); a conversation without tool parts as its
    {role, content} turns."""
    tools = tool_calling.loads_tools(tools)
    if not tool_calling.has_tool_parts(messages, tools):
        return [{"role": m["role"], "content": m["content"]} for m in messages], None
    if handles_tools(tokenizer):
        return tool_calling.native_messages(messages), tools
    return tool_calling.plain_turns(messages, tools), None


def end_of_turn(tokenizer) -> int:
    """The token the template writes after an assistant reply (snaketune.data.template_check); TemplateError when
    it writes none."""
    reply = _PROBE[1]["content"]
    # Rendered whole: a template that writes the token only when another turn follows shows it there.
    text = _render(tokenizer, _PROBE)
    if reply not in text:  # it drops earlier replies (spans refuse it where it matters)
        text = _render(tokenizer, _PROBE[:2])
    if reply not in text:
        raise TemplateError(
            f"the chat template does not render the assistant's reply {reply!r} (rendered: {text!r}; "
            f"{_template_id(tokenizer)}); allowed: a template that renders message['content'] of assistant messages"
        )
    after = text[text.index(reply) + len(reply) :]
    end = template_check.first_special(tokenizer, _backend(tokenizer), after)
    if end is None:
        raise TemplateError(
            f"the chat template writes no end-of-turn token after an assistant reply (after {reply!r} it renders "
            f"{after!r}; {_template_id(tokenizer)}), so a model trained on it has no token to stop at; allowed: a "
            "template that ends assistant turns with eos or an end-of-turn token, e.g. tokenize.chat_template: deepseek"
        )
    return end


def _template_id(tokenizer) -> str:
    """How error messages name a tokenizer and its chat template."""
    return f"tokenizer {tokenizer.name_or_path!r}, chat template sha256 {sha256_text(chat_template_text(tokenizer))[:12]}"


def check_chat_template(tokenizer) -> None:
    """Raise TemplateError unless the template renders a plain two-exchange conversation with its replies
    in assistant spans, writes an end-of-turn token the turns train on, and ends its generation prompt where the
    reply's tokens start (the prompt encoded alone is the conversation's tokens up to the reply), for a tool-calling
    conversation too: checked once before tokenizing, so a broken template fails before any data is read.
    """
    where = _template_id(tokenizer)
    try:
        text, spans = assistant_spans(tokenizer, _PROBE)
    except TemplateError:
        raise
    except Exception as e:  # jinja2 errors, raise_exception() in the template, missing variables
        raise TemplateError(
            f"the chat template cannot render a user/assistant conversation ({where}): "
            f"{type(e).__name__}: {e}; allowed: a template for roles user and assistant, "
            "e.g. tokenize.chat_template: deepseek"
        ) from e
    replies = [m["content"] for m in _PROBE if m["role"] == "assistant"]
    for reply, (start, end) in zip(replies, spans, strict=True):
        if reply not in text[start:end]:
            raise TemplateError(
                f"the chat template does not put the assistant's reply {reply!r} in the assistant's turn "
                f"(rendered: {text!r}; {where}); allowed: a template that renders message['content'] of "
                "assistant messages, e.g. tokenize.chat_template: deepseek"
            )
    end_of_turn(tokenizer)
    # Every row's checks, on the probe, and on a tool call where the template renders tools itself (else the project's
    # plain turns render them, which the probe's turns show already).
    probes = [(_PROBE, None)] + ([(_TOOL_PROBE, _TOOLS_PROBE)] if handles_tools(tokenizer) else [])
    try:
        [(ids, _), *_] = encode_conversations(
            tokenizer, [p for p, _ in probes], tools=[t for _, t in probes], assistant_only_loss=True
        )
    except TemplateError as e:
        named = str(e).replace("conversation index 0:", "the probe conversation (two exchanges):", 1)
        raise TemplateError(
            named.replace("conversation index 1:", "the tool-calling probe conversation:", 1)
        ) from e
    prompt = _backend(tokenizer).encode(_render(tokenizer, _PROBE[:1], True), add_special_tokens=False).ids
    if ids[: len(prompt)].tolist() != prompt:
        at = next(
            (i for i, (a, b) in enumerate(zip(prompt, ids.tolist(), strict=False)) if a != b), len(prompt)
        )
        shown = tokenizer.convert_ids_to_tokens(prompt[at]) if at < len(prompt) else "(the prompt's end)"
        raise TemplateError(
            f"the generation prompt, encoded alone as inference does, differs from the conversation's tokens at "
            f"token {at}: {shown!r} ({where}); allowed: a template whose generation prompt is the text that "
            "precedes the reply in the rendered conversation"
        )


class ChatRenderer:
    """``tokenizer.apply_chat_template(messages, tokenize=False, ...)``, compiled once.

    transformers renders a chat by converting every message to plain data and calling the compiled jinja
    template with the tokenizer's special tokens; for the {role, content} messages of this workflow that
    conversion changes nothing, so the template is called directly (about 10x faster). The renderer checks
    itself against apply_chat_template on the probe conversation when it is made and falls back to it
    where they differ (a template that reads what the conversion adds).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._compiled = None
        try:
            from transformers.utils.chat_template_utils import _compile_jinja_template

            self._compiled = _compile_jinja_template(chat_template_text(tokenizer))
            self._kwargs = dict(tokenizer.special_tokens_map)
            probes = [(_PROBE, None)]
            if handles_tools(tokenizer):
                probes.append((tool_calling.native_messages(_TOOL_PROBE), _TOOLS_PROBE))
            for probe, tools in probes:
                for n in range(1, len(probe) + 1):
                    for prompt in (False, True):
                        if self(probe[:n], prompt, tools) != _render(tokenizer, probe[:n], prompt, tools):
                            raise ValueError("differs")
        except Exception:  # noqa: BLE001 - any doubt: transformers' own path
            self._compiled = None

    def __call__(self, messages: Sequence[Message], add_generation_prompt: bool = False, tools=None) -> str:
        if self._compiled is None:
            return _render(self.tokenizer, messages, add_generation_prompt, tools)
        return self._compiled.render(
            messages=list(messages),
            tools=tools,
            documents=None,
            add_generation_prompt=add_generation_prompt,
            **self._kwargs,
        )


def _spans(render, tokenizer, messages: Sequence[Message], tools=None) -> tuple[str, list[tuple[int, int]]]:
    text = render(messages, False, tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = render(messages[:i], True, tools)
        turn = render(messages[: i + 1], False, tools)
        if not (text.startswith(prompt) and text.startswith(turn) and len(prompt) < len(turn)):
            template = _template_id(tokenizer)
            if turn in (prompt, render(messages[:i], False, tools)):
                raise TemplateError(
                    f"the chat template renders assistant message {i} without its reply (adding it adds nothing "
                    f"beyond the generation prompt), so there are no tokens to train on ({template}); allowed: a "
                    "template that renders the content of role 'assistant' messages, e.g. "
                    "tokenize.chat_template: deepseek"
                )
            raise TemplateError(
                "the chat template renders turns differently in context, so assistant tokens cannot be marked: "
                f"rendering messages[:{i}] with the generation prompt, or messages[:{i + 1}], is not a prefix of "
                f"the whole conversation ({template}); use tokenize.chat_template: deepseek "
                "or a template that renders earlier turns unchanged"
            )
        spans.append((len(prompt), len(turn)))
    return text, spans


def _backend(tokenizer):
    """The Rust tokenizer behind a transformers fast tokenizer, without truncation or padding (the stages
    truncate themselves; a tokenizer.json that sets either would otherwise cut or pad silently)."""
    backend = tokenizer.backend_tokenizer
    if backend.truncation is not None or backend.padding is not None:
        from tokenizers import Tokenizer

        backend = Tokenizer.from_str(backend.to_str())
        backend.no_truncation()
        backend.no_padding()
    return backend


def _labels(ids: np.ndarray, offsets: np.ndarray, spans: list[tuple[int, int]], assistant_only: bool):
    labels = ids.copy()
    if assistant_only:
        if spans:
            bounds = np.asarray(spans, dtype=np.int64)
            # Spans are sorted and disjoint: only the last one starting at or before a token can hold it.
            k = np.searchsorted(bounds[:, 0], offsets[:, 0], side="right") - 1
            inside = (k >= 0) & (offsets[:, 0] < bounds[np.maximum(k, 0), 1])
        else:
            inside = np.zeros(len(ids), dtype=bool)
        labels[~inside] = IGNORE_INDEX
    if len(labels):
        # A causal LM never predicts its first token (the loss shifts labels left), and in a packed block
        # that label would otherwise be predicted from the previous conversation.
        labels[0] = IGNORE_INDEX
    return labels


def encode_conversations(
    tokenizer,
    conversations: Iterable[Sequence[Message]],
    *,
    assistant_only_loss: bool,
    last_turn_only: bool = False,
    tools: Iterable | None = None,
    check: template_check.TurnCheck | None = None,
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(input_ids, labels) of each conversation, untruncated, int32, in input order.

    ``labels`` are the token ids on assistant replies and their end-of-turn tokens (every token but the first
    when not assistant_only_loss; only the last assistant turn with ``last_turn_only``, as for a preference
    pair's reply) and IGNORE_INDEX elsewhere; they are not shifted. ``tools``: each conversation's tools (JSON text
    or a list; None without). Every row is checked (snaketune.data.template_check; ``check`` counts what was). A
    conversation whose template rendering fails, or whose row fails the check, raises TemplateError with
    ``conversation index N`` in its message. Batches are encoded on a worker thread (the Rust tokenizer releases
    the GIL) while the next one is rendered.
    """
    render = ChatRenderer(tokenizer)
    backend = _backend(tokenizer)
    end_id = end_of_turn(tokenizer)
    tools = iter(tools) if tools is not None else None

    def rendered(batch):
        out = []
        for index, messages in batch:
            conversation_tools = next(tools) if tools is not None else None
            try:
                shown, shown_tools = template_inputs(tokenizer, messages, conversation_tools)
                text, spans = _spans(render, tokenizer, shown, shown_tools)
                out.append((index, text, spans[-1:] if last_turn_only else spans))
            except TemplateError as e:
                raise TemplateError(f"conversation index {index}: {e}") from e
            # jinja2's errors, raise_exception() in the template ("System role not supported"), ...
            except Exception as e:
                roles = ", ".join(dict.fromkeys(m["role"] for m in messages))
                raise TemplateError(
                    f"conversation index {index}: the chat template cannot render it (roles {roles}; "
                    f"{_template_id(tokenizer)}): {type(e).__name__}: {e}; allowed: a template that renders these "
                    "roles, e.g. tokenize.chat_template: deepseek (system turns as text before the first user turn)"
                ) from e
            if check is not None:
                check.conversations += 1
                check.assistant_turns += len(out[-1][2])
                check.conversations_with_tools += tool_calling.has_tool_parts(messages, conversation_tools)
        return out

    def encode(texts_spans):
        encodings = backend.encode_batch([t for _, t, _ in texts_spans], add_special_tokens=False)
        out = []
        for enc, (index, text, spans) in zip(encodings, texts_spans, strict=True):
            ids = np.asarray(enc.ids, dtype=np.int32)
            offsets = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
            labels = _labels(ids, offsets, spans, assistant_only_loss)
            try:
                template_check.check_row(text, ids, offsets, labels, spans, end_id, tokenizer)
            except template_check.TurnError as e:
                raise TemplateError(f"conversation index {index}: {e} ({_template_id(tokenizer)})") from e
            out.append((ids, labels))
        return out

    batch: list = []
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending = None
        for item in enumerate(conversations):
            batch.append(item)
            if len(batch) == ENCODE_BATCH:
                job = pool.submit(encode, rendered(batch))
                batch = []
                if pending is not None:
                    yield from pending.result()
                pending = job
        if pending is not None:
            yield from pending.result()
        if batch:
            yield from encode(rendered(batch))


def turn_check(tokenizer) -> template_check.TurnCheck:
    """An empty count of what encode_conversations checks, with the template's end-of-turn token, generation prompt
    and tool rendering."""
    end_id = end_of_turn(tokenizer)
    one = _render(tokenizer, _PROBE[:1])
    return template_check.TurnCheck(
        end_of_turn=tokenizer.convert_ids_to_tokens(end_id),
        end_of_turn_id=end_id,
        tool_rendering="template" if handles_tools(tokenizer) else "project",
        generation_prompt=_render(tokenizer, _PROBE[:1], True).removeprefix(one),
    )


def encode_conversation(
    tokenizer, messages: Sequence[Message], *, assistant_only_loss: bool
) -> tuple[list[int], list[int]]:
    """Token ids and labels of one conversation, untruncated (see :func:`encode_conversations`)."""
    [(ids, labels)] = list(
        encode_conversations(tokenizer, [messages], assistant_only_loss=assistant_only_loss)
    )
    return ids.tolist(), labels.tolist()
