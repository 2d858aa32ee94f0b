"""Preference tuning: pairs from ranked siblings, the DPO/IPO loss against hand computations, chunked
log-probabilities against autograd, cached reference log-probabilities against the trainer's own, and the
preference trainer's invariants on CPU ranks (1 rank = 2 ranks, resume = uninterrupted)."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pandas as pd
import pytest
import torch

from conftest import REAL_OASST, assert_close_to_scale, run_reference, run_training
from snaketune.data import pairs
from snaketune.data.messages import DataError
from snaketune.data.preferences import GROUP_DROP_REASONS, build_preferences
from snaketune.data.readers import read_messages
from snaketune.model import batching
from snaketune.preference.logprobs import pair_logprobs, preference_loss, reply_sums, token_logprobs

# ---- the loss ----------------------------------------------------------------------------------------------


def test_dpo_loss_and_rewards_equal_a_hand_computation():
    policy = torch.tensor([[-10.0, -12.0], [-5.0, -4.0]])
    reference = torch.tensor([[-11.0, -11.0], [-5.5, -5.0]])
    losses, chosen, rejected = preference_loss(policy, reference, beta=0.5, loss="dpo")
    # pair 1: log ratios +1 (chosen), -1 (rejected): h = 2, loss = -log sigmoid(0.5 * 2) = log(1 + e^-1)
    # pair 2: log ratios +0.5, +1.0: h = -0.5, loss = log(1 + e^0.25)
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-1.0)), math.log1p(math.exp(0.25))])
    assert chosen.tolist() == pytest.approx([0.5, 0.25]) and rejected.tolist() == pytest.approx([-0.5, 0.5])


def test_ipo_loss_uses_length_averaged_log_ratios():
    policy = torch.tensor([[-10.0, -12.0]])
    reference = torch.tensor([[-11.0, -11.0]])
    counts = torch.tensor([[4, 2]])
    losses, _, _ = preference_loss(policy, reference, beta=0.25, loss="ipo", counts=counts)
    # averaged log ratios 1/4 and -1/2: h = 0.75; (h - 1 / (2 * 0.25))^2 = (0.75 - 2)^2
    assert losses.item() == pytest.approx((0.75 - 2.0) ** 2)


def test_sft_weight_adds_the_chosen_replies_mean_nll():
    policy, reference, counts = (
        torch.tensor([[-8.0, -9.0]]),
        torch.tensor([[-8.0, -9.0]]),
        torch.tensor([[4, 3]]),
    )
    plain, _, _ = preference_loss(policy, reference, beta=0.1, counts=counts)
    rpo, _, _ = preference_loss(policy, reference, beta=0.1, counts=counts, sft_weight=0.5)
    assert plain.item() == pytest.approx(math.log(2)) and rpo.item() == pytest.approx(
        math.log(2) + 0.5 * 8 / 4
    )


def test_token_logprobs_and_their_gradients_equal_autograd():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(37, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 50, (37,), generator=gen)
    targets[::5] = batching.IGNORE
    upstream = torch.randn(37, generator=gen, dtype=torch.float64)
    mine = token_logprobs(hidden, weight, targets, chunk=8)  # several chunks, the last one short
    (mine.double() * upstream).sum().backward()
    got = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    plain = (hidden @ weight.t()).log_softmax(-1).gather(1, targets.clamp(min=0)[:, None]).squeeze(1)
    plain = torch.where(targets != batching.IGNORE, plain, 0.0)
    (plain * upstream).sum().backward()
    # The chunks compute in fp32: a log-prob sums over the 50 vocabulary entries, the hidden states' gradient over
    # them too, the weight's over the 37 tokens.
    fp32 = torch.finfo(torch.float32).eps
    assert_close_to_scale(mine.double(), plain, terms=50, eps=fp32, msg="log-probs")
    assert_close_to_scale(got[0], hidden.grad, terms=50, eps=fp32, msg="hidden")
    assert_close_to_scale(got[1], weight.grad, terms=37, eps=fp32, msg="weight")


def test_pair_logprobs_of_a_packed_row_equal_each_side_alone(tiny_data):
    """A pair in one row (chosen, then rejected with restarting positions) gives each side's own summed
    log-probability, as a forward pass over that side alone does; pads change nothing."""
    from snaketune.data.tokenization import load_tokenizer
    from snaketune.evaluation.evaluate import load_base_model

    tok = load_tokenizer(tiny_data.tokenizer_dir, "deepseek")
    from snaketune.config.schema import ModelConfig

    net = load_base_model(ModelConfig(), tok, seed=3, train_dtype=torch.float32, dtype=torch.float32)
    gen = np.random.default_rng(0)
    sides = []
    for n in (9, 6, 12, 7):
        ids = gen.integers(2, len(tok), size=n)
        labels = ids.copy()
        labels[: n // 2] = batching.IGNORE
        sides.append((ids, labels))
    rows = [(sides[0], sides[1]), (sides[2], sides[3])]
    split = batching.TokenizedSplit(
        [np.concatenate([a[0], b[0]]) for a, b in rows],
        [np.concatenate([a[1], b[1]]) for a, b in rows],
        [np.concatenate([np.arange(len(a[0])), np.arange(len(b[0]))]) for a, b in rows],
        np.zeros(2, dtype=np.int64),
    )
    batch = batching.collate(split, np.arange(2), pad_id=0)
    with torch.no_grad():
        for fused in (True, False):
            got, counts = pair_logprobs(net, **batch, packed_attention=False, fused=fused)
            for r, (a, b) in enumerate(rows):
                for s, (ids, labels) in enumerate((a, b)):
                    logits = net(input_ids=torch.tensor(ids)[None].long()).logits[0, :-1]
                    t = torch.tensor(labels[1:]).long()
                    keep = t != batching.IGNORE
                    want = -torch.nn.functional.cross_entropy(logits[keep], t[keep], reduction="sum")
                    assert got[r, s].item() == pytest.approx(want.item(), rel=1e-5)
                    assert counts[r, s].item() == int(keep.sum())


def test_reply_sums_ignore_pads_after_the_second_sequence():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 0]])  # chosen (3), rejected (2), two pads
    targets = torch.tensor([[-100, 5, -100, 7, -100, -100, -100]])
    values = torch.tensor([[9.0, 1.0, 9.0, 2.0, 9.0, 9.0, 9.0]])
    assert reply_sums(values, targets, pos).tolist() == [[1.0, 2.0]]


# ---- pairs ---------------------------------------------------------------------------------------------------


def msg(mid, parent, role, text, rank=None, **extra):
    return {"message_id": mid, "parent_id": parent, "role": role, "text": text, "rank": rank, "lang": "en",
            "message_tree_id": extra.pop("tree", "t"), **extra}  # fmt: skip


TREE = [
    msg("q", None, "prompter", "Q?"),
    msg("a0", "q", "assistant", "best", 0),
    msg("a1", "q", "assistant", "middle", 1),
    msg("a2", "q", "assistant", "worst", 2),
    msg("a3", "q", "assistant", "tied with worst", 2),
    msg("a4", "q", "assistant", "unranked"),
    msg("f", "a0", "prompter", "Follow-up?"),
    msg("f0", "f", "assistant", "good", 0),
    msg("f1", "f", "assistant", "also rank 0", 0),  # a tie at the top: no pair between them
    msg("g", "a1", "prompter", "Lonely?"),
    msg("g0", "g", "assistant", "only reply", 0),
    msg("h", "a2", "prompter", "Unranked?"),
    msg("h0", "h", "assistant", "x"),
    msg("h1", "h", "assistant", "y"),
]


def test_pairs_best_vs_rest_and_all_never_pair_ties():
    split = {"t": "train"}
    best = build_preferences(pd.DataFrame(TREE), split, pairs="best_vs_rest")
    got = sorted(zip(best.train["chosen"], best.train["rejected"], strict=True))
    assert got == sorted([("best", "middle"), ("best", "worst"), ("best", "tied with worst")])
    every = build_preferences(pd.DataFrame(TREE), split, pairs="all")
    got = sorted(zip(every.train["chosen"], every.train["rejected"], strict=True))
    assert got == sorted(
        [("best", "middle"), ("best", "worst"), ("best", "tied with worst"), ("middle", "worst"),
         ("middle", "tied with worst")]
    )  # fmt: skip
    row = best.train.iloc[0]
    assert [m["role"] for m in row["prompt"]] == ["user"] and row["prompt"][0]["content"] == "Q?"
    stats = best.stats
    assert stats["groups"] == 4 and stats["groups_with_pairs"] == 1
    assert stats["groups_dropped"] == {
        **dict.fromkeys(GROUP_DROP_REASONS, 0),
        "fewer_than_two_replies": 1,
        "fewer_than_two_ranked": 1,
        "ranks_tied": 1,
    }
    assert stats["unranked_replies"] == 3 and stats["pairs"] == {"train": 3, "validation": 0}


def test_pairs_follow_the_conversation_so_far_and_the_cleaning_rules():
    rows = [dict(r) for r in TREE]
    next(r for r in rows if r["message_id"] == "a1").update(deleted=True)  # and its subtree (g, g0)
    result = build_preferences(pd.DataFrame(rows), {"t": "validation"})
    assert sorted(result.validation["rejected"]) == ["tied with worst", "worst"]
    assert result.stats["dropped"]["deleted"] == 1 and result.stats["dropped"]["under_dropped_parent"] == 2
    deep = build_preferences(pd.DataFrame(TREE), {"t": "train"}, pairs="all")
    assert deep.stats["groups_dropped"]["ranks_tied"] == 1  # f0 and f1 share rank 0


def test_no_split_and_no_pairs_are_named():
    """A ranked tree the split map lacks is dropped as no_split (once) while the other tree still gives its pairs;
    a group under a path that does not alternate is non_alternating; a prompt without replies is no group; the
    tie inside a group that gives pairs (worst and tied with worst) is counted as skipped."""
    lonely = [msg("z", None, "prompter", "Z?", tree="z")]  # no replies: not a group
    unsplit = [
        msg("u", None, "prompter", "U?", tree="u"),
        msg("u0", "u", "assistant", "u best", 0, tree="u"),
        msg("u1", "u", "assistant", "u worse", 1, tree="u"),
    ]
    assistant_root = [
        msg("v", None, "assistant", "V.", tree="v"),
        msg("vp", "v", "prompter", "V?", tree="v"),
        msg("v0", "vp", "assistant", "v best", 0, tree="v"),
        msg("v1", "vp", "assistant", "v worse", 1, tree="v"),
    ]
    result = build_preferences(
        pd.DataFrame(TREE + lonely + unsplit + assistant_root), {"t": "train", "v": "train", "z": "train"}
    )
    stats = result.stats
    assert stats["groups"] == 6 and stats["groups_with_pairs"] == 1
    assert stats["groups_dropped"] == {
        "fewer_than_two_replies": 1,
        "fewer_than_two_ranked": 1,
        "ranks_tied": 1,
        "non_alternating": 1,
        "no_split": 1,
    }
    assert stats["tied_reply_pairs_skipped"] == 1
    assert stats["pairs"] == {"train": 3, "validation": 0}
    assert set(result.train["message_tree_id"]) == {"t"}
    with pytest.raises(DataError, match=r"no preference pairs \(preference\.pairs: 'best_vs_rest'\)"):
        build_preferences(
            pd.DataFrame([r for r in TREE if r["message_id"] not in ("a1", "a2", "a3")]), {"t": "train"}
        )


@pytest.mark.parametrize(("trees", "rows"), [
    ("en_100_tree.jsonl.gz", "en_100.hf_rows.jsonl.gz"),
    ("openpaws_oasst2.trees.jsonl.gz", "openpaws_oasst2.hf_rows.jsonl.gz"),
])  # fmt: skip
def test_real_samples_give_the_same_pairs_in_both_forms(trees, rows):
    from snaketune.data.conversations import build_conversations

    out = []
    for name in (trees, rows):
        messages = read_messages(REAL_OASST / name)
        conv = build_conversations(messages)
        split = {t: s for s in ("train", "validation") for t in getattr(conv, s)["message_tree_id"]}
        out.append(build_preferences(messages, split))
    a, b = out
    assert a.stats == b.stats and a.stats["pairs"]["train"] > 0
    pd.testing.assert_frame_equal(a.train, b.train)
    pd.testing.assert_frame_equal(a.validation, b.validation)


def test_max_trees_keeps_a_stable_sample_of_trees_and_the_pairs_follow_it():
    """dataset.max_trees on the real sample: that many trees, each in the split it has in the full data, a larger
    sample holding the smaller one, the same sample whatever the file's order; the preference pairs are those of
    the sampled trees (the others count as no_split)."""
    from snaketune.data.conversations import build_conversations

    messages = read_messages(REAL_OASST / "openpaws_oasst2.hf_rows.jsonl.gz")

    def trees(max_trees, frame=messages):
        conv = build_conversations(frame, validation_fraction=0.2, max_trees=max_trees)
        return conv, {t: s for s in ("train", "validation") for t in getattr(conv, s)["message_tree_id"]}

    full, everything = trees(None)
    (small, twenty), (_, fifty) = trees(20), trees(50)
    _, shuffled = trees(20, messages.sample(frac=1.0, random_state=0))
    assert len(everything) > 60 and len(twenty) == 20 and len(fifty) == 50
    assert twenty == shuffled and twenty.items() <= fifty.items() <= everything.items()
    assert small.stats["max_trees"] == 20 and small.stats["trees_sampled_out"] == len(everything) - 20
    assert full.stats["trees_sampled_out"] == 0 and trees(10_000)[1] == everything
    pairs_all, pairs_twenty = build_preferences(messages, everything), build_preferences(messages, twenty)
    kept = set(pairs_twenty.train["message_tree_id"]) | set(pairs_twenty.validation["message_tree_id"])
    assert len(kept) > 0 and kept <= set(twenty)
    assert pairs_twenty.stats["groups_dropped"]["no_split"] > pairs_all.stats["groups_dropped"]["no_split"]
    pd.testing.assert_frame_equal(
        pairs_twenty.train.reset_index(drop=True),
        pairs_all.train[pairs_all.train["message_tree_id"].isin(twenty)].reset_index(drop=True),
    )


# ---- tokenized pairs ----------------------------------------------------------------------------------------


def test_a_long_side_keeps_the_replys_start():
    """pairs.fit: bos, then the latest turns of the conversation so far, then the reply from its start; where both
    are long, half the budget stays for the conversation and the reply's end goes. Labels follow their tokens."""
    IGNORE = batching.IGNORE

    def side(prompt: int, reply: int):
        ids = np.arange(prompt + reply)
        return ids, np.where(ids >= prompt, ids, IGNORE)

    # A 70-token conversation so far, a 30-token reply, 64 kept: the reply whole, 33 latest prompt tokens.
    kept, lab, cut = pairs.fit(*side(70, 30), 64)
    assert cut == "prompt"
    assert kept.tolist() == [0, *range(37, 100)]
    assert lab.tolist() == [IGNORE] * 34 + list(range(70, 100))
    # A 10-token conversation, a 90-token reply: the conversation whole, the reply's first 54 tokens.
    kept, lab, cut = pairs.fit(*side(10, 90), 64)
    assert cut == "reply" and kept.tolist() == list(range(64))
    assert lab.tolist() == [IGNORE] * 10 + list(range(10, 64))
    # Both long (70 and 90): 32 for the conversation (bos and its latest 31), 32 for the reply's start.
    kept, lab, cut = pairs.fit(*side(70, 90), 64)
    assert cut == "reply"
    assert kept.tolist() == [0, *range(39, 70), *range(70, 102)]
    assert lab.tolist() == [IGNORE] * 32 + list(range(70, 102))
    # What fits is kept as it is.
    ids, labels = side(20, 10)
    kept, lab, cut = pairs.fit(ids, labels, 64)
    assert cut is None and kept.tolist() == ids.tolist() and lab.tolist() == labels.tolist()


