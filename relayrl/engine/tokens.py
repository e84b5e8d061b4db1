"""What happens to a LocalEngine sequence as each of its tokens is sampled: recorded (with its logprob, version and
alternatives), handed to the request's listener when it streams, and checked for the end of the request.

The listener (relayrl.engine.base.TokenCallback) gets the token before the end check, so the last token comes too.
A listener that fails is dropped: its request (and the others in the batch, which the worker would fail with it)
runs on unstreamed, and the GenOutput still has every token.
"""

from __future__ import annotations

import logging

from relayrl.engine.sequence import Seq
from relayrl.engine.stops import Decode, matched_stop

log = logging.getLogger("relayrl.engine.local")


def append_sampled(seqs: list[Seq], tokens: list[int], logprobs: list[float],
                   alternatives: list[list[tuple[int, float]]] | None, version: int) -> None:
    """Record each sequence's sampled token (stamped with the weights' `version`) and stream it."""
    for i, (seq, tok, lp) in enumerate(zip(seqs, tokens, logprobs)):
        seq.out_ids.append(tok)
        seq.logprobs.append(lp)
        seq.versions.append(version)
        if alternatives is not None and seq.params.top_logprobs:
            seq.top_logprobs = seq.top_logprobs or []
            seq.top_logprobs.append(alternatives[i])
        if seq.on_token is not None:
            hand_out(seq)


def hand_out(seq: Seq) -> None:
    """Hand a streaming request its newest token (a failing listener is dropped: module doc)."""
    try:
        seq.on_token(seq.out_ids[-1], seq.logprobs[-1], seq.top_logprobs[-1] if seq.top_logprobs else None)
    except Exception:
        log.warning("a streaming request's token listener failed; the request runs on unstreamed", exc_info=True)
        seq.on_token = None


def finish_reason(seq: Seq, decode: Decode | None, max_seq_len: int) -> str | None:
    """Why the sequence ends after its newest token ("stop": a stop token or string, "length"), or None."""
    if seq.out_ids[-1] in seq.stop_ids:
        return "stop"
    if seq.params.stop_strings and (hit := matched_stop(seq.out_ids, seq.params.stop_strings, decode)):
        seq.stop_string = hit
        return "stop"
    if len(seq.out_ids) >= seq.params.max_new_tokens or seq.kv_len + 1 >= max_seq_len:
        return "length"
    return None
