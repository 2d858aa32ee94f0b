"""AdamW applied inside the backward pass (`train.optimizer_step: in_backward`): the full fine-tune of a 7B on one
24 GB card.

The plain path holds every gradient until the optimizer step (bf16: 2 B per parameter, 12.9 GiB for the 7B) beside
fp32 masters and Adam states (12 B). Here each parameter is updated by a hook as soon as backward has accumulated
its gradient (torch's post-accumulate-grad hook, as torchtune's `optimizer_in_bwd` and torchao's example do), and
the gradient is freed at once: only the gradients of the tensors backward is working on exist. The weights are their
own masters (bf16 on a GPU: the update is rounded stochastically into them, so that updates far below a bf16 ulp
still move the weight on average; Zamirai et al. 2020, torchao's `bf16_stochastic_round`), and m and v take
`train.optimizer_states`: fp32 (8 B per parameter), 8bit (torchao's block-wise 8-bit, ~2 B) or 4bit (torchao's 4-bit
format, ~1.06 B: Li et al. 2023, "Memory Efficient Optimizers with 4-bit States"; v's codes snaketune's,
states4bit.V_CODES). The 7B then needs 12.9 GiB of weights and 6.8 GiB of 4-bit states. The arithmetic of one
parameter's update is torchao's `single_param_adam` (AdamW: decoupled weight decay, bias correction), compiled on
CUDA (one fused kernel per tensor shape) and eager on the CPU. 4-bit states are updated by snaketune's code, which
rounds the new m and v to their codes stochastically (torchao rounds to nearest, which leaves them far above their
averages; snaketune.train.states4bit): in one Triton pass per tensor on CUDA with `train.optimizer_kernel` triton
(auto; snaketune.train.adam4bit: 1.7x the tokens/s of the 7B on an H200 against torchao's compiled update), in torch
elsewhere (states4bit.update).

What changes against the plain path (state it wherever this is chosen):
- Gradient accumulation is impossible: a micro-batch's gradient is applied before the next one exists. The config
  must give one micro-batch per rank per optimizer step (global batch = micro-batch x ranks).
- Gradient clipping by the global norm needs every gradient before the first update. Here step t's gradients are
  divided by max(1, norm_{t-1} / grad_clip), the norm of the previous step (the current one is known only after
  the last update); the first step is not clipped. The reported `train/grad_norm` is step t's own norm, before
  clipping, as elsewhere.
- With several ranks each gradient is all-reduced (averaged) by its hook before the update, one tensor at a time,
  in the gradient's dtype (DeepSpeed's bucketed all-reduce is off): correct, not fast.
"""

from __future__ import annotations

import functools
import math

import torch

from snaketune.model import sizes
from snaketune.train import states4bit

STATES = ("fp32", "8bit", "4bit")
BLOCK = sizes.TORCHAO_BLOCK
"""Elements per quantization block: torchao's defaults for AdamW8bit and AdamW4bit."""
MIN_QUANTIZED = 4096
"""Smaller tensors (and those not a multiple of the block) keep fp32 m and v, as torchao and bitsandbytes do."""
CHUNK_ELEMENTS = 2**25
"""Most elements one update handles at once (`_row_chunks`): its fp32 temporaries stay near 0.5 GiB."""
BYTES_PER_PARAM = sizes.STATE_BYTES
"""m and v per trained parameter, with one fp32 scale per block for each (the memory plan counts these)."""


def require(states: str) -> None:
    """ValueError naming the key unless torchao's optimizer module imports."""
    try:
        import torchao.optim  # noqa: F401
    except ImportError as e:
        raise ValueError(
            f"config key 'train.optimizer_step': 'in_backward' (states {states}) needs torchao "
            f"(pip install -r requirements.txt): {e}"
        ) from e


