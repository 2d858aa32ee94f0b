"""Tool calling in the common chat format (what TRL, Axolotl, LLaMA-Factory and NeMo AutoModel read), checked,
stored, and rendered into plain turns for a chat template that has no tool syntax.

The form (docs/own-data.md#tool-calling): a conversation's `tools`, a list of JSON-schema functions
`{"type": "function", "function": {"name", "description", "parameters"}}` (or a string holding that list as JSON, as
some hub datasets store it); an assistant turn's `tool_calls`, each `{"id", "type": "function", "function": {"name",
"arguments"}}` with the arguments a JSON object or a string holding one (OpenAI's API sends a string, transformers'
chat templates read an object: both are read, and stored as the object's JSON); and `tool` turns, whose `content` is
a call's result and whose optional `tool_call_id` names the call. A call to a function the conversation's tools do
not declare, or arguments that are no JSON object, are refused naming the file, line and field.

Rendering. A template that renders tools itself gets them as they are (snaketune.data.chat decides by rendering a
probe). For any other template, the DeepSeek template included, the project writes the tool parts into the turns
the template knows, in the form of Qwen2.5-Instruct's chat template (tokenizer_config.json of
Qwen/Qwen2.5-7B-Instruct, Hermes's function-calling format): the tools in the system turn inside `<tools>` tags,
each call as `<tool_call>{"name": ..., "arguments": ...}</tool_call>` after the assistant's text, and the results of
one round of calls as one user turn of `<tool_response>` blocks. Roles then alternate as in any chat, so every
template, span and stop token check works unchanged; the loss falls on the assistant's calls and replies, never on
the tools or the results.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from snaketune.data.cells import Cell, bad_value, missing_key

CALL = pa.struct(
    [
        ("id", pa.string()),
        ("type", pa.string()),
        ("function", pa.struct([("name", pa.string()), ("arguments", pa.string())])),
    ]
)
MESSAGE = pa.struct(
    [
        ("role", pa.string()),
        ("content", pa.string()),
        ("tool_calls", pa.list_(CALL)),
        ("tool_call_id", pa.string()),
    ]
)
"""A message as every stage's files store it (conversations, preference prompts): `tool_calls` null but on an
assistant turn that calls tools, `tool_call_id` null but on a tool turn that names its call."""

TOOLS_ALLOWED = (
    'a list of {"type": "function", "function": {"name", "description", "parameters"}} objects, or a string '
    "holding that list as JSON (or null)"
)
ARGUMENTS_ALLOWED = 'a JSON object, or a string holding one (e.g. {"city": "Paris"})'

# Qwen2.5-Instruct's chat template (tokenizer_config.json of Qwen/Qwen2.5-7B-Instruct), word for word: what a
# model trained on Hermes-style function calling has seen.
TOOLS_HEADER = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>"
)
TOOLS_FOOTER = (
    "\n</tools>\n\nFor each function call, return a json object with function name and arguments within "
    '<tool_call></tool_call> XML tags:\n<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n'
    "</tool_call>"
)


def _json(value: Any) -> str:
    # transformers' `tojson` filter (and llama-cpp-python's) is json.dumps with ensure_ascii=False: the same text.
    return json.dumps(value, ensure_ascii=False)


def _as_list(value: Any) -> Any:
    return value.tolist() if isinstance(value, np.ndarray) else value  # a list column that pandas holds


# ---- reading (download, preferences) ----------------------------------------------------------------------------


def parse_tools(value: Any, at: Cell, key: str = "tools") -> list[dict] | None:
    """A record's tools, checked, as [{"type": "function", "function": {...}}] (None without tools)."""
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_value(at, key, value, f"{TOOLS_ALLOWED}; the string is not JSON: {e}") from None
    value = _as_list(value)
    if not isinstance(value, list) or not value:
        raise bad_value(at, key, value, TOOLS_ALLOWED)
    out, names = [], set()
    for i, tool in enumerate(value):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(function, dict) or tool.get("type", "function") != "function":
            raise bad_value(at, f"{key}[{i}]", tool, TOOLS_ALLOWED)
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise bad_value(at, f"{key}[{i}].function.name", name, "a non-empty string, the function's name")
        if name in names:
            raise bad_value(at, f"{key}[{i}].function.name", name, "a name no other tool of the record has")
        names.add(name)
        out.append({"type": "function", "function": function})
    return out


def tool_names(tools: list[dict] | None) -> list[str]:
    return [t["function"]["name"] for t in tools or ()]


