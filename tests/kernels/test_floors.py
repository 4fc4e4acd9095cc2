"""The bytes-only skeletons (kernels/floors.py) compute what they claim (sums, in-place update) in
every shape, so that their timings (k3lab/floors.py) are of real work on every byte; bad input is
named. On CPU the kernels run under the interpreter and the floors are NaN (no GPU figure); on
CUDA the floors are positive and ordered as their dependencies say."""

import math

import pytest
import torch

from k3lab import floors
from k3lab.kernels import floors as skeletons


@pytest.mark.parametrize("then,after", [("none", False), ("last", False), ("kernel", False),
                                        ("pdl", False), ("none", True), ("last", True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_stream_sums_every_byte(then, after, dtype, device):
    """A length that ends inside a chunk and inside a block: nothing missed, nothing twice."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3 * 4096 + 37, generator=g).to(dtype).to(device)
    got = skeletons.stream(x, then, chunk_kb=16, warps=4, after=after)
    want = x.double().sum()
    programs = -(-x.numel() * x.element_size() // (16 * 1024))
    assert got.numel() == (programs if then == "none" else 1)
    assert abs(float(got.double().sum()) - float(want)) < 1e-3


def test_stream_last_program_resets_its_counter(device):
    """Two calls in a row: the completion counter is back to 0 after each, so the second call's
    last program is found again (a graph replays the same launch)."""
    x = torch.ones(10000, device=device)
    for _ in range(2):
        assert float(skeletons.stream(x, "last", chunk_kb=8)) == 10000.0


def test_update_touches_every_state_element(device):
    g = torch.Generator().manual_seed(1)
    state = torch.randn(2 * 4096 + 5, generator=g).to(device)
    w = torch.randn(4096 + 9, generator=g).to(torch.bfloat16).to(device)
    before = state.clone()
    partial = skeletons.update(state, w, chunk_kb=8)
    torch.testing.assert_close(state, before * 0.5 + 1.0)
    assert abs(float(partial.double().sum()) - float(w.double().sum())) < 1e-3


def test_bad_input_is_named(device):
    x = torch.zeros(64, device=device)
    with pytest.raises(ValueError, match="then: expected one of"):
        skeletons.stream(x, "later")
    with pytest.raises(ValueError, match="x: expected a 1-D"):
        skeletons.stream(x.view(8, 8))
    with pytest.raises(ValueError, match="chunk_kb: expected a positive int"):
        skeletons.stream(x, chunk_kb=0)
    with pytest.raises(ValueError, match="state: expected a 1-D fp32"):
        skeletons.update(x.half(), x.bfloat16())
    with pytest.raises(ValueError, match="w: expected a 1-D bf16"):
        skeletons.update(x, x)
    with pytest.raises(ValueError, match="x: expected a cuda"):
        skeletons.stream(x.to("meta"))
    with pytest.raises(ValueError, match="after: expected a bool"):
        skeletons.stream(x, "none", after=1)
    with pytest.raises(ValueError, match="after: expected a bool"):
        floors.stream_floor_us(1 << 20, device, after="yes")
    with pytest.raises(ValueError, match="nbytes: expected a positive int"):
        floors.stream_floor_us(0, device)
    with pytest.raises(ValueError, match="weight_bytes: expected a positive int"):
        floors.update_floor_us(4096, -1, device)


@pytest.mark.interpreter
def test_floors_are_nan_off_the_gpu():
    assert math.isnan(floors.stream_floor_us(1 << 20, "cpu", "last"))
    assert math.isnan(floors.update_floor_us(1 << 20, 1 << 19, "cpu"))


@pytest.mark.gpu
def test_floors_on_the_gpu():
    """Positive, and a dependent step never makes the skeleton faster than the read alone."""
    read = floors.stream_floor_us(8 << 20, "cuda", "none", chunks_kb=(16,), warps=(8,))
    last = floors.stream_floor_us(8 << 20, "cuda", "last", chunks_kb=(16,), warps=(8,))
    upd = floors.update_floor_us(4 << 20, 2 << 20, "cuda", chunks_kb=(16,), warps=(4,))
    after = floors.stream_floor_us(8 << 20, "cuda", "none", after=True, chunks_kb=(16,),
                                   warps=(8,))
    assert 0 < read <= last * 1.05 and upd > 0 and after > 0