def _zeros(p: torch.Tensor, states: str, signed: bool) -> torch.Tensor:
    n = p.numel()
    if states == "fp32" or n < MIN_QUANTIZED or n % BLOCK[states]:
        return torch.zeros_like(p, dtype=torch.float32, memory_format=torch.contiguous_format)
    if states == "4bit":  # v in snaketune's map, not torchao's linear one (states4bit.V_CODES)
        return states4bit.zeros(p.shape, signed, BLOCK[states], p.device)
    from torchao.optim.subclass_8bit import OptimState8bit

    return OptimState8bit.zeros(p.shape, signed, BLOCK[states], p.device, dtype=torch.float32)


def _row_chunks(p: torch.Tensor, states: str) -> list[slice | None]:
    """Row ranges of `p` of at most CHUNK_ELEMENTS each, on quantization-block boundaries (the update of a quantized
    state materializes the new m and v in fp32 to find each block's scale: 2 x 1.6 GiB for the 7B's embedding
    whole, measured as 2.85 GiB above the plan on one H200). [None] (the whole tensor) where `p` is small or 1-D."""
    n = p.numel()
    if n <= CHUNK_ELEMENTS or p.dim() < 2:
        return [None]
    stride = n // p.shape[0]
    block = BLOCK.get(states, 1)
    align = block // math.gcd(stride, block)  # rows per block boundary
    rows = max(align, CHUNK_ELEMENTS // stride // align * align)
    return [slice(start, min(start + rows, p.shape[0])) for start in range(0, p.shape[0], rows)]


@functools.cache
def _update_fn(compiled: bool):
    """One parameter's AdamW update with its gradient divided by the clipping divisor: torchao's single_param_adam,
    compiled into one kernel per (shape, dtype, state type, decay) on CUDA (a handful for a decoder; the recompile
    limit is lifted for it, as torchao's optimizers do)."""
    from torchao.optim.adam import single_param_adam

    def update(p, grad, divisor, step, exp_avg, exp_avg_sq, lr, beta1, beta2, weight_decay, eps, stochastic):
        single_param_adam(
            p,
            grad / divisor,
            step,
            exp_avg,
            exp_avg_sq,
            None,
            lr,
            beta1,
            beta2,
            weight_decay,
            eps,
            True,
            stochastic,
        )

    return torch.compile(update, fullgraph=True, dynamic=False) if compiled else update


class BackwardAdamW(torch.optim.Optimizer):
    """AdamW whose update runs in the backward pass (module docstring). The optimizer's parameters are the model's
    own trained parameters; `step()` only closes the step (the norm for the log and the next step's clipping).
    DeepSpeed's engine drives it as a client optimizer at ZeRO stage 0 with its own all-reduce and clipping off
    (snaketune.train.engine)."""

    def __init__(
        self,
        groups: list[dict],
        *,
        lr: float,
        betas: tuple[float, float],
        eps: float = 1e-8,
        grad_clip: float = 0.0,
        states: str = "fp32",
        compile: bool | None = None,
        kernel: str = "torch",
    ):
        if states not in STATES:
            raise ValueError(f"config key 'train.optimizer_states': {states!r}; allowed: {', '.join(STATES)}")
        groups = [{**g, "params": [p for p in g["params"] if p.requires_grad]} for g in groups]
        groups = [g for g in groups if g["params"]]  # DeepSpeed drops empty groups
        super().__init__(groups, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": 0.0})
        require(states)  # torchao's update runs for fp32 states too
        self.states = states
        self.grad_clip = grad_clip
        device = next(p.device for g in self.param_groups for p in g["params"])
        self.compile = device.type == "cuda" if compile is None else compile
        # `triton` (train.optimizer_kernel, resolved by the caller): the 4-bit tensors' update in one Triton pass
        # (snaketune.train.adam4bit); the rest (fp32 or 8-bit states, small tensors) keeps torchao's update.
        self.triton = kernel == "triton" and states == "4bit"
        if self.triton:  # imported here, not at the top: it imports Triton, which CPU builds of torch lack
            from snaketune.train import adam4bit

            self._adam4bit = adam4bit
        torchaos = (
            "torchao single_param_adam, compiled" if self.compile else "torchao single_param_adam"
        ) + (f", {states} states" if states != "4bit" else "")
        # With 4-bit states the quantized tensors take snaketune's update (the Triton kernel or
        # snaketune.train.states4bit); the small ones torchao keeps unquantized take torchao's.
        if self.triton:
            self.kernel = "snaketune Triton 4-bit AdamW (torchao's states)"
        elif states == "4bit":
            self.kernel = f"snaketune 4-bit AdamW in torch (torchao's states; small tensors: {torchaos})"
        else:
            self.kernel = torchaos
        self._seed = torch.initial_seed() % 2**31
        self._index = {p: i for i, p in enumerate(p for g in self.param_groups for p in g["params"])}
        # per tensor: whether the Triton kernel updates it
        self._fast: dict[torch.Tensor, bool] = {}
        self._world: int | None = None  # ranks, read at the first hook (after the process group exists)
        # This step's squared gradient norms, one slot per tensor (each hook writes its own: no read-modify-write),
        # and the divisor this step's gradients get (the previous step's clipping). Device tensors: no host sync
        # inside backward.
        self._sq_parts = torch.zeros(len(self._index), dtype=torch.float32, device=device)
        self._sq_slots = self._sq_parts.unbind()  # 0-d views, made once
        self._divisor = torch.ones((), dtype=torch.float32, device=device)
        self._lr = [torch.tensor(float(g["lr"]), dtype=torch.float32) for g in self.param_groups]
        self._global_grad_norm: torch.Tensor | None = None  # where DeepSpeed's engine looks for it
        self._hooks = [
            p.register_post_accumulate_grad_hook(functools.partial(self._apply, index))
            for index, g in enumerate(self.param_groups)
            for p in g["params"]
        ]

    @torch.no_grad()
    def _apply(self, index: int, p: torch.Tensor) -> None:
        """The hook: average the gradient over ranks, count its norm, update the parameter, free the gradient."""
        import torch.distributed as dist

        grad = p.grad
        if grad is None:
            return
        if self._world is None:
            self._world = dist.get_world_size() if dist.is_initialized() else 1
        if self._world > 1:
            dist.all_reduce(grad)  # SUM: gloo (CPU ranks) has no AVG
            grad.div_(self._world)
        group = self.param_groups[index]
        state = self.state[p]
        if not state:
            state["step"] = torch.zeros((), dtype=torch.float32)  # on the host, as torchao keeps it
            state["exp_avg"] = _zeros(p, self.states, signed=True)
            state["exp_avg_sq"] = _zeros(p, self.states, signed=False)
        state["step"] += 1
        fast = self._fast.get(p)
        if fast is None:  # asked once per tensor
            fast = self._fast[p] = self.triton and self._adam4bit.supports(p, state["exp_avg"])
        i = self._index[p]
        if not fast:  # the kernel writes its norm itself
            self._sq_slots[i].copy_(torch.linalg.vector_norm(grad, dtype=torch.float32).square())
        if fast or type(state["exp_avg"]).__name__ == "OptimState4bit":
            self._update_4bit(p, grad, state, group, i, fast)
        else:
            self._update_torchao(index, p, grad, state, group)
        p.grad = None

    def _update_4bit(
        self, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict, i: int, fast: bool
    ) -> None:
        """snaketune's 4-bit update of `p`: the Triton kernel (`fast`; it writes the gradient's squared norm into the
        tensor's slot itself) or the kernel's arithmetic and rounding in torch (CPU ranks, optimizer_kernel torch)."""
        step = int(state["step"])
        common = {
            "divisor": self._divisor,
            "step": step,
            "lr": float(group["lr"]),
            "betas": group["betas"],
            "eps": group["eps"],
            "weight_decay": group["weight_decay"],
            # a random stream per (step, tensor): a resumed run rounds as the uninterrupted one
            "seed": (self._seed + step * 65_537 + i) % 2**31,
        }
        m, v = state["exp_avg"], state["exp_avg_sq"]
        if fast:
            # The hook's host time bounds the 7B's step (273 hooks): no detach, no slicing, one launch besides the
            # kernel's (its norm into this tensor's slot).
            contiguous = grad if grad.is_contiguous() else grad.contiguous()
            self._adam4bit.update(p, contiguous, m, v, sq_out=self._sq_slots[i], **common)
        else:
            states4bit.update(p, grad, m, v, **common)

    def _update_torchao(
        self, index: int, p: torch.Tensor, grad: torch.Tensor, state: dict, group: dict
    ) -> None:
        """torchao's update of `p` (fp32 or 8-bit states), compiled on CUDA, row chunk by row chunk."""
        lr = self._lr[index]
        lr.fill_(float(group["lr"]))  # the scheduler writes floats; the compiled update takes a tensor
        beta1, beta2 = group["betas"]
        update = _update_fn(self.compile)
        weight = p.detach()
        with torch._dynamo.utils.disable_cache_limit():
            for rows in _row_chunks(p, self.states):
                part = (lambda t: t) if rows is None else (lambda t: t[rows])  # noqa: B023 - used at once
                update(
                    part(weight),
                    part(grad),
                    self._divisor,
                    state["step"],
                    part(state["exp_avg"]),
                    part(state["exp_avg_sq"]),
                    lr,
                    beta1,
                    beta2,
                    group["weight_decay"],
                    group["eps"],
                    p.dtype == torch.bfloat16,
                )

    @torch.no_grad()
    def step(self, closure=None):
        """Close the step: every update has happened in backward. Keep the norm for the log and set the next step's
        clipping divisor (clip_grad_norm_'s coefficient max_norm / (norm + 1e-6), at most 1, as a divisor)."""
        if closure is not None:
            raise ValueError("BackwardAdamW.step takes no closure")
        norm = self._sq_parts.sum().sqrt()
        self._global_grad_norm = norm
        if self.grad_clip > 0:
            self._divisor = torch.clamp((norm + 1e-6) / self.grad_clip, min=1.0)
        self._sq_parts.zero_()  # after the sum above, in stream order; a tensor without a gradient adds nothing
        return None

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Nothing to clear: each hook freed its gradient (frozen parameters never had one)."""

    def state_dict(self) -> dict:
        """torch's, with each quantized m and v as its plain tensors (codes, scales, code map) and attributes:
        DeepSpeed loads checkpoints with a callable map_location, which torch cannot apply to a tensor subclass."""
        sd = super().state_dict()
        sd["state"] = {i: {k: _plain(v) for k, v in s.items()} for i, s in sd["state"].items()}
        sd["clip_divisor"] = self._divisor
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        state_dict = dict(state_dict)
        divisor = state_dict.pop("clip_divisor", None)
        # torch's Optimizer.load_state_dict casts each state tensor to its parameter's dtype (bf16 on a GPU):
        # m and v keep their own dtype and type (fp32, or torchao's quantized subclasses) instead.
        saved = {i: dict(s) for i, s in state_dict.get("state", {}).items()}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for i, s in saved.items():
            p = params[int(i)]
            self.state[p] = {
                "step": s["step"].detach().to("cpu", torch.float32),
                "exp_avg": _restore(s["exp_avg"], p.device),
                "exp_avg_sq": _restore(s["exp_avg_sq"], p.device),
            }
        if divisor is not None:
            self._divisor = divisor.to(self._divisor.device, torch.float32)


def _plain(value):
    """A torchao quantized state as {"torchao": class name, "tensors": {...}, "attributes": [...]}; else itself."""
    if torch.is_tensor(value) and hasattr(value, "__tensor_flatten__"):
        names, attributes = value.__tensor_flatten__()
        return {
            "torchao": type(value).__name__,
            "tensors": {n: getattr(value, n) for n in names},
            "attributes": list(attributes),
        }
    return value


def _restore(value, device: torch.device) -> torch.Tensor:
    """The inverse of `_plain`, on `device`."""
    if not isinstance(value, dict):
        return value.to(device)
    from torchao.optim.subclass_4bit import OptimState4bit
    from torchao.optim.subclass_8bit import OptimState8bit

    cls = {c.__name__: c for c in (OptimState4bit, OptimState8bit)}[value["torchao"]]
    tensors = {n: t.to(device) for n, t in value["tensors"].items()}
    return cls.__tensor_unflatten__(tensors, value["attributes"], None, None)
