"""The fast training path computes what the plain one does (issue: performance on real GPUs).

The fast path (bf16 weights with fp32 masters in snaketune.train.optim.MasterWeightAdamW, fused linear
cross-entropy, varlen attention over packed conversations) is what a GPU run uses by default; the plain path
(fp32 or DeepSpeed's bf16, logits + cross-entropy, SDPA with a block mask) is the reference. Unit tests check the
optimizer against torch's AdamW (the model's kernels: tests/test_kernels.py); end-to-end runs on CPU ranks check
that the training loss of the fast path follows the plain path's, that it resumes exactly, and that 2 ranks
follow 1.
"""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import torch

from conftest import run_training
from snaketune.train import optim

STEPS = 12
FAST = dict(
    max_steps=STEPS,
    precision="bf16",
    bf16_optimizer="snaketune",
    fused_cross_entropy=True,
    attention="varlen",
    checkpoint_every=4,
)
PLAIN = dict(max_steps=STEPS, precision="fp32", fused_cross_entropy=False, attention="sdpa")
# In fp32 the fast path is the plain path's arithmetic in another order: measured 2e-7 relative on losses.
EXACT_RTOL = 1e-5
# bf16 rounds weights, activations and gradients to 8 mantissa bits. Measured (torch 2.13.0+cpu, 12 steps):
# per-step losses within 0.1% of the fp32 plain path's but at step 12, where the fp32 run's gradient norm
# spikes to 6.4 (2.7 in bf16) and the losses differ by 1.45%; the validation loss within 0.12%. DeepSpeed's own
# bf16 path (ZeRO-0) lands 0.35-1% from fp32 on the same steps. The loss falls by 1.9 over these steps, so a
# wrong learning rate, schedule or update is far outside these tolerances.
LOSS_RTOL = 3e-2
MEAN_LOSS_RTOL = 5e-3
VAL_RTOL = 1e-2


# ---- master-weight AdamW -------------------------------------------------------------------------------


def _mlp(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)).to(
        dtype
    )


def _train(net, opt, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(steps):
        x = torch.randn(64, 8, generator=gen).to(next(net.parameters()).dtype)
        net.zero_grad()
        loss = (net(x).float() - 1.0).pow(2).mean()
        loss.backward()
        if not isinstance(opt, optim.MasterWeightAdamW):
            torch.nn.utils.clip_grad_norm_(net.parameters(), 0.5)
        opt.step()
        losses.append(loss.item())
    return losses


@pytest.mark.parametrize("fused", [False, True])  # CUDA uses the fused kernel, which clips through grad_scale
def test_master_weight_adamw_is_torch_adamw_in_fp32(monkeypatch, fused):
    monkeypatch.setattr(optim, "CHUNK_ELEMENTS", 300)  # several chunks per group
    net, ref = _mlp(), _mlp()
    mine = optim.MasterWeightAdamW(
        optim.param_groups(net, 0.1), lr=1e-2, betas=(0.9, 0.95), grad_clip=0.5, fused=fused
    )
    theirs = torch.optim.AdamW(optim.param_groups(ref, 0.1), lr=1e-2, betas=(0.9, 0.95), eps=1e-8)
    assert _train(net, mine, 8) == pytest.approx(_train(ref, theirs, 8), rel=1e-6)
    for a, b in zip(net.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)


def test_master_weights_keep_bf16_training_on_the_fp32_track():
    """bf16 weights alone lose small updates to rounding; with fp32 masters the run follows fp32 training."""
    ref = _mlp()
    ref_losses = _train(ref, torch.optim.AdamW(optim.param_groups(ref, 0.0), lr=1e-3, betas=(0.9, 0.95)), 40)
    net = _mlp(torch.bfloat16)
    opt = optim.MasterWeightAdamW(optim.param_groups(net, 0.0), lr=1e-3, betas=(0.9, 0.95), grad_clip=0.5)
    losses = _train(net, opt, 40)
    assert all(p.dtype == torch.bfloat16 for p in net.parameters())
    assert all(m.dtype == torch.float32 for g in opt.param_groups for m in g["params"])
    # Measured: within 0.41% of fp32 at every step; torch's AdamW on the bf16 weights themselves drifts to 4.9%.
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-2)
    plain = _mlp(torch.bfloat16)
    plain_losses = _train(
        plain, torch.optim.AdamW(optim.param_groups(plain, 0.0), lr=1e-3, betas=(0.9, 0.95)), 40
    )
    assert max(abs(a / b - 1) for a, b in zip(plain_losses, ref_losses, strict=True)) > 3e-2


