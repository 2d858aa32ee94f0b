"""Optimizers of the train stage: torch's AdamW, and AdamW over fp32 master copies of bf16 weights.

`MasterWeightAdamW` is mixed-precision training as Megatron-LM and torchtitan do it, without DeepSpeed's
extra gradient copies: the model's weights and gradients stay bf16 on the GPU and the optimizer keeps, per
trained parameter, an fp32 master weight and Adam's fp32 m and v (2 + 2 + 4 + 8 = 16 B/param,
docs/facts.md). DeepSpeed's own bf16 path at ZeRO stage 0 flattens the bf16 gradients and casts them to
fp32 for the step (22 B/param at its peak on one GPU, like ZeRO-2): 7B full fine-tuning then does not fit a
141 GB H200, while with this optimizer it does. The step works through the parameters in chunks of at most
`CHUNK_ELEMENTS`: the chunk's gradients are cast to fp32, clipped by the global norm, and one fused AdamW
kernel updates the fp32 masters, which are then copied (rounded to nearest) into the bf16 weights. Only one
chunk of fp32 gradients exists at a time.

With `states="8bit"` (train.optimizer_states) m and v are bitsandbytes' block-wise 8-bit states
(snaketune.train.adam8bit): the step goes tensor by tensor, casting one gradient to fp32 at a time, and costs 10 B per
trained parameter in all; elsewhere bitsandbytes' AdamW8bit is the client optimizer DeepSpeed wraps.

DeepSpeed still drives training (backward scaling, accumulation boundaries, the all-reduce of gradients,
checkpoints): the trainer gives it this optimizer as a client optimizer with DeepSpeed's own bf16 handling
off (snaketune.config.deepspeed), so DeepSpeed treats the model as it would an fp32 one and leaves its dtype alone.
"""

from __future__ import annotations

import functools

import torch
from torch.optim.adam import adam as _adam_functional

from snaketune.model import sizes
from snaketune.train import adam8bit

CHUNK_ELEMENTS = sizes.MASTER_CHUNK_ELEMENTS
"""Most parameters whose fp32 gradients exist at once in a step (1 GiB of fp32; the memory plan counts it)."""
KERNELS = ("auto", "triton", "torch")
TRITON_BLOCK = 1024
"""Elements per Triton program (4 warps): 38.8-39.0 ms for the 24-layer 7B's 5.7B parameters on one H200, 96-98%
of a plain copy's bandwidth, against 41.8-41.9 ms at 4096 (bench/optimizer_step.py, two runs, bench/RESULTS.md)."""


def triton_available(device: torch.device) -> bool:
    """Whether the fused Triton AdamW below can run: a CUDA device and an importable Triton."""
    if device.type != "cuda":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_triton(key: str, mode: str, device: torch.device) -> str:
    """An `auto | triton | torch` setting (train.optimizer_kernel, train.loss_kernel) -> `triton` or `torch` on
    `device`: `auto` is triton where it runs; `triton` where it cannot is an error naming the key."""
    if mode not in KERNELS:
        raise ValueError(f"config key '{key}': {mode!r}; allowed: {', '.join(KERNELS)}")
    if mode == "triton" and not triton_available(device):
        raise ValueError(
            f"config key '{key}': 'triton' needs a CUDA device and the triton package (device {device}); "
            "allowed here: auto, torch"
        )
    return "triton" if mode == "triton" or (mode == "auto" and triton_available(device)) else "torch"


