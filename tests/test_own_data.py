"""Your own data in the common formats (docs/own-data.md): chat-format conversations with system turns and tool calls
(single and parallel calls, multi-turn) and prompt/chosen/rejected pairs (some choosing between calls), written here,
through the whole workflow with the README's own-data config; the
README's example as written (its records, its YAML, its two commands); system turns through both chat templates
without a loss; what `dataset.format: auto` tells apart, and the chat data the config refuses before any job.
Malformed records: tests/test_bad_own_data.py."""

from __future__ import annotations

import json
import random
import re
import shlex
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import yaml

from chat_data import WORDS, sentence
from conftest import CHATML, REPO, TINY_CONFIG, chatml_tokenizer, copy_workflow, dry_run, job_stats, snakemake
from snaketune.config.choices import ConfigError
from snaketune.config.load import load_config
from snaketune.data import download
from snaketune.data.chat import IGNORE_INDEX, TemplateError, encode_conversation, encode_conversations
from snaketune.data.chat_format import clean_chats, read_chats
from snaketune.data.conversations import conversations_of_file
from snaketune.data.format_config import resolve_format
from snaketune.data.formats import detect_format
from snaketune.data.messages import DataError
from snaketune.data.pair_format import build_pair_preferences
from snaketune.data.prompts import resolve_prompts
from snaketune.data.tokenization import load_tokenizer
from snaketune.data.tokenizer import BOS, EOS
from snaketune.io import sha256_file

ARGS = ("--cores", "2", "--resources", "gpu=2")


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


# ---- the data a user brings ------------------------------------------------------------------------------------


def turn(role: str, content: str | None) -> dict:
    return {"role": role, "content": content}


SYSTEM = "Answer in one short sentence."
CHAT_DROPS = {
    # OpenAI's deprecated function calling (the common form's `tool` turns train: TOOL_CHATS)
    "tool_use": [turn("user", "weather?"), turn("function", "sun"), turn("assistant", "Sunny.")],
    "empty_content": [turn("user", "hello"), turn("assistant", "  ")],
    "roles_out_of_order": [turn("user", "one"), turn("user", "two"), turn("assistant", "three")],
    "no_assistant_turn": [turn("system", SYSTEM), turn("user", "anyone there?")],
}
"""One conversation per reason the conversations stage drops (a duplicate is added to them)."""


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "weather",
            "description": "The weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "time", "description": "The time in a city."}},
]


def tool_chats(n: int = 8) -> list[dict]:
    """n tool-calling conversations: a single call, parallel calls, a system turn and a call, and a call in a longer
    conversation, in turn."""
    rng = random.Random(3)
    out = []
    for i in range(n):
        city = [rng.choice(WORDS) for _ in range(2)]
        calls = [
            {"id": f"c{i}-{j}", "type": "function", "function": {"name": "weather", "arguments": {"city": c}}}
            for j, c in enumerate(city[: 2 if i % 4 == 1 else 1])
        ]
        messages = [turn("system", SYSTEM)] if i % 4 == 2 else []
        messages += [turn("user", f"Weather in {' and '.join(city)}? {sentence(rng, 1, 3)}")]
        messages += [{"role": "assistant", "content": None, "tool_calls": calls}]
        messages += [{"role": "tool", "tool_call_id": c["id"], "content": sentence(rng, 1, 3)} for c in calls]
        messages += [turn("assistant", sentence(rng, 2, 6))]
        if i % 4 == 3:
            messages += [turn("user", sentence(rng, 2, 5)), turn("assistant", sentence(rng, 2, 6))]
        out.append({"tools": TOOLS, "messages": messages})
    return out


def chats(n: int = 48) -> list[dict]:
    """n conversations, every third opening with a system turn; the tool-calling ones; then one of each kind the
    stage drops or repairs."""
    rng = random.Random(1)
    out = []
    for i in range(n):
        messages = [turn("system", SYSTEM)] if i % 3 == 0 else []
        for _ in range(1 + i % 2):
            messages += [turn("user", sentence(rng, 2, 5)), turn("assistant", sentence(rng, 2, 6))]
        out.append({"messages": messages})
    out += tool_chats()
    out += [{"messages": m} for m in CHAT_DROPS.values()]
    out.append(dict(out[1]))  # a duplicate
    out.append({"messages": [turn("system", ""), turn("user", "hi"), turn("assistant", "hello")]})  # repaired
    out.append(
        {"messages": [turn("user", "ping"), turn("assistant", "pong"), turn("user", "again?")]}
    )  # repaired
    unanswered = tool_chats(1)[0]
    out.append({**unanswered, "messages": unanswered["messages"][:-1]})  # repaired: its result is cut
    return out


