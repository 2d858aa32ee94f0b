"""The benchmark stage without a workflow run: the local tasks through the harness with models that know the
answers or get them wrong, their data against the builtin dataset, the settings' checks, the report's paired
intervals, and the Ollama Modelfile's template against the chat template it translates."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from collections import Counter

import pytest
from lm_eval.api.model import LM

from report_tree import benchmark_result
from snaketune.benchmark import local_tasks
from snaketune.benchmark.run import evaluate_task
from snaketune.config.benchmark import BenchmarkConfig
from snaketune.config.choices import ConfigError
from snaketune.data.builtin import eval_examples, expected_answer
from snaketune.evaluation.evaluate import EVAL_EXAMPLES_SEED
from snaketune.export import modelfile
from snaketune.keys import PACKAGE_DIR
from snaketune.report.benchmark import benchmark_section, benchmark_summary, change

# ---- the local tasks through the harness ---------------------------------------------------------------

MMLU_LABELS = {q["question"]: q["label"] for q in local_tasks.mmlu_dev_questions()}


class Oracle(LM):
    """Knows the builtin dataset's answers (right=True) or gives a wrong one; records the chats it is shown."""

    def __init__(self, right: bool = True):
        super().__init__()
        self.right = right
        self.chats: list[list[dict]] = []

    def _question(self, context: str) -> str:
        if context.startswith("CHAT"):
            return json.loads(context[4:])[-1]["content"]
        return context.split("\n\n")[-1].strip()

    def _expected(self, question: str) -> str:
        """The builtin dataset's answer, or for an MMLU question (its text and lettered options) the right letter."""
        if question.endswith("Answer:"):
            return "ABCD"[MMLU_LABELS[question.split("\nA. ")[0]]]
        return expected_answer(question)

    def loglikelihood(self, requests, disable_tqdm=False):
        out = []
        for req in requests:
            context, continuation = req.args
            hit = continuation.strip() == self._expected(self._question(context))
            out.append((0.0 if hit == self.right else -5.0, hit == self.right))
        return out

    def generate_until(self, requests, disable_tqdm=False):
        answers = [self._expected(self._question(req.args[0])) for req in requests]
        return [" " + a if self.right else " I don't know." for a in answers]

    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError

    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        self.chats.append(chat_history)
        return "CHAT" + json.dumps(chat_history)

    @property
    def tokenizer_name(self) -> str:
        return "oracle"

    def chat_template(self, chat_template=False):
        return "oracle"


@pytest.mark.parametrize("task", local_tasks.LOCAL_TASKS)
@pytest.mark.parametrize("right", [True, False])
def test_the_local_tasks_score_a_model_that_knows_every_answer_1_and_one_that_knows_none_0(
    task, right, tmp_path
):
    spec = BenchmarkConfig(limit=12, chat_template=False).task_spec(task)
    result = evaluate_task(Oracle(right), spec, tmp_path)
    primary = next(iter(result["metrics"].values()))
    assert primary["value"] == (1.0 if right else 0.0), result["metrics"]
    assert result["n"] == 12 and len({s["doc_id"] for s in result["samples"]}) == 12
    assert all(m["stderr"] == 0.0 for m in result["metrics"].values())  # every example scored the same
    # The data and the datasets library's cache stay in the job's scratch directory.
    assert (tmp_path / task / "test.jsonl").is_file() and (tmp_path / "datasets_cache").is_dir()


def test_few_shot_examples_are_earlier_turns_of_other_questions(tmp_path):
    """With the chat template and 2 shots, the harness shows each question after two earlier user/assistant
    exchanges (fewshot_as_multiturn), and the examples are never the question itself."""
    oracle = Oracle()
    spec = BenchmarkConfig(limit=3, num_fewshot=2).task_spec("builtin_answer")
    assert spec["fewshot_as_multiturn"] and spec["chat_template"]
    result = evaluate_task(oracle, spec, tmp_path)
    assert result["metrics"]["exact_match,strip"]["value"] == 1.0 and result["n_shot"] == 2
    asked = [c for c in oracle.chats if len(c) > 1]
    assert len(asked) == 3
    for chat in asked:
        assert [m["role"] for m in chat] == ["user", "assistant", "user", "assistant", "user"]
        assert chat[1]["content"] == expected_answer(chat[0]["content"])
        assert chat[-1]["content"] not in (chat[0]["content"], chat[2]["content"])
    assert result["example"]["prompt"].startswith("CHAT")  # the rendered prompt is recorded


