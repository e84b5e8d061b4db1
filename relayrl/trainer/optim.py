"""AdamW for the trainer: torch's fused kernel, or a variant that keeps its two moments in bfloat16; and the
stochastic rounding into bf16 that both this optimizer and a bf16 engine's weight sync need (`round_to_bf16_`).

fp32 weights + gradients + AdamW moments cost 16 bytes per parameter; the moments are half of it. With
`train.optimizer_state_dtype: bfloat16` they are stored in bf16 (12 bytes per parameter: -0.54 GB at 135M
parameters) and every update is computed in fp32, a slice of at most `CHUNK` elements at a time so that the
fp32 working copies stay a few MB. Storing the moments back needs care:

- the first moment (beta1 = 0.9) moves by 10% of the way to the gradient each step, far above bf16's
  resolution (2^-8 relative): round to nearest is exact enough;
- the second moment (beta2 = 0.999) moves by 0.1% per step, below half of bf16's resolution: rounded to
  nearest it would stop moving (0.999 * v rounds back to v). It is rounded stochastically (up with the
  probability of the dropped fraction), so its expected value is the fp32 one and it decays and grows as it
  should (tests/unit/test_optim.py checks both).

bf16 weights (`model.train_dtype: bfloat16`, 8 bytes per parameter with their bf16 gradients and moments) always
take this optimizer, whatever the moments' setting: torch's AdamW would store each update rounded to nearest, and an
update at RL learning rates (~lr a step) is far below half a bf16 step of the weight (2^-9 of it), so almost no
weight would move (tests/unit/test_optim.py). Here the step is computed in fp32 and the weight stored rounded
stochastically, unbiased as the second moment is.

On the CPU the step runs in a small C kernel (`kernels/adamw_bf16.c`, built once per machine by
relayrl.common.cbuild): one pass over each parameter instead of ~15 over fp32 slices, with the rounding noise
hashed from (step, parameter, element) instead of drawn by torch.randint, which makes the step many times
faster (bench/kernels.py optim_step; docs/benchmarks.md, "The optimizer step: bf16-moment AdamW in C"). Elsewhere
(GPU, DTensor shards, no compiler, RELAYRL_KERNELS=0) the PyTorch slices below do the same arithmetic.
"""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch

from relayrl.common import cbuild
from relayrl.common.device import plain_cpu

CHUNK = 1 << 20  # elements per fp32 working slice (4 MB each)
STATE_DTYPES = ("float32", "bfloat16")
_SOURCE = Path(__file__).with_name("kernels") / "adamw_bf16.c"


@functools.cache
def load_kernel() -> ctypes.CDLL | None:
    """The C library (AdamW step, stochastic rounding), or None (logged once) when it cannot be built or
    kernels are switched off."""
    f32, ptr, u32, i64 = ctypes.c_float, ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int64
    step = ([i64, ptr, ptr, ptr, ptr, f32, f32, f32, f32, f32, f32, f32, u32, ctypes.c_int], None)
    signatures = {"relayrl_adamw_bf16": step, "relayrl_adamw_bf16_weights": step,
                  "relayrl_round_bf16": ([i64, ptr, ptr, u32, ctypes.c_int], None)}
    return cbuild.load(_SOURCE, signatures=signatures,
                       fallback="the PyTorch version runs")


def _kernel_can_take(*tensors: torch.Tensor) -> bool:
    """Plain contiguous CPU tensors only: a DTensor shard or a device pointer must never reach C."""
    return plain_cpu(*tensors) and all(t.is_contiguous() for t in tensors)


def adamw(params: list[torch.nn.Parameter], *, state_dtype: str = "float32", **kwargs) -> torch.optim.Optimizer:
    """torch's fused AdamW (one kernel per step, fp32 moments), or Bf16StateAdamW for state_dtype=bfloat16 and
    for any bf16 weights (whose updates must be rounded stochastically: module doc)."""
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"train.optimizer_state_dtype must be one of {STATE_DTYPES}, got {state_dtype!r}")
    if state_dtype == "bfloat16" or any(p.dtype == torch.bfloat16 for p in params):
        return Bf16StateAdamW(params, **kwargs)
    return torch.optim.AdamW(params, fused=True, **kwargs)


def round_to_bf16_(dst: torch.Tensor, src: torch.Tensor, seed: int) -> None:
    """dst (bf16) <- src (fp32) rounded stochastically, the noise a function of `seed` (and the element).

    Why: a bf16 copy of fp32 master weights (a bf16 inference engine beside an fp32 trainer) rounded to nearest
    stays where it is until the weights have moved by half a bf16 step, 2^-9 of their size: at RL learning
    rates (Adam moves a weight by ~lr a step) most weights of SmolLM2 did not change their bf16 value in the
    first steps, and the engine kept sampling from the first policy. Rounded stochastically the copy follows
    the master weights in expectation from the first step (docs/benchmarks.md, "A bf16 engine that learns").

    A `src` on another device moves to `dst`'s first and is rounded there: host copies for a GPU engine (the dist
    and disk transports) rounded on the host, by a producer's one torch thread, kept the engine paused for
    seconds per update (docs/benchmarks.md, "On a GPU", the sixth run)."""
    if dst.shape != src.shape:
        raise ValueError(f"cannot round a tensor of shape {tuple(src.shape)} into one of {tuple(dst.shape)}")
    if src.device != dst.device:
        src = src.to(dst.device)
    lib = load_kernel()
    if lib is not None and src.dtype == torch.float32 and dst.dtype == torch.bfloat16 and _kernel_can_take(src, dst):
        lib.relayrl_round_bf16(src.numel(), src.data_ptr(), dst.data_ptr(), seed & 0xFFFFFFFF,
                               torch.get_num_threads())
        return
    stochastic_round_(dst, src.float().contiguous(), torch.Generator(src.device).manual_seed(seed))


