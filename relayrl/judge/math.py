"""Math answer reward: does the model's final answer equal the gold answer?

The comparison itself is math-verify's (`parse` + `verify`: numbers, fractions, LaTeX, sets, intervals,
units); this module decides *which part* of a free-form response is the final answer, because that is
where a reward for a small model goes wrong most often. The rule, in order:

1. the content of the LAST complete ``\\boxed{...}`` (nested braces allowed; ``\\fbox`` too);
2. else the first number after the last ``####`` (the GSM8K answer marker);
3. else the LAST number in the text.

A "number" is an integer or decimal, optionally with a sign, thousands commas ("1,234"), a leading
currency sign ("$18"), a trailing percent sign, or a simple fraction ("3/4", "\\frac{3}{4}"). Words
after a number (units: "18 dollars", "18 cm") are ignored simply because only the number is taken.

Percent: math-verify treats "18%" as equal to both 18 and 0.18, and we keep that rule: GSM8K golds write
percentages without the sign, while some datasets write them as fractions, and both should match.

Only the percent *sign* is recognised in free text ("18 percent" is read as 18).

Timeouts: math-verify bounds each step with SIGALRM, which works only in a main thread. We use it there
(~3 s per step: a Judge worker runs us in its main thread, so a runaway sympy evaluation such as
``\\boxed{10^{10^{10}}}`` ends as "incorrect" instead of costing the worker) and switch it off in other
threads, where it would raise. In a main thread this cancels any alarm the caller had set. Work stuck
in C code ignores signals; only `TimeoutPool`'s kill bounds that, which is why the Judge uses one.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import deque
from functools import lru_cache
from typing import Any

from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

from relayrl.judge.functions import REWARDS

_LATEX = [LatexExtractionConfig(boxed_match_priority=0)]
_EXPR = [ExprExtractionConfig()]
_MV_TIMEOUT_S = 3  # per math-verify step, main thread only; the pool's timeout bounds the whole call
_MAX_BOXED_CHARS = 4096  # a boxed "answer" longer than this is not an answer; also bounds the brace scan
_MAX_BOXED_TRIES = 32  # unclosed \boxed{ occurrences to skip before giving up (bounds the work)

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = r"\\[dt]?frac\{\s*-?\d+(?:\.\d+)?\s*\}\{\s*\d+(?:\.\d+)?\s*\}"
_PLAIN = r"\d{1,3}(?:,\d{3})+(?![\d,])(?:\.\d+)?|\d+(?:\.\d+)?(?:/\d+(?![\d.]))?|\.\d+"
# Not glued to a preceding word or decimal point: "x2" and "v1.5" hold no number; "5-3" is 5 and 3, not -3.
_NUMBER_RE = re.compile(rf"(?<![\w.\\])(?:-\s?)?(?:\\?\$\s?)?(?:{_FRAC}|{_PLAIN})(?:\s?\\?%)?")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_UNICODE = str.maketrans({"\u2212": "-", "\u2013": "-", "\u00a0": " ", "\u2009": " ", "\u202f": " "})


class _NoTimeoutWarning(logging.Filter):
    """Drop math-verify's one-time 'timeout is disabled' warning: we disable it on purpose (see above)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("Timeout is disabled")


for _name in ("math_verify.parser", "math_verify.grader"):
    logging.getLogger(_name).addFilter(_NoTimeoutWarning())


@REWARDS.register("math")
def math_reward(response: str, data: dict[str, Any], *, answer_key: str = "answer",
                format_bonus: float = 0.0) -> dict[str, float]:
    """Score a response against `data[answer_key]`: reward = correct + format_bonus * format.

    `format` is 1.0 when the response has a complete, non-empty ``\\boxed{...}``. A malformed *response*
    never raises (it scores 0); a missing or empty *gold* answer raises ValueError, because that is a
    dataset bug that should show up as a judge failure rather than as a silently wrong reward.
    """
    gold = _gold_parsed(normalize_gold(data.get(answer_key) if isinstance(data, dict) else None, answer_key))
    text = response if isinstance(response, str) else ""
    try:
        boxed = last_boxed(text)
    except Exception:  # defensive: the contract is "never raises on a response"
        boxed = None
    try:
        pred = _parse_boxed(boxed) if boxed is not None else _parse_number(extract_number(text))
        correct = bool(pred) and verify(list(gold), pred, timeout_seconds=_timeout_s())
    except Exception:  # math-verify and sympy can raise almost anything on adversarial input
        correct = False
    fmt = 1.0 if boxed else 0.0
    return {"reward": float(correct) + format_bonus * fmt, "correct": float(correct), "format": fmt}