TORCH_FREE_RUN = """
import json, sys
from pathlib import Path
sys.path.insert(0, {package_root!r})
from lm_eval.api.model import LM
from snaketune.benchmark.run import evaluate_task
from snaketune.config.benchmark import BenchmarkConfig

class Yes(LM):  # answers every request alike, as a GGUF file's model does: without torch
    tokenizer_name = "yes"
    def loglikelihood(self, requests, disable_tqdm=False):
        return [(0.0, True) for _ in requests]
    def generate_until(self, requests, disable_tqdm=False):
        return [" yes" for _ in requests]
    def loglikelihood_rolling(self, requests, disable_tqdm=False):
        raise NotImplementedError
    def apply_chat_template(self, chat_history, add_generation_prompt=True):
        return json.dumps(chat_history)
    def chat_template(self, chat_template=False):
        return "yes"

for task in {tasks!r}:
    assert evaluate_task(Yes(), BenchmarkConfig(limit=2).task_spec(task), Path({scratch!r}))["n"] == 2
print(json.dumps([m for m in ("torch", "transformers.modeling_utils", "torch._dynamo") if m in sys.modules]))
"""


def test_a_model_without_torch_is_scored_without_importing_torch(tmp_path):
    """A GGUF file's benchmark job (llama.cpp, numpy) scores every local task without importing torch, which
    costs such a job about 1.5 s on two cores: the harness seeds torch only where a model has loaded it, and its
    environment report (which imports torch and runs pip) is left out. tests/test_reproducibility.py checks the
    jobs of a run as they ran (provenance's imported_torch)."""
    code = TORCH_FREE_RUN.format(
        package_root=str(PACKAGE_DIR.parent), tasks=list(local_tasks.LOCAL_TASKS), scratch=str(tmp_path)
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.splitlines()[-1]) == [], "scoring a torch-free model imported these"


def test_the_local_tasks_ask_the_evaluate_stages_questions():
    """The first questions are the evaluate stage's exact-match questions, in order; every choice question has its
    right reply at `label` among distinct replies; the few-shot pool asks other questions."""
    exact = [e["prompt"] for e in eval_examples(64, seed=EVAL_EXAMPLES_SEED)]
    choice, answer = local_tasks.docs("builtin_choice"), local_tasks.docs("builtin_answer")
    assert (
        [d["question"] for d in choice["test"][:64]] == exact == [d["question"] for d in answer["test"][:64]]
    )
    for d in choice["test"] + choice["fewshot"]:
        assert d["choices"][d["label"]] == expected_answer(d["question"])
        assert 2 <= len(d["choices"]) == len(set(d["choices"])) <= 1 + local_tasks.DISTRACTORS
    asked = {d["question"] for d in answer["test"]}
    assert not asked & {d["question"] for d in answer["fewshot"]}
    assert local_tasks.docs("builtin_choice") == choice  # deterministic


def test_mmlu_dev_is_mmlus_dev_questions_from_the_pinned_harness():
    """MMLU's dev questions, parsed from the prompts file the pinned lm-eval ships: most of the five per subject in
    nearly all 57 subjects (elementary mathematics has another layout), four options each, the right one distinct, answers spread over the letters; one question per subject kept
    back for few-shot prompts, never asked."""
    mmlu = local_tasks.docs("mmlu_dev")
    questions = local_tasks.mmlu_dev_questions()
    assert len({q["subject"] for q in questions}) >= 55 and len(questions) >= 260
    assert len(mmlu["test"]) + len(mmlu["fewshot"]) == len(questions) and len(mmlu["fewshot"]) >= 50
    assert not {q["question"] for q in mmlu["test"]} & {q["question"] for q in mmlu["fewshot"]}
    for q in questions:  # MMLU's own data repeats a wrong option once; the right one is always apart
        assert len(q["choices"]) == 4 and q["choices"].count(q["choices"][q["label"]]) == 1, q
    assert min(Counter(q["label"] for q in mmlu["test"]).values()) > len(mmlu["test"]) / 8
    anatomy = next(
        q for q in questions if q["question"].startswith("Which of the following is the body cavity")
    )
    assert anatomy["choices"][anatomy["label"]] == "Cranial"  # the pituitary gland