@functools.cache
def _triton_adamw():
    """One pass per parameter: read the bf16 gradient and the fp32 master, m and v; write master, m, v and the
    bf16 weight (28 B per parameter). torch's path needs an fp32 copy of each gradient, the fused AdamW over it
    and a copy back to bf16 (40 B per parameter and two extra kernels): on a 5.7B model that is ~70 GB less
    memory traffic per step. Same arithmetic as torch.optim.AdamW (decoupled decay, bias correction)."""
    import triton
    import triton.language as tl

    @triton.jit
    def adamw(
        weight_ptr,
        grad_ptr,
        master_ptr,
        m_ptr,
        v_ptr,
        divisor_ptr,
        n,
        lr,
        beta1,
        beta2,
        eps,
        decay,
        step_size,
        bc2_sqrt,
        HAS_DIVISOR: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_DIVISOR:
            g = g / tl.load(divisor_ptr)
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        p = p * (1.0 - lr * decay)
        m = beta1 * m + (1.0 - beta1) * g
        v = beta2 * v + (1.0 - beta2) * g * g
        p = p - step_size * m / (tl.sqrt(v) / bc2_sqrt + eps)
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(weight_ptr + offs, p.to(weight_ptr.dtype.element_ty, fp_downcast_rounding="rtne"), mask=mask)

    return adamw


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's shape, also under ZeRO-3, whose partitioned parameters are empty 1-D tensors that keep
    the real shape in `ds_shape`."""
    return tuple(getattr(p, "ds_shape", p.shape))


def decays(p: torch.Tensor) -> bool:
    """Weight decay on matrices (linear and embedding weights), none on norms and biases (1-D), as nanoGPT and
    litgpt do."""
    return len(full_shape(p)) >= 2


def param_groups(net: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two AdamW groups: decayed parameters and the rest (see `decays`)."""
    decay, no_decay = [], []
    for p in net.parameters():
        if p.requires_grad:
            (decay if decays(p) else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def _chunks(items: list, sizes: list[int], limit: int) -> list[list[int]]:
    """Indices of `items` in consecutive groups of at most `limit` total size (a bigger item alone)."""
    out, current, total = [], [], 0
    for idx, n in enumerate(sizes):
        if current and total + n > limit:
            out.append(current)
            current, total = [], 0
        current.append(idx)
        total += n
    if current:
        out.append(current)
    return out


def _add_to(buffer: torch.Tensor):
    def hook(param: torch.Tensor) -> None:
        buffer.add_(param.grad)  # bf16 -> fp32 in the add
        param.grad = None

    return hook


class MasterWeightAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, as torch.optim.AdamW) on fp32 master copies of low-precision weights.

    The optimizer's own parameters are the fp32 masters (so torch's state_dict/load_state_dict keep m and v
    in fp32); `model_params` are the bf16 tensors the model computes with, whose `.grad` the step reads.
    The masters are saved in the state dict under "master_weights", so a resumed run continues from the
    exact fp32 values rather than from their bf16 rounding. Gradient clipping happens here, in fp32, on the
    global norm (which is reported as `_global_grad_norm`, where DeepSpeed's engine looks for it).
    """

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        grad_clip: float = 0.0,
        fused: bool | None = None,
        kernel: str = "auto",
        accumulate_fp32: bool = False,
        states: str = "fp32",
    ):
        self.model_params: list[list[torch.Tensor]] = []
        master_groups = []
        for group in groups:
            params = [p for p in group["params"] if p.requires_grad]
            if not params:
                continue  # DeepSpeed drops empty groups from param_groups; model_params must stay aligned
            self.model_params.append(params)
            masters = [p.detach().float().clone() for p in params]
            master_groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": masters})
        super().__init__(master_groups, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0})
        self.grad_clip = grad_clip
        device = next((p.device for ps in self.model_params for p in ps), torch.device("cpu"))
        # torch's fused AdamW kernels exist for CUDA (and CPU); foreach is the portable fallback.
        self.fused = device.type == "cuda" if fused is None else fused
        self.kernel = resolve_triton("train.optimizer_kernel", kernel, device)
        self.states = states
        if states == "8bit":  # bitsandbytes' 8-bit kernel does the update (snaketune.train.adam8bit)
            adam8bit.require()
            self.kernel = "bitsandbytes 8-bit"
        self._global_grad_norm: torch.Tensor | None = None
        self.main_grads: torch.Tensor | None = None
        self._grad_views: list[list[torch.Tensor]] = []
        self._hooks: list = []
        if accumulate_fp32:
            self._accumulate_in_fp32(device)

    def _accumulate_in_fp32(self, device: torch.device) -> None:
        """Gradient accumulation in fp32, as Megatron-LM's main_grad: one flat fp32 buffer over the trained
        parameters (4 B each, against the 2 B of their bf16 .grad), to which each parameter's bf16 gradient is
        added as soon as backward has produced it (a post-accumulate-grad hook), after which that .grad is
        freed. Summing micro-batches in bf16 would round the running sum to 8 bits of mantissa at every
        micro-batch (tests/test_fast_path.py measures the difference). The step reads the buffer; with several
        ranks it all-reduces it first (the trainer turns DeepSpeed's own all-reduce of .grad off)."""
        total = sum(p.numel() for ps in self.model_params for p in ps)
        self.main_grads = torch.zeros(total, dtype=torch.float32, device=device)
        offset = 0
        for params in self.model_params:
            views = []
            for p in params:
                view = self.main_grads[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
                views.append(view)
                self._hooks.append(p.register_post_accumulate_grad_hook(_add_to(view)))
            self._grad_views.append(views)

    def _grads(self, group_index: int) -> list[torch.Tensor | None]:
        """The gradients the step uses: the fp32 buffer's views, or the model's own .grad."""
        if self.main_grads is not None:
            return self._grad_views[group_index]
        return [p.grad for p in self.model_params[group_index]]

    def reduce_main_grads(self) -> None:
        """Average the fp32 gradient buffer over the ranks (no-op on one rank or without the buffer)."""
        import torch.distributed as dist

        if self.main_grads is None or not dist.is_initialized() or dist.get_world_size() == 1:
            return
        dist.all_reduce(self.main_grads)  # SUM: gloo (CPU ranks) has no AVG
        self.main_grads.div_(dist.get_world_size())

    def _state(self, master: torch.Tensor) -> dict:
        state = self.state[master]
        # torch's fused kernels want the step on the device; the Triton kernel's bias corrections are computed
        # on the host, so its counter stays there (reading a device counter would sync once per tensor).
        where = master.device if self.fused and self.kernel == "torch" else torch.device("cpu")
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32, device=where)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        elif state["step"].device != where:  # a checkpoint loaded with the other kernel
            state["step"] = state["step"].to(where)
        return state

    @torch.no_grad()
    def grad_norm(self) -> torch.Tensor:
        """Global L2 norm of the gradients, accumulated in fp32 (stays on the device)."""
        grads = [g for i in range(len(self.model_params)) for g in self._grads(i) if g is not None]
        if not grads:
            return torch.zeros(())
        # One reduction kernel per tensor reads the bf16 gradient and accumulates in fp32; torch._foreach_norm
        # reaches half the memory bandwidth on one H200 (5.5 ms for 5.7B parameters, bench/optimizer_step.py).
        norms = [torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]
        return torch.linalg.vector_norm(torch.stack(norms))

    @torch.no_grad()
    def step(self, closure=None):
        if closure is not None:
            raise ValueError("MasterWeightAdamW.step takes no closure")
        self.reduce_main_grads()
        norm = self.grad_norm()
        self._global_grad_norm = norm  # a device tensor: read (synced) only when a step is logged
        # Clipping as torch.nn.utils.clip_grad_norm_ does it (coefficient max_norm / (norm + 1e-6), at most 1),
        # as a divisor that stays on the device: the fused kernel divides the gradients by it in the same pass
        # (its grad_scale input, meant for AMP's loss scale), so clipping costs no host sync and no extra pass.
        divisor = None
        if self.grad_clip > 0:
            divisor = torch.clamp((norm.float() + 1e-6) / self.grad_clip, min=1.0)
        if self.states == "8bit":
            self._step_8bit(divisor)
        elif self.kernel == "triton":
            self._step_triton(divisor)
        else:
            self._step_torch(divisor)
        if self.main_grads is not None:
            self.main_grads.zero_()
        return None

    def _step_torch(self, divisor: torch.Tensor | None) -> None:
        for index, (group, params) in enumerate(zip(self.param_groups, self.model_params, strict=True)):
            model_grads = self._grads(index)
            live = [i for i, g in enumerate(model_grads) if g is not None]
            beta1, beta2 = group["betas"]
            for chunk in _chunks(live, [params[i].numel() for i in live], CHUNK_ELEMENTS):
                idx = [live[j] for j in chunk]
                masters = [group["params"][i] for i in idx]
                states = [self._state(m) for m in masters]
                grads = [model_grads[i].float() for i in idx]
                if divisor is not None and not self.fused:
                    torch._foreach_div_(grads, divisor)
                _adam_functional(
                    masters,
                    grads,
                    [s["exp_avg"] for s in states],
                    [s["exp_avg_sq"] for s in states],
                    [],
                    [s["step"] for s in states],
                    foreach=not self.fused,
                    fused=self.fused,
                    grad_scale=divisor if self.fused else None,
                    decoupled_weight_decay=True,
                    amsgrad=False,
                    beta1=beta1,
                    beta2=beta2,
                    lr=group["lr"],
                    weight_decay=group["weight_decay"],
                    eps=group["eps"],
                    maximize=False,
                )
                del grads
                torch._foreach_copy_([params[i] for i in idx], masters)

    def _step_triton(self, divisor: torch.Tensor | None) -> None:
        kernel = _triton_adamw()
        for index, (group, params) in enumerate(zip(self.param_groups, self.model_params, strict=True)):
            beta1, beta2 = group["betas"]
            lr, decay, eps = group["lr"], group["weight_decay"], group["eps"]
            for master, weight, grad in zip(group["params"], params, self._grads(index), strict=True):
                if grad is None:
                    continue
                state = self._state(master)
                state["step"] += 1  # on the host (see _state): no device sync
                step = float(state["step"])
                bc1, bc2 = 1 - beta1**step, 1 - beta2**step
                n = master.numel()
                tensors = (weight, grad, master, state["exp_avg"], state["exp_avg_sq"])
                scalars = (lr, beta1, beta2, eps, decay, lr / bc1, bc2**0.5)
                kernel[((n + TRITON_BLOCK - 1) // TRITON_BLOCK,)](
                    *tensors,
                    divisor if divisor is not None else master,  # read only with HAS_DIVISOR
                    n,
                    *scalars,
                    HAS_DIVISOR=divisor is not None,
                    BLOCK=TRITON_BLOCK,
                )

    def _step_8bit(self, divisor: torch.Tensor | None) -> None:
        """Tensor by tensor: the bf16 gradient cast to fp32 (and clipped), the 8-bit AdamW update of the fp32
        master and its states, the master rounded into the bf16 weight. One fp32 gradient exists at a time."""
        for index, (group, params) in enumerate(zip(self.param_groups, self.model_params, strict=True)):
            for master, weight, grad in zip(group["params"], params, self._grads(index), strict=True):
                if grad is None:
                    continue
                state = self.state[master]
                if not state:
                    state.update(adam8bit.init_state(master))
                g = grad.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
                if divisor is not None:
                    g.div_(divisor)
                adam8bit.update(
                    master,
                    g,
                    state,
                    lr=group["lr"],
                    betas=group["betas"],
                    eps=group["eps"],
                    weight_decay=group["weight_decay"],
                )
                del g
                weight.copy_(master)

    def state_dict(self) -> dict:
        sd = super().state_dict()
        sd["master_weights"] = [m for g in self.param_groups for m in g["params"]]
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        masters = state_dict.pop("master_weights", None)
        super().load_state_dict(state_dict)
        for state in self.state.values():
            adam8bit.restore_dtypes(state)
        if masters is None:
            return  # an older checkpoint: the masters stay the (loaded) bf16 weights, upcast
        mine = [m for g in self.param_groups for m in g["params"]]
        if len(masters) != len(mine):
            raise ValueError(
                f"optimizer checkpoint has {len(masters)} master weights, this model trains {len(mine)}"
            )
        with torch.no_grad():
            for dst, src in zip(mine, masters, strict=True):
                dst.copy_(src)
            for group, params in zip(self.param_groups, self.model_params, strict=True):
                torch._foreach_copy_(params, group["params"])


def _tensors(optimizer: torch.optim.Optimizer):
    """(what, tensor) of every parameter and state tensor an optimizer holds."""
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            yield f"param_groups[{g}].params[{i}]", p
            for key, value in optimizer.state.get(p, {}).items():
                if torch.is_tensor(value) and value.dim() > 0:  # the step counter may live on the host
                    yield f"state of param_groups[{g}].params[{i}]['{key}']", value


def check_placement(
    optimizer: torch.optim.Optimizer,
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    model_params: list[torch.Tensor] | None = None,
) -> int:
    """RuntimeError unless every master weight and optimizer state is on `device` in `dtype` (fp32 for bf16
    training) and every model parameter it updates is on `device` too; returns how many tensors it checked.

    The optimizer is the one that does the arithmetic (DeepSpeed's ZeRO optimizers wrap a torch optimizer
    over their flat fp32 partitions: that inner one is checked; `device` is the host for optimizer offload).
    A master weight left on the CPU while its bf16 parameter trains on the GPU is what `from_pretrained`
    followed by a late `.to(device)` produces; torch's kernels then fail at the first step with "Tensors of
    the same index must be on the same device", which this check turns into a message at setup.
    """
    bad, n = [], 0
    items = list(_tensors(optimizer))
    if isinstance(optimizer, MasterWeightAdamW):
        items += [
            (f"model parameter {i}", p) for i, p in enumerate(p for ps in optimizer.model_params for p in ps)
        ]
        if optimizer.main_grads is not None:
            items.append(("fp32 gradient buffer", optimizer.main_grads))
    for i, p in enumerate(model_params or ()):
        items.append((f"trained parameter {i}", p))
    for what, tensor in items:
        n += 1
        want_dtype = None if what.startswith(("model parameter", "trained parameter")) else dtype  # None: any
        if tensor.dtype == torch.uint8 and any(f"['{k}']" in what for k in adam8bit.STATE_KEYS):
            want_dtype = torch.uint8  # 8-bit m and v (train.optimizer_states)
        if tensor.device.type != device.type or (device.index is not None and tensor.device != device):
            bad.append(f"{what} on {tensor.device} (expected {device})")
        elif want_dtype is not None and tensor.dtype != want_dtype:
            bad.append(f"{what} is {tensor.dtype} (expected {want_dtype})")
    if bad:
        shown = "; ".join(bad[:5]) + (f"; and {len(bad) - 5} more" if len(bad) > 5 else "")
        raise RuntimeError(
            f"{type(optimizer).__name__}: {len(bad)} of {n} optimizer tensors are not where they train: {shown}"
        )
    return n