def test_tokenized_pairs_hold_chosen_then_rejected_with_labels_on_the_reply(tiny_data, tmp_path):
    """tokenize_pairs' rows: chosen, then rejected with position ids restarting at 0, each the conversation so far
    plus its reply as the chat template renders it; labels (the token ids) on the reply and its eos only, never on
    the prompt or an earlier reply. Long pairs are cut (in the prompt when the reply fits, else in the reply) and every cut side counted."""
    from snaketune.data.preferences import write_preferences
    from snaketune.data.tokenization import load_tokenizer
    from snaketune.data.tokenizer import BOS, EOS

    long_prompt = "please explain in detail how this works " * 12
    long_reply = "it works by turning the crank until the light goes on " * 8
    rows = [
        msg("q", None, "prompter", "Is the sky blue?"),
        msg("a0", "q", "assistant", "Yes, it is blue.", 0),
        msg("a1", "q", "assistant", "No, it is green.", 1),
        msg("f", "a0", "prompter", "Why is it blue?"),
        msg("f0", "f", "assistant", "Light scatters.", 0),
        msg("f1", "f", "assistant", "Nobody knows.", 1),
        msg("l", None, "prompter", long_prompt, tree="long"),
        msg("l0", "l", "assistant", "Yes.", 0, tree="long"),
        msg("l1", "l", "assistant", long_reply, 1, tree="long"),
        msg("l2", "l", "assistant", "No.", 2, tree="long"),
    ]
    write_preferences(
        build_preferences(pd.DataFrame(rows), {"t": "train", "long": "validation"}), tmp_path / "pairs"
    )
    stats = pairs.tokenize_pairs(
        tmp_path / "pairs",
        tiny_data.tokenizer_dir,
        tmp_path / "tokenized",
        max_length=64,
        chat_template="deepseek",
    )
    tok = load_tokenizer(tiny_data.tokenizer_dir, "deepseek")
    IGNORE = batching.IGNORE

    def sides(data, r):
        """Row r cut where its position ids restart at 0: [(ids, labels), ...]."""
        pos = data.position_ids[r].tolist()
        starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
        for a, b in zip(starts, starts[1:], strict=False):
            assert pos[a:b] == list(range(b - a))
        return [
            (data.input_ids[r][a:b].tolist(), data.labels[r][a:b].tolist())
            for a, b in zip(starts, starts[1:], strict=False)
        ]

    def prompt_and_reply(ids, labels):
        """The unlabelled start and the labelled rest, decoded; labels are the ids, only on a run at the end."""
        start = next(i for i, label in enumerate(labels) if label != IGNORE)
        assert labels[:start] == [IGNORE] * start and labels[start:] == ids[start:]
        return tok.decode(ids[:start]), tok.decode(ids[start:])

    first = f"{BOS}User: Is the sky blue?\n\nAssistant:"
    second = f"{first} Yes, it is blue.{EOS}User: Why is it blue?\n\nAssistant:"
    train = batching.load_split(tmp_path / "tokenized" / "train")
    assert len(train) == 2
    got = [[prompt_and_reply(*side) for side in sides(train, r)] for r in range(2)]
    assert got == [
        [(first, f" Yes, it is blue.{EOS}"), (first, f" No, it is green.{EOS}")],
        [(second, f" Light scatters.{EOS}"), (second, f" Nobody knows.{EOS}")],
    ]

    # Yes. > the long reply, Yes. > No.: three sides cut in the prompt (its oldest tokens went), one in the reply.
    validation = batching.load_split(tmp_path / "tokenized" / "validation")
    (yes, long), (yes_again, no) = sides(validation, 0), sides(validation, 1)
    assert [len(ids) for ids, _ in (yes, long, yes_again, no)] == [64] * 4
    assert all(ids[0] == tok.bos_token_id for ids, _ in (yes, long, yes_again, no))
    assert [prompt_and_reply(*side)[1] for side in (yes, yes_again, no)] == [f" Yes.{EOS}"] * 2 + [
        f" No.{EOS}"
    ]
    assert f" {long_reply}".startswith(prompt_and_reply(*long)[1])  # the reply's end went
    counts = {
        split: (s["pairs"], s["sides_cut_in_prompt"], s["sides_cut_in_reply"])
        for split, s in stats["splits"].items()
    }
    assert counts == {"train": (2, 0, 0), "validation": (2, 3, 1)}
    assert stats["splits"]["validation"]["max_side_tokens"] > 64
    assert stats["splits"]["train"]["tokens"] == sum(len(x) for x in train.input_ids)


