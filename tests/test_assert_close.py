"""assert_close (k3lab.boundaries): tolerances, and non-finite values on either side."""

import math

import pytest
import torch

from k3lab.boundaries import assert_close

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize("actual,expected", [
    (123.0, NAN), (0.0, INF), (INF, -INF), (-INF, INF), (NAN, INF), (1e30, INF),
    (NAN, 1.0), (INF, 1.0), ([1.0, 2.0], [1.0, NAN]), ([NAN, 2.0], [NAN, 3.5])])
def test_non_finite_mismatch_fails(actual, expected):
    with pytest.raises(AssertionError, match="x: max abs error"):
        assert_close("x", torch.tensor(actual), torch.tensor(expected), atol=1.0)


def test_numbers_are_tensors():
    with pytest.raises(AssertionError, match="x:"):
        assert_close("x", 123, NAN, atol=0.0)
    assert assert_close("x", 1.0, 1.5, atol=0.5) == 0.5


@pytest.mark.parametrize("actual,expected", [
    (NAN, NAN), (INF, INF), (-INF, -INF), ([NAN, INF, 1.0, -INF], [NAN, INF, 1.25, -INF])])
def test_non_finite_matches_pass(actual, expected):
    err = assert_close("x", torch.tensor(actual), torch.tensor(expected), atol=0.25)
    assert math.isfinite(err) and err <= 0.25


def test_tolerances():
    e = torch.tensor([1.0, -100.0])
    assert assert_close("x", e + torch.tensor([0.1, 1.0]), e, atol=0.1, rtol=0.01) == 1.0
    with pytest.raises(AssertionError, match="1 of 2 elements"):
        assert_close("x", e + torch.tensor([0.2, 0.0]), e, atol=0.1, rtol=0.01)
    with pytest.raises(AssertionError, match="shape"):
        assert_close("x", e[:1], e, atol=1.0)
