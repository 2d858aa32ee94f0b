"""The model's fast kernels compute what the plain modules do (issue: performance on real GPUs): the fused linear
cross-entropy and the Triton cross-entropy against logits + cross-entropy, varlen attention over packed conversations
against SDPA with a block mask, Liger's RMSNorm, RoPE and SwiGLU against the torch modules, and torch.compile of the
decoder layers without recompiles. The optimizer's fast path and the end-to-end runs: tests/test_fast_path.py. On CPU
the varlen attention runs its block-masked SDPA fallback; test_varlen_kernel_matches_masked_sdpa checks the CUDA
kernel.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_close_to_scale
from snaketune.model import attention, kernels
from snaketune.model.batching import IGNORE, packed_attention_mask, token_loss_sum
from snaketune.model.build import LossModel
from snaketune.model.losses import causal_targets, fused_linear_cross_entropy, logits_cross_entropy
from snaketune.train import optim


def _packed_batch(gen: torch.Generator, vocab: int, b: int = 3, length: int = 40):
    """Rows of several conversations (position ids restart at 0), the last row padded after 30 tokens."""
    ids = torch.randint(0, vocab, (b, length), generator=gen)
    first = 15 * length // 40
    pos = torch.cat([torch.arange(first), torch.arange(length - first)]).repeat(b, 1)
    pos[1] = torch.arange(length)
    tail = 30 * length // 40
    pos[2, tail:] = 0
    labels = ids.clone()
    labels[:, :4] = IGNORE  # a prompt
    labels[2, tail:] = IGNORE
    return ids, labels, pos, [length, length, tail] + [length] * (b - 3)


# ---- fused linear cross-entropy ------------------------------------------------------------------------


@pytest.mark.parametrize("chunk", [5, 64, 10_000])
@pytest.mark.parametrize("train_weight", [True, False])
def test_fused_cross_entropy_equals_logits_and_cross_entropy(chunk, train_weight):
    gen = torch.Generator().manual_seed(chunk)
    hidden = torch.randn(37, 16, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(50, 16, generator=gen, dtype=torch.float64, requires_grad=train_weight)
    targets = torch.randint(0, 50, (37,), generator=gen)
    targets[::4] = IGNORE

    loss = fused_linear_cross_entropy(hidden, weight, targets, chunk=chunk)
    (loss * 0.37).backward()  # the trainer scales the sum before backward
    ref_h = hidden.detach().clone().requires_grad_()
    ref_w = weight.detach().clone().requires_grad_(train_weight)
    ref = F.cross_entropy(ref_h @ ref_w.t(), targets, ignore_index=IGNORE, reduction="sum")
    (ref * 0.37).backward()

    # The fused path computes the softmax in fp32 whatever the input dtype: fp32 rounding, not fp64's.
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=0)
    # Each gradient entry sums over the 50 vocabulary entries (hidden) or the 37 tokens (weight), in fp32.
    fp32 = torch.finfo(torch.float32).eps
    assert_close_to_scale(hidden.grad, ref_h.grad, terms=50, eps=fp32, msg="hidden")
    if train_weight:
        assert_close_to_scale(weight.grad, ref_w.grad, terms=37, eps=fp32, msg="weight")
    else:
        assert weight.grad is None
    with torch.no_grad():  # validation: the loss alone
        assert fused_linear_cross_entropy(hidden, weight, targets, chunk=chunk).item() == pytest.approx(
            ref.item(), rel=1e-6
        )


def test_causal_targets_match_token_loss_sum():
    gen = torch.Generator().manual_seed(0)
    ids, labels, pos, _ = _packed_batch(gen, vocab=30)
    logits = torch.randn(*ids.shape, 30, generator=gen)
    targets = causal_targets(labels, pos)
    # Position t predicts t + 1; never across a conversation start, never from the last position.
    assert (targets[:, -1] == IGNORE).all() and (targets[0, 14] == IGNORE) and targets[0, 15] == labels[0, 16]
    fused_layout = F.cross_entropy(
        logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction="sum"
    )
    torch.testing.assert_close(fused_layout, token_loss_sum(logits, labels, pos))


def _tiny_bf16_case(device: torch.device):
    """builtin-tiny in bf16 on `device` (vocabulary 256) and a batch of packed rows with its cu_seqlens."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from snaketune.model.architectures import BUILTIN_TINY

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(
        LlamaConfig(**BUILTIN_TINY, vocab_size=256), attn_implementation="sdpa", dtype=torch.bfloat16
    ).to(device)
    ids, labels, pos, lengths = _packed_batch(torch.Generator().manual_seed(2), vocab=256, b=4, length=128)
    cu = attention.segments(pos, lengths).to(device)
    return net, (ids.to(device), labels.to(device), pos.to(device), cu)