# ---- the stages on CPU ranks ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def preference_data(tiny_data, tmp_path_factory):
    """Pairs of the tiny sample, tokenized; an SFT model to start from; its cached reference log-probs."""
    from snaketune.data.conversations import read_messages as read
    from snaketune.data.preferences import read_split_of_trees, write_preferences

    root = tmp_path_factory.mktemp("preference")
    result = build_preferences(
        read(tiny_data.raw_dir / "messages.parquet"), read_split_of_trees(tiny_data.conversations_dir)
    )
    write_preferences(result, root / "pairs")
    pairs.tokenize_pairs(
        root / "pairs", tiny_data.tokenizer_dir, root / "tokenized", max_length=64, chat_template="deepseek"
    )
    sft = run_training(root / "sft", tiny_data, train_overrides={"max_steps": 6})
    # The DPO runs' model construction (train_overrides as _dpo's), micro-batches of 3: other batches than DPO's.
    out = run_reference(
        root / "reference",
        tiny_data,
        data_dir=root / "tokenized",
        model={"base": str(sft.out_dir / "model")},
        train_overrides={"micro_batch_size": 3},
    )
    for name in ("reference.parquet", "reference.json"):
        shutil.copy(out / name, root / name)
    return root, sft


def _dpo(root, sft, tmp_path, tiny_data, *, nproc=1, overrides=None, checkpoint_dir=None, beta=0.1):
    preference = {"beta": beta, "loss": "dpo", "max_length": 64, "reference_logprobs": str(root / "reference.parquet"),
                  "sft_weight": 0.0}  # fmt: skip
    train = {
        "max_steps": 12,
        "global_batch_size": 8,
        "micro_batch_size": 4,
        "learning_rate": 2e-3,
        **(overrides or {}),
    }
    return run_training(
        tmp_path,
        tiny_data,
        nproc=nproc,
        train_overrides=train,
        deepspeed="zero2",
        checkpoint_dir=checkpoint_dir,
        module="snaketune.preference.dpo",
        data_dir=root / "tokenized",
        model={"base": str(sft.out_dir / "model")},
        preference=preference,
    )