def _arguments(value: Any, at: Cell, key: str) -> str:
    """The arguments as their object's JSON (the stored form)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise bad_value(at, key, value, f"{ARGUMENTS_ALLOWED}; the string is not JSON: {e}") from None
    if not isinstance(value, dict):
        raise bad_value(at, key, value, ARGUMENTS_ALLOWED)
    return _json(value)


def parse_tool_calls(value: Any, at: Cell, key: str, tools: list[dict] | None) -> list[dict]:
    """An assistant turn's tool_calls, checked against the record's tools: [{id, type, function: {name,
    arguments (JSON text)}}]."""
    value = _as_list(value)
    if not isinstance(value, list) or not value:
        raise bad_value(
            at, key, value, 'a list of {"id", "type": "function", "function": {"name", "arguments"}}'
        )
    names = tool_names(tools)
    out = []
    for j, call in enumerate(value):
        k = f"{key}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type") not in (None, "function"):
            raise bad_value(at, k, call, '{"id", "type": "function", "function": {"name", "arguments"}}')
        name = function.get("name")
        if name not in names:
            declared = (
                f"names in the record's tools: {', '.join(names)}"
                if names
                else "none: the record has no tools"
            )
            raise bad_value(
                at, f"{k}.function.name", name, f"a function the conversation's tools declare ({declared})"
            )
        if "arguments" not in function:
            raise missing_key(at, f"{k}.function", "arguments", ARGUMENTS_ALLOWED)
        call_id = call.get("id")
        if call_id is not None and (not isinstance(call_id, str) or not call_id):
            raise bad_value(at, f"{k}.id", call_id, "a non-empty string or null")
        arguments = _arguments(function["arguments"], at, f"{k}.function.arguments")
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
    return out


def check_call_ids(messages: Sequence[dict], at: Cell, key: str) -> None:
    """A tool turn's tool_call_id names a call of the assistant turn before it that called tools."""
    calls: list[dict] = []
    for i, m in enumerate(messages):
        if m["role"] == "assistant":
            calls = m["tool_calls"] or []
        elif m["role"] == "tool" and m["tool_call_id"] is not None and calls:
            ids = [c["id"] for c in calls if c["id"] is not None]
            if m["tool_call_id"] not in ids:
                raise bad_value(
                    at,
                    f"{key}[{i}].tool_call_id",
                    m["tool_call_id"],
                    f"an id of the calls it answers ({', '.join(ids) or 'they have none'}) or null",
                )


# ---- what templates see ---------------------------------------------------------------------------------------


def has_tool_parts(messages: Sequence[dict], tools: Any) -> bool:
    return bool(tools) or any(m.get("tool_calls") or m["role"] == "tool" for m in messages)


def loads_tools(tools: str | list | None) -> list[dict] | None:
    """Tools as the stages' files store them (JSON text) or as given (a list)."""
    return json.loads(tools) if isinstance(tools, str) else tools


def _call(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    return {
        **({"id": call["id"]} if call.get("id") is not None else {}),
        "type": "function",
        "function": {
            "name": call["function"]["name"],
            "arguments": json.loads(arguments) if isinstance(arguments, str) else arguments,
        },
    }


def native_messages(messages: Sequence[dict]) -> list[dict]:
    """The messages in the common form for a template that renders tools: content never null, arguments as
    objects, no null keys (a template that asks `'tool_calls' in message` must not see a null one)."""
    out = []
    for m in messages:
        message = {"role": m["role"], "content": m.get("content") or ""}
        if m.get("tool_calls"):
            message["tool_calls"] = [_call(c) for c in m["tool_calls"]]
        if m["role"] == "tool" and m.get("tool_call_id") is not None:
            message["tool_call_id"] = m["tool_call_id"]
        out.append(message)
    return out


def call_text(call: dict) -> str:
    """One call as the project writes it (Qwen2.5's form)."""
    c = _call(call)["function"]
    return "<tool_call>\n" + _json({"name": c["name"], "arguments": c["arguments"]}) + "\n</tool_call>"


def tools_text(tools: list[dict]) -> str:
    return TOOLS_HEADER + "".join("\n" + _json(t) for t in tools) + TOOLS_FOOTER


def plain_turns(messages: Sequence[dict], tools: str | list | None) -> list[dict]:
    """The conversation as system, user and assistant turns of text, the tool parts written in (module docstring):
    what a template without tool syntax renders. A conversation without tool parts comes back as its
    {role, content} turns."""
    tools = loads_tools(tools)
    out: list[dict] = []
    results = False  # the last turn written holds tool results
    for m in messages:
        content = m.get("content") or ""
        if m["role"] == "tool":
            block = "<tool_response>\n" + content + "\n</tool_response>"
            if results:
                out[-1]["content"] += "\n" + block  # one user turn holds one round of results
            else:
                out.append({"role": "user", "content": block})
            results = True
            continue
        results = False
        if m.get("tool_calls"):
            calls = "\n".join(call_text(c) for c in m["tool_calls"])
            content = content + "\n" + calls if content else calls
        out.append({"role": m["role"], "content": content})
    if tools:
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + tools_text(tools)}
        else:
            out.insert(0, {"role": "system", "content": tools_text(tools)})
    return out
