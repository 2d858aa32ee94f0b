"""End-to-end training on CPU ranks: the invariants the trainer promises, checked on the tiny model.

Every run goes through snaketune.train.launch (torchrun + DeepSpeed over gloo), in fp32, with metrics at every
step so that per-step losses can be compared. Runs are module-scoped fixtures shared by the tests that read
them; each costs ~15-25 s on 2 cores, mostly imports, so there are as few as the invariants need.

Runs that are compared use the same warmup (10 steps) and compare only steps inside it: during warmup the
learning rate is (step+1)/10 x peak whatever max_steps is, so a 6-step run follows a 20-step run exactly.
"""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import run_training
from snaketune.config.choices import ConfigError
from snaketune.config.schema import ModelConfig
from snaketune.data.tokenizer import BOS, DEEPSEEK_CHAT_TEMPLATE
from snaketune.model.batching import collate, load_split, packed_attention_mask, token_loss_sum
from snaketune.model.build import checkpoint_layers, load_model
from snaketune.train.launch import LaunchError

COMPARED_STEPS = 6
SHORT = dict(max_steps=COMPARED_STEPS)
# 2 ranks x micro-batch 2 x accumulation 1 = the same global batch of 4 as the 1-rank base run.
TWO_RANKS = dict(max_steps=COMPARED_STEPS, micro_batch_size=2)
# Measured: 1 vs 2 ranks, ZeRO 0/2/3 and micro-batch x accumulation differ by < 3e-7 relative in losses
# and gradient norms (fp32, reduction order only). 1e-4 leaves a wide margin and still catches any change
# of the math: a wrong normalization or a sample seen twice moves the first losses by far more than 1e-3.
RTOL = 1e-4
# Losses and gradient norms of the base run's first 3 steps (torch 2.13.0+cpu, deepspeed 0.19.8,
# transformers 5.23; data packed best-fit-decreasing; the builtin sample with flawed ranked siblings): a change to the model, init, data order, packing,
# masking, loss normalization or optimizer
# moves them by far more than this; CPU kernels are deterministic here (repeated runs agree exactly).
GOLDEN_LOSSES = [6.289613700207369, 6.073735894097222, 5.864225034360532]
GOLDEN_GRAD_NORMS = [5.834714889526367, 3.9118261337280273, 2.8282346725463867]
GOLDEN_ATOL = 1e-4


@pytest.fixture(scope="module")
def base_run(default_training_run):
    """1 rank, ZeRO-2, micro-batch 4 x accumulation 1, 20 steps at the default learning rate (conftest's)."""
    return default_training_run


@pytest.fixture(scope="module")
def zero2_run(tiny_data, tmp_path_factory):
    """2 ranks, ZeRO-2, with a checkpoint at step 3 (which the resume tests start from)."""
    return run_training(
        tmp_path_factory.mktemp("zero2"),
        tiny_data,
        nproc=2,
        train_overrides={**TWO_RANKS, "checkpoint_every": 3},
    )


@pytest.fixture(scope="module")
def zero3_run(tiny_data, tmp_path_factory):
    return run_training(
        tmp_path_factory.mktemp("zero3"), tiny_data, nproc=2, train_overrides=TWO_RANKS, deepspeed="zero3"
    )


@pytest.fixture(scope="module")
def zero0_run(tiny_data, tmp_path_factory):
    return run_training(
        tmp_path_factory.mktemp("zero0"), tiny_data, nproc=2, train_overrides=TWO_RANKS, deepspeed="zero0"
    )


@pytest.fixture(scope="module")
def lora_run(tiny_data, tmp_path_factory):
    """2 ranks, ZeRO-2, LoRA rank 4, weight decay 0.1 (the other runs have none); metrics every 2 steps and
    validation every 5 (not a multiple of 2)."""
    overrides = dict(
        max_steps=10,
        micro_batch_size=2,
        log_every=2,
        eval_every=5,
        lora={"enabled": True, "rank": 4},
        weight_decay=0.1,
    )
    return run_training(tmp_path_factory.mktemp("lora"), tiny_data, nproc=2, train_overrides=overrides)


