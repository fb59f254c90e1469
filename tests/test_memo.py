"""Tests of the probes' outcome memo (`fx_fusion/memo.py`)."""

import pytest
import torch

from fx_fusion.memo import OutcomeMemo, plain


def test_plain_tells_apart_what_python_equates_and_refuses_objects() -> None:
    assert plain([1, (2, None)]) == plain([1, (2, None)])
    assert len({plain(1), plain(1.0), plain(True)}) == 3
    assert plain([1]) != plain((1,))
    assert plain({"dim": 1, "dtype": torch.float32}) == plain({"dtype": torch.float32, "dim": 1})
    for thing in (torch.zeros(1), object(), [1, object()]):
        with pytest.raises(TypeError):
            plain(thing)


def test_outcomes_values_and_errors_are_computed_once_per_key() -> None:
    memo, calls = OutcomeMemo((ValueError,)), []

    def compute(result):
        calls.append(result)
        if result < 0:
            raise ValueError(f"negative {result}")
        return result

    assert memo.outcome(lambda: plain(3), lambda: compute(3)) == 3
    assert memo.outcome(lambda: plain(3), lambda: compute(99)) == 3  # a hit: not computed again
    for _ in range(2):
        with pytest.raises(ValueError, match="negative -1"):
            memo.outcome(lambda: plain(-1), lambda: compute(-1))
    assert calls == [3, -1] and len(memo) == 2


def test_unkeyable_inputs_compute_every_time_and_other_errors_pass_through() -> None:
    memo, calls = OutcomeMemo((ValueError,), limit=2), []
    for _ in range(2):
        assert memo.outcome(lambda: plain(object()), lambda: calls.append(1) or 7) == 7
    assert calls == [1, 1] and len(memo) == 0
    with pytest.raises(KeyError):  # not one of the memo's errors: raised, not kept
        memo.outcome(lambda: plain(5), lambda: {}["missing"])
    assert len(memo) == 0
    for key in range(3):  # bounded: cleared when full
        memo.outcome(lambda: plain(key), lambda: key)
    assert len(memo) == 1 and list(memo) == [plain(2)]