@pytest.fixture(scope="module")
def dpo_run(preference_data, tiny_data, tmp_path_factory):
    root, sft = preference_data
    return _dpo(root, sft, tmp_path_factory.mktemp("dpo"), tiny_data, overrides={"checkpoint_every": 6})


@pytest.mark.slow
def test_cached_reference_log_probs_equal_the_ones_computed_on_the_fly(preference_data, tiny_data):
    from snaketune.config.schema import ModelConfig
    from snaketune.model.inference import load_tuned_model
    from snaketune.preference.logprobs import read_reference

    root, sft = preference_data
    cached = read_reference(root / "reference.parquet")
    net = load_tuned_model(sft.out_dir / "model", ModelConfig(), dtype=torch.float32)
    for split in ("train", "validation"):
        data = batching.load_split(root / "tokenized" / split)
        batch = batching.collate(data, np.arange(len(data)), pad_id=1)
        with torch.no_grad():
            lp, n = pair_logprobs(net, **batch, packed_attention=False)
        torch.testing.assert_close(cached[split]["logprobs"], lp.double(), rtol=1e-6, atol=1e-5)
        assert torch.equal(cached[split]["tokens"], n.long())
    record = json.loads((root / "reference.json").read_text())
    assert record["reference"] == "sft" and record["pairs"]["train"] == len(cached["train"]["logprobs"])