def first(run, n=COMPARED_STEPS, key="train/loss") -> list[float]:
    assert [row["step"] for row in run.rows[:n]] == list(range(1, n + 1))
    return [row[key] for row in run.rows[:n]]


def assert_same_steps(run, reference) -> None:
    """Same losses and same pre-clipping gradient norms. Losses alone would miss a wrong gradient scale:
    Adam's update, after clipping, is nearly invariant to it; the logged norm is not."""
    np.testing.assert_allclose(first(run), first(reference), rtol=RTOL)
    np.testing.assert_allclose(
        first(run, key="train/grad_norm"), first(reference, key="train/grad_norm"), rtol=RTOL
    )


def validation_loss(model, tiny_data, pad_id: int) -> float:
    """Token-weighted validation loss, computed as the trainer does, in one batch."""
    split = load_split(tiny_data.data_dir / "validation")
    batch = collate(split, np.arange(len(split)), pad_id)
    with torch.no_grad():
        logits = model(
            input_ids=batch["input_ids"],
            position_ids=batch["position_ids"],
            attention_mask=packed_attention_mask(batch["position_ids"], torch.float32),
        ).logits
    return token_loss_sum(logits, batch["labels"], batch["position_ids"]).item() / int(
        split.loss_tokens.sum()
    )


# ---- invariants ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_one_rank_equals_two_ranks(base_run, zero2_run):
    assert base_run.summary["world_size"] == 1 and zero2_run.summary["world_size"] == 2
    assert zero2_run.summary["gradient_accumulation_steps"] == 1
    assert_same_steps(zero2_run, base_run)


@pytest.mark.slow
def test_zero_stages_agree(zero2_run, zero3_run, zero0_run):
    assert [r.summary["zero_stage"] for r in (zero0_run, zero2_run, zero3_run)] == [0, 2, 3]
    decayed = zero2_run.summary["weight_decay_parameters"]
    assert decayed["tensors"] > 0 and decayed["weight_decay"] == 0.0
    assert all(r.summary["weight_decay_parameters"] == decayed for r in (zero0_run, zero3_run))
    assert_same_steps(zero3_run, zero2_run)
    assert_same_steps(zero0_run, zero2_run)
    # ZeRO-3 gathers its partitioned weights to save them: the saved model is the one ZeRO-2 trained.
    w2 = load_file(zero2_run.out_dir / "model" / "model.safetensors")
    for run in (zero3_run, zero0_run):
        w = load_file(run.out_dir / "model" / "model.safetensors")
        assert w.keys() == w2.keys()
        for name, tensor in w2.items():
            torch.testing.assert_close(w[name], tensor, rtol=0, atol=1e-4, msg=name)


@pytest.mark.slow
def test_micro_batch_times_accumulation_is_invariant(base_run, tiny_data, tmp_path):
    """Micro-batch 1 x accumulation 4 equals micro-batch 4 x accumulation 1 (1 rank, global batch 4)."""
    run = run_training(tmp_path, tiny_data, nproc=1, train_overrides={**SHORT, "micro_batch_size": 1})
    assert run.summary["gradient_accumulation_steps"] == 4
    assert_same_steps(run, base_run)


@pytest.mark.slow
def test_checkpointing_some_layers_changes_nothing_but_memory(base_run, tiny_data, tmp_path):
    """train.gradient_checkpointing: 2 (the first 2 of builtin-tiny's 4 layers recompute in backward) trains
    exactly as without checkpointing."""
    run = run_training(tmp_path, tiny_data, nproc=1, train_overrides={**SHORT, "gradient_checkpointing": 2})
    assert_same_steps(run, base_run)


@pytest.mark.slow
def test_offloaded_checkpoint_inputs_change_nothing_but_memory(base_run, tiny_data, tmp_path):
    """train.offload_activations (the checkpointed layers' inputs in host memory until backward, tests/test_offload.py)
    through the train rule's ranks: the same steps as without checkpointing, and the rank built it that way."""
    overrides = {**SHORT, "gradient_checkpointing": True, "offload_activations": True}
    run = run_training(tmp_path, tiny_data, nproc=1, train_overrides=overrides)
    assert run.summary["offload_activations"] is True
    assert_same_steps(run, base_run)


