"""Selective activation checkpointing (relayrl.trainer.checkpointing) on a real tiny model: the same gradients as
no checkpointing, and the backward recomputes fewer matmuls the more the layers keep."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from relayrl.models import load_model
from relayrl.trainer.engine import TrainEngine


class CountMatmuls(TorchDispatchMode):
    """Matmuls run while active, by output width."""

    def __init__(self):
        super().__init__()
        self.widths: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default):
            self.widths.append(out.shape[-1])
        return out


def grads_and_backward_matmuls(tiny_path, saves):
    torch.manual_seed(0)
    model = load_model(tiny_path, dtype="float32")
    if saves is not None:  # as the trainer sets it up (model.gradient_checkpointing, model.checkpoint_saves)
        TrainEngine(model, gradient_checkpointing=True, checkpoint_saves=saves)
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids, use_cache=False).logits
    loss = torch.log_softmax(logits.float(), -1).gather(-1, ids[:, 1:, None].roll(1, 1)).mean()
    with CountMatmuls() as count:
        loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, count.widths, model.config


@pytest.fixture(scope="module")
def reference(tiny_path):
    return grads_and_backward_matmuls(tiny_path, None)


@pytest.mark.parametrize("saves", ["nothing", "mlp", "matmuls"])
def test_gradients_equal_no_checkpointing(tiny_path, reference, saves):
    ref, _, _ = reference
    grads, _, _ = grads_and_backward_matmuls(tiny_path, saves)
    for name, g in ref.items():
        assert torch.allclose(grads[name], g, atol=1e-6, rtol=1e-5), name


def test_kept_matmuls_are_not_recomputed(tiny_path, reference):
    _, none_mm, cfg = reference
    counts = {s: grads_and_backward_matmuls(tiny_path, s)[1] for s in ("nothing", "mlp", "matmuls")}
    layers, wide = cfg.num_hidden_layers, cfg.intermediate_size
    # plain checkpointing reruns every layer's matmuls up to the last one backward needs an input of (down_proj's
    # input is the gating product, so down_proj itself is not rerun): q, k, v, o, gate, up = 6 per layer
    assert len(counts["nothing"]) - len(none_mm) == 6 * layers
    # "mlp" keeps gate and up: the two [tokens x intermediate] matmuls per layer are not rerun
    assert counts["nothing"].count(wide) - counts["mlp"].count(wide) == 2 * layers
    assert len(counts["mlp"]) - len(none_mm) == 4 * layers
    assert len(counts["matmuls"]) == len(none_mm)  # nothing rerun but elementwise work and attention