@pytest.mark.slow
def test_dpo_starts_at_log_2_and_learns_the_preferences(dpo_run):
    rows = dpo_run.rows
    # The policy starts as the reference: every reward 0, every pair's loss log 2 (the first window is step 1).
    assert rows[0]["dpo/loss"] == pytest.approx(math.log(2), rel=1e-4)
    assert rows[0]["dpo/chosen_reward"] == pytest.approx(0.0, abs=1e-4)
    assert np.mean([r["dpo/loss"] for r in rows[-4:]]) < math.log(2) - 0.05
    assert np.mean([r["dpo/margin"] for r in rows[-4:]]) > 0
    s = dpo_run.summary
    assert s["objective"] == "dpo" and s["final_val_reward_accuracy"] is not None
    assert (dpo_run.out_dir / "model" / "model.safetensors").is_file()


@pytest.mark.slow
def test_dpo_one_rank_equals_two_ranks(dpo_run, preference_data, tiny_data, tmp_path):
    root, sft = preference_data
    two = _dpo(root, sft, tmp_path, tiny_data, nproc=2, overrides={"micro_batch_size": 2})
    assert two.summary["world_size"] == 2
    for key in ("dpo/loss", "dpo/margin", "train/grad_norm"):
        np.testing.assert_allclose(
            [r[key] for r in two.rows], [r[key] for r in dpo_run.rows], rtol=1e-4, atol=1e-6, err_msg=key
        )


