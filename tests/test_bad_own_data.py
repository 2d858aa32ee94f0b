"""Bad input catalog, your own data (docs/own-data.md): every way a chat-format file (the download stage) or a pairs
file (the preferences stage) can be malformed, each run through the stage's own function, asserting what the user
reads: the file, the line (JSONL, 1-based) or row (Parquet, 0-based), the field and what is allowed. Every failing
case loses nothing: the previous good outputs stay byte for byte (tests/bad_data.py's `fails_and_keeps`). The oasst
catalog: tests/test_bad_sources.py."""

from __future__ import annotations

import copy
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from bad_data import fails_and_keeps, write_jsonl
from snaketune.data import download
from snaketune.data.messages import DataError
from snaketune.data.pair_format import build_pair_preferences
from snaketune.data.preferences import write_preferences

ROLES = "system, user, assistant, tool (a conversation with function or ipython turns is dropped and counted)"


def turn(role: str, content) -> dict:
    return {"role": role, "content": content}


CHATS = [
    {"messages": [turn("system", "Be brief."), turn("user", "Hi"), turn("assistant", "Hello.")]},
    {"messages": [turn("user", "Why?"), turn("assistant", "Because.")]},
    {"messages": [turn("user", "What?"), turn("assistant", "That.")]},
]
PAIRS = [
    {"prompt": "Hi", "chosen": "Hello.", "rejected": "Go away."},
    {"prompt": [turn("user", "Why?")], "chosen": [turn("assistant", "Because.")], "rejected": "No."},
    {"prompt": "What?", "chosen": "That.", "rejected": "This."},
]
BAD = 1
"""The record each case breaks: the second, on line 3 of a JSONL file (write_jsonl starts with a blank line)."""


def changed(records: list[dict], **changes) -> list[dict]:
    out = copy.deepcopy(records)
    for key, value in changes.items():
        if value is ...:
            del out[BAD][key]
        else:
            out[BAD][key] = value
    return out


@pytest.fixture
def raw_dir(tmp_path: Path) -> Path:
    out = tmp_path / "results" / "data" / "raw"
    download.materialize(str(write_jsonl(tmp_path / "good.jsonl", CHATS)), out, fmt="chat")
    return out


def chat_fails(tmp_path: Path, raw_dir: Path, records: list, suffix: str = ".jsonl") -> tuple[str, Path]:
    src = tmp_path / f"bad{suffix}"
    if suffix == ".jsonl":
        write_jsonl(src, records)
    else:
        pq.write_table(pa.Table.from_pylist(records), src)
    return fails_and_keeps(raw_dir, DataError, download.materialize, str(src), raw_dir, fmt="chat"), src


# ==== chat-format conversations (download stage) ================================================================


def test_a_line_without_messages(tmp_path, raw_dir):
    text, src = chat_fails(tmp_path, raw_dir, changed(CHATS, messages=..., conversation=[]))
    assert text == (
        f"{src}: line 3: missing required key 'messages' (the line has conversation); required on every line: "
        "messages (a list of {role, content}); optional: id, split, lang, tools"
    )


@pytest.mark.parametrize(
    ("messages", "key", "shown", "allowed"),
    [
        ("Hi", "messages", "'Hi' (str)", "a list of {role, content} objects"),
        ([turn("user", "Hi"), "Hello"], "messages[1]", "'Hello' (str)", "an object with role and content"),
        ([turn("user", "Hi"), turn("human", "x")], "messages[1].role", "'human' (str)", ROLES),
        ([turn("user", "Hi"), turn(None, "x")], "messages[1].role", "null", ROLES),
        (
            [turn("user", [{"type": "text", "text": "Hi"}])],
            "messages[0].content",
            "[{'type': 'text', 'text': 'Hi'}] (list)",
            "a string or null (a list of content parts is not read)",
        ),
    ],
)
def test_a_bad_message_names_its_field(tmp_path, raw_dir, messages, key, shown, allowed):
    text, src = chat_fails(tmp_path, raw_dir, changed(CHATS, messages=messages))
    assert text == f"{src}: line 3, key {key!r}: {shown} is not allowed; allowed: {allowed}"


@pytest.mark.parametrize(
    ("message", "missing", "allowed"),
    [
        ({"content": "Hi"}, "role", f"an object with role ({ROLES}) and content"),
        ({"role": "assistant"}, "content", "an object with role and content (a string)"),
    ],
)
def test_a_message_without_role_or_content(tmp_path, raw_dir, message, missing, allowed):
    text, src = chat_fails(tmp_path, raw_dir, changed(CHATS, messages=[turn("user", "Hi"), message]))
    assert text == f"{src}: line 3, key 'messages[1]': missing key {missing!r}; allowed: {allowed}"


