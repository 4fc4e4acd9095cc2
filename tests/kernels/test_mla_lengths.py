"""MLA decode and its references at the edges of the lengths: rows past a sequence's length
hold NaN and must never reach the output; lengths beyond the cache (or negative) are refused
(CPU: always; GPU: validate="full"), and where not refused the token's output is NaN, never a
read past the cache."""

import pytest
import torch

from k3lab.boundaries import assert_close
from k3lab.config import preset
from k3lab.kernels import mla_decode
from k3lab.reference.mla import mla_decode_reference, mla_decode_unabsorbed
from k3lab.weights import make_generator, randn

TINY = preset("tiny")
# o_lat in bf16 from fp32 math; lse fp32 (as tests/kernels/test_mla.py)
O_ATOL, O_RTOL, LSE_ATOL = 2e-2, 2e-2, 1e-4


def _inputs(lens, max_len, device, seed=0):
    gen = make_generator(seed, device)
    m, h, c, r = len(lens), TINY.mla_heads, TINY.kv_lora, TINY.qk_rope
    q_lat, q_rope = randn((m, h, c), gen), randn((m, h, r), gen)
    kv = randn((m, max_len, c + r), gen)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
    return q_lat, q_rope, kv, seq_lens


def _poison_past_lengths(kv, lens):
    kv = kv.clone()
    for i, n in enumerate(lens):
        kv[i, n:] = float("nan")
    return kv


@pytest.mark.parametrize("num_splits", [1, 3])
def test_rows_past_the_length_never_reach_the_output(num_splits, device):
    """NaN in every cache row at or past each length: kernel and reference equal the clean
    cache's reference, finite; a zero length gives o = 0, lse = -inf in both."""
    lens = [5, 70, 1, 0]
    q_lat, q_rope, kv, sl = _inputs(lens, 96, device)
    clean = mla_decode_reference(q_lat, q_rope, kv, sl, sm_scale=0.2, return_lse=True)
    dirty = _poison_past_lengths(kv, lens)
    ro, rlse = mla_decode_reference(q_lat, q_rope, dirty, sl, sm_scale=0.2, return_lse=True)
    o, lse = mla_decode(q_lat, q_rope, dirty, sl, sm_scale=0.2, num_splits=num_splits,
                        return_lse=True)
    assert torch.isfinite(ro).all() and torch.isfinite(o).all()
    assert_close("o_lat (reference)", ro, clean[0], atol=0.0)
    assert_close("lse (reference)", rlse, clean[1], atol=0.0)
    assert_close("o_lat", o, ro, atol=O_ATOL, rtol=O_RTOL)
    assert_close("lse", lse, rlse, atol=LSE_ATOL)
    assert not o[3].any() and (lse[3] == float("-inf")).all()


def test_unabsorbed_ignores_rows_past_the_length():
    lens = [3, 9]
    q_lat, q_rope, kv, sl = _inputs(lens, 16, "cpu")
    gen = make_generator(1, "cpu")
    h, c = TINY.mla_heads, TINY.kv_lora
    w_uk, w_uv = randn((h, 8, c), gen).float(), randn((h, 8, c), gen).float()
    q_nope = randn((2, h, 8), gen)
    clean = mla_decode_unabsorbed(q_nope, q_rope, kv, sl, w_uk, w_uv, sm_scale=0.2)
    dirty = mla_decode_unabsorbed(q_nope, q_rope, _poison_past_lengths(kv, lens), sl, w_uk,
                                  w_uv, sm_scale=0.2)
    assert torch.isfinite(clean).all()
    assert_close("o", dirty, clean, atol=0.0)


BAD_LENGTHS = [[17, 4], [4, 1000], [-1, 4]]


@pytest.mark.interpreter
@pytest.mark.parametrize("lens", BAD_LENGTHS, ids=lambda v: "-".join(map(str, v)))
@pytest.mark.parametrize("fn", ["kernel", "reference", "unabsorbed"])
def test_lengths_beyond_the_cache_refused(fn, lens):
    q_lat, q_rope, kv, sl = _inputs(lens, 16, "cpu")
    with pytest.raises(ValueError, match=r"^seq_lens: expected lengths in \[0, L_max=16\]"):
        if fn == "kernel":
            mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.2)
        elif fn == "reference":
            mla_decode_reference(q_lat, q_rope, kv, sl, sm_scale=0.2)
        else:
            w = torch.zeros(TINY.mla_heads, 8, TINY.kv_lora)
            mla_decode_unabsorbed(q_lat[..., :8], q_rope, kv, sl, w, w, sm_scale=0.2)


@pytest.mark.interpreter
def test_validate_mode_checked():
    q_lat, q_rope, kv, sl = _inputs([3], 16, "cpu")
    for fn in (mla_decode, mla_decode_reference):
        with pytest.raises(ValueError, match="^validate"):
            fn(q_lat, q_rope, kv, sl, sm_scale=0.2, validate="all")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4])
def test_gpu_lengths_beyond_the_cache(num_splits):
    """On the GPU without a sync: the bad token's outputs are NaN (kernel and reference), the
    good token's are right, and nothing past the cache is read (a NaN-filled neighbour after the
    cache in the same allocation stays out of the good token); validate="full" raises."""
    lens = [40, 9]
    q_lat, q_rope, kv, sl = _inputs(lens, 32, "cuda")
    big = torch.full((3, 32, kv.shape[2]), float("nan"), dtype=kv.dtype, device="cuda")
    big[:2] = kv
    kv = big[:2]  # the rows after the cache hold NaN
    o, lse = mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.2, num_splits=num_splits,
                        return_lse=True)
    ro, rlse = mla_decode_reference(q_lat, q_rope, kv, sl, sm_scale=0.2, return_lse=True)
    assert o[0].isnan().all() and lse[0].isnan().all()
    assert ro[0].isnan().all() and rlse[0].isnan().all()
    assert_close("o_lat", o[1:], ro[1:], atol=O_ATOL, rtol=O_RTOL)
    assert_close("lse", lse[1:], rlse[1:], atol=LSE_ATOL)
    for fn in (mla_decode, mla_decode_reference):
        with pytest.raises(ValueError, match="^seq_lens"):
            fn(q_lat, q_rope, kv, sl, sm_scale=0.2, validate="full")
