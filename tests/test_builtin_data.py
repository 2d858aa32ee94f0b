"""The builtin dataset: determinism, the oasst1 schema, tree invariants and the features downstream code handles."""

from __future__ import annotations

import collections
import datetime as dt
import itertools
import json
import random
from typing import Any

import pytest

from snaketune.config.choices import BUILTIN_EVAL_QUESTIONS
from snaketune.data import builtin as bd

FIELD_TYPES: dict[str, tuple[type, ...]] = {
    "message_id": (str,),
    "parent_id": (str, type(None)),
    "user_id": (str,),
    "created_date": (str,),
    "text": (str,),
    "role": (str,),
    "lang": (str,),
    "review_count": (int,),
    "review_result": (bool,),
    "deleted": (bool,),
    "rank": (int, type(None)),
    "synthetic": (bool,),
    "model_name": (type(None),),
    "detoxify": (type(None),),
    "message_tree_id": (str,),
    "tree_state": (str,),
    "emojis": (type(None),),
    "labels": (type(None),),
}


@pytest.fixture(scope="module")
def rows() -> list[dict[str, Any]]:
    return bd.generate(600, 0)


@pytest.fixture(scope="module")
def by_id(rows: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {r["message_id"]: r for r in rows}


@pytest.fixture(scope="module")
def children(rows: list[dict[str, Any]]) -> dict[str | None, list[dict[str, Any]]]:
    kids: dict[str | None, list[dict[str, Any]]] = collections.defaultdict(list)
    for r in rows:
        kids[r["parent_id"]].append(r)
    return kids


def _path(row: dict[str, Any], by_id: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Root-to-`row` messages."""
    path = [row]
    while path[-1]["parent_id"] is not None:
        path.append(by_id[path[-1]["parent_id"]])
    return path[::-1]


def _usable(row: dict[str, Any]) -> bool:
    return not row["deleted"] and row["review_result"]


def test_same_seed_same_rows_other_seed_other_rows() -> None:
    a = json.dumps(bd.generate(50, 3))
    assert a == json.dumps(bd.generate(50, 3))
    assert a != json.dumps(bd.generate(50, 4))
    assert json.dumps(bd.eval_examples(32, 5)) == json.dumps(bd.eval_examples(32, 5))
    assert json.dumps(bd.eval_examples(32, 5)) != json.dumps(bd.eval_examples(32, 6))


def test_smaller_call_is_a_prefix() -> None:
    small, large = bd.generate(20, 7), bd.generate(40, 7)
    assert large[: len(small)] == small


def test_generate_rejects_no_trees() -> None:
    with pytest.raises(ValueError, match="n_trees"):
        bd.generate(0)


def test_every_row_has_exactly_the_oasst1_fields(rows: list[dict[str, Any]]) -> None:
    assert tuple(FIELD_TYPES) == bd.FIELDS
    for r in rows:
        assert tuple(r) == bd.FIELDS
        for name, types in FIELD_TYPES.items():
            assert type(r[name]) in types, (name, r[name])
        assert r["role"] in ("prompter", "assistant")
        assert r["lang"] in bd.LANGS
        assert r["tree_state"] == "ready_for_export"
        assert r["synthetic"] is False
        assert r["review_count"] >= 0
        assert dt.datetime.fromisoformat(r["created_date"]).tzinfo is not None
        if r["role"] == "prompter":
            assert r["rank"] is None


def test_ids_unique_parents_precede_children_tree_ids_are_roots(rows: list[dict[str, Any]]) -> None:
    position = {r["message_id"]: i for i, r in enumerate(rows)}
    assert len(position) == len(rows)
    for i, r in enumerate(rows):
        if r["parent_id"] is None:
            assert r["role"] == "prompter"
            assert r["message_tree_id"] == r["message_id"]
            continue
        parent = rows[position[r["parent_id"]]]
        assert position[r["parent_id"]] < i
        assert r["message_tree_id"] == parent["message_tree_id"]
        assert r["role"] != parent["role"], "roles alternate along a thread"
        assert r["lang"] == parent["lang"]
        assert dt.datetime.fromisoformat(r["created_date"]) > dt.datetime.fromisoformat(
            parent["created_date"]
        )
    # Tree by tree: once a tree ends, its id never comes back.
    tree_order = [tid for tid, _ in itertools.groupby(r["message_tree_id"] for r in rows)]
    assert len(tree_order) == len(set(tree_order)) == 600


def test_size(rows: list[dict[str, Any]]) -> None:
    assert 2_000 <= len(rows) <= 6_000


def test_sibling_ranks(children: dict[str | None, list[dict[str, Any]]]) -> None:
    ranked_groups = unranked_groups = 0
    for parent_id, kids in children.items():
        replies = [k for k in kids if k["role"] == "assistant"]
        if parent_id is None or not replies:
            continue
        ranks = [k["rank"] for k in replies]
        if all(rank is None for rank in ranks):
            unranked_groups += 1
        else:
            assert sorted(ranks) == list(range(len(replies))), "ranks are 0..n-1 within a sibling group"
            ranked_groups += len(replies) >= 2
    assert ranked_groups >= 100
    assert unranked_groups >= 50


def test_features_present(
    rows: list[dict[str, Any]],
    by_id: dict[str, dict[str, Any]],
    children: dict[str | None, list[dict[str, Any]]],
) -> None:
    roots = children[None]
    leaves = [r for r in rows if not children[r["message_id"]]]
    assert sum(r["deleted"] for r in rows) >= 50
    assert sum(not r["review_result"] for r in rows) >= 50
    assert {r["lang"] for r in rows} >= {"en", "de", "es", "fr"}
    assert 0.55 <= sum(r["lang"] == "en" for r in roots) / len(roots) <= 0.75
    depths = collections.Counter(len(_path(leaf, by_id)) for leaf in leaves)
    assert max(depths) == bd.MAX_DEPTH
    assert sum(n for d, n in depths.items() if d >= 4) >= 100
    assert sum(not children[r["message_id"]] for r in roots) >= 10, "roots nobody answered"
    assert sum(leaf["role"] == "prompter" and leaf["parent_id"] is not None for leaf in leaves) >= 20
    prompter_branches = [r for r in rows if r["role"] == "assistant" and len(children[r["message_id"]]) >= 2]
    assert len(prompter_branches) >= 10


def test_flags_mostly_spare_the_good_path(
    rows: list[dict[str, Any]], children: dict[str | None, list[dict[str, Any]]]
) -> None:
    """Deleted / failed messages sit on wrong replies and follow-ups; a few prompts lose their good reply."""
    flagged = [r for r in rows if not _usable(r)]
    by_id = {r["message_id"]: r for r in rows}
    on_correct = [
        r
        for r in flagged
        if r["role"] == "assistant" and r["text"] == bd.expected_answer(by_id[r["parent_id"]]["text"])
    ]
    assert len(on_correct) < len(flagged) / 3
    answered = survived = 0
    for root in children[None]:
        replies = children[root["message_id"]]
        if not replies:
            continue
        answered += 1
        good = bd.expected_answer(root["text"])
        survived += any(r["text"] == good and _usable(r) for r in replies)
    assert answered - survived >= 5, "some trees must lose their only good reply"
    assert survived / answered >= 0.9


def test_rank0_replies_are_correct_and_others_are_not(
    rows: list[dict[str, Any]], by_id: dict[str, dict[str, Any]]
) -> None:
    for r in rows:
        if r["role"] == "prompter":
            assert bd.expected_answer(r["text"]) is not None, r["text"]
            continue
        good = bd.expected_answer(by_id[r["parent_id"]]["text"])
        if r["rank"] == 0:
            assert r["text"] == good
        elif r["rank"] is not None:
            assert r["text"] != good


def test_unranked_groups_start_with_the_correct_or_a_truncated_reply(
    by_id: dict[str, dict[str, Any]], children: dict[str | None, list[dict[str, Any]]]
) -> None:
    """The oldest reply of an unranked group (what top1 follows) is the correct one, or often a reply cut short
    (P_UNRANKED_TRUNCATED_FIRST), with the correct one among its siblings."""
    firsts = collections.Counter()
    for parent_id, kids in children.items():
        if (
            parent_id is None
            or len(kids) < 2
            or kids[0]["role"] != "assistant"
            or kids[0]["rank"] is not None
        ):
            continue
        good = bd.expected_answer(by_id[parent_id]["text"])
        first = min(kids, key=lambda k: dt.datetime.fromisoformat(k["created_date"]))
        assert any(k["text"] == good for k in kids)
        if first["text"] == good:
            firsts["correct"] += 1
        else:
            assert good.startswith(first["text"]) and first["text"] != good, first["text"]
            firsts["truncated"] += 1
    assert firsts["correct"] >= 20 and firsts["truncated"] >= 20, firsts


@pytest.mark.parametrize("flaw", bd.FLAWS)
def test_every_flaw_is_a_worse_reply(flaw: str) -> None:
    rng = random.Random(0)
    for q in bd.all_questions():
        text = bd.flawed_answer_text(q, flaw, rng)
        assert text != bd.answer_text(q), (flaw, q)
    q = bd.Question("capital", "en", "Zorvia")
    assert (
        bd.flawed_answer_text(q, "repeated", rng)
        == "The capital of Zorvia is Brelk. The capital of Zorvia is Brelk."
    )
    assert "The capital of Zorvia is Brelk.".startswith(bd.flawed_answer_text(q, "truncated", rng))
    assert bd.flawed_answer_text(q, "wrong_language", rng).endswith("Brelk.")


def test_ranked_groups_give_pairs_of_every_flaw(rows, by_id, children) -> None:
    """The preference signal: ranked groups hold rank-0 correct replies over each kind of flaw."""
    kinds = collections.Counter()
    for r in rows:
        if r["role"] != "assistant" or not r["rank"]:
            continue
        good = bd.expected_answer(by_id[r["parent_id"]]["text"])
        text = r["text"]
        if text in bd.DONT_KNOW.values():
            kinds["dont_know"] += 1
        elif text == f"{good} {good}":
            kinds["repeated"] += 1
        elif good.startswith(text):
            kinds["truncated"] += 1
        else:
            kinds["wrong_value_or_language"] += 1
    assert min(kinds.values()) >= 10 and len(kinds) == 4, kinds


def test_conversations_are_short(rows: list[dict[str, Any]], by_id: dict[str, dict[str, Any]]) -> None:
    leaf_ids = {r["message_id"] for r in rows} - {r["parent_id"] for r in rows}
    for leaf_id in leaf_ids:
        words = sum(len(m["text"].split()) for m in _path(by_id[leaf_id], by_id))
        assert words < 60


def test_question_texts_are_unique() -> None:
    questions = bd.all_questions()
    prompts = [bd.question_text(q) for q in questions]
    assert len(set(prompts)) == len(prompts)
    for q, prompt in zip(questions, prompts, strict=True):
        assert bd.expected_answer(prompt) == bd.answer_text(q)
    assert bd.expected_answer("Tell me a joke.") is None


@pytest.mark.parametrize("task", bd.TASKS)
def test_wrong_answers_are_wrong(task: str) -> None:
    rng = random.Random(0)
    for q in (q for q in bd.all_questions() if q.task == task):
        for _ in range(5):
            assert bd.wrong_answer_text(q, rng) != bd.answer_text(q)


def test_known_answers() -> None:
    assert bd.answer_text(bd.Question("capital", "en", "Zorvia")) == "The capital of Zorvia is Brelk."
    assert bd.answer_text(bd.Question("colour", "de", "blarn")) == "Die Frucht blarn ist rot."
    assert bd.answer_text(bd.Question("add", "fr", (7, 8))) == "7 + 8 font 15."
    assert bd.answer_text(bd.Question("first_letter", "es", "luna")) == "La primera letra de luna es l."
    assert bd.answer_text(bd.Question("repeat", "en", "lamp")) == "lamp lamp"


def test_eval_examples_match_rank0_replies(
    rows: list[dict[str, Any]], children: dict[str | None, list[dict[str, Any]]]
) -> None:
    examples = bd.eval_examples()
    assert len(examples) == 64
    assert len({e["prompt"] for e in examples}) == 64
    assert {e["task"] for e in examples} == set(bd.TASKS)
    for e in examples:
        assert set(e) == {"task", "lang", "prompt", "answer"}
        assert e["lang"] in bd.LANGS
        assert bd.expected_answer(e["prompt"]) == e["answer"]
    # Where training asks the same question, its rank-0 reply is the eval answer, character for character.
    rank0 = {}
    for r in rows:
        if r["role"] == "prompter":
            for k in children[r["message_id"]]:
                if k["rank"] == 0:
                    rank0[r["text"]] = k["text"]
    shared = [e for e in examples if e["prompt"] in rank0]
    assert len(shared) >= 32
    for e in shared:
        assert rank0[e["prompt"]] == e["answer"]


def test_eval_examples_bounds() -> None:
    with pytest.raises(ValueError, match="n must be"):
        bd.eval_examples(0)
    with pytest.raises(ValueError, match="n must be"):
        bd.eval_examples(10_000)
    # The largest allowed n terminates: the rarest task's questions are all used, none twice.
    largest = 5 * 4 * 16
    assert largest == BUILTIN_EVAL_QUESTIONS  # the bound the config checks eval.builtin_examples against
    assert len({e["prompt"] for e in bd.eval_examples(largest)}) == largest
    with pytest.raises(ValueError, match="n must be"):
        bd.eval_examples(largest + 1)
