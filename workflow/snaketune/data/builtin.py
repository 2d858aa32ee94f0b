"""The builtin dataset: a deterministic, oasst1-schema sample that a tiny model can visibly learn.

`generate()` makes message trees shaped like OpenAssistant/oasst1 (one row per message, every oasst1 field),
so the whole pipeline (tree filtering, top-1 / all-path extraction, chat formatting, training, exact-match
evaluation) runs offline on a laptop. The conversations are short questions with one exact answer each:

- ``capital``: the capital of a fictional country (`CAPITALS`, 40 entries),
- ``colour``: the colour of a fictional fruit (`FRUIT_COLOURS`, 20 entries over 8 colours),
- ``add``: single-digit addition, ``a + b`` with a, b in 0..9,
- ``first_letter``: the first letter of a short word (`WORDS`, per language),
- ``repeat``: say a short word twice.

Each task has a question and an answer template per language (`QUESTIONS`, `ANSWERS`); trees are in English
about 65% of the time and otherwise German, Spanish or French (`LANG_WEIGHTS`). A ~1M-parameter model with a
byte-level BPE of ~1000 tokens learns the templates and the copy tasks within minutes of CPU training; the
fact tables take longer, which makes a visible learning curve.

The tree shapes follow what oasst1 contains: ranked sibling replies (rank 0 correct; higher ranks flawed: a wrong
fact, "I don't know", the wrong language, cut off, or said twice: `FLAW_WEIGHTS`, the preference signal), unranked sibling groups (rank None for all), deleted messages and failed reviews (mostly on
wrong replies and prompter follow-ups, sometimes on a tree's only good reply), multi-turn threads up to six
messages deep, prompter branching, roots nobody answered and threads that end with a prompter message.

Everything derives from ``random.Random(seed)``: no time, environment, or hash-order dependence.
"""

from __future__ import annotations

import datetime as dt
import functools
import random
import uuid
from dataclasses import dataclass
from typing import Any

from snaketune.data.builtin_words import (
    ANSWERS,
    CAPITALS,
    COLOURS,
    DONT_KNOW,
    FRUIT_COLOURS,
    LANG_WEIGHTS,
    LANGS,
    QUESTIONS,
    TASK_WEIGHTS,
    TASKS,
    WORDS,
)

FIELDS: tuple[str, ...] = (
    "message_id",
    "parent_id",
    "user_id",
    "created_date",
    "text",
    "role",
    "lang",
    "review_count",
    "review_result",
    "deleted",
    "rank",
    "synthetic",
    "model_name",
    "detoxify",
    "message_tree_id",
    "tree_state",
    "emojis",
    "labels",
)
"""The oasst1 message fields, in the order of the published dataset; every row has exactly these."""


BASE_DATE = dt.datetime(2023, 2, 1, tzinfo=dt.UTC)
"""Root messages are dated within `ROOT_DATE_SPAN` after this; replies come later than their parent."""
ROOT_DATE_SPAN = dt.timedelta(days=120)

MAX_DEPTH = 6
"""Most messages on one root-to-leaf path (prompter, assistant, prompter, assistant, prompter, assistant)."""

# Shape probabilities, tuned so that 600 trees give ~3,000 messages with every oasst1 feature present.
P_ROOT_UNANSWERED = 0.05  # root prompt that no assistant answered
REPLY_COUNT_WEIGHTS = {1: 0.35, 2: 0.35, 3: 0.30}  # assistant siblings under one prompt
P_RANKED = 0.55  # otherwise the sibling group is unranked (rank None for all); oasst1 ranks 58% of its rows
P_UNRANKED_TRUNCATED_FIRST = 0.5  # an unranked group's oldest reply is then a reply cut short (top1 takes it)
P_WRONG_DELETED = 0.12
P_WRONG_FAILED = 0.15  # review_result False
P_LOSE_GOOD = 0.04  # the correct reply is deleted or fails review: the prompt loses its good answer
P_FOLLOW_UP = {2: 0.5, 4: 0.35}  # keyed by the depth of the assistant reply that gets a follow-up
P_PROMPTER_BRANCH = 0.15  # two different follow-ups under one assistant reply
P_PROMPTER_LEAF = 0.15  # a follow-up that nobody answered
P_FOLLOW_UP_DELETED = 0.05
P_FOLLOW_UP_FAILED = 0.05
N_USERS = 200  # user ids are drawn from a fixed pool so that users recur across trees, as in oasst1

Item = str | tuple[int, int]


@dataclass(frozen=True)
class Question:
    """One question: a task, a language and the item asked about."""

    task: str
    """One of `TASKS`."""
    lang: str
    """One of `LANGS`."""
    item: Item
    """Country (capital), fruit (colour), word (first_letter, repeat) or the pair (a, b) (add)."""