def test_an_assistant_turn_that_calls_tools_needs_no_content(tmp_path):
    call = {"role": "assistant", "tool_calls": [CALL]}
    records = changed(
        CHATS,
        tools=TOOLS,
        messages=[turn("user", "Hi"), call, turn("tool", "sun"), turn("assistant", "Sunny.")],
    )
    assert (
        download.materialize(str(write_jsonl(tmp_path / "t.jsonl", records)), tmp_path / "raw")["messages"]
        == 9
    )


# ---- tool calls (docs/own-data.md#tool-calling) ----

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOLS = [WEATHER]
CALL = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}
TOOLS_ALLOWED = (
    'a list of {"type": "function", "function": {"name", "description", "parameters"}} objects, or a string holding '
    "that list as JSON (or null)"
)
ARGUMENTS = 'a JSON object, or a string holding one (e.g. {"city": "Paris"})'


def calling(call: dict, tools=TOOLS, result: dict | None = None) -> dict:
    """The record BAD as a conversation that calls a tool: `call` its one call, then a result and a reply."""
    messages = [
        turn("user", "Weather in Oslo?"),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        result or {"role": "tool", "tool_call_id": "call_1", "content": "rain"},
        turn("assistant", "Rain."),
    ]
    return {"tools": tools, "messages": messages}


def with_function(**changes) -> dict:
    return {**CALL, "function": {**CALL["function"], **changes}}


@pytest.mark.parametrize(
    ("record", "key", "shown", "allowed"),
    [
        (
            calling(with_function(name="forecast")),
            "messages[1].tool_calls[0].function.name",
            "'forecast' (str)",
            "a function the conversation's tools declare (names in the record's tools: weather)",
        ),
        (
            calling(CALL, tools=None),
            "messages[1].tool_calls[0].function.name",
            "'weather' (str)",
            "a function the conversation's tools declare (none: the record has no tools)",
        ),
        (
            calling(with_function(arguments="{city: Oslo}")),
            "messages[1].tool_calls[0].function.arguments",
            "'{city: Oslo}' (str)",
            f"{ARGUMENTS}; the string is not JSON: Expecting property name enclosed in double quotes: line 1 column "
            "2 (char 1)",
        ),
        (
            calling(with_function(arguments='["Oslo"]')),
            "messages[1].tool_calls[0].function.arguments",
            "['Oslo'] (list)",
            ARGUMENTS,
        ),
        (
            calling(CALL, tools=[{"name": "weather"}]),
            "tools[0]",
            "{'name': 'weather'} (dict)",
            TOOLS_ALLOWED,
        ),
        (
            calling(CALL, tools=[WEATHER, WEATHER]),
            "tools[1].function.name",
            "'weather' (str)",
            "a name no other tool of the record has",
        ),
        (
            calling(CALL, result={"role": "tool", "tool_call_id": "call_9", "content": "rain"}),
            "messages[2].tool_call_id",
            "'call_9' (str)",
            "an id of the calls it answers (call_1) or null",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "Hi", "tool_calls": [CALL]},
                    turn("assistant", "Hello."),
                ]
            },
            "messages[0].tool_calls",
            f"{[CALL]!r} (list)",
            "null on a turn that is not the assistant's",
        ),
    ],
    ids=[
        "unknown tool",
        "no tools",
        "arguments not JSON",
        "arguments not an object",
        "tool not a function",
        "tool twice",
        "result of no call",
        "user calls",
    ],  # fmt: skip
)
def test_a_malformed_tool_call_names_its_field(tmp_path, raw_dir, record, key, shown, allowed):
    records = copy.deepcopy(CHATS)
    records[BAD] = record
    text, src = chat_fails(tmp_path, raw_dir, records)
    assert text == f"{src}: line 3, key {key!r}: {shown} is not allowed; allowed: {allowed}"


def test_parquet_tool_calls_name_the_column_and_row(tmp_path, raw_dir):
    records = [
        {**calling(CALL), "tools": '[{"type": "function", "function": {"name": "weather"}}]'} for _ in CHATS
    ]
    records[BAD] = calling(with_function(name="forecast"))
    records[BAD]["tools"] = records[0]["tools"]
    text, src = chat_fails(tmp_path, raw_dir, records, ".parquet")
    assert text.startswith(
        f"{src}: column 'messages[1].tool_calls[0].function.name', row 1: 'forecast' (str) is not allowed;"
    )