def test_loss_kernel_resolves_to_torch_where_triton_cannot_run():
    cpu = torch.device("cpu")
    assert optim.resolve_triton("train.loss_kernel", "auto", cpu) == "torch"
    assert optim.resolve_triton("train.loss_kernel", "torch", cpu) == "torch"
    with pytest.raises(
        ValueError, match=r"'train.loss_kernel': 'triton' needs a CUDA device .*allowed here: auto, torch"
    ):
        optim.resolve_triton("train.loss_kernel", "triton", cpu)
    with pytest.raises(ValueError, match=r"'train.loss_kernel': 'liger'; allowed: auto, triton, torch"):
        optim.resolve_triton("train.loss_kernel", "liger", cpu)


@pytest.mark.gpu
@pytest.mark.parametrize("vocab", [102400, 50257, 97])
def test_triton_cross_entropy_matches_torch(vocab):
    """logits_cross_entropy: F.cross_entropy's fp32 loss on the bf16 logits, and its gradient (scaled as the
    trainer scales it), written over the logits: nothing of the logits' size is allocated besides them."""
    if not (torch.cuda.is_available() and optim.triton_available(torch.device("cuda"))):
        pytest.skip("needs CUDA and triton")
    gen = torch.Generator(device="cuda").manual_seed(4)
    n = 1000
    logits = (4 * torch.randn(n, vocab, device="cuda", generator=gen)).bfloat16()
    targets = torch.randint(0, vocab, (n,), device="cuda", generator=gen)
    targets[::7] = IGNORE
    targets[-1] = IGNORE
    normalizer = int((targets != IGNORE).sum())
    ref_in = logits.clone().float().requires_grad_()
    ref = F.cross_entropy(ref_in, targets, ignore_index=IGNORE, reduction="sum")
    (ref / normalizer).backward()

    x = logits.clone().requires_grad_()  # consumed: its memory becomes its gradient
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    loss = logits_cross_entropy(x, targets)
    assert loss.dtype == torch.float32
    torch.testing.assert_close(loss, ref.detach(), rtol=2e-6, atol=0)
    (grad,) = torch.autograd.grad(loss / normalizer, x)
    extra = torch.cuda.max_memory_allocated() - before
    assert grad.data_ptr() == x.data_ptr()
    torch.testing.assert_close(grad, ref_in.grad.bfloat16(), rtol=1.6e-2, atol=1e-8)
    assert (grad[targets == IGNORE] == 0).all()
    # Per row an fp32 loss and logsumexp, the scale; no copy of the logits in any dtype.
    assert extra <= 16 * n + 2**20, extra