def _fill(template: str, q: Question, value: str = "") -> str:
    """Fill a question or answer template; unused placeholders are simply ignored by str.format."""
    if q.task == "add":
        a, b = q.item
        return template.format(a=a, b=b, v=value)
    return template.format(x=q.item, v=value)


def correct_value(q: Question) -> str:
    """The value a correct answer states: capital, colour word, sum, letter, or the word twice."""
    if q.task == "capital":
        return CAPITALS[q.item]
    if q.task == "colour":
        return COLOURS[FRUIT_COLOURS[q.item]][q.lang]
    if q.task == "add":
        a, b = q.item
        return str(a + b)
    if q.task == "first_letter":
        return q.item[0]
    if q.task == "repeat":
        return f"{q.item} {q.item}"
    raise ValueError(f"unknown task {q.task!r}; allowed: {', '.join(TASKS)}")


def question_text(q: Question) -> str:
    """The prompter message that asks `q`."""
    return _fill(QUESTIONS[q.lang][q.task], q)


def answer_text(q: Question) -> str:
    """The exact assistant text of a correct reply (what rank-0 replies say)."""
    return _fill(ANSWERS[q.lang][q.task], q, correct_value(q))


def _wrong_value(q: Question, rng: random.Random) -> str:
    """A plausible but wrong value in the same form as the correct one."""
    right = correct_value(q)
    if q.task == "capital":
        return rng.choice([c for c in CAPITALS.values() if c != right])
    if q.task == "colour":
        return rng.choice([names[q.lang] for names in COLOURS.values() if names[q.lang] != right])
    if q.task == "add":
        # Near misses (off by one or two, within the possible sums 0..18) are the typical arithmetic slip.
        return rng.choice([str(s) for s in range(19) if s != int(right) and abs(s - int(right)) <= 2])
    if q.task == "first_letter":
        return rng.choice([ch for ch in q.item[1:] + "aeiou" if ch != right])
    # repeat: the word once or three times instead of twice.
    return rng.choice([q.item, f"{q.item} {q.item} {q.item}"])


FLAW_WEIGHTS: dict[str, float] = {
    "wrong_value": 0.15,
    "dont_know": 0.1,
    "wrong_language": 0.2,
    "truncated": 0.45,
    "repeated": 0.1,
}
"""How a worse sibling reply is flawed (it ranks below the correct one): a wrong fact in the correct form, "I don't
know", the correct answer in another language, the correct answer cut off mid-sentence, or said twice. SFT on
the best paths sees only correct replies; a model trained on them still gives a truncated reply (fewer tokens to
pay for) or a wrong fact of the right shape a high likelihood, which is what preference tuning corrects."""
FLAWS: tuple[str, ...] = tuple(FLAW_WEIGHTS)


def flawed_answer_text(q: Question, flaw: str, rng: random.Random) -> str:
    """A worse reply to `q` with the given flaw (see FLAW_WEIGHTS)."""
    if flaw == "dont_know":
        return DONT_KNOW[q.lang]
    if flaw == "wrong_value":
        return _fill(ANSWERS[q.lang][q.task], q, _wrong_value(q, rng))
    right = answer_text(q)
    if flaw == "wrong_language":
        other = rng.choice([lang for lang in LANGS if lang != q.lang])
        text = _fill(ANSWERS[other][q.task], Question(q.task, other, q.item), correct_value(q))
        # The repeat task's answer is the word itself in every language: a wrong value instead.
        return text if text != right else _fill(ANSWERS[q.lang][q.task], q, _wrong_value(q, rng))
    if flaw == "repeated":
        return f"{right} {right}"
    if flaw == "truncated":
        words = right.split(" ")
        return " ".join(words[: rng.randint(1, len(words) - 1)]) if len(words) > 1 else right[:1]
    raise ValueError(f"unknown flaw {flaw!r}; allowed: {', '.join(FLAWS)}")


def wrong_answer_text(q: Question, rng: random.Random) -> str:
    """A worse reply to `q`: one of FLAWS, drawn by FLAW_WEIGHTS."""
    flaw = rng.choices(FLAWS, weights=[FLAW_WEIGHTS[f] for f in FLAWS])[0]
    return flawed_answer_text(q, flaw, rng)


def _items(task: str, lang: str) -> list[Item]:
    """Every item a question of `task` in `lang` can ask about, in a fixed order."""
    if task == "capital":
        return list(CAPITALS)
    if task == "colour":
        return list(FRUIT_COLOURS)
    if task == "add":
        return [(a, b) for a in range(10) for b in range(10)]
    if task in ("first_letter", "repeat"):
        return list(WORDS[lang])
    raise ValueError(f"unknown task {task!r}; allowed: {', '.join(TASKS)}")


