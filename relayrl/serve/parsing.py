"""Parsing of SGLang /generate requests into engine jobs, every field checked against the server's limits.

Kept apart from the routes (`relayrl.serve.native`) so the whole of what a client can send is in one place.
top_k follows SGLang (-1 = off; relayrl's 0 = off is accepted too); a seeded group of n gets seeds seed,
seed+1, ... so its samples differ yet repeat exactly. max_new_tokens is clamped to what the context leaves
(generation would stop there anyway) before it is counted against the in-flight budget. Logprobs follow SGLang
(`_logprob_asks`); `max_new_tokens: 0` is accepted only where the prompt's logprobs are asked (scoring alone).
`image_data` (a vision-language model's images, `_images`): per prompt a base64 image or a list of them, checked
and decoded before the request is queued (relayrl.serve.images); prompt logprobs are text only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from relayrl.engine.base import SamplingParams
from relayrl.serve.errors import BadRequest
from relayrl.serve.images import ServeImages, read_images
from relayrl.serve.limits import (
    MAX_NATIVE_STOP_STRINGS,
    MAX_TOKENS_HINT,
    ServerLimits,
    boolean,
    flag,
    number,
    rid,
    seed,
    stop_strings,
    stop_token_ids,
    temperature,
    top_k,
    top_p,
)
from relayrl.serve.openai_params import MAX_TOP_LOGPROBS

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default
_NEUTRAL = {"min_new_tokens": 0, "frequency_penalty": 0, "presence_penalty": 0, "repetition_penalty": 1,
            "min_p": 0}
_UNSUPPORTED = ("stop_regex", "regex", "json_schema", "ebnf", "structural_tag", "logit_bias",
                "custom_params")
_EXTRAS_ONLY = ("skip_special_tokens", "spaces_between_special_tokens", "no_stop_trim", "stream_interval")
_KNOWN = {"max_new_tokens", "temperature", "top_p", "top_k", "stop", "stop_token_ids", "ignore_eos", "seed",
          "sampling_seed", "n", *_NEUTRAL, *_UNSUPPORTED, *_EXTRAS_ONLY}
Tokenize = Callable[[list[str]], Awaitable[list[list[int]]]]


@dataclass(frozen=True)
class LogprobAsk:
    """What /generate's logprob fields ask for one prompt (SGLang's names and meanings)."""

    output: bool = False  # return_logprob: output_token_logprobs (and the prompt's, from input_start)
    input_start: int | None = None  # logprob_start_len >= 0 with return_logprob: prompt logprobs from there
    top: int = 0  # top_logprobs_num: alternatives per token (with return_logprob)
    text: bool = False  # return_text_in_logprobs: each entry's token text instead of null


@dataclass
class Job:
    prompt: list[int]
    params: SamplingParams
    rid: str
    engine_rid: str | None  # only client-named requests are abortable / keep their KV for the next turn
    logprobs: LogprobAsk
    skip_special_tokens: bool = True  # for `text` only; output_ids always hold every token
    generate: bool = True  # False: max_new_tokens 0, the prompt is only scored (params then ask for one token)
    trim_stop: bool = True  # False (SGLang's no_stop_trim): `text` keeps the stop string that ended it
    images: tuple[bytes, ...] = ()  # the prompt's image files, in the order of its image tokens

    @property
    def cost(self) -> int:
        return len(self.prompt) + self.params.max_new_tokens


def _check_supported(raw: dict[str, Any], where: str) -> None:
    for key, value in raw.items():
        if key in _NEUTRAL and value is not None and value != _NEUTRAL[key]:
            raise BadRequest(f"{where}.{key}", f"is not supported (only {_NEUTRAL[key]})")
        if key in _UNSUPPORTED and value:
            raise BadRequest(f"{where}.{key}", "is not supported")
        if key not in _KNOWN:
            raise BadRequest(f"{where}.{key}"[:200], "unknown sampling parameter")


def parse_sampling(raw: Any, limits: ServerLimits, where: str = "sampling_params") -> tuple[SamplingParams, int]:
    """SGLang sampling_params -> (SamplingParams, n), every value finite and inside the server's limits."""
    raw = {} if raw is None else raw
    if not isinstance(raw, dict):
        raise BadRequest(where, "must be an object")
    _check_supported(raw, where)
    n = number(raw, "n", 1, int, where, low=1)
    limits.check_samples(n, f"{where}.n")
    params = SamplingParams(
        max_new_tokens=number(raw, "max_new_tokens", min(DEFAULT_MAX_NEW_TOKENS, limits.max_tokens), int, where,
                              low=1, high=limits.max_tokens, hint=MAX_TOKENS_HINT),
        temperature=temperature(raw, where), top_p=top_p(raw, where), top_k=top_k(raw, limits.vocab_size, where),
        stop_token_ids=stop_token_ids(raw, limits.vocab_size, where), ignore_eos=flag(raw, "ignore_eos", False, where),
        seed=seed(raw, ("seed", "sampling_seed"), n, where),
        stop_strings=stop_strings(raw, where, MAX_NATIVE_STOP_STRINGS))
    return params, n