@pytest.mark.slow
def test_dpo_resume_equals_the_uninterrupted_run(dpo_run, preference_data, tiny_data, tmp_path):
    root, sft = preference_data
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(dpo_run.checkpoint_dir, ckpt)
    shutil.rmtree(ckpt / "step00000012")  # the run ended; resume as if it had died after step 6
    run = _dpo(root, sft, tmp_path, tiny_data, overrides={"checkpoint_every": 6}, checkpoint_dir=ckpt)
    assert run.summary["resumed_from_step"] == 6
    np.testing.assert_allclose(
        [r["dpo/loss"] for r in run.rows][6:], [r["dpo/loss"] for r in dpo_run.rows][6:], rtol=1e-6
    )


@pytest.mark.slow
def test_dpo_checks_that_it_starts_at_the_reference(dpo_run, preference_data, tiny_data, tmp_path):
    """The first micro-batch's log-probabilities equal the reference stage's (computed in other micro-batches),
    the DPO loss there is ln 2, logged; a reference of another model stops the run before its first step."""
    start = dpo_run.summary["start_check"]
    assert start["violations"] == 0 and start["max_abs_ratio"] < 1e-3
    assert abs(start["mean_log_ratio_per_token"]) < 1e-6  # fp32, other micro-batches than the reference's
    assert start["dpo_loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert "start check: policy vs reference log-probabilities" in dpo_run.log_file.read_text()
    root, sft = preference_data
    # Reference log-probabilities of the base model (random init), given to DPO as if they were the SFT model's.
    base = run_reference(
        tmp_path / "base_reference", tiny_data, data_dir=root / "tokenized", model={"base": "builtin-tiny"}
    )
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    shutil.copy(base / "reference.parquet", wrong / "reference.parquet")
    shutil.copytree(root / "tokenized", wrong / "tokenized")
    from snaketune.train.launch import LaunchError

    with pytest.raises(LaunchError):
        _dpo(wrong, sft, tmp_path / "dpo", tiny_data)
    log = (tmp_path / "dpo" / "train.log").read_text()
    assert "ReferenceMismatch" in log and "is not the model the reference stage scored" in log
    assert "replies differ by more than allowed. Rerun the reference stage" in log