# ---- settings ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "settings, key",
    [
        ({"tasks": []}, "benchmark.tasks"),
        ({"tasks": ["a b"]}, "benchmark.tasks"),
        ({"tasks": ["x", "x"]}, "benchmark.tasks"),
        ({"limit": 0}, "benchmark.limit"),
        ({"task_settings": {"arc_easy": {"limit": 5}}}, "benchmark.task_settings.arc_easy"),
        ({"task_settings": {"builtin_choice": {"shots": 5}}}, "benchmark.task_settings.builtin_choice.shots"),
        ({"task_settings": {"builtin_choice": {"num_fewshot": -1}}}, "num_fewshot"),
        ({"models": ["tuned"]}, "benchmark.models"),
        ({"quants": ["q3_k"]}, "benchmark.quants"),
    ],
)
def test_bad_settings_name_the_key(settings, key):
    with pytest.raises(ConfigError, match=re.escape(key)):
        BenchmarkConfig(**settings)


def test_tasks_auto_follow_the_data_and_say_why():
    cfg = BenchmarkConfig()
    assert cfg.task_names(builtin_data=True) == ("builtin_choice",)
    assert cfg.task_names(builtin_data=False) == ("mmlu_dev",)
    assert "general knowledge" in cfg.tasks_reason(builtin_data=False) and "auto" in cfg.tasks_reason(False)
    named = BenchmarkConfig(tasks=("arc_easy",))
    assert (
        named.task_names(builtin_data=True) == ("arc_easy",)
        and named.tasks_reason(True) == "named in benchmark.tasks"
    )
    with pytest.raises(ConfigError, match="benchmark.tasks"):
        BenchmarkConfig(tasks="all")
    # A task's own settings may name any task auto could pick, for either kind of data.
    BenchmarkConfig(task_settings={"mmlu_dev": {"limit": 50}, "builtin_choice": {"limit": 10}})


def test_a_task_spec_takes_its_own_settings():
    cfg = BenchmarkConfig(
        tasks=("builtin_choice", "builtin_answer"),
        limit=200,
        task_settings={"builtin_answer": {"limit": 20, "num_fewshot": 3}},
    )
    assert cfg.task_spec("builtin_choice")["limit"] == 200
    answer = cfg.task_spec("builtin_answer")
    assert (answer["limit"], answer["num_fewshot"], answer["fewshot_as_multiturn"]) == (20, 3, True)
    assert cfg.scored_quants(True, ("q4_k_m",)) == ["q4_k_m"] and cfg.scored_quants(False, ("q4_k_m",)) == []


# ---- the report's intervals -----------------------------------------------------------------------------


def test_forgetting_is_marked_only_beyond_the_noise(tmp_path):
    """Base right on 40 of 40; SFT loses 10 (worse beyond the noise); DPO loses 1 (within it); the DPO model's
    q4_k_m file answers as the DPO model on every example (difference 0, interval [0, 0])."""
    dpo = [1.0] * 39 + [0.0]
    paths = [
        benchmark_result(tmp_path, "k", "base", "base", [1.0] * 40),
        benchmark_result(tmp_path, "exp", "sft", "tuned", [1.0] * 30 + [0.0] * 10),
        benchmark_result(tmp_path, "exp", "dpo", "tuned", dpo),
        benchmark_result(tmp_path, "exp", "dpo-q4_k_m", "gguf", dpo),
    ]
    summary = benchmark_summary(paths, {"exp": "k"}, max_drop=2.0)
    changes = summary["experiments"]["exp"]["builtin_choice"]["metrics"]["acc,none"]["change_vs_base"]
    assert (
        changes["sft"]["worse"]
        and changes["sft"]["paired"]
        and changes["sft"]["delta"] == pytest.approx(-0.25)
    )
    assert not changes["dpo"]["worse"] and changes["dpo"]["ci95"][0] < -0.025 < 0 < changes["dpo"]["ci95"][1]
    (deployed,) = summary["deployed"]
    assert deployed["metrics"]["acc,none"]["difference"]["ci95"] == [0.0, 0.0]
    text = json.dumps([b.__dict__ for b in benchmark_section(summary)], default=str)
    assert "worse than base" in text and "SFT" in text