def test_master_weight_state_dict_resumes_exactly():
    net = _mlp(torch.bfloat16)
    opt = optim.MasterWeightAdamW(optim.param_groups(net, 0.0), lr=1e-2, betas=(0.9, 0.95))
    _train(net, opt, 3)
    saved_model, saved_opt = copy.deepcopy(net.state_dict()), copy.deepcopy(opt.state_dict())
    later = _train(net, opt, 3, seed=1)

    net2 = _mlp(torch.bfloat16)
    net2.load_state_dict(saved_model)
    opt2 = optim.MasterWeightAdamW(optim.param_groups(net2, 0.0), lr=1e-2, betas=(0.9, 0.95))
    opt2.load_state_dict(saved_opt)
    assert opt2.state[opt2.param_groups[0]["params"][0]]["exp_avg"].dtype == torch.float32
    assert _train(net2, opt2, 3, seed=1) == later  # the fp32 masters came back, not their bf16 rounding


def _micro_grads(net, n_micro: int, seed: int) -> list[list[torch.Tensor]]:
    """Each micro-batch's bf16 gradients of `net` (scaled as the trainer scales them: 1 / n_micro)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_micro):
        x = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
        net.zero_grad()
        ((net(x).float() - 1.0).pow(2).mean() / n_micro).backward()
        out.append([p.grad.clone() for p in net.parameters()])
    net.zero_grad()
    return out


def test_fp32_accumulation_equals_the_fp32_sum_of_micro_batch_gradients():
    """Over 8 micro-batches, MasterWeightAdamW(accumulate_fp32=True) updates with the fp32 sum of the bf16
    micro-batch gradients, exactly what torch's AdamW on fp32 masters does with that sum; summing in bf16
    (the model's own .grad) is measurably off, so the comparison would catch the difference."""
    steps, n_micro = 3, 8
    net = _mlp(torch.bfloat16)
    ref_masters = [p.detach().float().clone().requires_grad_() for p in net.parameters()]
    reference = torch.optim.AdamW(ref_masters, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0)
    opt = optim.MasterWeightAdamW(
        [{"params": list(net.parameters())}], lr=1e-2, betas=(0.9, 0.95), accumulate_fp32=True
    )
    for step in range(steps):
        # The reference: every micro-batch's bf16 gradient of the same weights, summed in fp32.
        twin = _mlp(torch.bfloat16)
        twin.load_state_dict(net.state_dict())
        micro = _micro_grads(twin, n_micro, seed=step)
        fp32_sum = [torch.stack([g[i].float() for g in micro]).sum(0) for i in range(len(ref_masters))]
        bf16_sum = [sum(g[i] for g in micro[1:]) + micro[0][i] for i in range(len(ref_masters))]
        for master, grad in zip(ref_masters, fp32_sum, strict=True):
            master.grad = grad
        reference.step()
        gen = torch.Generator().manual_seed(step)
        for _ in range(n_micro):
            x = torch.randn(16, 8, generator=gen).to(torch.bfloat16)
            ((net(x).float() - 1.0).pow(2).mean() / n_micro).backward()
        assert all(p.grad is None for p in net.parameters())  # freed into the fp32 buffer as they came
        buffered = [v.clone() for v in opt._grad_views[0]]
        for got, want in zip(buffered, fp32_sum, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-9)
        if step == 0:
            err = max(
                ((b.float() - w).norm() / w.norm()).item() for b, w in zip(bf16_sum, fp32_sum, strict=True)
            )
            assert err > 1e-4, f"bf16 accumulation should differ measurably from fp32 (relative {err:.1e})"
        opt.step()
        net.zero_grad()
        masters = opt.param_groups[0]["params"]
        for mine, ref in zip(masters, ref_masters, strict=True):
            torch.testing.assert_close(mine, ref.detach(), rtol=1e-6, atol=1e-7)
    assert float(opt.main_grads.abs().max()) == 0.0  # cleared after each step


def test_placement_check_names_tensors_on_the_wrong_device_or_dtype():
    net = _mlp(torch.bfloat16)
    opt = optim.MasterWeightAdamW(optim.param_groups(net, 0.0), lr=1e-2, betas=(0.9, 0.95))
    assert optim.check_placement(opt, device=torch.device("cpu"), dtype=torch.float32) > 0
    with pytest.raises(
        RuntimeError,
        match=r"are not where they train: param_groups\[0\]\.params\[0\] on cpu \(expected meta\)",
    ):
        optim.check_placement(opt, device=torch.device("meta"), dtype=torch.float32)
    opt.param_groups[0]["params"][0].data = opt.param_groups[0]["params"][0].data.to(torch.bfloat16)
    with pytest.raises(
        RuntimeError, match=r"param_groups\[0\]\.params\[0\] is torch\.bfloat16 \(expected torch\.float32\)"
    ):
        optim.check_placement(opt, device=torch.device("cpu"), dtype=torch.float32)


def test_zero3_partitioned_parameters_keep_their_weight_decay_group():
    """Under ZeRO-3 a parameter is an empty 1-D partition with its real shape in ds_shape: the decay groups
    must follow ds_shape, not dim() (which would put every weight in the no-decay group)."""
    net = _mlp()
    expected = [[id(p) for p in g["params"]] for g in optim.param_groups(net, 0.1)]
    for p in net.parameters():
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    assert [[id(p) for p in g["params"]] for g in optim.param_groups(net, 0.1)] == expected
    assert len(expected[0]) == 2 and len(expected[1]) == 4  # two weight matrices; biases and the norm


@pytest.mark.gpu
@pytest.mark.parametrize("accumulate_fp32", [False, True])  # bf16 .grad in, or the fp32 accumulation buffer
def test_triton_adamw_matches_torch_adamw(accumulate_fp32):
    """The fused Triton step is torch's fused AdamW on fp32 gradient copies, bf16 weights rounded the same way."""
    device = torch.device("cuda")
    if not optim.triton_available(device):
        pytest.skip("needs CUDA and triton")
    nets = [_mlp(torch.bfloat16).to(device) for _ in range(2)]
    opts = [
        optim.MasterWeightAdamW(
            optim.param_groups(net, 0.1),
            lr=1e-2,
            betas=(0.9, 0.95),
            grad_clip=0.5,
            kernel=k,
            accumulate_fp32=accumulate_fp32,
        )
        for net, k in zip(nets, ("triton", "torch"), strict=True)
    ]
    gen = torch.Generator().manual_seed(4)
    for _ in range(5):
        x = torch.randn(64, 8, generator=gen).to(device, torch.bfloat16)
        for net, opt in zip(nets, opts, strict=True):
            net.zero_grad()
            (net(x).float() - 1.0).pow(2).mean().backward()
            opt.step()
        masters = [[m for g in opt.param_groups for m in g["params"]] for opt in opts]
        for a, b in zip(*masters, strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        # Both round the same master to bf16 to nearest-even; masters ~1e-7 apart may straddle a rounding
        # boundary now and then: at most one bf16 step apart, and nearly all elements equal.
        for a, b in zip(nets[0].parameters(), nets[1].parameters(), strict=True):
            torch.testing.assert_close(a.float(), b.float(), rtol=2**-7, atol=1e-6)
            assert (a == b).float().mean() > 0.99


# ---- end to end on CPU ranks ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain_run(tiny_data, tmp_path_factory):
    return run_training(tmp_path_factory.mktemp("plain"), tiny_data, train_overrides=PLAIN, deepspeed="zero0")


@pytest.fixture(scope="module")
def fast_run(tiny_data, tmp_path_factory):
    return run_training(tmp_path_factory.mktemp("fast"), tiny_data, train_overrides=FAST, deepspeed="zero0")


@pytest.mark.slow
def test_fast_path_in_fp32_is_the_plain_path(plain_run, tiny_data, tmp_path):
    """Fused loss and varlen attention change no number: in fp32 every step's loss and gradient norm agree."""
    run = run_training(tmp_path, tiny_data, train_overrides={**FAST, "precision": "fp32"}, deepspeed="zero0")
    assert run.summary["fused_cross_entropy"] is True and run.summary["attention"].startswith("varlen")
    assert plain_run.summary["fused_cross_entropy"] is False
    assert plain_run.summary["attention"] == "SDPA with a block-diagonal mask"
    np.testing.assert_allclose(run.losses, plain_run.losses, rtol=EXACT_RTOL)
    np.testing.assert_allclose(
        [r["train/grad_norm"] for r in run.rows], [r["train/grad_norm"] for r in plain_run.rows], rtol=1e-4
    )


@pytest.mark.slow
def test_fast_path_loss_follows_the_plain_path(fast_run, plain_run):
    s = fast_run.summary
    assert s["precision"] == "bfloat16"
    assert s["fp32_master_weights"] == "snaketune.train.optim.MasterWeightAdamW (torch kernel)"
    fast, plain = np.array(fast_run.losses), np.array(plain_run.losses)
    np.testing.assert_allclose(fast, plain, rtol=LOSS_RTOL)
    assert np.mean(np.abs(fast - plain) / plain) < MEAN_LOSS_RTOL
    assert np.mean(fast[-3:]) < np.mean(fast[:3]) - 1.0
    assert s["final_val_loss"] == pytest.approx(plain_run.summary["final_val_loss"], rel=VAL_RTOL)
    # Clipping happens in the optimizer, which reports the pre-clipping norm as DeepSpeed does: the norms
    # follow the fp32 run's (measured within 4% but at the step-12 spike).
    norms = [row["train/grad_norm"] for row in fast_run.rows]
    plain_norms = [row["train/grad_norm"] for row in plain_run.rows]
    np.testing.assert_allclose(norms[:-1], plain_norms[:-1], rtol=0.1)


@pytest.mark.slow
def test_fast_path_resumes_the_uninterrupted_run(fast_run, tiny_data, tmp_path):
    ckpt = tmp_path / "checkpoints"
    shutil.copytree(fast_run.checkpoint_dir, ckpt)
    # The newest two of the checkpoints at steps 4, 8 and 12 (the last step's) are kept: resume from step 8, as if
    # the run had died before its end.
    assert sorted(p.name for p in ckpt.glob("step*")) == ["step00000008", "step00000012"]
    shutil.rmtree(ckpt / "step00000012")
    run = run_training(tmp_path, tiny_data, train_overrides=FAST, deepspeed="zero0", checkpoint_dir=ckpt)
    assert run.summary["resumed_from_step"] == 8
    np.testing.assert_allclose(run.losses[8:], fast_run.losses[8:], rtol=1e-6)


@pytest.mark.slow
def test_fast_path_two_ranks_follow_one(fast_run, tiny_data, tmp_path):
    run = run_training(
        tmp_path,
        tiny_data,
        nproc=2,
        train_overrides={**FAST, "micro_batch_size": 2, "checkpoint_every": 0},
        deepspeed="zero0",
    )
    assert run.summary["world_size"] == 2
    np.testing.assert_allclose(run.losses, fast_run.losses, rtol=LOSS_RTOL)
    assert np.mean(np.abs(np.array(run.losses) - fast_run.losses) / fast_run.losses) < MEAN_LOSS_RTOL
    # Adam's update barely depends on the gradient's scale, so a wrong average over the ranks hides from the
    # losses: the norms show it (the last step's is the fp32 spike the module docstring describes).
    norms = [row["train/grad_norm"] for row in run.rows]
    np.testing.assert_allclose(norms[:-1], [r["train/grad_norm"] for r in fast_run.rows][:-1], rtol=0.05)


@pytest.mark.slow
def test_fast_path_accumulates_in_fp32_across_ranks(fast_run, tiny_data, tmp_path):
    """2 ranks x micro-batch 1 x accumulation 2: the fp32 gradient buffer is summed over micro-batches and
    all-reduced by the optimizer (DeepSpeed's all-reduce of .grad is off), and the run follows 1 rank x 4 x 1."""
    run = run_training(
        tmp_path,
        tiny_data,
        nproc=2,
        train_overrides={**FAST, "micro_batch_size": 1, "checkpoint_every": 0},
        deepspeed="zero0",
    )
    s = run.summary
    assert s["gradient_accumulation_steps"] == 2 and s["fp32_gradient_accumulation"] is True
    assert "fp32 gradient accumulation" in s["fp32_master_weights"]
    np.testing.assert_allclose(run.losses, fast_run.losses, rtol=LOSS_RTOL)
    assert np.mean(np.abs(np.array(run.losses) - fast_run.losses) / fast_run.losses) < MEAN_LOSS_RTOL
    norms = [row["train/grad_norm"] for row in run.rows]
    np.testing.assert_allclose(norms[:-1], [r["train/grad_norm"] for r in fast_run.rows][:-1], rtol=0.05)


@pytest.mark.slow
def test_fast_path_lora(tiny_data, tmp_path):
    """LoRA with fp32 masters: peft keeps its adapters in fp32 (DeepSpeed drops the empty no-decay group)."""
    lora = dict(FAST, max_steps=6, checkpoint_every=0, lora={"enabled": True, "rank": 4})
    run = run_training(tmp_path, tiny_data, train_overrides=lora, deepspeed="zero0")
    assert run.summary["fp32_master_weights"] == "snaketune.train.optim.MasterWeightAdamW (torch kernel)"
    assert run.summary["trainable_parameters"] < run.summary["parameters"] / 10
    assert run.losses[-1] < run.losses[0] - 0.2  # measured: 6.28 -> 5.92
    assert (run.out_dir / "model" / "adapter" / "adapter_model.safetensors").is_file()


@pytest.mark.slow
def test_bf16_optimizer_snaketune_needs_zero_stage_0(tiny_data, tmp_path):
    from snaketune.train.launch import LaunchError

    with pytest.raises(LaunchError, match="training failed"):
        run_training(tmp_path, tiny_data, train_overrides={**FAST, "max_steps": 1}, deepspeed="zero2")
    log = (tmp_path / "train.log").read_text()
    assert "train.bf16_optimizer 'snaketune' needs zero_optimization.stage 0 (found 2)" in log