def final_answer(text: str) -> str | None:
    """The answer a response commits to, as math_reward reads it (last \\boxed{}, else the last number);
    whitespace and thousands commas removed so equal answers compare equal (majority voting)."""
    try:
        ans = last_boxed(text)
        ans = ans if ans is not None else extract_number(text)
    except Exception:
        return None
    return None if ans is None else "".join(ans.split()).replace(",", "")


def normalize_gold(gold: Any, answer_key: str = "answer") -> str:
    """Reduce a dataset answer to the final answer text: GSM8K's '... #### 1,234' becomes '1234'."""
    if gold is None or (isinstance(gold, str) and not gold.strip()):
        raise ValueError(f"no gold answer: data[{answer_key!r}] is missing or empty")
    text = str(gold).translate(_UNICODE).strip()
    if "####" in text:
        text = text.rsplit("####", 1)[1].strip().replace(",", "")
    if _THOUSANDS_RE.match(text):
        text = text.replace(",", "")
    if not text:
        raise ValueError(f"no gold answer after '####' in data[{answer_key!r}]={gold!r}")
    return text


@lru_cache(maxsize=4096)
def _gold_parsed(gold: str) -> tuple:
    """Parse a gold answer once per worker: a group of samples shares one gold, and parsing is the cost."""
    if "\\boxed" not in gold:
        if len(gold) > 1 and gold.startswith("$") and gold.endswith("$"):
            gold = gold.strip("$")  # "$\frac{1}{2}$": math mode delimiters, not a currency sign
        gold = "\\boxed{" + gold + "}"
    parsed = parse(gold, extraction_config=_LATEX, parsing_timeout=_timeout_s())
    if all(isinstance(p, str) for p in parsed):  # kept only as text ('???', '-'): nothing could ever match it,
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")  # so the sample is rejected, not 0
    return tuple(parsed)


def last_boxed(text: str) -> str | None:
    """Content of the last complete, non-empty \\boxed{...}, or None; unclosed ones are skipped."""
    starts = [m.end() for m in _BOXED_RE.finditer(text)]
    for start in reversed(starts[-_MAX_BOXED_TRIES:]):
        depth = 1
        for i in range(start, min(len(text), start + _MAX_BOXED_CHARS)):
            ch = text[i]
            if ch == "{":
                depth += 1
            elif ch == "}":
                depth -= 1
                if depth == 0:
                    content = text[start:i].strip()
                    if content:
                        return content
                    break
    return None


def extract_number(text: str) -> str | None:
    """The first number after the last '####' if there is one, else the last number in the text."""
    text = text.translate(_UNICODE)
    if "####" in text:
        m = _NUMBER_RE.search(text.rsplit("####", 1)[1])
        if m:
            return m.group(0)
    last = deque(_NUMBER_RE.finditer(text), maxlen=1)
    return last[0].group(0) if last else None


def _timeout_s() -> int | None:
    """math-verify's SIGALRM timeout where it can work (a main thread), none elsewhere (see module doc)."""
    return _MV_TIMEOUT_S if threading.current_thread() is threading.main_thread() else None


def _parse_boxed(content: str) -> list:
    return parse("\\boxed{" + content + "}", extraction_config=_LATEX, parsing_timeout=_timeout_s())


def _parse_number(token: str | None) -> list:
    """Parse a number token: currency signs and spaces go; commas, %, fractions are math-verify's job."""
    if token is None:
        return []
    token = token.replace("\\$", "").replace("$", "").replace("\\%", "%").replace(" ", "")
    if "frac" in token:
        return parse("\\boxed{" + token + "}", extraction_config=_LATEX, parsing_timeout=_timeout_s())
    return parse(token, extraction_config=_EXPR, parsing_timeout=_timeout_s())
