"""Evaluation: the base model is the train stage's exact starting point; the loss is masked and weighted as in
training; exact-match scoring; generation decoding; metrics.json and generations.jsonl."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from snaketune.config.choices import DEFAULT_EVAL_PROMPTS, ConfigError
from snaketune.config.evaluation import EvalConfig
from snaketune.config.load import load_config, to_dict
from snaketune.config.schema import ModelConfig
from snaketune.data.builtin import eval_examples, expected_answer
from snaketune.data.tokenization import load_tokenizer
from snaketune.evaluation import evaluate
from snaketune.evaluation import scores as scoring
from snaketune.model import batching
from snaketune.model.build import load_model

REPO = Path(__file__).resolve().parent.parent
SEED = 1234
PROMPTS = ["What is the capital of Zorvia?", "Say tree twice.", "Tell me a joke about computers."]


@pytest.fixture(scope="module")
def tokenizer(tiny_data):
    return load_tokenizer(tiny_data.tokenizer_dir, "deepseek")


def tiny_model(tokenizer, seed: int = SEED) -> torch.nn.Module:
    return load_model(
        ModelConfig(),
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=torch.float32,
        seed=seed,
    ).eval()


@pytest.fixture(scope="module")
def nearly_untrained(tmp_path_factory, tiny_data):
    """A real train-stage run (DeepSpeed, 1 rank) of one step at a learning rate too small to move a weight
    visibly: what it saves is, to ~1e-9, the init the train stage started from."""
    from conftest import run_training

    return run_training(
        tmp_path_factory.mktemp("nearly_untrained"),
        tiny_data,
        train_overrides={"max_steps": 1, "learning_rate": 1e-9, "warmup_steps": 0},
    )


# ---- the base model ------------------------------------------------------------------------------


@pytest.mark.slow
def test_base_init_is_the_train_stage_start(nearly_untrained, tokenizer):
    base = evaluate.load_base_model(
        ModelConfig(), tokenizer, seed=SEED, train_dtype=torch.float32, dtype=torch.float32
    )
    tuned = evaluate.load_tuned_model(nearly_untrained.out_dir / "model", ModelConfig(), dtype=torch.float32)
    other_seed = tiny_model(tokenizer, seed=SEED + 1)
    base_sd, tuned_sd, other_sd = base.state_dict(), tuned.state_dict(), other_seed.state_dict()
    assert base_sd.keys() == tuned_sd.keys()
    for name, weight in base_sd.items():
        # Adam moves each weight by about the learning rate (1e-9) in one step.
        torch.testing.assert_close(weight, tuned_sd[name], rtol=0, atol=1e-6, msg=name)
    # The comparison can tell inits apart: another seed differs by far more than the tolerance.
    assert max((w - other_sd[n]).abs().max().item() for n, w in base_sd.items()) > 1e-2


def test_base_init_is_a_fresh_init_and_ignores_global_rng(tokenizer):
    fresh = tiny_model(tokenizer)
    torch.manual_seed(999)  # whatever ran before must not matter
    torch.rand(1000)
    base = evaluate.load_base_model(
        ModelConfig(), tokenizer, seed=SEED, train_dtype=torch.float32, dtype=torch.float32
    )
    for (name, a), b in zip(fresh.state_dict().items(), base.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


def test_bf16_base_is_built_in_the_training_dtype(tokenizer):
    """A bf16 run starts from an init drawn in bf16; the base must be that init, whatever the eval dtype."""
    in_bf16 = evaluate.load_base_model(
        ModelConfig(), tokenizer, seed=SEED, train_dtype=torch.bfloat16, dtype=torch.float32
    )
    reference = load_model(
        ModelConfig(),
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=torch.bfloat16,
        seed=SEED,
    )
    for (name, a), b in zip(in_bf16.state_dict().items(), reference.state_dict().values(), strict=True):
        assert a.dtype == torch.float32 and torch.equal(a, b.float()), name


# ---- validation loss -----------------------------------------------------------------------------


def _conversation(rng: np.random.Generator, n: int, vocab: int) -> tuple[np.ndarray, np.ndarray]:
    ids = rng.integers(2, vocab, size=n)
    labels = ids.copy()
    labels[: n // 2] = batching.IGNORE  # a prompt without loss, then a reply with loss
    labels[0] = batching.IGNORE
    return ids, labels


def test_validation_loss_is_the_token_weighted_mean_over_conversations(tokenizer):
    """Packed rows and padding change nothing: the loss equals the per-conversation sum of next-token
    losses over labelled targets divided by their count, computed on each conversation alone."""
    net = tiny_model(tokenizer)
    rng = np.random.default_rng(0)
    convs = [_conversation(rng, n, len(tokenizer)) for n in (9, 14, 6, 11)]
    # Rows: conversations 0+1 packed, 2 alone, 3 alone (different lengths, so collate pads).
    layout = [[0, 1], [2], [3]]
    rows_ids, rows_labels, rows_pos = [], [], []
    for row in layout:
        rows_ids.append(np.concatenate([convs[i][0] for i in row]))
        rows_labels.append(np.concatenate([convs[i][1] for i in row]))
        rows_pos.append(np.concatenate([np.arange(len(convs[i][0])) for i in row]))
    split = batching.TokenizedSplit(
        rows_ids,
        rows_labels,
        rows_pos,
        np.array(
            [batching.target_mask(lab, pos).sum() for lab, pos in zip(rows_labels, rows_pos, strict=True)]
        ),
    )

    total, count = 0.0, 0
    with torch.no_grad():
        for ids, labels in convs:
            logits = net(input_ids=torch.tensor(ids)[None], use_cache=False).logits[0]
            targets = torch.tensor(labels[1:])
            keep = targets != batching.IGNORE
            total += F.cross_entropy(logits[:-1][keep], targets[keep], reduction="sum").item()
            count += int(keep.sum())

    for batch_size in (1, 2, 3):
        got = evaluate.validation_loss(net, split, pad_id=evaluate.pad_id(tokenizer), batch_size=batch_size)
        assert got["loss_tokens"] == count and got["rows"] == 3
        assert got["loss"] == pytest.approx(total / count, rel=1e-5)
        assert got["perplexity"] == pytest.approx(math.exp(got["loss"]), rel=1e-12)


# ---- generation ----------------------------------------------------------------------------------


def test_render_prompt_is_the_chat_template_with_generation_prompt(tokenizer):
    ids = evaluate.render_prompt(tokenizer, "What is 3 + 4?")
    assert ids[0] == tokenizer.bos_token_id and ids.count(tokenizer.bos_token_id) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True) == "User: What is 3 + 4?\n\nAssistant:"


def test_decode_new_tokens_stops_at_eos_and_strips(tokenizer):
    reply = tokenizer(" 3 + 4 = 7.", add_special_tokens=False)["input_ids"]
    garbage = tokenizer("after the end", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    assert evaluate.decode_new_tokens(tokenizer, reply + [eos] + garbage + [eos, eos]) == "3 + 4 = 7."
    assert evaluate.decode_new_tokens(tokenizer, reply) == "3 + 4 = 7."  # ran out of max_new_tokens
    assert evaluate.decode_new_tokens(tokenizer, [eos]) == ""


def test_batched_generation_equals_one_by_one(tokenizer):
    """Left padding and the attention mask keep batched greedy decoding identical to unbatched."""
    net = tiny_model(tokenizer)
    prompts = ["Hi", "What is the capital of Zorvia?", "Was ist die Hauptstadt von Kaldia?", "Say cat twice."]
    one = evaluate.generate(net, tokenizer, prompts, max_new_tokens=12, batch_size=1)
    batched = evaluate.generate(net, tokenizer, prompts, max_new_tokens=12, batch_size=3)
    assert one == batched
    assert all(isinstance(r, str) and tokenizer.eos_token not in r for r in one)


# ---- exact match ---------------------------------------------------------------------------------


def test_exact_match_scoring():
    examples = [
        {"task": "add", "lang": "en", "prompt": "What is 3 + 4?", "answer": "3 + 4 = 7."},
        {"task": "add", "lang": "de", "prompt": "Was ist 1 + 1?", "answer": "1 + 1 ergibt 2."},
        {"task": "repeat", "lang": "en", "prompt": "Say cat twice.", "answer": "cat cat"},
        {
            "task": "capital",
            "lang": "en",
            "prompt": "What is the capital of Zorvia?",
            "answer": "The capital of Zorvia is Brelk.",
        },
    ]
    replies = ["  3 + 4 = 7.\n", "1 + 1 ergibt 3.", "Cat cat", "The capital of Zorvia is Brelk."]
    got = scoring.score(examples, replies)
    assert (got["n"], got["correct"], got["accuracy"]) == (4, 2, 0.5)  # outer whitespace only; case counts
    assert got["by_task"] == {
        "add": {"n": 2, "correct": 1, "accuracy": 0.5},
        "capital": {"n": 1, "correct": 1, "accuracy": 1.0},
        "repeat": {"n": 1, "correct": 0, "accuracy": 0.0},
    }
    assert got["by_lang"]["de"] == {"n": 1, "correct": 0, "accuracy": 0.0}
    assert got["by_lang"]["en"]["correct"] == 2
    assert scoring.exact_match(" cat cat ", "cat cat") and not scoring.exact_match("cat cat.", "cat cat")
    with pytest.raises(ValueError, match="4 examples but 3 replies"):
        scoring.score(examples, replies[:3])


def test_builtin_examples_have_the_dataset_answers():
    for example in eval_examples(20, seed=evaluate.EVAL_EXAMPLES_SEED):
        assert expected_answer(example["prompt"]) == example["answer"]


# ---- the stage -----------------------------------------------------------------------------------


def _job(trained, data, tmp_path, **changes) -> evaluate.EvalJob:
    """The evaluate stage's job on the nearly untrained model and the tiny data, on the CPU; `changes` replace fields."""
    job = evaluate.EvalJob(
        model=to_dict(ModelConfig()),
        seed=SEED,
        chat_template="deepseek",
        builtin_dataset=False,
        tuned_dir=trained.out_dir / "model",
        train_summary=trained.out_dir / "summary.json",
        tokenizer_dir=data.tokenizer_dir,
        data_dir=data.data_dir,
        prompts=PROMPTS[:1],
        max_new_tokens=4,
        builtin_examples=0,
        batch_size=8,
        metrics_out=tmp_path / "m.json",
        generations_out=tmp_path / "g.jsonl",
        device="cpu",
    )
    return dataclasses.replace(job, **changes)


