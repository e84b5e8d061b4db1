"""Scoring a token sequence: each token's logprob given the tokens before it, and the most likely alternatives.

What prompt logprobs report (OpenAI's `echo` with `logprobs`, SGLang's `input_token_logprobs`), and so what
log-likelihood evaluations (lm-eval's multiple-choice tasks) sum. It is the trainer's computation on the same
tokens: the decoder over the whole sequence, then the LM head, log_softmax in fp32 (relayrl.trainer.engine). It
does not read the engine's KV cache: a prefix shared between prompts or parked from an earlier turn, or a cache
narrower than the model, would change the logits slightly, and a score must not depend on what else ran.
LocalEngine.submit_score runs it on its worker, between two steps.
"""

from __future__ import annotations

import torch

CHUNK_BYTES = 32 * 2**20  # fp32 logits of one chunk of positions (relayrl.trainer.logprobs uses the same size)
Scored = tuple[list[float], list[list[tuple[int, float]]]]  # logprobs, and top alternatives per position


def scored_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                    top_k: int = 0) -> Scored:
    """Per row of `logits` [rows, vocab]: log_softmax(logits / temperature)[target] in fp32 and the top_k most
    likely (token, logprob), most likely first ([] when top_k is 0)."""
    scaled = logits.float()
    if temperature != 1:
        scaled = scaled / temperature
    lsm = torch.log_softmax(scaled, dim=-1)
    chosen = lsm.gather(-1, targets[:, None]).squeeze(-1).tolist()
    if top_k <= 0:
        return chosen, [[] for _ in chosen]
    values, ids = lsm.topk(min(top_k, lsm.shape[-1]), dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


def score_forward(model: torch.nn.Module, ids: list[int], top_k: int = 0, temperature: float = 1.0,
                  chunk_bytes: int = CHUNK_BYTES) -> Scored:
    """Logprobs of ids[1:] (and top_k alternatives at each of those positions) under `model`, whose LM head runs
    over chunks of positions so that a long sequence never holds [tokens x vocab] logits whole."""
    device = next(model.parameters()).device
    tokens = torch.tensor([ids], device=device)
    with torch.inference_mode():
        hidden = model.get_decoder()(input_ids=tokens, use_cache=False).last_hidden_state[0, :-1]
        head, targets = model.get_output_embeddings(), tokens[0, 1:]
        rows = max(1, chunk_bytes // (4 * int(head.weight.shape[0])))
        logprobs: list[float] = []
        top: list[list[tuple[int, float]]] = []
        for start in range(0, len(ids) - 1, rows):
            lp, alt = scored_logprobs(head(hidden[start: start + rows]), targets[start: start + rows], temperature,
                                      top_k)
            logprobs += lp
            top += alt
    return logprobs, top
