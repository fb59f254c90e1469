"""Tests of `concatenated_view`: weights stacked once by re-homing, never stale, copied only when unsafe."""

from __future__ import annotations

import logging

import pytest
import torch
from torch import nn

from fx_fusion.kernels import stacked_params
from fx_fusion.kernels.stacked_params import concatenated_view

DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=[pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]),
]


def _params(device: str, rows=(3, 5, 2), cols: int = 4) -> list[nn.Parameter]:
    return [nn.Parameter(torch.randn(n, cols, device=device)) for n in rows]


def _expected(parts) -> torch.Tensor:
    return torch.cat([p.detach().clone() for p in parts], dim=0)


@pytest.fixture
def copy_warnings(monkeypatch, caplog):
    """Re-arm the copy-fallback warning and capture it."""
    monkeypatch.setattr(stacked_params, "_warned_copy_fallback", False)
    caplog.set_level(logging.WARNING, logger="fx_fusion")
    return caplog


@pytest.mark.parametrize("device", DEVICES)
def test_parameters_are_stacked_once_then_viewed(device: str, copy_warnings) -> None:
    params = _params(device)
    expected = _expected(params)
    first = concatenated_view(params)
    torch.testing.assert_close(first, expected, rtol=0, atol=0)
    # The parameters now live in the stacked buffer, with their own values.
    for param, rows in zip(params, torch.split(expected, [3, 5, 2])):
        assert param.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
        torch.testing.assert_close(param.detach(), rows, rtol=0, atol=0)
    second = concatenated_view(params)
    assert second.data_ptr() == first.data_ptr() and second.shape == (10, 4)
    # An in-place update of a parameter is seen by the next call, without restacking.
    with torch.no_grad():
        params[1].mul_(-2.0)
    third = concatenated_view(params)
    assert third.data_ptr() == first.data_ptr()
    torch.testing.assert_close(third, _expected(params), rtol=0, atol=0)
    assert "concatenated on every call" not in copy_warnings.text


@pytest.mark.parametrize("device", DEVICES)
def test_replaced_parameter_is_rehomed(device: str) -> None:
    params = _params(device)
    concatenated_view(params)
    params[2].data = torch.randn(2, 4, device=device)  # e.g. a new tensor assigned after compiling
    result = concatenated_view(params)
    torch.testing.assert_close(result, _expected(params), rtol=0, atol=0)
    assert all(p.untyped_storage().data_ptr() == result.untyped_storage().data_ptr() for p in params)


def test_views_of_one_buffer_in_order_are_used_as_they_are() -> None:
    buffer = torch.randn(10, 4)
    parts = [buffer[:3], buffer[3:8], buffer[8:]]
    result = concatenated_view(parts)
    assert result.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(result, buffer, rtol=0, atol=0)


@pytest.mark.parametrize(
    "make_parts, why",
    [
        (lambda b: [b[3:8], b[:3], b[8:]], "out of order"),
        (lambda b: [b[:3], b[8:]], "a gap between parts"),
        (lambda b: [b[:3, :2], b[3:8, :2]], "non-contiguous parts"),
        (lambda b: [b[:3], b[:3]], "the same tensor twice"),
    ],
)
def test_views_that_cannot_be_rehomed_are_copied(make_parts, why: str, copy_warnings) -> None:
    buffer = torch.randn(10, 4)
    parts = make_parts(buffer)
    before = buffer.clone()
    result = concatenated_view(parts)
    torch.testing.assert_close(result, _expected(parts), rtol=0, atol=0, msg=why)
    torch.testing.assert_close(buffer, before, rtol=0, atol=0, msg=f"{why}: the source changed")
    assert "concatenated on every call" in copy_warnings.text


def test_one_dimensional_parts_end_to_end() -> None:
    params = [nn.Parameter(torch.randn(6)) for _ in range(3)]
    expected = _expected(params)
    torch.testing.assert_close(concatenated_view(params), expected, rtol=0, atol=0)
    torch.testing.assert_close(concatenated_view(params).view(3, 6), expected.view(3, 6), rtol=0, atol=0)


def test_parameters_sharing_a_users_storage_are_not_taken_over(copy_warnings) -> None:
    """Parameters that are slots of the user's own buffer keep that sharing: copied, not re-homed."""
    user_buffer = torch.randn(10, 4)
    params = [nn.Parameter(torch.empty(0)) for _ in range(2)]
    params[0].data, params[1].data = user_buffer[5:], user_buffer[:5]  # not in stacking order
    result = concatenated_view(params)
    torch.testing.assert_close(result, torch.cat([user_buffer[5:], user_buffer[:5]]), rtol=0, atol=0)
    assert all(p.untyped_storage().data_ptr() == user_buffer.untyped_storage().data_ptr() for p in params)
    assert "concatenated on every call" in copy_warnings.text