@pytest.mark.slow
def test_evaluate_writes_metrics_and_generations(nearly_untrained, tiny_data, tmp_path):
    metrics_path, generations_path = tmp_path / "metrics.json", tmp_path / "generations.jsonl"
    job = _job(
        nearly_untrained,
        tiny_data,
        tmp_path,
        builtin_dataset=True,
        prompts=PROMPTS,
        max_new_tokens=8,
        builtin_examples=10,
        batch_size=4,
        metrics_out=metrics_path,
        generations_out=generations_path,
    )
    metrics = evaluate.evaluate(job)
    assert json.loads(metrics_path.read_text()) == json.loads(json.dumps(metrics))
    val = metrics["validation"]
    # Same masking and weighting as the train stage: its final validation loss, on the same weights.
    assert val["tuned"]["loss"] == pytest.approx(nearly_untrained.summary["final_val_loss"], rel=1e-5)
    assert val["base"]["loss"] == pytest.approx(val["tuned"]["loss"], rel=1e-4)  # lr 1e-9: barely moved
    assert val["base"]["perplexity"] == pytest.approx(math.exp(val["base"]["loss"]))
    assert val["loss_tokens"] > 0 and val["rows"] > 0
    em = metrics["exact_match"]
    assert em["n"] == 10 and len(em["examples"]) == 10
    assert set(em["base"]) == {"n", "correct", "accuracy", "by_task", "by_lang"}
    assert metrics["versions"]["torch"] == torch.__version__
    assert metrics["device"] == "cpu" and metrics["dtype"] == "float32"

    rows = [json.loads(line) for line in generations_path.read_text().splitlines()]
    assert [r["prompt"] for r in rows] == PROMPTS
    for row in rows:
        assert set(row) == {"prompt", "base", "tuned", "expected"}
        assert isinstance(row["base"], str) and isinstance(row["tuned"], str)
        assert "end▁of▁sentence" not in row["base"] + row["tuned"]
        assert row["base"] == row["base"].strip()
        assert row["expected"] == expected_answer(row["prompt"])
    assert rows[0]["expected"] == "The capital of Zorvia is Brelk." and rows[2]["expected"] is None


