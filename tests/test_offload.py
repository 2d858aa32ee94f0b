"""train.offload_activations (snaketune.model.offload): the checkpointed layers' inputs wait in host memory until
backward, and training computes exactly what checkpointing alone computes. The CPU path makes the same copies (a
plain host copy instead of a pinned one), so these run anywhere; the end-to-end run through the train rule's ranks is
tests/test_training.py's."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from snaketune.config.choices import ConfigError
from snaketune.config.schema import TrainConfig
from snaketune.model import offload
from snaketune.model.build import checkpoint_layers

LAYERS = 4


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=LAYERS,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    net = LlamaForCausalLM(cfg).to(torch.float64)
    net.train()
    return net


def loss_and_grads(setting: bool | int, offloaded: bool) -> tuple[float, dict[str, torch.Tensor], int]:
    """One forward and backward of the same batch; (loss, every parameter's gradient, inputs packed to the host)."""
    net = tiny_llama()
    checkpoint_layers(net, setting, offload=offloaded)
    packed = []
    for layer in net.model.layers:
        hooks = getattr(layer._gradient_checkpointing_func, "keywords", {}).get("hooks")
        if hooks is not None and hooks not in packed:
            packed.append(hooks)
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    loss = net(input_ids=x, labels=x).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in net.named_parameters()}
    return loss.item(), grads, sum(h.packed for h in packed)


@pytest.mark.parametrize("setting", [True, 2])
def test_offloaded_inputs_change_no_loss_and_no_gradient(setting):
    """Every layer or the first 2 checkpointed: the same loss and gradients (float64: bit for bit) with the inputs
    offloaded, and exactly one tensor per checkpointed layer went to the host: the layer's input, not what the layer
    saves inside (that is recomputed)."""
    loss, grads, packed = loss_and_grads(setting, offloaded=False)
    assert packed == 0
    loss_off, grads_off, packed_off = loss_and_grads(setting, offloaded=True)
    assert packed_off == (LAYERS if setting is True else setting)
    assert loss_off == loss
    for name, grad in grads.items():
        torch.testing.assert_close(grads_off[name], grad, rtol=0, atol=0, msg=name)


def test_the_input_lives_in_a_separate_host_copy():
    """What the hook keeps is its own host tensor, not a view of the activation: the activation's memory can be
    reused (overwritten here behind autograd's back) and backward still gets the saved values."""
    x = torch.randn(3, 5, dtype=torch.float64, requires_grad=True)
    hooks = offload.InputsOnHost()
    with hooks:
        y = x.exp()  # exp saves its output for backward
    assert hooks.packed == 1
    expected = y.detach().clone()
    y.data.zero_()  # the activation's memory reused
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, expected, rtol=0, atol=0)


def test_offload_without_checkpointing_is_refused():
    """Nothing recomputes, so nothing's input could wait on the host: the key and what is allowed are named."""
    with pytest.raises(ConfigError, match=r"train.offload_activations.*needs train.gradient_checkpointing"):
        TrainConfig(offload_activations=True, gradient_checkpointing=False)
    assert TrainConfig(offload_activations=True, gradient_checkpointing=3).offload_activations
    # train.strategy auto decides checkpointing itself, and turns offload on only with it (snaketune.plan.search).
    assert TrainConfig(offload_activations=True, strategy="auto").offload_activations


def test_compiled_layers_offload_and_compute_the_same():
    """train.compile with train.offload_activations and partial checkpointing: torch.compile traces each layer
    (aot_eager here: the graph capture without code generation) and the offloaded inputs still go through the hook
    (dynamo leaves the hook's context to eager code and compiles the layer inside it); loss and gradients as eager."""
    from snaketune.model.build import compile_layers

    def run(compiled: bool) -> tuple[float, dict[str, torch.Tensor], int]:
        net = tiny_llama()
        checkpoint_layers(net, 2, offload=True)
        hooks = net.model.layers[0]._gradient_checkpointing_func.keywords["hooks"]
        if compiled:
            compile_layers(net, backend="aot_eager")
        x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
        for _ in range(2):  # the second step runs the compiled graphs without compiling
            net.zero_grad()
            loss = net(input_ids=x, labels=x).loss
            loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in net.named_parameters()}, hooks.packed

    loss, grads, packed = run(compiled=False)
    loss_c, grads_c, packed_c = run(compiled=True)
    assert packed == packed_c == 2 * 2  # two checkpointed layers, two steps
    assert loss_c == loss
    for name, grad in grads.items():
        torch.testing.assert_close(grads_c[name], grad, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("offloaded", [False, True], ids=["checkpointed", "offloaded"])
def test_checkpointed_layers_run_compiled_in_forward_and_recompute(offloaded):
    """train.compile with the first 2 of 4 layers checkpointed: every layer runs a compiled graph, the checkpointed
    ones twice per step (forward and backward's recompute), the others once. Compiled around transformers'
    checkpoint, Dynamo compiled nothing of a checkpointed layer (it ran eagerly: with FP8 its casts as separate
    kernels, 3.5x slower on an H100, issue #50). A counting backend: the graphs as Dynamo captured them."""
    from snaketune.model.build import compile_layers

    runs = []

    def counting(graph, _inputs):
        def run(*args):
            runs.append(len(graph.graph.nodes))
            return graph.forward(*args)

        return run

    torch._dynamo.reset()
    try:
        net = tiny_llama()
        checkpoint_layers(net, 2, offload=offloaded)
        compile_layers(net, backend=counting)
        x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
        net(input_ids=x, labels=x).loss.backward()
    finally:
        torch._dynamo.reset()
    assert len(runs) == 2 * 2 + 2  # 2 checkpointed layers x (forward + recompute) + 2 others
    assert min(runs) > 20  # a whole layer's graph, not a fragment around a graph break


@pytest.mark.parametrize("setting", [True, 2])
def test_backward_fetches_the_next_layers_input_ahead_within_one_step(setting):
    """Unpacking a layer's input starts the copy back of the layer before it (the one backward reaches next): every
    checkpointed layer but the first is fetched ahead, and a second step's first layer never waits on the first
    step's last (the chain ends with each forward); the gradients stay those of checkpointing alone."""
    net = tiny_llama()
    n = checkpoint_layers(net, setting, offload=True)
    hooks = net.model.layers[0]._gradient_checkpointing_func.keywords["hooks"]
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    for step in (1, 2):
        net(input_ids=x, labels=x).loss.backward()
        assert (hooks.packed, hooks.fetched_ahead) == (step * n, step * (n - 1))
    _, grads, _ = loss_and_grads(setting, offloaded=False)
    for name, p in net.named_parameters():
        torch.testing.assert_close(p.grad, 2 * grads[name], rtol=1e-12, atol=1e-12, msg=name)


def test_a_forward_without_backward_leaves_no_chain():
    """A forward whose graph is dropped (no backward) holds nothing: the next forward's first input has no
    predecessor to fetch, and the dropped inputs' host copies are freed with their graph."""
    net = tiny_llama()
    n = checkpoint_layers(net, True, offload=True)
    hooks = net.model.layers[0]._gradient_checkpointing_func.keywords["hooks"]
    x = torch.randint(0, 96, (2, 24), generator=torch.Generator().manual_seed(1))
    net(input_ids=x, labels=x).loss  # noqa: B018 - the graph is dropped here
    net(input_ids=x, labels=x).loss.backward()
    assert (hooks.packed, hooks.fetched_ahead) == (2 * n, n - 1)
