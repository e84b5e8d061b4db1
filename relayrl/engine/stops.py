"""Stop strings: generation ends as soon as the generated text contains one of a request's stop strings.

The engine works in token ids and a stop string is text: its characters can be split over several tokens, or
end inside a token whose text goes on past it. So after each sampled token the engine decodes a tail of the
sequence's tokens and looks for the stop strings in that text. Only a bounded tail is decoded, so a step costs
the same however long the sequence has grown: every token decodes to at least one byte of UTF-8 (byte-level
BPE and SentencePiece byte fallback alike), so an occurrence that the newest token completes starts within the
last `len(stop.encode())` tokens; a few tokens more keep the decoding of the tail's first token (a leading
space a tokenizer drops, half of a multi-byte character) away from it. Special tokens decode to nothing (the
text a client gets skips them), so they are the one kind of token that does not count towards the bound.

A match ends the sequence with finish_reason "stop" and `GenOutput.stop_string` set. The engine's output keeps
every token it sampled (the one that completed the stop string included, with its logprob): training data is
exactly what was sampled. Whoever returns text cuts it right before the stop string (`cut_at_stop`).
"""

from __future__ import annotations

from collections.abc import Callable

Decode = Callable[[list[int]], str]  # token ids -> text, special tokens skipped (LocalEngine's `decode`)
TAIL_MARGIN = 4  # tokens decoded beyond the longest stop string's byte length (see the module docstring)


def tail_tokens(stops: tuple[str, ...]) -> int:
    """How many of the newest tokens can hold a stop string that the newest token completes, plus the margin."""
    return max(len(s.encode()) for s in stops) + TAIL_MARGIN


def first_stop(text: str, stops: tuple[str, ...]) -> tuple[int, str] | None:
    """The stop string that occurs first in `text` and where: the earliest start wins, then the shortest (it
    was complete first)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = text.find(s)
        if i >= 0 and (best is None or (i, len(s)) < (best[0], len(best[1]))):
            best = (i, s)
    return best


def matched_stop(out_ids: list[int], stops: tuple[str, ...], decode: Decode) -> str | None:
    """The stop string the generated tokens now contain (checked after each token, so a match is one the newest
    token completed), or None. Decodes only the last `tail_tokens(stops)` tokens."""
    hit = first_stop(decode(out_ids[-tail_tokens(stops):]), stops)
    return None if hit is None else hit[1]


def cut_at_stop(text: str, stops: tuple[str, ...]) -> str:
    """`text` up to (not including) the first stop string in it: what OpenAI and SGLang return."""
    hit = first_stop(text, stops)
    return text if hit is None else text[:hit[0]]
