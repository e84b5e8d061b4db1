"""Stop strings made to match at a known place: a random tiny model's text is not known in advance, so a test
generates once without stops, then picks a piece of that text with the shape it needs (within one token, across
token boundaries, ending inside a token) and knows where the same run with that stop must end. The runs are seeded
samples rather than greedy ones: the tiny model, greedy, repeats one token forever, and a seeded request samples the
same tokens however it is batched (relayrl.engine.base.SamplingParams.seed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Stop:
    text: str  # the stop string
    last: int  # index of the token that completes its first occurrence: generation ends with this token
    span: int  # how many tokens that occurrence touches
    inside: bool  # the last token's text goes on past the stop string
    expected_text: str  # the whole greedy text, cut right before the stop string


def _decode(tok: Any, ids: list[int]) -> str:
    return tok.decode(ids, skip_special_tokens=True)


def first_hit(tok: Any, ids: list[int], stop: str) -> Stop | None:
    """Where `stop` first appears in the text of `ids`, decoded a token more at a time (as the engine checks)."""
    full = _decode(tok, ids)
    for k in range(1, len(ids) + 1):
        text = _decode(tok, ids[:k])
        start = text.find(stop)
        if start < 0:
            continue
        first = max(j for j in range(k) if len(_decode(tok, ids[:j])) <= start)
        return Stop(stop, k - 1, k - first, start + len(stop) < len(text), full[:full.find(stop)])
    return None


def find_stop(tok: Any, ids: list[int], span: int, inside: bool, skip: int = 2) -> Stop:
    """A stop string whose first occurrence in the text of `ids` touches `span` tokens and (with `inside`) ends
    inside its last token. Pieces start at token `skip` or later, so the stop does not end the first steps."""
    for i in range(skip, len(ids) - span):
        piece = _decode(tok, ids[i:i + span])
        if "\ufffd" in piece:
            continue  # a multi-byte character cut by a token boundary: not text a stop string can name
        first_text, last_text = _decode(tok, ids[i:i + 1]), _decode(tok, ids[i + span - 1:i + span])
        stop = piece
        if span > 1 and len(first_text) > 1:
            stop = stop[1:]  # starts inside the first token: the occurrence still touches all `span` tokens
        if inside:
            if len(last_text) < 2:
                continue
            stop = stop[:-1]
        if not stop.strip() or not stop.isprintable():
            continue
        hit = first_hit(tok, ids, stop)
        if hit is not None and hit.span == span and hit.inside == inside:
            return hit
    raise AssertionError(f"no stop string touching {span} tokens (inside={inside}) in {_decode(tok, ids)!r}")
