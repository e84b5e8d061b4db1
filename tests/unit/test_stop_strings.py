"""Stop strings in the engine (relayrl.engine.stops): LocalEngine on the real tiny model and its real tokenizer
ends a sequence at the token whose text completes a stop string, keeps every sampled token, and decodes only a
bounded tail per step. The served API's side: tests/integration/test_serve_stop.py."""

import pytest
from stops_for_tests import find_stop, first_hit

from relayrl.engine.base import SamplingParams
from relayrl.engine.dialects import sglang_sampling
from relayrl.engine.local import LocalEngine
from relayrl.engine.stops import cut_at_stop, first_stop, matched_stop, tail_tokens
from relayrl.models import eos_token_ids, load_model, load_tokenizer

PROMPT_TEXT = "Once upon a time there was"
N = 64
SEED = 3


@pytest.fixture(scope="module")
def tok(tiny_path):
    return load_tokenizer(tiny_path)


@pytest.fixture(scope="module")
def engine(tiny_path):
    eng = LocalEngine.from_pretrained(tiny_path, dtype="float32", max_batch_size=8)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def prompt(tok):
    return tok(PROMPT_TEXT, add_special_tokens=False)["input_ids"]


@pytest.fixture(scope="module")
def reference(engine, prompt):
    """The prompt's seeded sample without stops: the reference every stop test cuts (tests/stops_for_tests.py)."""
    return prompt, engine.generate([prompt], params())[0]


def params(*stops: str, seed: int | None = SEED) -> SamplingParams:
    """A seeded sample (the same tokens with or without stops), or greedy with seed=None."""
    return SamplingParams(max_new_tokens=N, temperature=1.0 if seed is not None else 0, seed=seed, ignore_eos=True,
                          stop_strings=stops)


def test_sampling_params_checks_stop_strings():
    assert SamplingParams(stop_strings=["a", "b"]).stop_strings == ("a", "b")  # a list becomes a tuple
    for bad in ("abc", ("",), ("a", 3)):
        with pytest.raises(ValueError, match="stop_strings"):
            SamplingParams(stop_strings=bad)


def test_earliest_stop_wins_then_shortest():
    assert first_stop("xx ab abc", ("abc", "ab")) == (3, "ab")
    assert first_stop("x abc y", ("y", "bc", "abc")) == (2, "abc")
    assert first_stop("nothing", ("a", "b")) is None
    assert cut_at_stop("one. two. three", ("two", ". t")) == "one"
    assert cut_at_stop("no stop here", ("#",)) == "no stop here"


@pytest.mark.parametrize(("span", "inside"), [(1, False), (1, True), (2, False), (3, False), (2, True), (3, True)])
def test_engine_ends_at_the_token_that_completes_the_stop(engine, tok, reference, span, inside):
    """Within one token, across 2-3 token boundaries, ending inside a token: the output is the reference run's
    prefix up to and including the completing token, with the same logprobs."""
    prompt, ref = reference
    stop = find_stop(tok, ref.output_ids, span, inside)
    out = engine.generate([prompt], params(stop.text))[0]
    assert out.finish_reason == "stop" and out.stop_string == stop.text
    assert out.output_ids == ref.output_ids[:stop.last + 1]
    assert out.logprobs == pytest.approx(ref.logprobs[:stop.last + 1], abs=1e-5)
    text = tok.decode(out.output_ids, skip_special_tokens=True)
    assert text.endswith(stop.text) != inside  # ending inside a token: the token's text goes on past the stop
    assert cut_at_stop(text, (stop.text,)) == stop.expected_text


def test_greedy_runs_with_and_without_a_stop_share_the_prefix(engine, tok, prompt):
    ref = engine.generate([prompt], params(seed=None))[0]  # the tiny model repeats one token: cut after two
    stop = find_stop(tok, ref.output_ids, 2, True, skip=0)
    out = engine.generate([prompt], params(stop.text, seed=None))[0]
    assert out.output_ids == ref.output_ids[:stop.last + 1] and out.stop_string == stop.text


def test_several_stops_the_earliest_wins(engine, tok, reference):
    prompt, ref = reference
    a, b = find_stop(tok, ref.output_ids, 1, False), find_stop(tok, ref.output_ids, 2, False, skip=20)
    early, late = (a, b) if a.last < b.last else (b, a)
    assert early.last < late.last
    out = engine.generate([prompt], params(late.text, early.text))[0]
    assert out.stop_string == early.text and out.output_ids == ref.output_ids[:early.last + 1]


def test_stops_in_a_batch_end_each_sequence_on_its_own(engine, tok, reference):
    prompt, ref = reference
    stop = find_stop(tok, ref.output_ids, 2, False)
    outs = engine.generate([prompt, prompt, [5, 6, 7]], params(stop.text))
    assert [o.output_ids for o in outs[:2]] == [ref.output_ids[:stop.last + 1]] * 2
    other = engine.generate([[5, 6, 7]], params())[0]
    hit = first_hit(tok, other.output_ids, stop.text)  # the other prompt's text may hold it too, elsewhere
    assert outs[2].output_ids == (other.output_ids if hit is None else other.output_ids[:hit.last + 1])


def test_only_a_bounded_tail_is_decoded(tok, reference):
    """The check after each token decodes at most tail_tokens ids, however long the sequence is."""
    _, ref = reference
    seen: list[int] = []

    def decode(ids: list[int]) -> str:
        seen.append(len(ids))
        return tok.decode(ids, skip_special_tokens=True)

    stops = ("never in this text \u2603",)
    for k in range(1, len(ref.output_ids) + 1):
        assert matched_stop(ref.output_ids[:k], stops, decode) is None
    assert max(seen) == tail_tokens(stops) < len(ref.output_ids)


def test_an_engine_without_decode_refuses_stop_strings(tiny_path):
    model = load_model(tiny_path, dtype="float32")
    engine = LocalEngine(model, eos_token_ids=eos_token_ids(load_tokenizer(tiny_path), tiny_path))
    try:
        with pytest.raises(ValueError, match="decode"):
            engine.submit([1, 2], params("x"))
    finally:
        engine.close()


def test_remote_engine_sends_sglang_stop():
    assert sglang_sampling(params("a", "bc"))["stop"] == ["a", "bc"]
    assert "stop" not in sglang_sampling(params())