def pairs(n: int = 40) -> list[dict]:
    """n pairs in the shapes preference files come in, then one of each kind the stage drops."""
    rng = random.Random(2)
    out = []
    for i in range(n):
        prompt, good, bad = sentence(rng, 2, 5), sentence(rng, 2, 5), sentence(rng, 2, 5) + " no"
        shape = i % 4
        if shape == 0:  # plain strings
            out.append({"prompt": prompt, "chosen": good, "rejected": bad})
        elif (
            shape == 1
        ):  # a conversation with a system turn, the replies as one-turn lists (TRL's explicit prompt)
            msgs = [turn("system", SYSTEM), turn("user", prompt)]
            out.append(
                {"prompt": msgs, "chosen": [turn("assistant", good)], "rejected": [turn("assistant", bad)]}
            )
        elif (
            shape == 2
        ):  # whole conversations as the replies (UltraFeedback's layout), the prompt as a string
            conv = [turn("user", prompt)]
            out.append(
                {
                    "prompt": prompt,
                    "chosen": [*conv, turn("assistant", good)],
                    "rejected": [*conv, turn("assistant", bad)],
                }
            )
        else:  # no prompt: the turns chosen and rejected share (TRL's implicit prompt)
            conv = [turn("user", prompt)]
            out.append(
                {"chosen": [*conv, turn("assistant", good)], "rejected": [*conv, turn("assistant", bad)]}
            )
    for conversation in tool_chats(4):  # the right call over the wrong tool, then the reply to the results
        messages = conversation["messages"]
        at = next(i for i, m in enumerate(messages) if m.get("tool_calls"))
        wrong = [{**c, "function": {**c["function"], "name": "time"}} for c in messages[at]["tool_calls"]]
        reply = next(i for i, m in enumerate(messages) if i > at and m["role"] == "assistant")
        out.append(
            {
                "tools": TOOLS,
                "prompt": messages[:at],
                "chosen": [messages[at]],
                "rejected": [{**messages[at], "tool_calls": wrong}],
            }
            if len(out) % 2
            else {
                "tools": TOOLS,
                "prompt": messages[:reply],
                "chosen": messages[reply]["content"],
                "rejected": "no",
            }
        )
    out += [
        {"prompt": "same?", "chosen": "yes", "rejected": "yes"},  # identical
        {"prompt": "empty?", "chosen": "no", "rejected": ""},  # empty_content
        {
            "prompt": [turn("user", "a"), turn("function", "b"), turn("user", "c")],
            "chosen": "d",
            "rejected": "e",
        },
        {
            "prompt": [turn("user", "a"), turn("user", "b")],
            "chosen": "c",
            "rejected": "d",
        },  # roles_out_of_order
        dict(out[0]),  # duplicate
    ]
    return out


# ---- the README's example -------------------------------------------------------------------------------------


def readme_example() -> dict:
    """The "Use your own data" section's records, YAML (with its file name) and commands."""
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Use your own data\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"```(\w+)\n(.*?)```", section, re.S)
    records = [json.loads(text) for lang, text in blocks if lang == "json"]
    (config,) = [text for lang, text in blocks if lang == "yaml"]
    (commands,) = [text for lang, text in blocks if lang == "bash"]
    return {
        "chat": next(r for r in records if "messages" in r),
        "pair": next(r for r in records if "chosen" in r),
        "config_name": re.match(r"# (\S+)\n", config).group(1),
        "config": config,
        "commands": [shlex.split(line) for line in commands.strip().splitlines()],
    }


def test_the_readme_example_runs_as_written(tmp_path):
    """The README's records in the files its YAML names, its YAML under its own name, each of its two commands as
    written (a dry run): both plan every stage from download to DPO on the pairs file."""
    example = readme_example()
    workdir = copy_workflow(tmp_path / "wf")
    (workdir / example["config_name"]).write_text(example["config"])
    sources = yaml.safe_load(example["config"])
    write_jsonl(workdir / sources["dataset"]["source"], [example["chat"]])
    write_jsonl(workdir / sources["preference"]["source"], [example["pair"]])
    with_file, with_config = example["commands"]
    assert with_file[-2:] == ["--configfile", example["config_name"]], "the config file comes last (nargs)"
    code, output = dry_run(workdir, with_file[1:])
    assert code == 0, output[-3000:]
    assert {"download", "conversations", "preferences", "dpo"} <= set(job_stats(output))
    code, output = dry_run(workdir, with_config[1:])
    assert code == 0, output[-3000:]
    assert {"download", "conversations", "preferences", "dpo"} <= set(job_stats(output))