@pytest.mark.parametrize(
    ("change", "key", "shown", "allowed"),
    [
        ({"split": "test"}, "split", "'test' (str)", "train, validation or null"),
        ({"id": 1.5}, "id", "1.5 (float)", "a non-empty string or an integer, unique in the file (or null)"),
        ({"id": True}, "id", "True (bool)", "a non-empty string or an integer, unique in the file (or null)"),
        ({"lang": 7}, "lang", "7 (int)", "a language code string (e.g. en, pt-BR) or null"),
    ],
)
def test_a_bad_optional_field(tmp_path, raw_dir, change, key, shown, allowed):
    text, src = chat_fails(tmp_path, raw_dir, changed(CHATS, **change))
    assert text == f"{src}: line 3, key {key!r}: {shown} is not allowed; allowed: {allowed}"


def test_a_split_on_some_records_only(tmp_path, raw_dir):
    records = [{**r, "split": "train"} for r in CHATS]
    del records[2]["split"]
    text, src = chat_fails(tmp_path, raw_dir, records)
    assert text == (
        f"{src}: line 4, key 'split': no split while line 2 has one; allowed: train, validation on every record, "
        "or on none (then a hash of the id splits them)"
    )


def test_a_repeated_id(tmp_path, raw_dir):
    records = [{**r, "id": f"c{i}"} for i, r in enumerate(CHATS)]
    records[2]["id"] = "c0"
    text, src = chat_fails(tmp_path, raw_dir, records)
    assert text == (
        f"{src}: line 4, key 'id': duplicate id 'c0' (first in line 2); allowed: ids unique in the file (or no id: "
        "the messages' hash names the conversation)"
    )


def test_parquet_names_the_column_and_row(tmp_path, raw_dir):
    records = changed(CHATS, messages=[turn("user", "Hi"), turn("gpt", "x")])
    text, src = chat_fails(tmp_path, raw_dir, records, ".parquet")
    assert text == f"{src}: column 'messages[1].role', row 1: 'gpt' (str) is not allowed; allowed: {ROLES}"


def test_parquet_without_a_messages_column(tmp_path, raw_dir):
    records = [{"conversations": [{"from": "human", "value": "Hi"}]}]
    text, src = chat_fails(tmp_path, raw_dir, records, ".parquet")
    assert text == (
        f"{src}: missing required column messages (the file has conversations); required: messages (a list of "
        "{role, content}); optional: id, split, lang, tools"
    )


def test_chat_data_read_as_oasst_says_so(tmp_path, raw_dir):
    src = write_jsonl(tmp_path / "chats.jsonl", CHATS)
    text = fails_and_keeps(raw_dir, DataError, download.materialize, str(src), raw_dir, fmt="oasst")
    assert text.startswith(f"{src}: line 2: missing required key(s) message_id, parent_id, role, text;")
    assert text.endswith(
        "it has `messages`, the chat format's field: dataset.format: chat (or auto) reads it, from a local file"
    )


def test_nothing_left_to_train_on(tmp_path):
    from snaketune.data.conversations import conversations_of_file

    records = [{"messages": [turn("user", "Hi")]}, {"messages": [turn("assistant", "Hello.")]}]
    download.materialize(str(write_jsonl(tmp_path / "c.jsonl", records)), tmp_path / "raw")
    path = tmp_path / "raw" / "messages.parquet"
    with pytest.raises(DataError) as e:
        conversations_of_file(path)
    assert str(e.value) == (
        f"{path}: no conversation is left to train on: 2 read, dropped: roles_out_of_order 1, no_assistant_turn 1; "
        "allowed: conversations where a user turn is answered by an assistant turn, roles in order (an optional "
        "system turn first, then a user turn; a user turn answered by an assistant turn; an assistant turn that "
        "calls tools answered by tool turns, and tool turns by an assistant turn), no empty user or assistant turn"
    )


# ==== preference pairs (preferences stage) ======================================================================

REQUIRED = (
    "required: chosen and rejected (a string, or a messages list ending in the assistant's reply) and prompt (a "
    "string, or a messages list ending in a user turn or tool results; optional where chosen and rejected are "
    "messages lists that share the turns before the reply); optional: id, split, lang, tools"
)


def run_pairs(src: Path, out_dir: Path) -> None:
    """What workflow/scripts/preferences.py does with a pairs file."""
    write_preferences(build_pair_preferences(src, validation_fraction=0.3), out_dir)