@pytest.mark.slow
def test_evaluate_without_builtin_data_skips_exact_match(nearly_untrained, tiny_data, tmp_path):
    metrics = evaluate.evaluate(_job(nearly_untrained, tiny_data, tmp_path, builtin_examples=64))
    assert metrics["exact_match"] is None
    assert json.loads((tmp_path / "g.jsonl").read_text())["expected"] is None


@pytest.mark.slow
def test_seed_mismatch_with_the_train_summary_is_refused(nearly_untrained, tiny_data, tmp_path):
    with pytest.raises(ValueError, match="seed"):
        evaluate.evaluate(_job(nearly_untrained, tiny_data, tmp_path, seed=SEED + 1))


# ---- the eval config -----------------------------------------------------------------------------


def _default_config() -> dict:
    import yaml

    return yaml.safe_load((REPO / "config/config.yaml").read_text())


def test_config_yaml_spells_out_the_eval_defaults():
    assert load_config(_default_config()).eval == load_config({}).eval == EvalConfig()
    assert EvalConfig().prompts == "auto"
    for prompt in DEFAULT_EVAL_PROMPTS[:-1]:  # auto on the builtin data: its questions, and one it never asks
        assert expected_answer(prompt) is not None, prompt
    assert expected_answer(DEFAULT_EVAL_PROMPTS[-1]) is None


