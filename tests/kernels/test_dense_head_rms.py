"""Dense GEMV with x's per-head RMS taken from its producer's partial sums of squares
(``dense_gemv(head_sums=..., head_dim=...)``), against the fp32 reference, under the interpreter
on CPU."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3lab.kernels.dense import GemvConfig, dense_gemv

# Tolerance, derived as in test_dense.py: one bf16 rounding of the output (the interpreter's
# cast truncates: 2^-7), the fp32 sum's error (K * 2^-24 of sum |terms|, under 2^-12 at K <=
# 4096), and with several tokens x * rstd rounded to bf16 for the tensor cores (2^-8 a term).
BF16_OUT = 2.0 ** -7
FP32_SUM = 2.0 ** -12
BF16_IN = 2.0 ** -8

CASES = [  # (id, M, heads, head_dim, partial sums a head, N, config)
    ("M1-h12-d128-p4", 1, 12, 128, 4, 40, None),
    ("M1-h5-d32-p2-split3", 1, 5, 32, 2, 37, GemvConfig(block_n=16, block_k=32, split_k=3)),
    ("M1-h3-d64-p1-unroll", 1, 3, 64, 1, 21, GemvConfig(block_n=8, block_k=64, unroll_k=True)),
    ("M3-h6-d64-p4", 3, 6, 64, 4, 38, GemvConfig(block_n=16, block_k=128)),
    ("M1-h4-d16-p16-wide-steps", 1, 4, 16, 16, 19, GemvConfig(block_n=4, block_k=64)),
    # steps narrower than a head: each column gathers its head's sums
    ("M1-h3-d64-p2-narrow-steps", 1, 3, 64, 2, 21, GemvConfig(block_n=8, block_k=32)),
    ("M2-h3-d64-p2-narrow-split2", 2, 3, 64, 2, 33, GemvConfig(block_n=16, block_k=32,
                                                                  split_k=2)),
]


def _inputs(m, heads, d, p, n, seed):
    gen = torch.Generator().manual_seed(seed)
    o = torch.randn(m, heads, d, generator=gen) * torch.logspace(-3, 3, heads)[None, :, None]
    o[0, 0] = 0.0  # a head whose output is zero: rsqrt(eps) times zero
    parts = o.view(m, heads, p, d // p)
    sums = parts.pow(2).sum(-1).contiguous()  # the producer's partial sums of squares
    w = (torch.randn(n, heads * d, generator=gen) / (heads * d) ** 0.5).bfloat16()
    x = (o * torch.rand(m, heads, d, generator=gen)).bfloat16().view(m, heads * d)  # gated o
    return x, sums, w, o


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_head_rms_prologue(case, device):
    _, m, heads, d, p, n, cfg = case
    x, sums, w, o = _inputs(m, heads, d, p, n, 5)
    gen = torch.Generator().manual_seed(6)
    res = torch.randn(m, n, generator=gen).bfloat16()
    got = dense_gemv(x.to(device), w.to(device), head_sums=sums.to(device), head_dim=d,
                     residual=res.to(device), eps=1e-5, config=cfg).cpu()
    rstd = torch.rsqrt(o.pow(2).mean(-1) + 1e-5).repeat_interleave(d, -1)  # [m, K]
    xs = x.float() * rstd
    want = xs @ w.float().T + res.float()
    terms = xs.abs() @ w.float().abs().T + res.float().abs()
    bound = BF16_OUT * want.abs() + (FP32_SUM + (BF16_IN if m > 1 else 0.0)) * terms
    err = (got.float() - want).abs()
    assert torch.isfinite(got.float()).all()
    assert (err <= bound + 1e-6).all(), f"max excess {(err - bound).max().item():.3g}"


def test_head_rms_bad_input_is_named(device):
    x, sums, w, _ = _inputs(1, 4, 32, 2, 8, 1)
    x, sums, w = x.to(device), sums.to(device), w.to(device)
    with pytest.raises(ValueError, match="head_dim: expected a positive int dividing K=128"):
        dense_gemv(x, w, head_sums=sums, head_dim=48)
    with pytest.raises(ValueError, match="head_sums: expected fp32"):
        dense_gemv(x, w, head_dim=32)
    with pytest.raises(ValueError, match=r"head_sums: expected \[M=1, K/head_dim=4, P\] with"):
        dense_gemv(x, w, head_sums=sums[:, :3].contiguous(), head_dim=32)
    with pytest.raises(ValueError, match="P a power of two up to 16"):
        dense_gemv(x, w, head_sums=sums.repeat(1, 1, 3)[..., :3].contiguous(), head_dim=32)
    with pytest.raises(ValueError, match="head_sums: expected dtype"):
        dense_gemv(x, w, head_sums=sums.double(), head_dim=32)
    with pytest.raises(ValueError, match="takes no norm_weight"):
        dense_gemv(x, w, head_sums=sums, head_dim=32, norm_weight=torch.ones(128, device=device))


@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(heads=st.integers(1, 5), log_d=st.integers(2, 6), log_p=st.integers(0, 2),
       m=st.integers(1, 3), log_bk=st.integers(4, 7), n=st.integers(1, 24),
       seed=st.integers(0, 2 ** 16))
def test_head_rms_is_the_scaled_input(heads, log_d, log_p, m, log_bk, n, seed, device):
    """The contract: the prologue's product is the product of x already scaled per head, for
    head widths and K steps either side of each other (a step of several heads, or a head
    over several steps); heads of both signs from 1e-3 to 1e3 in scale, one of zeros."""
    d, p, bk = 2 ** log_d, min(2 ** log_p, 2 ** log_d), 2 ** log_bk
    x, sums, w, o = _inputs(m, heads, d, p, n, seed)
    cfg = GemvConfig(block_n=16 if m > 1 else 4, block_k=bk)
    got = dense_gemv(x.to(device), w.to(device), head_sums=sums.to(device), head_dim=d,
                     eps=1e-5, config=cfg).cpu()
    rstd = torch.rsqrt(sums.sum(-1) / d + 1e-5).repeat_interleave(d, -1)
    xs = x.float() * rstd
    want = xs @ w.float().T
    bound = BF16_OUT * want.abs() + (FP32_SUM + (BF16_IN if m > 1 else 0.0)) * (
        xs.abs() @ w.float().abs().T)
    assert ((got.float() - want).abs() <= bound + 1e-6).all()