def test_checkpoint_layers_recomputes_only_the_first_n(tiny_data):
    """Each checkpointed layer runs its forward twice in a training step (once more in backward), the others
    once; a count above the model's layers is refused with the key and the allowed values."""
    tokenizer = AutoTokenizer.from_pretrained(tiny_data.tokenizer_dir)
    ids = dict(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    for setting, expected in ((2, [2, 2, 1, 1]), (True, [2, 2, 2, 2]), (False, [1, 1, 1, 1])):
        net = load_model(ModelConfig(), dtype=torch.float32, seed=0, **ids)
        net.train()
        assert checkpoint_layers(net, setting) == expected.count(2)
        calls = [0] * len(net.model.layers)
        for i, layer in enumerate(net.model.layers):
            # On a submodule: transformers checkpoints the layer's forward, inside its hooks.
            layer.mlp.register_forward_pre_hook(lambda *_, i=i, c=calls: c.__setitem__(i, c[i] + 1))
        x = torch.randint(0, len(tokenizer), (2, 16))
        net(input_ids=x, labels=x).loss.backward()
        assert calls == expected, setting
    with pytest.raises(
        ConfigError, match=r"'train.gradient_checkpointing': 5 layers.*allowed: true, false or 1..4"
    ):
        checkpoint_layers(load_model(ModelConfig(), dtype=torch.float32, seed=0, **ids), 5)


@pytest.mark.slow
def test_golden_first_losses(base_run):
    np.testing.assert_allclose(base_run.losses[:3], GOLDEN_LOSSES, rtol=0, atol=GOLDEN_ATOL)
    np.testing.assert_allclose(
        first(base_run, 3, "train/grad_norm"), GOLDEN_GRAD_NORMS, rtol=0, atol=GOLDEN_ATOL
    )


@pytest.mark.slow
def test_loss_falls_at_the_default_learning_rate(base_run):
    losses = base_run.losses
    assert len(losses) == 20 and all(math.isfinite(x) for x in losses)
    # Measured: 6.28 -> 3.8 (mean of the first 3 steps 6.09, of the last 3 3.82); validation 4.16.
    assert np.mean(losses[-3:]) < np.mean(losses[:3]) - 1.5
    assert base_run.summary["final_val_loss"] < losses[0] - 1.0
    # The schedule the rows logged: 10 warmup steps up to 3e-3, then a cosine from it (step 10) down to
    # min_lr_ratio 0.1 of it, reached at the last step; step 14 is 4/9 of the way, where the factor is
    # 0.1 + 0.9 * (1 + cos(4 pi / 9)) / 2 = 0.628142.
    lrs = [row["train/lr"] for row in base_run.rows]
    assert lrs[:11] == pytest.approx([3e-4 * (i + 1) for i in range(10)] + [3e-3])
    assert lrs[14] == pytest.approx(3e-3 * 0.628142, rel=1e-5)
    assert lrs[19] == pytest.approx(3e-4) and all(a > b for a, b in zip(lrs[10:-1], lrs[11:], strict=True))


# ---- outputs -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_final_model_loads_and_generates(base_run, tiny_data):
    model_dir = base_run.out_dir / "model"
    config = json.loads((model_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    assert (model_dir / "model.safetensors").is_file()
    assert not list(model_dir.glob("*.bin")) and not list(model_dir.glob("*.pt"))

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert tokenizer.chat_template == DEEPSEEK_CHAT_TEMPLATE
    # The saved weights are the trained ones: they reproduce the validation loss the run reported.
    pad_id = tokenizer.pad_token_id
    assert validation_loss(model, tiny_data, pad_id) == pytest.approx(
        base_run.summary["final_val_loss"], rel=1e-5
    )

    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 3 + 4?"}], tokenize=False, add_generation_prompt=True
    )
    assert prompt.startswith(BOS) and prompt.endswith("Assistant:")
    enc = tokenizer(prompt, add_special_tokens=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=8, do_sample=False, pad_token_id=pad_id)
    assert out.shape[1] > enc["input_ids"].shape[1]
    assert isinstance(tokenizer.decode(out[0, enc["input_ids"].shape[1] :]), str)


@pytest.mark.slow
def test_run_outputs_and_checkpoint_layout(zero2_run):
    summary = zero2_run.summary
    assert summary["steps"] == COMPARED_STEPS and summary["resumed_from_step"] == 0
    assert summary["precision"] == "float32" and len(summary["peak_memory_gib_per_rank"]) == 2
    assert summary["final_train_loss"] == pytest.approx(zero2_run.losses[-1])
    assert (zero2_run.out_dir / "tb").is_dir()
    ckpt = zero2_run.checkpoint_dir / "step00000003"
    marker = json.loads((ckpt / "COMPLETE.json").read_text())
    assert {k: marker[k] for k in ("step", "world_size", "zero_stage")} == {
        "step": 3,
        "world_size": 2,
        "zero_stage": 2,
    }
    assert (ckpt / "rng_rank0.pt").is_file() and (ckpt / "rng_rank1.pt").is_file()
    # Checkpoints are only written before the last step: the final model is in output_dir/model.
    # And the last step's, durable before the outputs are written (a rerun after a failure there only saves).
    assert sorted(p.name for p in zero2_run.checkpoint_dir.glob("step*")) == ["step00000003", "step00000006"]


@pytest.mark.slow
def test_resume_continues_the_uninterrupted_run(zero2_run, tiny_data, tmp_path):
    """From the step-3 checkpoint, steps 4-6 repeat the losses of the run that went through."""
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(zero2_run.checkpoint_dir, ckpt)
    assert sorted(p.name for p in ckpt.glob("step*")) == [
        "step00000003",
        "step00000006",
    ]  # the last step's too
    shutil.rmtree(ckpt / "step00000006")  # as if the run had died after step 3
    run = run_training(
        tmp_path,
        tiny_data,
        nproc=2,
        train_overrides={**TWO_RANKS, "checkpoint_every": 3},
        checkpoint_dir=ckpt,
    )
    assert run.summary["resumed_from_step"] == 3
    assert [row["step"] for row in run.rows] == list(range(1, COMPARED_STEPS + 1))
    assert run.losses[:3] == zero2_run.losses[:3]  # rows of the first run, kept
    np.testing.assert_allclose(run.losses[3:], zero2_run.losses[3:], rtol=1e-6)
    assert run.summary["final_val_loss"] == pytest.approx(zero2_run.summary["final_val_loss"], rel=1e-6)


@pytest.mark.slow
def test_lora_checkpoints_hold_the_adapters_and_resume_the_uninterrupted_run(tiny_data, tmp_path):
    """LoRA's checkpoints leave the frozen base out (13 GB of a 7B in every one); a resume loads the base as the
    run started, then the adapters and their optimizer, and goes on as the uninterrupted run did."""
    overrides = dict(max_steps=6, checkpoint_every=3, lora={"enabled": True, "rank": 4})
    first = run_training(tmp_path / "a", tiny_data, train_overrides=overrides)
    states = first.checkpoint_dir / "step00000003" / "mp_rank_00_model_states.pt"
    full = (first.out_dir / "model" / "model.safetensors").stat().st_size
    assert states.stat().st_size < full / 4, (states.stat().st_size, full)
    ckpt = tmp_path / "resumed_checkpoints"
    shutil.copytree(first.checkpoint_dir, ckpt)
    shutil.rmtree(ckpt / "step00000006")
    (tmp_path / "b").mkdir()
    run = run_training(tmp_path / "b", tiny_data, train_overrides=overrides, checkpoint_dir=ckpt)
    assert run.summary["resumed_from_step"] == 3
    np.testing.assert_allclose(run.losses[3:], first.losses[3:], rtol=1e-6)
    assert run.summary["final_val_loss"] == pytest.approx(first.summary["final_val_loss"], rel=1e-6)


@pytest.mark.slow
def test_lora_trains_adapters_and_saves_a_merged_model(lora_run, tiny_data):
    from peft import PeftModel

    from snaketune.config.schema import ModelConfig
    from snaketune.model.build import load_model

    # A row every 2 steps, plus the validation steps 5 and 10 (each row averages the steps since the last).
    assert [row["step"] for row in lora_run.rows] == [2, 4, 5, 6, 8, 10]
    assert [row["step"] for row in lora_run.rows if row.get("val/loss") is not None] == [5, 10]
    losses = lora_run.losses
    # Measured: 6.26 (steps 1-2) -> 5.83 (step 10).
    assert losses[-1] < losses[0] - 0.25
    assert (
        lora_run.summary["lora"]
        and lora_run.summary["trainable_parameters"] < lora_run.summary["parameters"] / 10
    )
    # train.weight_decay reached the optimizer, which decays every adapter (all matrices) and nothing else.
    decayed = lora_run.summary["weight_decay_parameters"]
    assert decayed["weight_decay"] == 0.1 and decayed["elements"] == lora_run.summary["trainable_parameters"]

    model_dir = lora_run.out_dir / "model"
    assert (model_dir / "adapter" / "adapter_model.safetensors").is_file()
    assert json.loads((model_dir / "adapter" / "adapter_config.json").read_text())["r"] == 4
    merged = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert not any("lora" in name for name in merged.state_dict())

    # The base the run started from: builtin models are initialized from the train seed.
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    base = load_model(
        ModelConfig(),
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        dtype=torch.float32,
        seed=1234,
    ).eval()
    base_state = {k: v.clone() for k, v in base.state_dict().items()}
    merged_state = merged.state_dict()
    # Only adapters trained: embeddings and norms are untouched, a projection moved by a rank-4 update.
    torch.testing.assert_close(
        merged_state["model.embed_tokens.weight"], base_state["model.embed_tokens.weight"]
    )
    delta = (
        merged_state["model.layers.0.self_attn.q_proj.weight"]
        - base_state["model.layers.0.self_attn.q_proj.weight"]
    )
    assert delta.abs().max() > 1e-4
    assert torch.linalg.matrix_rank(delta).item() <= 4

    peft_model = PeftModel.from_pretrained(base, model_dir / "adapter").eval()
    split = load_split(tiny_data.data_dir / "validation")
    batch = collate(split, np.arange(len(split)), tokenizer.pad_token_id)
    kwargs = dict(
        input_ids=batch["input_ids"],
        position_ids=batch["position_ids"],
        attention_mask=packed_attention_mask(batch["position_ids"], torch.float32),
    )
    with torch.no_grad():
        torch.testing.assert_close(merged(**kwargs).logits, peft_model(**kwargs).logits, rtol=1e-4, atol=1e-4)
    assert validation_loss(merged, tiny_data, tokenizer.pad_token_id) == pytest.approx(
        lora_run.summary["final_val_loss"], rel=1e-5
    )


# ---- bad inputs ----------------------------------------------------------------------------------


@pytest.mark.slow
def test_unknown_deepspeed_key_fails_the_run(tiny_data, tmp_path):
    bad = tmp_path / "typo.json"
    bad.write_text(json.dumps({"zero_optimisation": {"stage": 2}}))
    with pytest.raises(LaunchError, match="training failed") as failed:
        run_training(tmp_path, tiny_data, nproc=1, train_overrides=SHORT, deepspeed=bad)
    message = f"{bad}: unknown key 'zero_optimisation'; did you mean 'zero_optimization'?"
    assert message in (tmp_path / "train.log").read_text()
    # The error itself says why (Snakemake shows it; CI logs keep it where the log file is gone).
    assert f"(rank exit code 1): rank 0: snaketune.config.choices.ConfigError: {message}" in str(failed.value)
    assert not (tmp_path / "out" / "summary.json").exists()


@pytest.mark.slow
def test_resume_with_another_world_size_fails(zero2_run, tiny_data, tmp_path):
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(zero2_run.checkpoint_dir, ckpt)
    with pytest.raises(LaunchError, match="training failed"):
        run_training(tmp_path, tiny_data, nproc=1, train_overrides=TWO_RANKS, checkpoint_dir=ckpt)
    log = (tmp_path / "train.log").read_text()
    assert "was written by 2 ranks but 1 were granted; rerun with --resources gpu=2" in log


# ---- what changes no weight, and what must be the same on every rank ------------------------------------------


@pytest.mark.slow
def test_bookkeeping_changes_no_weight(base_run, tiny_data, tmp_path):
    """Checkpoint and logging cadence are runtime and record keys (snaketune.config.owners): they neither rerun a
    finished training nor name its checkpoints, because the weights do not depend on them. The base run's 20
    steps again, logging every 3rd, validating every 4th, checkpointing every 5th (keeping 1): every weight equal."""
    bookkeeping = dict(log_every=3, eval_every=4, checkpoint_every=5, keep_checkpoints=1)
    run = run_training(tmp_path, tiny_data, nproc=1, train_overrides=bookkeeping)
    logged = {int(r["step"]) for r in run.rows if r.get("train/loss") is not None}
    assert {3, 6, 9} <= logged and not {1, 2, 5} & logged, sorted(logged)
    got = load_file(run.out_dir / "model" / "model.safetensors")
    want = load_file(base_run.out_dir / "model" / "model.safetensors")
    assert got.keys() == want.keys()
    assert not [name for name in want if not torch.equal(got[name], want[name])]


def test_train_seed_draws_the_lora_adapters(tiny_data):
    """train.seed reaches LoRA's initial adapters (peft draws them from torch's global generator, which nothing
    seeded for a hub model): the same seed, the same adapters; another seed, others."""
    from snaketune.config.schema import LoraConfig
    from snaketune.model.build import apply_lora

    tokenizer = AutoTokenizer.from_pretrained(tiny_data.tokenizer_dir)
    ids = dict(
        vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )

    def adapters(seed: int) -> dict:
        net = load_model(ModelConfig(), dtype=torch.float32, seed=0, **ids)
        torch.manual_seed(12345)  # whatever state the global generator is in must not matter
        net = apply_lora(net, LoraConfig(enabled=True, rank=4), seed=seed)
        return {n: p.detach().clone() for n, p in net.named_parameters() if p.requires_grad}

    first, again, other = adapters(7), adapters(7), adapters(8)
    lora_a = [n for n in first if "lora_A" in n]
    assert lora_a and all(torch.equal(first[n], again[n]) for n in first)
    assert not any(torch.equal(first[n], other[n]) for n in lora_a)


def _start_check(rank: int, world: int, port: int, out) -> None:
    """Rank `rank`'s start checks: weights the same on every rank, then one bias element off on rank 1."""
    import torch.distributed as dist

    from snaketune.train.engine import check_same_start

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        for differ in (False, True):
            net = torch.nn.Linear(4, 4)
            torch.nn.init.constant_(net.weight, 1.0)
            torch.nn.init.constant_(net.bias, 0.0)
            if differ and rank == 1:
                net.bias.data[2] = 1e-6
            try:
                check_same_start(net, torch.device("cpu"))
                out.put((differ, rank, "same"))
            except RuntimeError as e:
                out.put((differ, rank, str(e)))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_ranks_are_checked_to_start_from_the_same_weights():
    """Two ranks (spawned processes, one pair for both cases: each spawn imports this module's world, 6 s of CPU)."""
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_start_check, args=(r, 2, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    results = {(differ, rank): r for differ, rank, r in (out.get(timeout=120) for _ in range(2 * len(procs)))}
    for p in procs:
        p.join(timeout=60)
    assert {rank: results[False, rank] for rank in range(2)} == {0: "same", 1: "same"}
    assert all(
        "ranks start from different trainable weights (1 tensors differ, first bias)" in results[True, rank]
        for rank in range(2)
    ), results