@pytest.mark.parametrize(
    ("eval_cfg", "expected"),
    [
        ({"prompts": []}, "config key 'eval.prompts': must be a list of at least one prompt, or auto"),
        (
            {"prompts": "all"},
            "config key 'eval.prompts': 'all' is not allowed; allowed: auto or a list of prompts",
        ),
        ({"prompts": ["  "]}, "config key 'eval.prompts': '  ' is not a non-empty string"),
        ({"max_new_tokens": 0}, "config key 'eval.max_new_tokens': 0 must be between 1 and 4096"),
        (
            {"builtin_examples": 1000},
            "config key 'eval.builtin_examples': 1000 is not allowed; allowed: 0 (off) to 320",
        ),
        ({"batch_size": 0}, "config key 'eval.batch_size': 0 must be >= 1"),
        ({"max_new_token": 8}, "'eval.max_new_token': unknown key; did you mean 'max_new_tokens'?"),
    ],
)
def test_bad_eval_values_name_the_key(eval_cfg, expected):
    with pytest.raises(ConfigError) as e:
        load_config({"eval": eval_cfg})
    assert expected in str(e.value)


def test_schema_knows_the_eval_section():
    import jsonschema
    import yaml

    schema = yaml.safe_load((REPO / "workflow/schemas/config.schema.yaml").read_text())
    raw = _default_config()
    jsonschema.validate(raw, schema)
    raw["eval"]["max_new_token"] = 8
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(raw, schema)


def test_preference_intervals_are_wilsons_and_the_means():
    # Newcombe (1998), Statistics in Medicine 17:857, table I: 81 of 263 -> Wilson 95% interval 0.2553-0.3662;
    # 0 of 10 -> 0.0000-0.2775 (the normal approximation would give a zero-width interval there).
    lo, hi = scoring.wilson_interval(81, 263)
    assert (round(lo, 4), round(hi, 4)) == (0.2553, 0.3662)
    lo, hi = scoring.wilson_interval(0, 10)
    assert lo == 0.0 and round(hi, 4) == 0.2775
    # 40 pairs whose chosen reply wins 30 times by the summed log-prob and never per token, rewards against a
    # reference 0.5 nats lower on the chosen side only.
    counts = torch.tensor([[2.0, 10.0]] * 40)  # short chosen replies: less likely per token
    logprobs = torch.tensor([[-8.0, -9.0]] * 30 + [[-10.0, -9.0]] * 10)
    reference = logprobs - torch.tensor([0.5, 0.0])
    scores = scoring.preference_scores(logprobs, counts, reference, beta=0.1)
    assert scores["accuracy"] == 0.75 and scores["accuracy_ci95"] == scoring.wilson_interval(30, 40)
    assert scores["accuracy_per_token"] == 0.0 and scores["accuracy_per_token_ci95"][0] == 0.0
    assert scores["reward_accuracy"] == 1.0 and scores["reward_margin"] == pytest.approx(0.05)
    # Every pair has the same margin: no spread, a zero-width interval.
    assert scores["reward_margin_ci95"] == pytest.approx([0.05, 0.05])
    # 1..5: mean 3, sample standard deviation sqrt(2.5) = 1.5811, standard error 1.5811 / sqrt(5) = 0.7071, so
    # 3 -+ 1.959964 x 0.7071 = 3 -+ 1.3859 (the population deviation would give 3 -+ 1.2396).
    lo, hi = scoring.mean_interval(torch.tensor([1.0, 2.0, 3.0, 4.0, 5.0]))
    assert (round(lo, 4), round(hi, 4)) == (1.6141, 4.3859)
    assert scoring.mean_interval(torch.tensor([2.5])) == [2.5, 2.5]  # one value: no spread to estimate