def rounded_to_bf16(named: Iterable[tuple[str, torch.Tensor]], seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """The fp32 tensors of `named` as bf16 copies rounded stochastically (round_to_bf16_), the others as they are:
    what a bf16 inference server is sent, so that it follows the trainer's fp32 weights as a local bf16 engine
    does (a server casting fp32 itself rounds to nearest). Lazy: one tensor at a time, in the source's order."""
    for i, (name, t) in enumerate(named):
        if t.dtype == torch.float32:
            out = torch.empty(t.shape, dtype=torch.bfloat16, device=t.device)
            round_to_bf16_(out, t.detach().contiguous(), seed * 1_000_003 + i)
            t = out
        yield name, t


def stochastic_round_(dst: torch.Tensor, src: torch.Tensor, generator: torch.Generator | None = None) -> None:
    """dst (bf16) <- src (fp32) rounded up or down at random, with E[dst] = src.

    bf16 is fp32 with the low 16 bits dropped: adding a uniform random 16-bit integer to the fp32 bit pattern
    before dropping them carries into the kept bits with probability (dropped part / 2^16)."""
    bits = src.view(torch.int32)
    noise = torch.randint(0, 1 << 16, bits.shape, dtype=torch.int32, device=src.device, generator=generator)
    dst.copy_(bits.add(noise).bitwise_and_(-65536).view(torch.float32))


class Bf16StateAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias correction as torch.optim.AdamW) with bf16 moments, fp32 math; fp32 weights
    or bf16 ones (stored rounded stochastically)."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 use_kernel: bool = True):
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay))
        self.kernel = load_kernel() if use_kernel else None

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        index = 0
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    self._update(p, group, index)
                index += 1
        return loss

    def _update(self, p: torch.nn.Parameter, group: dict, index: int) -> None:
        lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        state = self.state[p]
        if not state:
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
            state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.bfloat16, memory_format=torch.contiguous_format)
        state["step"] += 1
        t = float(state["step"])
        step_size, bc2_sqrt = lr / (1 - beta1**t), math.sqrt(1 - beta2**t)
        # the rounding noise is a function of (step, parameter): a resumed run rounds as the straight one did,
        # and the process's own random streams are left alone
        seed = int(t) * 1_000_003 + index
        m_all, v_all = state["exp_avg"], state["exp_avg_sq"]
        entry = self._kernel_entry(p, m_all, v_all)
        if entry is not None:
            entry(p.numel(), p.data_ptr(), p.grad.data_ptr(), m_all.data_ptr(), v_all.data_ptr(), lr, beta1, beta2,
                  eps, wd, step_size, bc2_sqrt, seed & 0xFFFFFFFF, torch.get_num_threads())
            return
        gen = torch.Generator(p.device).manual_seed(seed)
        flat = (p.view(-1), p.grad.reshape(-1), state["exp_avg"].view(-1), state["exp_avg_sq"].view(-1))
        for w_store, g, m_bf16, v_bf16 in zip(*(x.split(CHUNK) for x in flat)):
            g = g.float()
            m = m_bf16.float().lerp_(g, 1 - beta1)
            v = v_bf16.float().mul_(beta2).addcmul_(g, g, value=1 - beta2)
            w = w_store if w_store.dtype == torch.float32 else w_store.float()
            if wd:
                w.mul_(1 - lr * wd)
            w.addcdiv_(m, v.sqrt().div_(bc2_sqrt).add_(eps), value=-step_size)
            m_bf16.copy_(m)
            stochastic_round_(v_bf16, v, gen)
            if w is not w_store:  # bf16 weights: rounded stochastically (module doc)
                stochastic_round_(w_store, w, gen)

    def _kernel_entry(self, p: torch.nn.Parameter, m: torch.Tensor, v: torch.Tensor):
        """The C step for this parameter's dtypes (fp32 or bf16 weight and gradient alike), or None."""
        if self.kernel is None or p.dtype != p.grad.dtype or not _kernel_can_take(p, p.grad, m, v):
            return None
        return {torch.float32: self.kernel.relayrl_adamw_bf16,
                torch.bfloat16: self.kernel.relayrl_adamw_bf16_weights}.get(p.dtype)

    def load_state_dict(self, state_dict: dict) -> None:
        """torch casts loaded moments to the parameter's dtype (fp32 here); keep them bf16 as saved."""
        super().load_state_dict(state_dict)
        for state in self.state.values():
            for key in ("exp_avg", "exp_avg_sq"):
                if key in state:
                    state[key] = state[key].to(torch.bfloat16)
