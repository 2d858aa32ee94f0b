"""The benchmark tasks defined in this repository, on local data: lm-evaluation-harness task files (tasks/*.yaml)
whose data the job writes before the harness reads it (`dataset_path: json` with `data_files`), so that they run
offline.

- ``builtin_choice`` (multiple choice): the correct reply beside up to three replies of the same form with a
  wrong fact, scored by log-likelihood (acc, acc_norm).
- ``builtin_answer`` (generation): the greedy reply, stripped, must equal the exact answer (exact_match), as in
  the evaluate stage.
- ``mmlu_dev`` (multiple choice, general knowledge): MMLU's dev questions as the pinned lm-eval ships them.

The builtin tasks ask the evaluate stage's exact-match questions (``eval_examples`` with its seed) in the same
order, so a ``limit`` of n asks the first n of them; few-shot examples come from questions outside that set.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from pathlib import Path

import yaml

from snaketune.data.builtin import (
    Question,
    all_questions,
    answer_text,
    eval_examples,
    flawed_answer_text,
    question_text,
)

TASK_DIR = Path(__file__).resolve().parent / "tasks"
LOCAL_TASKS = ("builtin_choice", "builtin_answer", "mmlu_dev")
"""The task names this repository defines; any other name is the harness's own (read from the hub)."""
QUESTIONS_SEED = 1
"""eval_examples' seed: the evaluate stage's exact-match questions (snaketune.evaluation.evaluate)."""
TEST_DOCS = 200
"""Questions per task (40 per question type); `limit` takes the first ones."""
FEWSHOT_DOCS = 40
FEWSHOT_SEED = 2
DISTRACTORS = 3
"""Wrong replies per multiple-choice question, where the question type has that many (a sum near 0 or 18, or a
word said once or three times, has fewer)."""


def is_local(name: str) -> bool:
    return name in LOCAL_TASKS


def definition_path(name: str) -> Path:
    return TASK_DIR / f"{name}.yaml"


def definition_sha256(name: str) -> str:
    """The task file's hash, and its data file's where the data comes from a file: part of the benchmark's task
    spec (neither is covered by the stage's code hash)."""
    digest = hashlib.sha256(definition_path(name).read_bytes())
    if name == "mmlu_dev":
        digest.update(mmlu_prompts_file().read_bytes())
    return digest.hexdigest()


def mmlu_prompts_file() -> Path:
    """lm-eval's FLAN chain-of-thought prompts for MMLU: five dev questions per subject, with options and answer."""
    import lm_eval

    return Path(lm_eval.__file__).parent / "tasks" / "mmlu" / "flan_cot_fewshot" / "_cot_prompts.json"


_MMLU_QUESTION = re.compile(
    r"^(?P<question>.+?)\n\(A\) (?P<a>.+?) \(B\) (?P<b>.+?) \(C\) (?P<c>.+?) \(D\) (?P<d>.+?)\nA: .*"
    r"The answer is \((?P<answer>[ABCD])\)\.?$",
    re.S,
)


def mmlu_dev_questions() -> list[dict]:
    """{"subject", "question", "choices", "label"} of each dev question whose options and answer parse cleanly
    (the prompts file holds a few with other layouts, and a few whose LaTeX lost its backslashes to JSON escapes:
    control characters; both are left out), subjects in order."""
    out = []
    for subject, text in json.loads(mmlu_prompts_file().read_text(encoding="utf-8")).items():
        for block in text.split("\n\nQ: ")[1:]:  # after the subject's header line
            m = _MMLU_QUESTION.match(block.strip())
            if not m or any(ord(c) < 32 and c not in "\n\t" for c in block):
                continue
            choices = [m[k].strip() for k in "abcd"]
            if any("\n" in c or not c for c in choices):
                continue
            out.append(
                {
                    "subject": subject,
                    "question": m["question"].strip(),
                    "choices": choices,
                    "label": "ABCD".index(m["answer"]),
                }
            )
    return out


@functools.cache
def _questions_by_prompt() -> dict[str, Question]:
    return {question_text(q): q for q in all_questions()}


def _test_questions() -> list[dict[str, str]]:
    return eval_examples(TEST_DOCS, seed=QUESTIONS_SEED)


def _fewshot_questions(test: list[dict[str, str]]) -> list[dict[str, str]]:
    """Questions outside the test set, drawn with their own seed (the few-shot pool)."""
    asked = {e["prompt"] for e in test}
    pool = [p for p in _questions_by_prompt() if p not in asked]
    random.Random(FEWSHOT_SEED).shuffle(pool)
    return [{"prompt": p, "answer": answer_text(_questions_by_prompt()[p])} for p in pool[:FEWSHOT_DOCS]]


def choice_doc(example: dict[str, str], rng: random.Random) -> dict:
    """{"question", "choices", "label"}: the correct reply at a random place among replies of the same form that
    state a wrong fact."""
    q = _questions_by_prompt()[example["prompt"]]
    right = example["answer"]
    wrong: list[str] = []
    for _ in range(10 * DISTRACTORS):  # the wrong values are drawn; a type with few of them repeats draws
        text = flawed_answer_text(q, "wrong_value", rng)
        if text != right and text not in wrong:
            wrong.append(text)
        if len(wrong) == DISTRACTORS:
            break
    label = rng.randrange(len(wrong) + 1)
    choices = [*wrong[:label], right, *wrong[label:]]
    return {"question": example["prompt"], "choices": choices, "label": label}


def answer_doc(example: dict[str, str]) -> dict:
    return {"question": example["prompt"], "answer": example["answer"]}


def docs(name: str) -> dict[str, list[dict]]:
    """The task's splits: test (the questions asked) and fewshot (examples for few-shot prompts)."""
    if name == "mmlu_dev":
        # The last question of each subject is the few-shot pool (drawn from for any subject: the harness picks
        # few-shot examples from the whole split), the rest are asked, subjects in order.
        questions = mmlu_dev_questions()
        last = {q["subject"]: i for i, q in enumerate(questions)}
        fewshot_ids = set(last.values())
        return {
            "test": [q for i, q in enumerate(questions) if i not in fewshot_ids],
            "fewshot": [questions[i] for i in sorted(fewshot_ids)],
        }
    test = _test_questions()
    fewshot = _fewshot_questions(test)
    if name == "builtin_choice":
        rng = random.Random(QUESTIONS_SEED)
        return {"test": [choice_doc(e, rng) for e in test], "fewshot": [choice_doc(e, rng) for e in fewshot]}
    if name == "builtin_answer":
        return {"test": [answer_doc(e) for e in test], "fewshot": [answer_doc(e) for e in fewshot]}
    raise ValueError(f"unknown local task {name!r}; allowed: {', '.join(LOCAL_TASKS)}")


def materialize(name: str, scratch: str | Path) -> dict:
    """Write the task's data under `scratch` and return its harness config (a dict lm_eval takes as a task), with
    data_files pointing there and the datasets cache inside `scratch` (nothing written elsewhere)."""
    scratch = Path(scratch)
    config = yaml.safe_load(definition_path(name).read_text())
    files = config["dataset_kwargs"]["data_files"]
    for split, rows in docs(name).items():
        key = "test" if split == "test" else "validation"
        path = scratch / files[key]
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
        files[key] = str(path)
    config["dataset_kwargs"]["cache_dir"] = str(scratch / "datasets_cache")
    return config