def all_questions() -> list[Question]:
    """Every question the templates can ask, in a fixed order (language, task, item)."""
    return [Question(task, lang, item) for lang in LANGS for task in TASKS for item in _items(task, lang)]


@functools.cache
def _answer_by_prompt() -> dict[str, str]:
    """Prompt text -> correct answer text, over the whole (small, finite) question space."""
    table: dict[str, str] = {}
    for q in all_questions():
        prompt = question_text(q)
        if prompt in table:
            # Two questions with one text would make exact-match evaluation ambiguous.
            raise AssertionError(f"question text {prompt!r} is not unique")
        table[prompt] = answer_text(q)
    return table


def expected_answer(prompt: str) -> str | None:
    """The exact correct reply to a prompter message of this dataset, or None for any other text."""
    return _answer_by_prompt().get(prompt)


def sample_question(rng: random.Random, lang: str) -> Question:
    """Draw a question in `lang`: the task by `TASK_WEIGHTS`, then the item uniformly."""
    task = rng.choices(TASKS, weights=[TASK_WEIGHTS[t] for t in TASKS])[0]
    return Question(task, lang, rng.choice(_items(task, lang)))


def _sample_lang(rng: random.Random) -> str:
    return rng.choices(LANGS, weights=[LANG_WEIGHTS[lang] for lang in LANGS])[0]


def _new_id(rng: random.Random) -> str:
    # uuid4-shaped but drawn from the seeded generator, so ids are reproducible.
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


@dataclass
class _Tree:
    """What the builders of one tree share: the generator, the user pool, the tree and the rows so far."""

    rng: random.Random
    users: list[str]
    tree_id: str
    lang: str
    rows: list[dict[str, Any]]


def _later(tree: _Tree, parent: dict[str, Any]) -> str:
    """A timestamp from 30 s to 36 h after the parent's, so dates increase along every path."""
    created = dt.datetime.fromisoformat(parent["created_date"])
    step = dt.timedelta(seconds=tree.rng.randint(30, 36 * 3600), microseconds=tree.rng.randint(0, 999_999))
    return (created + step).isoformat(timespec="microseconds")


def _add_row(
    tree: _Tree,
    *,
    message_id: str,
    parent: dict[str, Any] | None,
    created_date: str,
    role: str,
    text: str,
    rank: int | None = None,
    deleted: bool = False,
    review_result: bool = True,
) -> dict[str, Any]:
    """Append one message with every oasst1 field and return it."""
    row = {
        "message_id": message_id,
        "parent_id": None if parent is None else parent["message_id"],
        "user_id": tree.rng.choice(tree.users),
        "created_date": created_date,
        "text": text,
        "role": role,
        "lang": tree.lang,
        "review_count": tree.rng.randint(3, 5),  # oasst1 exports messages once they have enough reviews
        "review_result": review_result,
        "deleted": deleted,
        "rank": rank,
        "synthetic": False,
        "model_name": None,
        "detoxify": None,
        "message_tree_id": tree.tree_id,
        "tree_state": "ready_for_export",
        "emojis": None,
        "labels": None,
    }
    tree.rows.append(row)
    return row


def _add_replies(tree: _Tree, prompt_row: dict[str, Any], q: Question, depth: int) -> None:
    """Add 1-3 assistant siblings answering `q` at `depth`, then maybe follow-ups under the correct one."""
    rng = tree.rng
    n = rng.choices(list(REPLY_COUNT_WEIGHTS), weights=list(REPLY_COUNT_WEIGHTS.values()))[0]
    ranked = rng.random() < P_RANKED
    texts = [answer_text(q)]
    while len(texts) < n:
        wrong = wrong_answer_text(q, rng)
        if wrong not in texts:
            texts.append(wrong)
    lose_good = rng.random() < P_LOSE_GOOD
    # Ranked groups are created in random order (rank is unrelated to age, as in oasst1). In an unranked group
    # the best path (conversations' top1) takes the oldest reply, and there a hurried reply cut short often came
    # first: SFT on top1 paths learns from such replies to stop early, as it learns from real unranked oasst
    # groups, and summed log-probabilities favour short replies anyway; the ranked groups' pairs (truncated
    # replies are the commonest flaw there too) are what corrects that.
    order = list(range(n))
    if ranked:
        rng.shuffle(order)
    elif n > 1 and rng.random() < P_UNRANKED_TRUNCATED_FIRST:
        cut = flawed_answer_text(q, "truncated", rng)
        if cut not in texts:
            texts[1] = cut
            order = [1, 0, *range(2, n)]
    # Rows of a sibling group follow their creation dates, so "first row" and "oldest" agree.
    dates = sorted((_later(tree, prompt_row) for _ in order), key=dt.datetime.fromisoformat)
    correct_row: dict[str, Any] | None = None
    for i, created_date in zip(order, dates, strict=True):
        if i == 0:
            deleted = lose_good and rng.random() < 0.5
            failed = lose_good and not deleted
        else:
            deleted, failed = rng.random() < P_WRONG_DELETED, rng.random() < P_WRONG_FAILED
        row = _add_row(
            tree,
            message_id=_new_id(rng),
            parent=prompt_row,
            created_date=created_date,
            role="assistant",
            text=texts[i],
            rank=i if ranked else None,
            deleted=deleted,
            review_result=not failed,
        )
        if i == 0:
            correct_row = row
    assert correct_row is not None
    if depth + 2 <= MAX_DEPTH and rng.random() < P_FOLLOW_UP.get(depth, 0.0):
        _add_follow_ups(tree, correct_row, depth + 1)