async def _prompts(body: dict[str, Any], limits: ServerLimits, tokenize: Tokenize) -> tuple[list[list[int]], bool]:
    """(prompts, is_batch) from input_ids (the main path) or text (tokenized off the event loop)."""
    ids = body.get("input_ids")
    if ids is None and body.get("text") is not None:
        text = body["text"]
        texts = text if isinstance(text, list) else [text]
        if not texts:
            raise BadRequest("text", "must be a string or a non-empty list of strings")
        limits.check_samples(len(texts), "text")
        texts = [limits.check_text(t, f"text[{i}]" if isinstance(text, list) else "text") for i, t in enumerate(texts)]
        ids = await tokenize(texts)
        ids = ids if isinstance(text, list) else ids[0]
        field = "text"
    else:
        field = "input_ids"
    if ids is None:
        raise BadRequest("input_ids", "missing (send input_ids, or text)")
    if isinstance(ids, list) and ids and all(isinstance(p, list) for p in ids):
        limits.check_samples(len(ids), field)
        return [limits.check_prompt(p, f"{field}[{i}]") for i, p in enumerate(ids)], True
    return [limits.check_prompt(ids, field)], False


def _per_prompt(value: Any, count: int, field: str) -> list[Any]:
    """SGLang lets most fields be one value for the batch or a list with one value per prompt."""
    if not isinstance(value, list):
        return [value] * count
    if len(value) != count:
        raise BadRequest(field, f"has {len(value)} entries for {count} prompts")
    return value


def _logprob_asks(body: dict[str, Any], prompts: list[list[int]]) -> list[LogprobAsk]:
    """return_logprob, logprob_start_len (-1: none of the prompt; k: from its token k on, the first token's logprob
    null), top_logprobs_num and return_text_in_logprobs, each one value or one per prompt, checked."""
    if body.get("token_ids_logprob") is not None:
        raise BadRequest("token_ids_logprob", "is not supported (top_logprobs_num is)")
    keys = ("return_logprob", "logprob_start_len", "top_logprobs_num", "return_text_in_logprobs")
    values = {key: _per_prompt(body.get(key), len(prompts), key) for key in keys}
    asks = []
    for i, prompt in enumerate(prompts):
        raw = {key: values[key][i] for key in keys}
        field = {key: f"{key}[{i}]" if isinstance(body.get(key), list) else key for key in keys}
        on = boolean(raw["return_logprob"], False, field["return_logprob"])
        start = number({field["logprob_start_len"]: raw["logprob_start_len"]}, field["logprob_start_len"], -1, int,
                       low=-1, high=len(prompt) - 1)
        top = number({field["top_logprobs_num"]: raw["top_logprobs_num"]}, field["top_logprobs_num"], 0, int, low=0,
                     high=MAX_TOP_LOGPROBS)
        text = boolean(raw["return_text_in_logprobs"], False, field["return_text_in_logprobs"])
        asks.append(LogprobAsk(on, start if on and start >= 0 else None, top if on else 0, text))
    return asks


