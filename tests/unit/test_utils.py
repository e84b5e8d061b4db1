"""relayrl.common.utils helpers that the rest of the package leans on."""

from relayrl.common.utils import close_all


def test_close_all_closes_every_part_and_raises_the_first_failure():
    closed = []

    def fail(name):
        def close():
            closed.append(name)
            raise RuntimeError(name)
        return close

    try:
        close_all([fail("a"), None, lambda: closed.append("b"), fail("c")])
    except RuntimeError as e:
        assert str(e) == "a"
    else:
        raise AssertionError("close_all swallowed the failure")
    assert closed == ["a", "b", "c"]