def test_the_readme_records_are_read_as_written(tmp_path):
    example = readme_example()
    table, _ = read_chats(write_jsonl(tmp_path / "c.jsonl", [example["chat"]]))
    by_split, stats = clean_chats(table.to_pylist(), languages=(), validation_fraction=0.1, source="c.jsonl")
    assert stats["rows_kept"] == 1 and sum(stats["with_system_turn"].values()) == 1
    result = build_pair_preferences(
        write_jsonl(tmp_path / "p.jsonl", [example["pair"]]), validation_fraction=0.1
    )
    assert result.stats["rows_kept"] == 1


def test_max_trees_samples_a_chat_files_conversations(tmp_path):
    """dataset.max_trees on chat data: each conversation counts as a tree; the sample is the same whatever the
    file's order and a larger one holds it."""
    chats = [
        {
            "messages": [
                {"role": "user", "content": f"question {i}"},
                {"role": "assistant", "content": f"answer {i}"},
            ]
        }
        for i in range(40)
    ]

    def kept(rows, max_trees):
        table, _ = read_chats(write_jsonl(tmp_path / f"c{max_trees}.jsonl", rows))
        by_split, stats = clean_chats(
            table.to_pylist(), languages=(), validation_fraction=0.2, source="c.jsonl", max_trees=max_trees
        )
        texts = {s: {r["messages"][0]["content"] for r in by_split[s]} for s in by_split}
        return texts, stats

    (ten, stats), (twenty, _) = kept(chats, 10), kept(chats, 20)
    assert stats["rows_kept"] == 10 and stats["trees_sampled_out"] == 30 and stats["max_trees"] == 10
    assert sum(map(len, ten.values())) == 10 and all(ten[s] <= twenty[s] for s in ten)
    assert kept(chats[::-1], 10)[0] == ten


# ---- the whole workflow on them ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def own_run(tmp_path_factory) -> Path:
    """One workflow run of the tiny config with the README's own-data YAML over it, on the data above under the
    names it gives (GGUF export and the benchmark stage off: they read only the models, and add nothing here)."""
    example = readme_example()
    workdir = copy_workflow(tmp_path_factory.mktemp("own_data") / "wf")
    shutil.copy2(TINY_CONFIG, workdir / "tiny.yaml")
    (workdir / example["config_name"]).write_text(example["config"])
    (workdir / "models_only.yaml").write_text("export: {enabled: false}\nbenchmark: {enabled: false}\n")
    sources = yaml.safe_load(example["config"])
    write_jsonl(workdir / sources["dataset"]["source"], chats())
    write_jsonl(workdir / sources["preference"]["source"], pairs())
    configs = ("tiny.yaml", example["config_name"], "models_only.yaml")
    snakemake(workdir, *ARGS, "--configfile", *configs, timeout=900)
    return workdir


@pytest.mark.slow
def test_chat_data_with_system_turns_trains_end_to_end(own_run):
    stats = json.loads((own_run / "results/data/conversations/stats.json").read_text())
    assert stats["format"] == "chat"
    assert stats["dropped"] == {**dict.fromkeys(CHAT_DROPS, 1), "language": 0, "duplicate": 1}
    assert stats["empty_system_turns_removed"] == 1 and stats["trailing_user_turns_cut"] == 1
    assert stats["trailing_tool_results_cut"] == 1
    assert stats["rows_kept"] == 59 == sum(stats["conversations"].values())
    assert (
        sum(stats["with_system_turn"].values()) == 16 + 2
    )  # every third of 48, every fourth tool-calling one
    assert sum(stats["with_tool_calls"].values()) == 8 + 1
    files = [own_run / f"results/data/conversations/{split}.parquet" for split in ("train", "validation")]
    kept = [m for f in files for m in pq.read_table(f).column("messages").to_pylist()]
    assert sum(m[0]["role"] == "system" and m[0]["content"] == SYSTEM for m in kept) == 18
    parallel = [m for m in kept if m[1]["tool_calls"] and len(m[1]["tool_calls"]) == 2]
    assert len(parallel) == 2 and [t["role"] for t in parallel[0][2:4]] == ["tool", "tool"]
    (tokenized,) = (own_run / "results/tokenized").iterdir()
    tok_stats = json.loads((tokenized / "stats.json").read_text())
    assert sum(s["conversations"] for s in tok_stats["splits"].values()) == 59
    check = tok_stats["template_check"]  # every row proven before training
    assert check["conversations_checked"] == 59 and check["conversations_with_tools"] == 9
    assert check["end_of_turn"] == EOS and check["tool_rendering"] == "project"
    assert "Template check, before training" in (own_run / "results/report/report.md").read_text()
    summary = json.loads((own_run / "results/train/default/summary.json").read_text())
    assert summary["steps"] == 4


