"""What one request may ask of `relayrl serve`, and the checks of single fields against it.

A request is checked whole before any of it reaches the engine: one bad value in the continuous batch (a NaN
temperature, a token id past the vocabulary) would fail every sequence decoded with it, so another client
would pay for it. The limits are set when the server starts (flags of `relayrl serve`); their defaults follow
the engine, so a request the engine could run is accepted:

- `max_prompt_tokens` (--max-prompt-tokens, default max_seq_len - 1): longest prompt;
- `max_tokens` (--max-tokens, default max_seq_len - 1): largest max_new_tokens / max_tokens of one sample;
  generation also stops where the context ends, as it always did;
- `max_n` (--max-n, default max_batch_size): most samples in one request (n x prompts of a batch);
- `budget` (--max-tokens-in-flight, default max_batch_size x max_seq_len): tokens (prompt + max_new_tokens,
  per sample) the engine holds at once; a request that needs more than all of it is refused up front;
- `max_body_bytes` (--max-body-bytes, default 16 MiB): largest request body (413 past it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from relayrl.serve.errors import BadRequest

MAX_TEMPERATURE = 100.0  # at T=100 sampling is already uniform to 1e-4; larger values only overflow float32
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily (SGLang and vLLM do the same): 1/T would overflow
INT64 = (-(2**63), 2**63 - 1)
MAX_STOP_TOKENS = 1024
MAX_STOP_STRINGS = 4  # OpenAI's bound on `stop`; the native API allows more (SGLang sets none)
MAX_NATIVE_STOP_STRINGS = 32
MAX_STOP_BYTES = 256  # of one stop string: the engine decodes about that many tokens per step (relayrl.engine.stops)
MAX_RID_CHARS = 512
MAX_TOKENS_HINT = " (the server's --max-tokens)"
CHARS_PER_TOKEN = 16  # text longer than max_prompt_tokens x this is refused before tokenizing it
DEFAULT_MAX_BODY = 16 * 2**20


@dataclass(frozen=True)
class ServerLimits:
    """The server's limits; see the module docstring."""

    max_seq_len: int
    vocab_size: int
    max_prompt_tokens: int
    max_tokens: int
    max_n: int
    budget: int
    max_body_bytes: int = DEFAULT_MAX_BODY

    @classmethod
    def for_engine(cls, max_seq_len: int, vocab_size: int, max_batch_size: int, *, max_prompt_tokens: int | None = None,
                   max_tokens: int | None = None, max_n: int | None = None, budget: int | None = None,
                   max_body_bytes: int | None = None) -> ServerLimits:
        """The limits with their defaults filled in from the engine; a ValueError names a bad flag."""
        limits = cls(max_seq_len, vocab_size, max_prompt_tokens or max_seq_len - 1, max_tokens or max_seq_len - 1,
                     max_n or max_batch_size, budget or max_batch_size * max_seq_len,
                     max_body_bytes or DEFAULT_MAX_BODY)
        if not 1 <= limits.max_prompt_tokens < max_seq_len:
            raise ValueError(f"--max-prompt-tokens must be in [1, {max_seq_len - 1}] (max_seq_len - 1), "
                             f"got {limits.max_prompt_tokens}")
        for flag, value in (("--max-tokens", limits.max_tokens), ("--max-n", limits.max_n),
                            ("--max-tokens-in-flight", limits.budget), ("--max-body-bytes", limits.max_body_bytes)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1, got {value}")
        return limits

    def new_tokens(self, prompt_len: int, requested: int) -> int:
        """max_new_tokens as the engine will honour it: generation stops where the context ends anyway, so the
        rest would only count against the in-flight budget."""
        return max(1, min(requested, self.max_seq_len - prompt_len))

    def check_samples(self, samples: int, field: str) -> None:
        if samples > self.max_n:
            raise BadRequest(field, f"asks for {samples} samples; this server allows at most {self.max_n} per "
                             "request (--max-n)", "too_many_samples")

    def check_cost(self, cost: int, field: str) -> None:
        """A request that could never fit the in-flight budget is refused now rather than queued forever."""
        if cost > self.budget:
            raise BadRequest(field, f"the request needs {cost} tokens in flight (prompt + max new tokens, per "
                             f"sample), more than this server's budget of {self.budget} (--max-tokens-in-flight); "
                             "ask for fewer samples or tokens", "budget_exceeded")

    def check_prompt(self, ids: Any, field: str) -> list[int]:
        """A prompt of token ids: integers inside the vocabulary, not empty, not longer than max_prompt_tokens."""
        if not isinstance(ids, list) or not all(type(t) is int for t in ids):
            raise BadRequest(field, "must be a list of token ids (integers)")
        if not ids:
            raise BadRequest(field, "is empty")
        if len(ids) > self.max_prompt_tokens:
            raise BadRequest(field, f"prompt of {len(ids)} tokens is longer than this server accepts "
                             f"({self.max_prompt_tokens}; --max-prompt-tokens, max_seq_len={self.max_seq_len})",
                             "context_length_exceeded")
        check_token_ids(ids, self.vocab_size, field)
        return ids

    def check_text(self, text: Any, field: str) -> str:
        """A text prompt, short enough to tokenize without holding up the server (strings only; Unicode is
        checked when the body is parsed)."""
        if not isinstance(text, str):
            raise BadRequest(field, "must be a string")
        if not text:
            raise BadRequest(field, "is empty")
        if len(text) > self.max_prompt_tokens * CHARS_PER_TOKEN:
            raise BadRequest(field, f"{len(text)} characters is longer than any prompt this server accepts "
                             f"({self.max_prompt_tokens} tokens; --max-prompt-tokens)", "context_length_exceeded")
        return text


def check_token_ids(ids: list[int], vocab_size: int, field: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise BadRequest(field, f"token id {_show(bad)} is outside the vocabulary [0, {vocab_size})")


# ---- single fields ------------------------------------------------------------------------------------------
def _name(key: str, where: str) -> str:
    return f"{where}.{key}" if where else key


def number(raw: dict[str, Any], key: str, default: Any, kind: type, where: str = "", *,
           low: float | None = None, high: float | None = None, hint: str = "") -> Any:
    """raw[key] as a finite int or float in [low, high] (default when absent or null). An integral float (8.0)
    counts as an integer; booleans, strings, NaN and infinities do not. The error names `where.key`; `hint`
    (the flag that sets a bound) is added to a range error."""
    value = raw.get(key)
    if value is None:
        return default
    field = _name(key, where)
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise BadRequest(field, f"must be {'an integer' if kind is int else 'a number'}, got {_show(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise BadRequest(field, f"must be a finite number, got {value}")
    if kind is int and value != int(value):
        raise BadRequest(field, f"must be an integer, got {value}")
    if (low is not None and value < low) or (high is not None and value > high):
        raise BadRequest(field, f"must be in [{_bound(low, '-inf')}, {_bound(high, 'inf')}], got {_show(value)}{hint}")
    return kind(value)


def flag(raw: dict[str, Any], key: str, default: bool, where: str = "") -> bool:
    """A boolean field; 0 and 1 pass too (form-like clients send them)."""
    return boolean(raw.get(key), default, _name(key, where))


def boolean(value: Any, default: bool, field: str) -> bool:
    if value is None:
        return default
    if isinstance(value, bool) or (type(value) is int and value in (0, 1)):
        return bool(value)
    raise BadRequest(field, f"must be true or false, got {_show(value)}")


def temperature(raw: dict[str, Any], where: str = "") -> float:
    t = number(raw, "temperature", 1.0, float, where, low=0.0, high=MAX_TEMPERATURE)
    return 0.0 if t < GREEDY_BELOW else t


def top_p(raw: dict[str, Any], where: str = "") -> float:
    p = number(raw, "top_p", 1.0, float, where, high=1.0)
    if not p > 0:
        raise BadRequest(_name("top_p", where), f"must be in (0, 1], got {p}")
    return p


def top_k(raw: dict[str, Any], vocab_size: int, where: str = "") -> int:
    """-1 (SGLang's and vLLM's "off") and 0 (relayrl's) mean no top-k; k >= the vocabulary is no top-k too."""
    k = number(raw, "top_k", 0, int, where, low=-1, high=2**31 - 1)
    return 0 if k < 0 or k >= vocab_size else k


def seed(raw: dict[str, Any], keys: tuple[str, ...], samples: int, where: str = "") -> int | None:
    """A 64-bit seed; sample i of a group gets seed + i, which must still fit."""
    for key in keys:
        value = number(raw, key, None, int, where, low=INT64[0], high=INT64[1] - max(samples - 1, 0))
        if value is not None:
            return value
    return None


def rid(value: Any, field: str = "rid") -> str | None:
    """A client's request id (the trajectory's name); "" counts as none, as it always did."""
    if value is None or value == "":
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_RID_CHARS:
        raise BadRequest(field, f"must be a non-empty string of at most {MAX_RID_CHARS} characters")
    return value


def stop_token_ids(raw: dict[str, Any], vocab_size: int, where: str = "") -> tuple[int, ...]:
    field = _name("stop_token_ids", where)
    stop = raw.get("stop_token_ids") or []
    if not isinstance(stop, list) or not all(type(t) is int for t in stop) or len(stop) > MAX_STOP_TOKENS:
        raise BadRequest(field, f"must be a list of at most {MAX_STOP_TOKENS} token ids")
    check_token_ids(stop, vocab_size, field)
    return tuple(stop)


def stop_strings(raw: dict[str, Any], where: str = "", most: int = MAX_STOP_STRINGS) -> tuple[str, ...]:
    """`stop`: a string or a list of strings, each non-empty (an empty one would match at once)."""
    field = _name("stop", where)
    stop = raw.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > most or not all(isinstance(s, str) and s for s in stop):
        raise BadRequest(field, f"must be a non-empty string or a list of at most {most} non-empty strings")
    if any(len(s.encode()) > MAX_STOP_BYTES for s in stop):
        raise BadRequest(field, f"a stop string may be at most {MAX_STOP_BYTES} bytes of UTF-8")
    return tuple(dict.fromkeys(stop))


def _bound(x: float | None, unbounded: str) -> str:
    return unbounded if x is None else f"{x:g}" if isinstance(x, float) else str(x)


def _show(value: Any) -> str:
    """A value for an error message, cut short: a hostile 10k-digit number must not come back whole."""
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