@pytest.mark.gpu
def test_loss_model_triton_loss_matches_torch():
    """LossModel with loss_kernel triton gives the torch loss's loss and gradients (bf16, packed rows)."""
    cuda = torch.device("cuda")
    if not (torch.cuda.is_available() and optim.triton_available(cuda)):
        pytest.skip("needs CUDA and triton")
    net, (ids, labels, pos, cu) = _tiny_bf16_case(cuda)
    results = []
    for kernel in ("torch", "triton"):
        model = LossModel(
            copy.deepcopy(net), packed_attention=True, fused_cross_entropy=False, loss_kernel=kernel
        )
        loss = model(ids, labels, pos, cu)
        (loss / 100).backward()
        results.append((loss, {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    for name, ref in ref_grads.items():
        assert ((grads[name] - ref).norm() / ref.norm()) < 1e-2, name


# ---- varlen attention ----------------------------------------------------------------------------------


def test_segments_give_the_block_mask_of_packed_rows():
    gen = torch.Generator().manual_seed(1)
    _, _, pos, lengths = _packed_batch(gen, vocab=30)
    cu = attention.segments(pos, lengths)
    b, length = pos.shape
    ids = torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long()).view(b, length)
    allowed = (ids[:, :, None] == ids[:, None, :]) & torch.ones(length, length, dtype=torch.bool).tril()
    reference = packed_attention_mask(pos)[:, 0] == 0
    # Identical for every real token; the padded tail of row 2 is one segment instead of one per pad.
    for row, n in enumerate(lengths):
        assert torch.equal(allowed[row, :n], reference[row, :n])
    assert cu.tolist() == [0, 15, 40, 80, 95, 110, 120]


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
@pytest.mark.parametrize("fused", [False, True])
def test_loss_model_paths_agree(fused, kv_heads):
    """LossModel: varlen attention (CPU fallback) and the fused loss give the plain path's loss and gradients, with
    as many key/value heads as query heads (DeepSeek's 7B) and with fewer (grouped-query attention: SmolLM2's 9/3)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from snaketune.model.architectures import BUILTIN_TINY

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**BUILTIN_TINY, "num_key_value_heads": kv_heads}, vocab_size=64),
        attn_implementation="sdpa",
    )
    ids, labels, pos, lengths = _packed_batch(torch.Generator().manual_seed(2), vocab=64)
    # A throwaway pass first: the first forward and backward of a fresh process on 2 CPU threads came out less
    # accurate in about 1 process of 40 (gradients 1.8e-4 of their scale from float64's, where the same pass
    # after it errs by 1.1e-6; never seen on 1 thread): torch's CPU kernels at first use, not the paths compared.
    LossModel(copy.deepcopy(net), packed_attention=False, fused_cross_entropy=False)(
        ids, labels, pos
    ).backward()
    results = []
    for packed in (False, True):
        model = LossModel(copy.deepcopy(net), packed_attention=packed, fused_cross_entropy=fused)
        loss = model(ids, labels, pos, attention.segments(pos, lengths) if packed else None)
        loss.backward()
        results.append((loss, {n: p.grad for n, p in model.named_parameters()}))
    reference = LossModel(copy.deepcopy(net), packed_attention=False, fused_cross_entropy=False)
    ref_loss = reference(ids, labels, pos)
    ref_loss.backward()
    for loss, grads in results:
        torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
        for name, p in reference.named_parameters():
            # A weight's gradient sums over the batch's tokens; the paths differ in summation order only.
            assert_close_to_scale(grads[name], p.grad, terms=ids.numel(), msg=name)


def test_compiled_layers_compile_once_for_any_count_of_conversations():
    """`train.compile`: cu_seqlens has one entry per packed conversation plus one, a new length nearly every step.
    compile_layers marks it dynamic, so a batch with another count of conversations reuses the layers' graphs
    instead of recompiling every layer (on an H200 that recompile took 3.9 s of the first timed step). Dynamo's
    eager backend: the guards and recompiles are the compiler's; inductor's code generation is not checked here."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    from snaketune.model.architectures import BUILTIN_TINY
    from snaketune.model.build import compile_layers

    torch.manual_seed(0)
    net = AutoModelForCausalLM.from_config(
        LlamaConfig(**BUILTIN_TINY, vocab_size=64), attn_implementation="sdpa"
    )
    torch._dynamo.reset()
    assert compile_layers(net, backend="eager") == BUILTIN_TINY["num_hidden_layers"]
    model = LossModel(net, packed_attention=True, fused_cross_entropy=False)
    ids, labels, pos, lengths = _packed_batch(torch.Generator().manual_seed(2), vocab=64)
    model(ids, labels, pos, attention.segments(pos, lengths)).backward()
    one_each = torch.arange(ids.shape[1]).repeat(ids.shape[0], 1)  # one conversation per row: another count
    cu = attention.segments(one_each)
    assert len(cu) != len(attention.segments(pos, lengths))
    try:
        with torch._dynamo.config.patch(error_on_recompile=True):
            loss = model(ids, labels, one_each, cu)
            loss.backward()
    finally:
        torch._dynamo.reset()
    assert torch.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_heads", [8, 2], ids=["mha", "gqa"])
def test_varlen_kernel_matches_masked_sdpa(kv_heads):
    """The FlashAttention varlen path against SDPA with the block mask, also for grouped-query attention (each key/value
    head serves heads / kv_heads consecutive query heads, as transformers' repeat_kv and SDPA's enable_gqa)."""
    if not attention.kernel_available(torch.device("cuda"), torch.bfloat16):
        pytest.skip("needs CUDA and torch.nn.attention.varlen")
    gen = torch.Generator().manual_seed(3)
    _, _, pos, lengths = _packed_batch(gen, vocab=30, b=4, length=256)
    q, k, v = (
        torch.randn(4, heads, 256, 64, generator=gen).cuda().bfloat16().requires_grad_()
        for heads in (8, kv_heads, kv_heads)
    )
    cu = attention.segments(pos, lengths)
    out, _ = attention.packed_attention(
        None, q, k, v, None, scaling=64**-0.5, cu_seqlens=cu.cuda(), max_seqlen=256
    )
    mask = packed_attention_mask(pos.cuda(), torch.bfloat16)
    ref = F.scaled_dot_product_attention(
        q.float(), k.float(), v.float(), attn_mask=mask.float(), scale=64**-0.5, enable_gqa=kv_heads != 8
    )
    ref = ref.transpose(1, 2)
    real = torch.zeros(4, 256, dtype=torch.bool)
    for row, n in enumerate(lengths):
        real[row, :n] = True
    err = (out.float() - ref)[real.cuda()].norm() / ref[real.cuda()].norm()
    assert err < 1e-2
    grads = torch.autograd.grad(out[real.cuda()].float().sum(), (q, k, v))
    ref_grads = torch.autograd.grad(ref[real.cuda()].sum(), (q, k, v))
    for g, r in zip(grads, ref_grads, strict=True):
        assert ((g.float() - r.float()).norm() / r.float().norm()) < 2e-2


# ---- fused RMSNorm / RoPE / SwiGLU (Liger) -------------------------------------------------------------


def test_kernels_resolve_to_torch_where_liger_cannot_run():
    cpu = torch.device("cpu")
    assert kernels.resolve("auto", cpu, "llama") == "torch"
    assert kernels.resolve("torch", cpu, "llama") == "torch"
    with pytest.raises(
        ValueError, match=r"'train.kernels': liger needs a CUDA device .*allowed here: auto, torch"
    ):
        kernels.resolve("liger", cpu, "llama")
    with pytest.raises(ValueError, match=r"'train.kernels': 'fast'; allowed: auto, torch, liger"):
        kernels.resolve("fast", cpu, "llama")


@pytest.mark.gpu
def test_liger_kernels_match_the_torch_modules(monkeypatch):
    """Liger's RMSNorm, RoPE and SwiGLU give transformers' loss and gradients (bf16, packed rows, varlen)."""
    cuda = torch.device("cuda")
    usable, why = kernels.liger_available(cuda) if torch.cuda.is_available() else (False, "needs CUDA")
    if not usable:
        pytest.skip(why)
    from transformers.models.llama import modeling_llama

    for name in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):  # Liger patches the module globally
        monkeypatch.setattr(modeling_llama, name, getattr(modeling_llama, name))
    net, (ids, labels, pos, cu) = _tiny_bf16_case(cuda)
    results = []
    for mode in ("torch", "liger"):  # torch first: Liger's RoPE replaces the module's function
        model = LossModel(copy.deepcopy(net), packed_attention=True, fused_cross_entropy=True)
        kernels.apply(model.net, mode)
        if (
            mode == "liger"
        ):  # Liger's kernels run, or this would compare transformers' modules with themselves
            layers = model.net.model.layers
            assert model.net.model.norm._get_name() == "LigerRMSNorm"
            assert {m._get_name() for layer in layers for m in (layer.mlp, layer.input_layernorm)} == {
                "LigerSwiGLUMLP",
                "LigerRMSNorm",
            }
            assert modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
        loss = model(ids, labels, pos, cu)
        loss.backward()
        results.append((loss.float(), {n: p.grad.float() for n, p in model.named_parameters()}))
    (ref_loss, ref_grads), (loss, grads) = results
    torch.testing.assert_close(loss, ref_loss, rtol=1e-2, atol=0)
    for name, ref in ref_grads.items():
        assert ((grads[name] - ref).norm() / ref.norm()) < 3e-2, name