@pytest.fixture
def pairs_dir(tmp_path: Path) -> Path:
    out = tmp_path / "results" / "data" / "preferences" / "file-good"
    run_pairs(write_jsonl(tmp_path / "good.jsonl", PAIRS), out)
    return out


def pairs_fail(tmp_path: Path, pairs_dir: Path, records: list, suffix: str = ".jsonl") -> tuple[str, Path]:
    src = tmp_path / f"bad{suffix}"
    if suffix == ".jsonl":
        write_jsonl(src, records)
    else:
        pq.write_table(pa.Table.from_pylist(records), src)
    return fails_and_keeps(pairs_dir, DataError, run_pairs, src, pairs_dir), src


@pytest.mark.parametrize(
    ("key", "what"), [("chosen", "missing required key"), ("rejected", "null in required key")]
)
def test_a_pair_without_a_reply(tmp_path, pairs_dir, key, what):
    text, src = pairs_fail(tmp_path, pairs_dir, changed(PAIRS, **{key: ... if key == "chosen" else None}))
    assert text == f"{src}: line 3: {what} {key!r}; {REQUIRED}"


@pytest.mark.parametrize(
    ("change", "key", "shown", "allowed"),
    [
        ({"prompt": 42}, "prompt", "42 (int)", "a string, or a messages list ending in a user turn"),
        ({"prompt": []}, "prompt", "[] (list)", "a string, or a messages list ending in a user turn"),
        (
            {"prompt": [turn("user", "Why?"), turn("assistant", "Hm.")]},
            "prompt[1].role",
            "'assistant' (str)",
            "user or tool (the prompt ends with the turn the replies answer)",
        ),
        ({"prompt": [turn("bot", "Why?")]}, "prompt[0].role", "'bot' (str)", ROLES),
        (
            {"chosen": [turn("assistant", "Because."), turn("user", "Ok")]},
            "chosen[1].role",
            "'user' (str)",
            "assistant (the reply is the last turn)",
        ),
        (
            {"rejected": 3},
            "rejected",
            "3 (int)",
            "a string, or a messages list ending in the assistant's reply",
        ),
        ({"split": "dev"}, "split", "'dev' (str)", "train, validation or null"),
        (
            {
                "tools": TOOLS,
                "chosen": [{"role": "assistant", "tool_calls": [with_function(name="forecast")]}],
            },
            "chosen[0].tool_calls[0].function.name",
            "'forecast' (str)",
            "a function the conversation's tools declare (names in the record's tools: weather)",
        ),
    ],
)
def test_a_bad_pair_field(tmp_path, pairs_dir, change, key, shown, allowed):
    text, src = pairs_fail(tmp_path, pairs_dir, changed(PAIRS, **change))
    assert text == f"{src}: line 3, key {key!r}: {shown} is not allowed; allowed: {allowed}"


def test_replies_that_repeat_another_prompt(tmp_path, pairs_dir):
    chosen = [turn("user", "Something else?"), turn("assistant", "Because.")]
    text, src = pairs_fail(tmp_path, pairs_dir, changed(PAIRS, chosen=chosen))
    assert text == (
        f"{src}: line 3, key 'chosen': its turns before the reply differ from the prompt's; allowed: the reply alone, "
        "or the prompt's turns followed by the reply"
    )


def test_no_prompt_and_string_replies(tmp_path, pairs_dir):
    text, src = pairs_fail(tmp_path, pairs_dir, changed(PAIRS, prompt=..., chosen="a", rejected="b"))
    assert text == (
        f"{src}: line 3: no prompt, and chosen and rejected are not messages lists with turns before the reply; "
        f"{REQUIRED} (the record has no key 'prompt')"
    )


def test_parquet_pairs_name_the_column_and_row(tmp_path, pairs_dir):
    records = [
        {"prompt": p["prompt"] if isinstance(p["prompt"], str) else "x", "chosen": "a", "rejected": "b"}
        for p in PAIRS
    ]
    records[BAD]["rejected"] = None
    text, src = pairs_fail(tmp_path, pairs_dir, records, ".parquet")
    assert text == f"{src}: row 1: null in required key 'rejected'; {REQUIRED}"


def test_no_pair_left(tmp_path, pairs_dir):
    records = [
        {"prompt": "q", "chosen": "same", "rejected": "same"},
        {"prompt": "r", "chosen": "", "rejected": "x"},
    ]
    text, src = pairs_fail(tmp_path, pairs_dir, records)
    assert text == (
        f"{src}: no pair is left to train on: 2 read, dropped: empty_content 1, identical 1; allowed: pairs with a "
        "non-empty prompt ending in a user turn and two different, non-empty replies"
    )