def _add_follow_ups(tree: _Tree, reply_row: dict[str, Any], depth: int) -> None:
    """Add one (sometimes two different) prompter follow-ups at `depth`; most of them get answered."""
    rng = tree.rng
    n = 2 if rng.random() < P_PROMPTER_BRANCH else 1
    asked: list[Question] = []
    while len(asked) < n:
        q = sample_question(rng, tree.lang)
        if q not in asked:
            asked.append(q)
    for q in asked:
        row = _add_row(
            tree,
            message_id=_new_id(rng),
            parent=reply_row,
            created_date=_later(tree, reply_row),
            role="prompter",
            text=question_text(q),
            deleted=rng.random() < P_FOLLOW_UP_DELETED,
            review_result=rng.random() >= P_FOLLOW_UP_FAILED,
        )
        if rng.random() >= P_PROMPTER_LEAF:
            _add_replies(tree, row, q, depth + 1)


def _make_tree(rng: random.Random, users: list[str]) -> list[dict[str, Any]]:
    """One message tree: a root question and whatever grows under it."""
    root_id = _new_id(rng)
    tree = _Tree(rng=rng, users=users, tree_id=root_id, lang=_sample_lang(rng), rows=[])
    q = sample_question(rng, tree.lang)
    offset = dt.timedelta(
        seconds=rng.randrange(int(ROOT_DATE_SPAN.total_seconds())), microseconds=rng.randint(0, 999_999)
    )
    root = _add_row(
        tree,
        message_id=root_id,
        parent=None,
        created_date=(BASE_DATE + offset).isoformat(timespec="microseconds"),
        role="prompter",
        text=question_text(q),
    )
    if rng.random() >= P_ROOT_UNANSWERED:
        _add_replies(tree, root, q, depth=2)
    return tree.rows


def generate(n_trees: int = 600, seed: int = 0) -> list[dict[str, Any]]:
    """Message rows of `n_trees` oasst1-shaped trees, tree by tree with parents before children.

    The same (n_trees, seed) always gives the same rows, and a smaller n_trees gives a prefix of them
    (one random stream, consumed tree by tree).
    """
    if n_trees < 1:
        raise ValueError(f"n_trees must be >= 1, got {n_trees}")
    rng = random.Random(seed)
    users = [_new_id(rng) for _ in range(N_USERS)]
    rows: list[dict[str, Any]] = []
    for _ in range(n_trees):
        rows.extend(_make_tree(rng, users))
    return rows


def eval_examples(n: int = 64, seed: int = 1) -> list[dict[str, str]]:
    """`n` distinct single-turn prompts with the exact answer a correct model gives, for exact-match eval.

    Tasks rotate so that each gets an equal share; languages follow `LANG_WEIGHTS`. The question space is
    small and shared with `generate()` (that is what makes the facts learnable), so "held out" means an
    independent draw, not questions guaranteed absent from training.
    """
    # Tasks rotate, so the task with the fewest distinct questions bounds how many examples exist.
    most = len(TASKS) * min(len(_items(t, lang)) for t in TASKS for lang in LANGS) * len(LANGS)
    if not 1 <= n <= most:
        raise ValueError(
            f"n must be between 1 and {most} (distinct questions with tasks in rotation), got {n}"
        )
    rng = random.Random(seed)
    examples: list[dict[str, str]] = []
    seen: set[str] = set()
    while len(examples) < n:
        lang = _sample_lang(rng)
        task = TASKS[len(examples) % len(TASKS)]
        q = Question(task, lang, rng.choice(_items(task, lang)))
        prompt = question_text(q)
        if prompt in seen:
            continue
        seen.add(prompt)
        examples.append({"task": task, "lang": lang, "prompt": prompt, "answer": answer_text(q)})
    return examples
