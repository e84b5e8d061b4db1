"""The PPO critic: a separate HF causal-LM backbone with a scalar head, and its own AdamW optimizer.

A separate model (not a second head on the policy) keeps the policy's weights, gradients and the
weights relayed to inference engines exactly those of the policy, and lets the critic learn at its
own rate (`algo.critic_lr`). Values are read on the same packed micro-batches as the policy's
logprobs: V(s_t) is the head applied to the hidden state at the position that predicts response
token t (`MicroBatch.rows/cols`), i.e. the state before token t is chosen. Shared-prompt rows work
unchanged, because attention never crosses sequences there either. As with the policy's TrainEngine, each
micro-batch moves to the critic's device for its forward and the values come back on the CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from relayrl.common.device import model_device
from relayrl.models import load_model
from relayrl.trainer.algo import reduce_stats
from relayrl.trainer.engine import bf16_autocast, clip_and_step
from relayrl.trainer.optim import adamw
from relayrl.trainer.packer import MicroBatch

ValueLossFn = Callable[[MicroBatch, torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


class ValueModel(nn.Module):
    """A decoder backbone plus nn.Linear(hidden, 1). The head starts at zero, so the first values are 0 and
    the first advantages are plain reward-to-go rather than noise from a random head."""

    def __init__(self, backbone: nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        dtype = next(backbone.parameters()).dtype
        self.head = nn.Linear(hidden_size, 1, dtype=dtype, device=model_device(backbone))
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, mb: MicroBatch) -> torch.Tensor:
        hidden = self.backbone(input_ids=mb.input_ids, attention_mask=mb.attention_mask,
                               position_ids=mb.position_ids, use_cache=False).last_hidden_state
        return self.head(hidden[mb.rows, mb.cols]).squeeze(-1).float()


class Critic:
    """The value model and its optimizer: `forward_values` for GAE, `train_step` for the value loss."""

    def __init__(self, model: ValueModel, *, lr: float = 1e-5, betas: tuple[float, float] = (0.9, 0.999),
                 weight_decay: float = 0.0, grad_clip: float = 1.0, autocast_bf16: bool = False):
        self.model = model.train()
        self.device = model_device(model)
        self.grad_clip, self.autocast_bf16 = grad_clip, autocast_bf16
        # fused AdamW, or for a critic in bf16 (model.train_dtype=bfloat16) the one that rounds updates stochastically
        self.optimizer = adamw(list(model.parameters()), lr=lr, betas=betas, weight_decay=weight_decay)

    @classmethod
    def from_pretrained(cls, path: str, *, dtype: str | torch.dtype = "float32",
                        device: str | torch.device | None = None, **kwargs) -> Critic:
        """The backbone of the causal LM at `path` (its LM head is dropped) with a fresh value head, on `device`."""
        lm = load_model(path, dtype=dtype, device=device)
        return cls(ValueModel(lm.get_decoder(), lm.config.hidden_size), **kwargs)

    def _values(self, mb: MicroBatch) -> torch.Tensor:
        """V(s_t) per trained token, computed on the critic's device, returned on the CPU (with its graph)."""
        with bf16_autocast(self.device, self.autocast_bf16):
            return self.model(mb.to(self.device)).cpu()

    @torch.no_grad()
    def forward_values(self, mb: MicroBatch) -> torch.Tensor:
        return self._values(mb)

    def train_step(self, micro_batches: list[MicroBatch], loss_fn: ValueLossFn) -> dict[str, float]:
        """One optimizer step; loss_fn's weights make the sum over micro-batches the batch's value loss."""
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        per_mb = []
        for mb in micro_batches:
            if mb.num_tokens == 0:
                continue
            loss, stats = loss_fn(mb, self._values(mb))
            loss.backward()
            per_mb.append(stats)
        stats = reduce_stats(per_mb, mean=False)
        stats.update({f"critic_{k}": v for k, v in clip_and_step(self.model, self.optimizer, self.grad_clip).items()})
        stats["critic_step_s"] = time.perf_counter() - t0
        return stats

    def state_dict(self) -> dict:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