@pytest.mark.slow
def test_a_pairs_file_tunes_the_sft_model(own_run):
    source = yaml.safe_load(readme_example()["config"])["preference"]["source"]
    directory = own_run / f"results/data/preferences/file-{sha256_file(own_run / source)[:12]}"
    stats = json.loads((directory / "stats.json").read_text())
    assert stats["dropped"] == dict.fromkeys(
        ("tool_use", "empty_content", "roles_out_of_order", "identical", "duplicate"), 1
    )
    assert stats["rows_kept"] == 44 == sum(stats["pairs"].values())
    assert sum(stats["with_system_turn"].values()) == 10 + 1  # shape 1 of 4, the third tool-calling pair
    assert sum(stats["with_tool_calls"].values()) == 4
    prompts = pq.read_table(directory / "train.parquet").column("prompt").to_pylist()
    assert all(p[-1]["role"] in ("user", "tool") for p in prompts)
    dpo = json.loads((own_run / "results/dpo/default/summary.json").read_text())
    assert dpo["steps"] == 4
    metrics = json.loads((own_run / "results/eval/default/metrics.json").read_text())
    assert "dpo" in json.dumps(metrics)
    assert (own_run / "results/report/index.html").is_file()


@pytest.mark.slow
def test_naming_the_format_auto_found_reruns_no_data_stage(own_run):
    """auto is resolved when the config loads, so writing the format it found changes no stage's params."""
    (own_run / "format.yaml").write_text("dataset: {format: chat}\n")
    configs = ("tiny.yaml", readme_example()["config_name"], "models_only.yaml")
    code, output = dry_run(own_run, (*ARGS, "--configfile", *configs))
    assert code == 0 and job_stats(output) == {}, output[-2000:]
    code, output = dry_run(own_run, (*ARGS, "--configfile", *configs, "format.yaml"))
    assert code == 0 and set(job_stats(output)) == {"report", "all"}, output[-2000:]


# ---- system turns through both chat templates -----------------------------------------------------------------

CONVERSATION = [turn("system", "Answer briefly."), turn("user", "Hi there"), turn("assistant", "Hello.")]


def trained_text(tok, ids: list[int], labels: list[int]) -> str:
    return tok.decode([i for i, label in zip(ids, labels, strict=True) if label != IGNORE_INDEX])


def test_the_deepseek_template_renders_a_system_turn_without_loss(tok_dir):
    tok = load_tokenizer(tok_dir, "deepseek")
    ids, labels = encode_conversation(tok, CONVERSATION, assistant_only_loss=True)
    # DeepSeek-LLM-chat's own template (tokenizer_config.json of deepseek-llm-7b-chat): a system turn is its text and
    # a blank line, before the first user turn.
    assert tok.decode(ids) == f"{BOS}Answer briefly.\n\nUser: Hi there\n\nAssistant: Hello.{EOS}"
    assert trained_text(tok, ids, labels) == f" Hello.{EOS}"


def test_the_models_own_template_renders_a_system_turn_without_loss(tmp_path, tok_dir):
    tok = load_tokenizer(chatml_tokenizer(tok_dir, tmp_path / "tok"), "model")
    ids, labels = encode_conversation(tok, CONVERSATION, assistant_only_loss=True)
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>\n<|im_start|>user\nHi there")
    assert "helpful assistant" not in text  # the data's system turn, not the template's default
    assert trained_text(tok, ids, labels) == "Hello.<|im_end|>\n"


def test_a_template_that_refuses_system_turns_names_the_conversation(tmp_path, tok_dir):
    refusing = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}{% endif %}"
    tok = load_tokenizer(chatml_tokenizer(tok_dir, tmp_path / "tok", refusing + CHATML), "model")
    with pytest.raises(
        TemplateError, match=r"conversation index 1: .*roles system, user, assistant.*System role not"
    ):
        list(encode_conversations(tok, [CONVERSATION[1:], CONVERSATION], assistant_only_loss=True))


def test_eval_prompts_auto_asks_the_first_user_turn(tmp_path):
    directory = tmp_path / "conversations"
    directory.mkdir()
    from chat_data import write_conversations

    write_conversations(directory / "validation.parquet", [CONVERSATION])
    assert resolve_prompts("auto", builtin_dataset=False, conversations_dir=directory) == [
        {"prompt": "Hi there", "expected": "Hello."}
    ]


# ---- splits ------------------------------------------------------------------------------------------------------


