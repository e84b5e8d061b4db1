"""relayrl.trainer.embedding: the input embedding's backward adds the used rows into weight.grad, and every
gradient of a tied model is autograd's own (to float rounding), over accumulated micro-batches."""

from __future__ import annotations

import torch

from relayrl.models import load_model
from relayrl.trainer import embedding
from relayrl.trainer.engine import head_logprobs
from relayrl.trainer.logprobs import weight_grad_into_param


def _backward_twice(model: torch.nn.Module, batches) -> dict[str, torch.Tensor]:
    """Two micro-batches' loss.backward() as the trainer runs them (inside weight_grad_into_param)."""
    model.train()
    for ids, weights in batches:
        with weight_grad_into_param():
            hidden = model.get_decoder()(input_ids=ids).last_hidden_state
            logp, _ = head_logprobs(model, hidden[:, :-1].reshape(-1, hidden.shape[-1]), ids[:, 1:].reshape(-1),
                                    1.0, False, False)
        (logp * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_rowwise_backward_gives_autograds_gradients(tiny_path):
    g = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(2):
        ids = torch.randint(1, 512, (3, 11), generator=g)
        ids[0, 4] = ids[2, 7] = 0  # the padding row: no gradient, as nn.Embedding
        ids[1, :3] = ids[0, 5]  # repeated tokens: their rows add up
        batches.append((ids, torch.randn(3 * 10, generator=g)))
    plain = load_model(tiny_path, dtype="float32")
    patched = load_model(tiny_path, dtype="float32")
    assert embedding.install(patched)
    want, got = _backward_twice(plain, batches), _backward_twice(patched, batches)
    assert want.keys() == got.keys()
    for name in want:
        assert torch.allclose(got[name], want[name], rtol=1e-5, atol=1e-6), name
    assert got["model.embed_tokens.weight"].abs().sum() > 0


def test_it_runs_only_inside_weight_grad_into_param_with_gradients_on(tiny_path):
    model = load_model(tiny_path, dtype="float32")
    assert embedding.install(model) and embedding.install(model)  # a second install keeps one patch
    emb = model.get_input_embeddings()
    ids = torch.tensor([[3, 4, 5]])
    with weight_grad_into_param():
        assert type(emb(ids).grad_fn).__name__ == "_EmbeddingIntoGradBackward"
        with torch.no_grad():
            assert emb(ids).grad_fn is None
    assert type(emb(ids).grad_fn).__name__ == "EmbeddingBackward0"  # torch.autograd.grad callers: autograd's path
    hooked = load_model(tiny_path, dtype="float32")
    embedding.install(hooked)
    hooked.get_input_embeddings().weight.register_hook(lambda grad: grad)
    with weight_grad_into_param():  # a hook must see the gradient: autograd's path
        assert type(hooked.get_input_embeddings()(ids).grad_fn).__name__ == "EmbeddingBackward0"


def test_embeddings_with_their_own_backward_are_left_alone():
    class Wrapper(torch.nn.Module):
        def __init__(self, emb):
            super().__init__()
            self.emb = emb

        def get_input_embeddings(self):
            return self.emb

    for emb in (torch.nn.Embedding(10, 4, max_norm=1.0), torch.nn.Embedding(10, 4, sparse=True),
                torch.nn.Embedding(10, 4, scale_grad_by_freq=True)):
        assert not embedding.install(Wrapper(emb))
    assert embedding.install(Wrapper(torch.nn.Embedding(10, 4)))