async def _images(body: dict[str, Any], prompts: list[list[int]], batch: bool,
                  served: ServeImages | None) -> list[tuple[bytes, ...]]:
    """Each prompt's images from `image_data` (SGLang's shapes: one prompt's is a base64 image or a list; a batch's
    a list with one such entry per prompt), checked against the prompt's image tokens (relayrl.serve.images)."""
    raw = body.get("image_data")
    if raw is None or raw == []:
        per_prompt: list[Any] = [None] * len(prompts)
    else:
        per_prompt = _per_prompt(raw, len(prompts), "image_data") if batch else [raw]
    fields = []
    for i, entry in enumerate(per_prompt):
        at = f"image_data[{i}]" if batch else "image_data"
        entries = [] if entry is None else entry if isinstance(entry, list) else [entry]
        fields.append([(v, f"{at}[{k}]" if isinstance(entry, list) else at) for k, v in enumerate(entries)])
    read = iter(await read_images([f for group in fields for f in group], served))
    out = []
    for i, (prompt, group) in enumerate(zip(prompts, fields)):
        images = [next(read) for _ in group]
        if served is not None:
            await asyncio.to_thread(served.check_prompt, prompt, [img for _, img in images],
                                    f"input_ids[{i}]" if batch else "input_ids")
        out.append(tuple(data for data, _ in images))
    return out


async def parse_generate(body: dict[str, Any], limits: ServerLimits, tokenize: Tokenize,
                         served: ServeImages | None = None) -> tuple[list[Job], bool]:
    """One Job per sample (prompt-major when sampling_params.n > 1) and whether to answer with a list. The
    request as a whole must fit --max-n and the in-flight budget. `served`: the model's image side (None: a text
    model, which refuses image_data)."""
    if flag(body, "stream", False):
        raise BadRequest("stream", "streaming is not supported")
    prompts, batch = await _prompts(body, limits, tokenize)
    images = await _images(body, prompts, batch, served)
    listed = isinstance(body.get("sampling_params"), list)
    raw_params = _per_prompt(body.get("sampling_params"), len(prompts), "sampling_params")
    rids = _per_prompt(body.get("rid"), len(prompts), "rid") if batch else [body.get("rid")]
    asks = _logprob_asks(body, prompts)
    parsed = []
    for i, (prompt, raw, name, lp) in enumerate(zip(prompts, raw_params, rids, asks)):
        where = f"sampling_params[{i}]" if listed else "sampling_params"
        if images[i] and lp.input_start is not None:
            raise BadRequest("logprob_start_len", "prompt logprobs are not computed for prompts with images")
        # max_new_tokens 0 asks for the prompt's logprobs alone (lm-eval's loglikelihood); nothing else may ask it
        zero = isinstance(raw, dict) and raw.get("max_new_tokens") == 0 and type(raw["max_new_tokens"]) is not bool
        score_only = lp.input_start is not None and zero
        params, n = parse_sampling({**raw, "max_new_tokens": 1} if score_only else raw, limits, where)
        params = dataclasses.replace(params, max_new_tokens=limits.new_tokens(len(prompt), params.max_new_tokens),
                                     top_logprobs=lp.top)
        name = rid(name, f"rid[{i}]" if batch and isinstance(body.get("rid"), list) else "rid")
        text_options = (flag(raw or {}, "skip_special_tokens", True, where),
                        not flag(raw or {}, "no_stop_trim", False, where))
        parsed.append((prompt, params, n, name, lp, text_options, score_only, images[i]))
    limits.check_samples(sum(p[2] for p in parsed), "sampling_params.n")
    jobs: list[Job] = []
    for prompt, params, n, name, lp, (skip, trim), score_only, imgs in parsed:
        for k in range(n):  # a seeded group gets seeds seed..seed+n-1: distinct samples, still reproducible
            seeded = params if params.seed is None or k == 0 else dataclasses.replace(params, seed=params.seed + k)
            jobs.append(Job(prompt, seeded, name or uuid.uuid4().hex, name, lp, skip, not score_only, trim, imgs))
    limits.check_cost(sum(j.cost for j in jobs), "sampling_params.max_new_tokens")
    return jobs, batch or len(jobs) > 1