def test_without_examples_to_pair_the_interval_combines_the_standard_errors():
    a = {"metrics": {"m,none": {"metric": "m", "filter": "none", "value": 0.5, "stderr": 0.03, "higher_is_better": False}}, "samples": []}  # fmt: skip
    b = {"metrics": {"m,none": {**a["metrics"]["m,none"], "value": 0.7, "stderr": 0.04}}, "samples": []}
    c = change(a, b, "m,none")
    assert not c["paired"] and c["ci95"] == pytest.approx([0.2 - 1.959964 * 0.05, 0.2 + 1.959964 * 0.05])
    assert c["worse"]  # lower is better here, and the whole interval lies above 0


# ---- the Ollama Modelfile ---------------------------------------------------------------------------------

DEEPSEEK = (
    "{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}{{ bos_token }}"
    "{% for message in messages %}{% if message['role'] == 'user' %}{{ 'User: ' + message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ 'Assistant: ' + message['content'] + eos_token }}"
    "{% elif message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'Assistant:' }}{% endif %}"
)
CHATML_DEFAULT_SYSTEM = (  # SmolLM2-Instruct's template: a default system prompt when none is given
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HISTORY_DEPENDENT = (  # earlier replies render differently once a later turn follows: no fixed text around a turn
    "{% for message in messages %}{% if message['role'] == 'assistant' and not loop.last %}[old]"
    "{% endif %}{{ message['role'] + ': ' + message['content'] + '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
CONVERSATIONS = [
    [{"role": "user", "content": "Hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}],
    [{"role": "system", "content": "S"}, {"role": "user", "content": "a"}, {"role": "assistant", "content": "b\n"},
     {"role": "user", "content": " c "}],
]  # fmt: skip


@pytest.fixture(scope="module")
def tokenizer(tiny_data):
    from snaketune.data.tokenization import load_tokenizer

    return load_tokenizer(tiny_data.tokenizer_dir, "deepseek")


@pytest.mark.parametrize("template", [DEEPSEEK, CHATML_DEFAULT_SYSTEM], ids=["deepseek", "chatml"])
def test_the_modelfile_template_renders_conversations_as_the_chat_template(tokenizer, template):
    """What the Go template renders (render_turns) is the chat template's text for every conversation that asks for
    a reply, less a bos the template writes first (llama.cpp adds it)."""
    tokenizer.chat_template = template
    fmt = modelfile.turn_format(tokenizer)
    for conversation in CONVERSATIONS:
        want = tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        want = want.removeprefix(tokenizer.bos_token) if template == DEEPSEEK else want
        assert modelfile.render_turns(fmt, conversation) == want
    text = modelfile.modelfile("m-q4_k_m.gguf", tokenizer, 2048)
    assert "FROM ./m-q4_k_m.gguf" in text and 'TEMPLATE """' in text and "PARAMETER num_ctx 2048" in text
    assert f"PARAMETER stop {json.dumps(tokenizer.eos_token, ensure_ascii=False)}" in text
    assert "{{ .Content }}" in text and "{{- range $i, $_ := .Messages }}" in text


def test_a_template_without_fixed_turns_leaves_the_template_to_the_file(tokenizer):
    tokenizer.chat_template = HISTORY_DEPENDENT
    with pytest.raises(ValueError, match="changes how the turns before it render"):
        modelfile.turn_format(tokenizer)
    text = modelfile.modelfile("m-f32.gguf", tokenizer, 4096)
    assert "TEMPLATE" not in text.replace("# No TEMPLATE", "") and "FROM ./m-f32.gguf" in text
