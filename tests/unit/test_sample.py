"""The Sample record: growth, views, versions, serialisation."""

from relayrl.sample import NO_VERSION, Sample, Status


def test_generated_and_context_tokens_line_up():
    s = Sample(prompt_ids=[1, 2, 3], group_id="g")
    s.append_generated([10, 11], [-0.5, -0.25], [4, 5], "stop")
    s.append_context([20, 21, 22])  # e.g. a feedback turn: seen, not trained
    s.append_generated([12], [-1.0], [6], "length")
    assert s.input_ids == [1, 2, 3, 10, 11, 20, 21, 22, 12]
    assert s.loss_mask == [1, 1, 0, 0, 0, 1]
    assert s.versions == [4, 5, NO_VERSION, NO_VERSION, NO_VERSION, 6]
    assert s.logprobs == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0]
    assert [(t.start, t.end, t.version_start, t.version_end) for t in s.turns] == [(0, 2, 4, 5), (5, 6, 6, 6)]
    assert s.num_trained_tokens == 3 and s.finish_reason == "length"
    assert s.version_range() == (4, 6) and s.staleness(8) == 4


def test_round_trip_through_dict():
    s = Sample(prompt_ids=[1], data={"answer": "2"})
    s.append_generated([3], [-0.1], [0], "stop")
    s.status, s.reward = Status.COMPLETED, 1.0
    back = Sample.from_dict(s.to_dict())
    assert back == s and back.status is Status.COMPLETED


def test_uids_are_unique_and_lengths_checked():
    assert len({Sample(prompt_ids=[1]).uid for _ in range(1000)}) == 1000
    try:
        Sample(prompt_ids=[1]).append_generated([1, 2], [0.0], [0, 0], "stop")
    except ValueError as e:
        assert "lengths differ" in str(e)
    else:
        raise AssertionError("mismatched lengths accepted")