def conversations_of(tmp_path: Path, records: list[dict], **settings):
    tmp_path.mkdir(parents=True, exist_ok=True)
    download.materialize(str(write_jsonl(tmp_path / "c.jsonl", records)), tmp_path / "raw")
    return conversations_of_file(tmp_path / "raw/messages.parquet", **settings)


def test_a_split_column_is_the_split(tmp_path):
    records = [{**r, "split": "validation" if i < 5 else "train"} for i, r in enumerate(chats(20)[:20])]
    result = conversations_of(tmp_path, records, validation_fraction=0.5)
    assert result.stats["split_source"] == "source"
    assert len(result.validation) == 5 and len(result.train) == 15


def test_the_hash_split_follows_the_id_not_the_file_order(tmp_path):
    records = [{**r, "id": f"conv-{i}"} for i, r in enumerate(chats(30)[:30])]
    first = conversations_of(tmp_path / "a", records, validation_fraction=0.3)
    second = conversations_of(tmp_path / "b", records[::-1], validation_fraction=0.3)
    assert 0 < len(first.validation) < 30
    assert first.validation["conversation_id"].tolist() == second.validation["conversation_id"].tolist()


# ---- telling the formats apart, and refusing what cannot run ---------------------------------------------------

OASST_ROW = {"message_id": "m", "parent_id": None, "role": "prompter", "text": "hi"}


@pytest.mark.parametrize(
    ("record", "expected"),
    [
        (OASST_ROW, "oasst"),
        ({"message_tree_id": "t", "prompt": {**OASST_ROW, "replies": []}}, "oasst"),
        ({"messages": CONVERSATION}, "chat"),
    ],
)
def test_auto_tells_the_format_from_the_fields(tmp_path, record, expected):
    assert detect_format(write_jsonl(tmp_path / "d.jsonl", [record])) == expected


def test_a_file_with_both_formats_fields_is_ambiguous(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{**OASST_ROW, "messages": CONVERSATION}])
    with pytest.raises(DataError) as e:
        detect_format(path)
    assert str(e.value) == (
        f"{path}: line 1 has the chat format's `messages` and oasst's message fields (message_id, parent_id, role, "
        "text), so its format is ambiguous; allowed: set dataset.format to chat or oasst"
    )


def test_a_pairs_file_given_as_the_dataset_names_its_fields_and_where_it_belongs(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError) as e:
        detect_format(path)
    assert str(e.value).startswith(
        f"{path}: cannot tell the format: line 1 has the fields chosen, prompt, rejected,"
    )
    assert "give this file as preference.source" in str(e.value)
    assert str(e.value).endswith("allowed: a file in one of them, dataset.format: oasst | chat")


def config_for(tmp_path: Path, dataset: dict, preference: dict | None = None):
    raw = {"dataset": dataset, **({"preference": preference} if preference else {})}
    return resolve_format(load_config(raw), tmp_path)


def test_chat_data_needs_a_pairs_file_or_no_preference_tuning(tmp_path):
    write_jsonl(tmp_path / "c.jsonl", chats(4))
    refusal = (
        "config key 'preference.source': 'dataset' pairs replies by the ranks of oasst-format data, and dataset.source "
        "'c.jsonl' is chat-format (no ranks); allowed: a pairs file (.jsonl, .jsonl.gz or .parquet with prompt, "
        "chosen, rejected) as preference.source, or preference.enabled: false"
    )
    with pytest.raises(ConfigError) as auto:  # told from the file
        config_for(tmp_path, {"source": "c.jsonl"})
    with pytest.raises(ConfigError) as named:  # named: refused as the config loads, before the file is read
        load_config({"dataset": {"source": "missing.jsonl", "format": "chat"}})
    assert str(auto.value) == str(named.value).replace("missing.jsonl", "c.jsonl") == refusal
    cfg = config_for(tmp_path, {"source": "c.jsonl"}, {"enabled": False})
    assert cfg.dataset.format == cfg.experiments["default"].dataset.format == "chat"
    assert config_for(tmp_path, {"source": "c.jsonl"}, {"source": "p.jsonl"}).dataset.format == "chat"


def test_builtin_and_hub_data_are_oasst():
    with pytest.raises(ConfigError, match="'dataset.format': 'chat' with dataset.source 'builtin'"):
        load_config({"dataset": {"format": "chat"}})
    assert resolve_format(load_config({})).dataset.format == "oasst"


def test_the_dag_time_detector_knows_oasst_fields():
    """snaketune.data.formats keeps its own copy of oasst's required fields (it must not import pandas)."""
    from snaketune.data import formats, messages

    assert formats.OASST_FIELDS == messages.REQUIRED_COLUMNS
