"""Property tests (hypothesis) of the AttnRes read + RMSNorm kernel against its fp32 reference,
over the inputs where a sign, an offset or a tie bug would hide from random normal data: sealed
rows that tie exactly with each other or with the live row (copies, or copies with the sign
flipped), large projection weights (scores far apart: a softmax without its max subtraction
overflows) and negative ones, zero rows (the eps), all-negative values, awkward hidden sizes
(chunk and mask offsets) and every bank depth."""

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3lab.boundaries import assert_close
from k3lab.kernels import AttnResConfig, attn_res_norm
from k3lab.kernels.attn_res import MAX_SEALED
from k3lab.reference.attn_res import attn_res_norm_reference

# as tests/kernels/test_attn_res.py: one bf16 ulp of h (summation order), two of h_normed
H_ATOL, H_RTOL = 1e-3, 2.0 ** -7
H_NORMED_ATOL, H_NORMED_RTOL = 1e-3, 2.0 ** -6
# the default tiles, narrow ones (several H chunks and bank tiles, masked tails) of the
# one-program kernel, and the split schedule at narrow chunks (many programs a token) at every
# depth and by the default depth rule
CONFIGS = {"default": None,
           "narrow": AttnResConfig(max_block_h=32, tile_elems=128, split_h=0),
           "mid": AttnResConfig(max_block_h=128, tile_elems=1024, split_h=0),
           "split": AttnResConfig(split_h=16, split_min_candidates=1),
           "split-by-depth": AttnResConfig(split_h=32)}
SETTINGS = settings(max_examples=15, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow,
                                           HealthCheck.function_scoped_fixture])


@st.composite
def reads(draw):
    n = draw(st.integers(0, MAX_SEALED))
    m = draw(st.sampled_from([1, 2, 5]))
    hidden = draw(st.sampled_from([1, 3, 16, 37, 130, 257]))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 2**16)))
    rows = torch.randn(n + 1, m, hidden, generator=gen)
    for j in range(n + 1):  # each row: random, a (sign-flipped, scaled) copy, zero or negative
        kind = draw(st.sampled_from(["random", "copy", "flipped", "zero", "negative"]))
        src = draw(st.integers(0, n))
        if kind == "copy":
            rows[j] = rows[src] * draw(st.sampled_from([1.0, 2.0, 0.5]))
        elif kind == "flipped":
            rows[j] = -rows[src]
        elif kind == "zero":
            rows[j] = 0.0
        elif kind == "negative":
            rows[j] = -rows[j].abs()
    rows = rows * draw(st.sampled_from([1e-3, 1.0, 100.0]))
    wdtype = draw(st.sampled_from([torch.bfloat16, torch.float32]))

    def weight(scale_choices):
        w = torch.randn(hidden, generator=gen) * draw(st.sampled_from(scale_choices))
        return (w.abs() * draw(st.sampled_from([1.0, -1.0]))
                if draw(st.booleans()) else w).to(wdtype)

    return (rows[:n].to(torch.bfloat16).contiguous(), rows[n].to(torch.bfloat16),
            weight([1.0]), weight([400.0, 40.0, 1.0, 1e-3, 0.0]), weight([1.0, -1.0]),
            draw(st.sampled_from([1e-5, 1e-2])), draw(st.sampled_from(sorted(CONFIGS))))


@SETTINGS
@given(read=reads())
def test_attn_res_properties(read, device):
    bank, live, w_norm, w_proj, w_out, eps, chunk = read
    args = [t.to(device) for t in (bank, live, w_norm, w_proj, w_out)]
    config = CONFIGS[chunk]
    h, hn = attn_res_norm(*args, eps=eps, config=config)
    rh, rhn = attn_res_norm_reference(*args, eps=eps)
    assert torch.isfinite(rh.float()).all() and torch.isfinite(rhn.float()).all()
    assert_close("h", h, rh, atol=H_ATOL, rtol=H_RTOL)
    assert_close("h_normed", hn, rhn, atol=H_NORMED_ATOL, rtol=H_NORMED_RTOL)
