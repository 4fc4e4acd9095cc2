"""Dense decode GEMV against the fp32 reference, under the interpreter on CPU."""

import dataclasses

import pytest
import torch
import triton
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.sweeps import GEMV_CANDIDATES
from k3lab.config import preset
from k3lab.kernels.dense import (
    MAX_TOKENS,
    TUNED_M1,
    TUNED_M1_E4M3,
    GemvConfig,
    default_config,
    dense_gemv,
    heuristic_config,
)
from k3lab.kernels.dense.launch import interpreter_config
from k3lab.kernels.runtime import INTERPRETED
from k3lab.reference.dense import dense_engine, dense_reference, rms_norm

# Tolerance, derived: the output is one bf16 rounding of an fp32 sum (relative 2^-8 rounding to
# nearest on the GPU; the interpreter's cast truncates, up to one ulp: 2^-7), the sum's
# fp32 error is at most about K * 2^-24 of sum |terms| (bounded by 2^-12 at K <= 4096), and the
# tensor-core path (M > 1) rounds x * g of the RMSNorm prologue to bf16 (relative 2^-8 a term).
BF16_OUT = 2.0 ** -7
FP32_SUM = 2.0 ** -12
BF16_IN = 2.0 ** -8


def _terms(x, w, g=None):
    """sum_k |x_k (g_k) w_nk| per output, the scale of the sum's rounding errors."""
    xf = x.float().abs() * (g.float().abs() if g is not None else 1.0)
    return xf @ w.float().abs().T


def _close(got, want, terms, *, rounded_inputs=False, rstd=None):
    scale = terms * (rstd if rstd is not None else 1.0)
    bound = BF16_OUT * want.abs() + (FP32_SUM + (BF16_IN if rounded_inputs else 0.0)) * scale
    err = (got.float() - want).abs()
    assert torch.isfinite(got.float()).all()
    assert (err <= bound + 1e-6).all(), (
        f"max excess {(err - bound).max().item():.3g}, max err {err.max().item():.3g}")


def _data(m, n, k, seed, *, scale=1.0, mean=0.0):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(m, k, generator=gen) * scale + mean).bfloat16()
    w = (torch.randn(n, k, generator=gen) / k ** 0.5).bfloat16()
    return x, w


CASES = [  # (id, M, N, K, config)
    ("M1-N40-K96", 1, 40, 96, None),
    ("M1-N37-K600-split3", 1, 37, 600, GemvConfig(block_n=16, block_k=128, split_k=3)),
    ("M1-N128-K2048-split8", 1, 128, 2048, GemvConfig(block_n=32, block_k=64, split_k=8)),
    ("M3-N38-K600-split3", 3, 38, 600, GemvConfig(block_n=16, block_k=128, split_k=3)),
    ("M16-N64-K1024", 16, 64, 1024, None),
    ("M5-N17-K40", 5, 17, 40, GemvConfig(block_n=16, block_k=16, split_k=2)),
    ("M1-N21-K300-bn8-split2", 1, 21, 300, GemvConfig(block_n=8, block_k=64, split_k=2)),
    # gate and up rows in one K loop (only the activation tests use it), split and not
    ("M1-N19-K600-together-split3", 1, 19, 600,
     GemvConfig(block_n=8, block_k=64, split_k=3, gate_up_together=True)),
    ("M4-N33-K300-together", 4, 33, 300, GemvConfig(block_n=16, block_k=64,
                                                    gate_up_together=True)),
    # K steps unrolled: a K tail, a split whose last share is short, several tokens
    ("M1-N40-K300-unroll", 1, 40, 300, GemvConfig(block_n=8, block_k=64, unroll_k=True)),
    # 4-row tiles (one token): a row tail, a split
    ("M1-N39-K600-bn4-split2", 1, 39, 600, GemvConfig(block_n=4, block_k=128, split_k=2)),
    ("M1-N37-K600-unroll-split3", 1, 37, 600,
     GemvConfig(block_n=16, block_k=64, split_k=3, unroll_k=True)),
    ("M3-N38-K200-unroll", 3, 38, 200, GemvConfig(block_n=16, block_k=32, unroll_k=True)),
    # a register cap (compiled only) at 8 warps
    ("M1-N70-K600-warps8-cap128", 1, 70, 600,
     GemvConfig(block_n=32, block_k=128, num_warps=8, max_registers=128)),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_plain(case, device):
    _, m, n, k, cfg = case
    x, w = _data(m, n, k, 1)
    x, w = x.to(device), w.to(device)
    got = dense_gemv(x, w, config=cfg)
    assert got.shape == (m, n) and got.dtype == torch.bfloat16
    _close(got.cpu(), dense_reference(x, w).cpu(), _terms(x, w).cpu())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
@pytest.mark.parametrize("activation", ["situ", "silu"])
def test_gate_up_activation(case, activation, device):
    _, m, n, k, cfg = case
    x, w = _data(m, 2 * n, k, 2, scale=3.0)
    x, w = x.to(device), w.to(device)
    got = dense_gemv(x, w, activation=activation, config=cfg)
    want = dense_reference(x, w, activation=activation)
    assert got.shape == (m, n)
    # the activation's slope is at most about 1.1 * linear scale in g and u: the sums' error
    # carries through scaled by |u| and |g|
    t = _terms(x, w)
    g_t, u_t = t[:, :n], t[:, n:]
    ref = dense_reference(x, w)
    slope = 1.2 * (ref[:, n:].abs() + ref[:, :n].abs() + 1.0)
    _close(got.cpu(), want.cpu(), (slope * (g_t + u_t)).cpu())


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_norm_prologue_and_residual(case, device):
    _, m, n, k, cfg = case
    x, w = _data(m, n, k, 3, scale=2.0, mean=-0.5)
    gen = torch.Generator().manual_seed(4)
    g = torch.rand(k, generator=gen) * 2 - 0.5  # signed norm weights
    res = torch.randn(m, n, generator=gen).bfloat16()
    x, w, g, res = x.to(device), w.to(device), g.to(device), res.to(device)
    got = dense_gemv(x, w, norm_weight=g, residual=res, eps=1e-5, config=cfg)
    want = dense_reference(x, w, norm_weight=g, residual=res, eps=1e-5)
    rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-5)
    _close(got.cpu(), want.cpu(), _terms(x, w, g).cpu(), rounded_inputs=m > 1,
           rstd=rstd.cpu())


@pytest.mark.parametrize("m", [1, 4])
def test_merged_outputs(m, device):
    splits = (24, 1, 7, 16, 3)
    x, w = _data(m, sum(splits), 200, 5)
    x, w = x.to(device), w.to(device)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=2)
    outs = dense_gemv(x, w, splits=splits, config=cfg)
    wants = dense_reference(x, w, splits=splits)
    terms = _terms(x, w).split(list(splits), dim=-1)
    assert len(outs) == len(splits)
    for got, want, t, s in zip(outs, wants, terms, splits, strict=True):
        assert got.shape == (m, s) and got.is_contiguous()
        _close(got.cpu(), want.cpu(), t.cpu())


def test_repeated_split_calls_reset_tickets(device):
    """The split-K tickets are left zero: repeated calls on one buffer give the same answer."""
    x, w = _data(2, 50, 512, 6)
    x, w = x.to(device), w.to(device)
    cfg = GemvConfig(block_n=16, block_k=64, split_k=4)
    first = dense_gemv(x, w, config=cfg)
    for _ in range(3):
        assert torch.equal(dense_gemv(x, w, config=cfg), first)


def test_fp32_output(device):
    x, w = _data(1, 33, 300, 7)
    x, w = x.to(device), w.to(device)
    got = dense_gemv(x, w, out_dtype=torch.float32)
    assert got.dtype == torch.float32
    err = (got - dense_reference(x, w)).abs()
    assert (err <= FP32_SUM * _terms(x, w) + 1e-6).all()


@pytest.mark.parametrize("m", [1, 3])
def test_fp32_input_with_norm_and_fp32_residual(m, device):
    """The MoE tail's call: fp32 x (stage 2's y) through the RMSNorm prologue, an fp32 residual
    (the shared experts' output) added before the one bf16 rounding."""
    gen = torch.Generator().manual_seed(11 + m)
    x = torch.randn(m, 96, generator=gen) * 3.0
    w = (torch.randn(40, 96, generator=gen) / 96 ** 0.5).bfloat16()
    g = torch.rand(96, generator=gen) + 0.5
    res = torch.randn(m, 40, generator=gen)
    got = dense_gemv(x.to(device), w.to(device), norm_weight=g.to(device), eps=1e-6,
                     residual=res.to(device)).cpu()
    rn = rms_norm(x, g, 1e-6)
    want = rn @ w.float().T + res
    terms = rn.abs() @ w.float().abs().T + res.abs()
    _close(got, want, terms, rounded_inputs=m > 1)


@pytest.mark.parametrize("m,cfg", [(1, None), (1, GemvConfig(block_n=8, block_k=64, split_k=3)),
                                   (4, None), (3, GemvConfig(block_n=16, block_k=32, split_k=2)),
                                   (1, GemvConfig(block_n=8, block_k=64, split_k=3,
                                                  gate_up_together=True)),
                                   (3, GemvConfig(block_n=16, block_k=32, gate_up_together=True)),
                                   (1, GemvConfig(block_n=8, block_k=32, unroll_k=True,
                                                  gate_up_together=True)),
                                   (1, GemvConfig(block_n=8, block_k=64, split_k=2,
                                                  unroll_k=True))])
def test_mixed_plain_and_gated_rows(m, cfg, device):
    """splits (plain rows, 2S gate/up rows) with an activation: the plain rows as they are, the
    activation of the gate/up rows; the plain count not a multiple of the tile."""
    gen = torch.Generator().manual_seed(21 + m)
    x = torch.randn(m, 160, generator=gen).bfloat16()
    w = (torch.randn(37 + 2 * 22, 160, generator=gen) / 160 ** 0.5).bfloat16()
    z, a = dense_gemv(x.to(device), w.to(device), splits=(37, 44), activation="situ",
                      config=cfg)
    assert z.shape == (m, 37) and a.shape == (m, 22)
    want_z, want = dense_reference(x, w, splits=(37, 44), activation="situ")
    _close(z.cpu(), want_z, _terms(x, w[:37]))
    got = a.cpu().float()
    # the activation of two fp32 sums: bounded by its output rounding and the sums' error
    # carried through SiTU (|d act / d g|, |d act / d u| are at most about 1.1 and 4)
    bound = BF16_OUT * want.abs() + 8 * FP32_SUM * (_terms(x, w[37:59]) + _terms(x, w[59:]))
    assert ((got - want).abs() <= bound + 1e-6).all()


def _tail_data(m, seed):
    """x [M, 192] (fp32, not normalized), x2 [M, 72], W [45, 192], W2 [45, 72] (bf16) and a
    norm weight [192]: the MoE tail's launch in small."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, 192, generator=gen) * 2.0
    x2 = torch.randn(m, 72, generator=gen).bfloat16()
    w = (torch.randn(45, 192, generator=gen) / 192 ** 0.5).bfloat16()
    w2 = (torch.randn(45, 72, generator=gen) / 72 ** 0.5).bfloat16()
    return x, x2, w, w2, torch.rand(192, generator=gen) + 0.5


@pytest.mark.parametrize("m,cfg", [(1, None), (1, GemvConfig(block_n=8, block_k=64, split_k=4)),
                                   (5, None)])
def test_dual_product_with_norm(m, cfg, device):
    """y = RMSNorm(x) @ W^T + x2 @ W2^T: the norm applies to the first product only."""
    x, x2, w, w2, g = _tail_data(m, 31 + m)
    got = dense_gemv(x.to(device), w.to(device), norm_weight=g.to(device), eps=1e-5,
                     x2=x2.to(device), weight2=w2.to(device), config=cfg).cpu()
    rn = rms_norm(x, g, 1e-5)
    want = dense_reference(x, w, norm_weight=g, eps=1e-5, x2=x2, weight2=w2)
    terms = rn.abs() @ w.float().abs().T + x2.float().abs() @ w2.float().abs().T
    _close(got, want, terms, rounded_inputs=m > 1)


def _e4m3_rows(w):
    """Per-row e4m3 values and fp32 scales of w (amax / 448, as fp8_rows_quantize)."""
    amax = w.float().abs().amax(1)
    scale = torch.where(amax > 0, amax / 448.0, torch.ones_like(amax))
    return (w.float() / scale[:, None]).to(torch.float8_e4m3fn), scale


E4M3_CASES = [(1, None), (1, GemvConfig(block_n=8, block_k=64, split_k=3)),
              (1, GemvConfig(block_n=16, block_k=64, unroll_k=True)), (4, None)]


@pytest.mark.parametrize("m,cfg", E4M3_CASES, ids=["M1", "M1-split3", "M1-unroll", "M4"])
def test_e4m3_weight_with_row_scales(m, cfg, device):
    """An e4m3 weight times its row scales: the same sums as its values in bf16 would give,
    scaled per row (e4m3 values are exact in bf16 and fp32); rows of zeros and of mixed
    magnitudes among them."""
    x, w = _data(m, 37, 320, 41 + m, scale=3.0)
    w[3] = 0
    w[5] *= 100.0
    q, scale = _e4m3_rows(w)
    got = dense_gemv(x.to(device), q.to(device), weight_scale=scale.to(device), config=cfg).cpu()
    want = dense_reference(x, q, weight_scale=scale)
    _close(got, want, _terms(x, q.float() * scale[:, None]), rounded_inputs=m > 1)
    assert got[:, 3].float().abs().max() == 0


def _check_e4m3_tail(y, x2, w, w2, g, res, device):
    """The MoE tail's launch with the e4m3 rows of w against the fp32 reference."""
    q, scale = _e4m3_rows(w)
    got = dense_gemv(y.to(device), q.to(device), weight_scale=scale.to(device),
                     norm_weight=g.to(device), eps=1e-5, x2=x2.to(device),
                     weight2=w2.to(device), residual=res.to(device)).cpu()
    want = dense_reference(y, q, weight_scale=scale, norm_weight=g, eps=1e-5, x2=x2,
                           weight2=w2, residual=res)
    terms = (rms_norm(y, g, 1e-5).abs() @ (q.float() * scale[:, None]).abs().T
             + x2.float().abs() @ w2.float().abs().T + res.float().abs())
    _close(got, want, terms, rounded_inputs=y.shape[0] > 1)


@pytest.mark.parametrize("m", [1, 3])
def test_e4m3_tail_norm_second_product_and_residual(m, device):
    """The MoE tail's launch with an e4m3 up-projection: RMSNorm(y) @ (values * scale)^T +
    shared @ W2^T + residual; the scale applies to the first product only."""
    y, x2, w, w2, g = _tail_data(m, 7 + m)
    res = torch.randn(m, 45, generator=torch.Generator().manual_seed(m)).bfloat16()
    _check_e4m3_tail(y, x2, w, w2, g, res, device)


@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 4])
def test_e4m3_tail_at_k3_shapes_and_default_tiling(m, device):
    """The K3 tail at tp 8 (up-projection [7168, 3584] in e4m3, shared down [7168, 768] bf16,
    residual) at the default tiling, the e4m3 weight's own (TUNED_M1_E4M3)."""
    gen = torch.Generator().manual_seed(m)
    y = torch.randn(m, 3584, generator=gen) * 2.0
    x2 = torch.randn(m, 768, generator=gen).bfloat16()
    w = (torch.randn(7168, 3584, generator=gen) / 3584 ** 0.5).bfloat16()
    w2 = (torch.randn(7168, 768, generator=gen) / 768 ** 0.5).bfloat16()
    g = torch.rand(3584, generator=gen) + 0.5
    _check_e4m3_tail(y, x2, w, w2, g, torch.randn(m, 7168, generator=gen).bfloat16(), device)


SECOND_FIRST_CASES = [(1, None), (1, GemvConfig(block_n=8, block_k=64, split_k=3)),
                      (1, GemvConfig(block_n=16, block_k=64, unroll_k=True)),
                      (1, GemvConfig(block_n=8, block_k=64, pdl=True, prefetch_steps=2)),
                      (4, None)]


@pytest.mark.parametrize("e4m3", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("m,cfg", SECOND_FIRST_CASES,
                         ids=["M1", "M1-split3", "M1-unroll", "M1-pdl", "M4"])
def test_second_first_keeps_the_sums(m, cfg, e4m3, device):
    """The second product and the residual before the first (GemvConfig.second_first): the
    same bits as the default order, and within the tail's bound of the fp32 reference."""
    y, x2, w, w2, g = _tail_data(m, 17 + m)
    res = torch.randn(m, 45, generator=torch.Generator().manual_seed(3 + m)).bfloat16()
    q, scale = _e4m3_rows(w) if e4m3 else (w, None)
    # dense_gemv's own choice without a config (the interpreter's tiling under it)
    base = cfg or (interpreter_config(m, 45, 192) if INTERPRETED
                   else default_config(m, 45, 192, e4m3=e4m3))
    kw = dict(norm_weight=g.to(device), eps=1e-5, x2=x2.to(device), weight2=w2.to(device),
              residual=res.to(device),
              weight_scale=scale.to(device) if scale is not None else None)
    want = dense_gemv(y.to(device), q.to(device), config=base, **kw)
    got = dense_gemv(y.to(device), q.to(device),
                     config=dataclasses.replace(base, second_first=True), **kw)
    assert torch.equal(got, want)
    ref = dense_reference(y, q, weight_scale=scale, norm_weight=g, eps=1e-5, x2=x2,
                          weight2=w2, residual=res)
    wq = q.float() * (scale[:, None] if scale is not None else 1.0)
    terms = (rms_norm(y, g, 1e-5).abs() @ wq.abs().T + x2.float().abs() @ w2.float().abs().T
             + res.float().abs())
    _close(got.cpu(), ref, terms, rounded_inputs=m > 1)


def test_call_config_is_what_the_call_takes():
    from k3lab.kernels.dense import call_config

    mine = GemvConfig(block_n=8, block_k=64)
    assert call_config(mine, 1, 7168, 3584) is mine
    want = (interpreter_config(1, 7168, 3584) if INTERPRETED
            else default_config(1, 7168, 3584, e4m3=True))
    assert call_config(None, 1, 7168, 3584, e4m3=True) == want


@pytest.mark.parametrize("split", [1, 2])
def test_second_first_with_a_residual_alone(split, device):
    x, w = _data(1, 40, 256, 5, scale=2.0)
    res = torch.randn(1, 40, generator=torch.Generator().manual_seed(5)).bfloat16()
    cfg = GemvConfig(block_n=8, block_k=64, split_k=split)
    want = dense_gemv(x.to(device), w.to(device), residual=res.to(device), config=cfg)
    got = dense_gemv(x.to(device), w.to(device), residual=res.to(device),
                     config=dataclasses.replace(cfg, second_first=True))
    assert torch.equal(got, want)


def test_engine_baseline_matches_reference():
    x, w = _data(2, 48, 256, 8)
    g = torch.rand(256) + 0.5
    got = dense_engine(x, w, norm_weight=g, activation="situ")
    want = dense_reference(x, w, norm_weight=g, activation="situ")
    assert (got.float() - want).abs().max() < 0.05 * want.abs().max()
    assert torch.allclose(rms_norm(x, torch.ones(256), 1e-5).mean(), x.float().mean() *
                          torch.rsqrt(x.float().pow(2).mean(-1) + 1e-5).mean(), atol=1)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, MAX_TOKENS), n=st.integers(1, 70), k=st.integers(1, 300),
       split=st.sampled_from([1, 2, 3, 5]), block_k=st.sampled_from([16, 64, 256]),
       scale=st.sampled_from([1e-3, 1.0, 50.0]), seed=st.integers(0, 2 ** 16))
def test_property_any_shape(m, n, k, split, block_k, scale, seed):
    """Any M, N, K (odd, tiny, not multiples of a block), any split, tiny and large values."""
    x, w = _data(m, n, k, seed, scale=scale)
    cfg = GemvConfig(block_n=16, block_k=block_k, split_k=split)
    got = dense_gemv(x, w, config=cfg)
    _close(got, dense_reference(x, w), _terms(x, w))


def test_default_config_fills_the_machine():
    cfg = heuristic_config(1, 128, 7168)  # a thin projection: split K
    assert cfg.split_k > 1 and cfg.block_n == 8
    assert heuristic_config(1, 7168, 1536).split_k == 1  # many row tiles already
    assert heuristic_config(4, 7168, 1536).block_n == 16  # the tensor-core path
    assert default_config(1, 100, 300) == heuristic_config(1, 100, 300)  # not in the table


@pytest.mark.parametrize("m, rows, k", [(1, 7168, 2112), (1, 6284, 7168), (1, 100, 300),
                                        (4, 7168, 3584), (1, 64, 40), *TUNED_M1_E4M3])
def test_e4m3_takes_its_table_else_the_bf16_tilings_bytes_a_step(m, rows, k):
    """A one-byte weight at one token: its own table's entry, else twice the bf16 tiling's
    columns a step (the same bytes), at most K's next power of two, every other field as
    bf16's. Several tokens: bf16's."""
    bf16, fp8 = default_config(m, rows, k), default_config(m, rows, k, e4m3=True)
    if m > 1:
        assert fp8 == bf16
        return
    if (rows, k, False) in TUNED_M1_E4M3:
        assert fp8 is TUNED_M1_E4M3[(rows, k, False)]
        return
    assert fp8.block_k == min(2 * bf16.block_k, max(16, triton.next_power_of_2(k)))
    assert dataclasses.replace(fp8, block_k=bf16.block_k) == bf16


def test_tuned_table_lists_k3_shapes_only():
    """Every entry of the one-token table is a dense projection of Kimi-K3 at tp 8 or 16 (a
    stale key would never be looked up), the lookup returns it at one token only, and a gated
    shape does not take the plain shape's entry."""
    from k3lab.boundaries.dense import shapes
    keys = set()
    for tp in (8, 16):
        for s in shapes(preset("kimi-k3", tp=tp)).values():
            gated = bool(s.get("activation"))
            keys.add((s["rows"] // (2 if gated else 1), s["K"], gated))
    assert set(TUNED_M1) <= keys, set(TUNED_M1) - keys
    for (rows, k, gated), cfg in TUNED_M1.items():
        assert default_config(1, rows, k, gated=gated) is cfg
        assert default_config(4, rows, k, gated=gated) == heuristic_config(4, rows, k)
    assert default_config(1, 768, 7168, gated=True) != default_config(1, 768, 7168)


def test_tuned_table_picks_from_the_sweep():
    assert {GemvConfig(**c) for c in GEMV_CANDIDATES} >= set(TUNED_M1.values())
    # the e4m3 entries: K3 shapes that take an e4m3 weight, tilings of the fp8_tiles and
    # fp8_warps sweeps
    from benchmarks.sweeps import get
    from k3lab.boundaries.dense import shapes
    fields = {f.name for f in dataclasses.fields(GemvConfig)}
    swept = {GemvConfig(**{k: v for k, v in p.items() if k in fields})
             for name in ("fp8_tiles", "fp8_warps") for p in get("dense", name).points}
    assert swept >= set(TUNED_M1_E4M3.values())
    e4m3 = {(s["rows"], s["K"], False) for n, s in shapes(preset("kimi-k3", tp=8)).items()
            if n in ("moe.latent_up", "moe.latent_down", "kda.o_proj")}
    assert set(TUNED_M1_E4M3) <= e4m3


@pytest.mark.parametrize("fields", GEMV_CANDIDATES, ids=lambda c: (
    f"n{c['block_n']}k{c['block_k']}s{c['split_k']}st{c['num_stages']}p{c['prefetch_steps']}"
    + ("-together" if c.get("gate_up_together") else "")
    + ("-unroll" if c.get("unroll_k") else "")))
def test_tune_candidates(fields, device):
    """Each tiling the tune sweep (and so the table) may pick, on a shape with a K tail, plain
    and with the gate/up epilogue."""
    cfg = GemvConfig(**fields)
    x, w = _data(1, 40, 1100, 3)
    x, w = x.to(device), w.to(device)
    _close(dense_gemv(x, w, config=cfg).cpu(), dense_reference(x, w).cpu(), _terms(x, w).cpu())
    got = dense_gemv(x, w, activation="silu", config=cfg)
    t, ref = _terms(x, w).cpu(), dense_reference(x, w).cpu()  # bound as in test_gate_up_activation
    slope = 1.2 * (ref[:, 20:].abs() + ref[:, :20].abs() + 1.0)
    _close(got.cpu(), dense_reference(x, w, activation="silu").cpu(),
           slope * (t[:, :20] + t[:, 20:]))


BAD = [
    (dict(x=torch.zeros(17, 64).bfloat16()), "M"),
    (dict(x=torch.zeros(2, 64).half()), "x: expected dtype"),
    (dict(w=torch.zeros(32, 63).bfloat16()), "weight: expected"),
    (dict(w=torch.zeros(31, 64).bfloat16(), activation="situ"), "odd row count"),
    (dict(activation="gelu"), "activation"),
    (dict(splits=(10, 10)), "summing"),
    (dict(splits=(32, 0)), "splits"),
    (dict(splits=[1] * 32), "splits"),
    (dict(eps=0.0), "eps"),
    (dict(eps=float("nan")), "eps"),
    (dict(situ_beta="4"), "situ_beta"),
    (dict(residual=torch.zeros(2, 31).bfloat16()), "residual"),
    (dict(norm_weight=torch.zeros(63)), "norm_weight"),
    (dict(x=torch.zeros(64, 2).bfloat16().T), "contiguous"),
    (dict(out_dtype=torch.float16), "out_dtype"),
    (dict(config="fast"), "config"),
    (dict(config=GemvConfig(block_n=8)), "block_n=8 serves one token"),
    (dict(config=GemvConfig(block_n=4)), "block_n=4 serves one token"),
    (dict(x=torch.zeros(1, 2048).bfloat16(), w=torch.zeros(32, 2048).bfloat16(),
          config=GemvConfig(block_n=8, block_k=64, unroll_k=True)), "unroll_k unrolls"),
    (dict(splits=(16, 16), residual=torch.zeros(2, 32).bfloat16()), "no residual"),
    (dict(splits=(8, 8, 16), activation="situ"), "plain rows"),
    (dict(splits=(15, 17), activation="situ"), "plain rows"),
    (dict(x2=torch.zeros(2, 8).bfloat16()), "x2: give both"),
    (dict(x2=torch.zeros(2, 8).bfloat16(), weight2=torch.zeros(31, 8).bfloat16()), "weight2"),
    (dict(x2=torch.zeros(2, 8).bfloat16(), weight2=torch.zeros(32, 8).bfloat16(),
          activation="situ"), "x2: a second product"),
    (dict(w=torch.zeros(32, 64).to(torch.float8_e4m3fn)), "weight_scale: expected fp32 \\[N\\]"),
    (dict(weight_scale=torch.ones(32)), "weight_scale: expected fp32 \\[N\\]"),
    (dict(w=torch.zeros(32, 64).to(torch.float8_e4m3fn), weight_scale=torch.ones(31)),
     "weight_scale: expected \\[N=32\\]"),
    (dict(w=torch.zeros(32, 64).to(torch.float8_e4m3fn), weight_scale=torch.ones(32).double()),
     "weight_scale: expected dtype"),
    (dict(w=torch.zeros(32, 64).to(torch.float8_e4m3fn), weight_scale=torch.ones(32),
          activation="situ"), "weight_scale: an e4m3 weight"),
    (dict(w=torch.zeros(32, 64).half()), "weight: expected dtype"),
    (dict(config=GemvConfig(block_n=16, second_first=True)), "second_first"),
]


@pytest.mark.parametrize("kw,msg", BAD, ids=[b[1] for b in BAD])
def test_bad_input_is_a_clear_error(kw, msg, device):
    kw = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in kw.items()}
    x = kw.pop("x", torch.zeros(2, 64, device=device).bfloat16())
    w = kw.pop("w", torch.zeros(32, 64, device=device).bfloat16())
    with pytest.raises(ValueError, match=msg):
        dense_gemv(x, w, **kw)


@pytest.mark.parametrize("kw,msg", [
    (dict(block_n=24), "block_n"), (dict(block_n=2), "block_n"), (dict(block_k=8), "block_k"),
    (dict(split_k=0), "split_k"), (dict(prefetch_steps=9), "prefetch_steps"),
    (dict(num_warps=3), "num_warps"), (dict(pdl=1), "pdl"), (dict(wait_last=None), "wait_last"),
    (dict(gate_up_together=1), "gate_up_together"), (dict(unroll_k="yes"), "unroll_k"),
    (dict(pdl=True, wait_last=True, trigger_last=1), "trigger_last"),
    (dict(pdl=True, trigger_last=True), "trigger_last: expected only with wait_last"),
    (dict(max_registers=16), "max_registers"), (dict(max_registers=True), "max_registers"),
    (dict(second_first=1), "second_first")])
def test_bad_config(kw, msg):
    with pytest.raises(ValueError, match=f"GemvConfig.{msg}"):
        GemvConfig(**kw)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_graph_replay_split(pdl):
    x, w = _data(1, 1536, 7168, 9)
    x, w = x.cuda(), w.cuda()
    cfg = GemvConfig(block_n=16, block_k=512, split_k=4, pdl=pdl)
    want = dense_gemv(x, w, config=cfg)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = dense_gemv(x, w, config=cfg)
    for _ in range(5):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(y, want)
    _close(y.cpu(), dense_reference(x, w).cpu(), _terms(x, w).cpu())


@pytest.mark.gpu
def test_gpu_second_first_by_pdl_in_graph():
    """The K3 tail (e4m3 latent up, shared down, residual) by PDL after a launch that writes
    its y, with the second product before the wait: the default order's bits on every replay."""
    gen = torch.Generator().manual_seed(11)
    y0 = (torch.randn(1, 3584, generator=gen) * 2.0).cuda()
    x2 = torch.randn(1, 768, generator=gen).bfloat16().cuda()
    q, scale = _e4m3_rows((torch.randn(7168, 3584, generator=gen) / 3584 ** 0.5).bfloat16())
    q, scale = q.cuda(), scale.cuda()
    w2 = (torch.randn(7168, 768, generator=gen) / 768 ** 0.5).bfloat16().cuda()
    g = (torch.rand(3584, generator=gen) + 0.5).cuda()
    res = torch.randn(1, 7168, generator=gen).bfloat16().cuda()
    base = default_config(1, 7168, 3584, e4m3=True)
    outs = {}
    for first in (False, True):
        cfg = dataclasses.replace(base, pdl=True, second_first=first)
        y = torch.empty_like(y0)
        gr = torch.cuda.CUDAGraph()
        with torch.cuda.graph(gr):
            y.copy_(y0 * 1.5)  # the launch the tail waits for
            outs[first] = dense_gemv(y, q, weight_scale=scale, norm_weight=g, eps=1e-5, x2=x2,
                                     weight2=w2, residual=res, config=cfg)
        for _ in range(3):
            gr.replay()
        torch.cuda.synchronize()
    assert torch.equal(outs[True], outs[False])


@pytest.mark.parametrize("shape", ["kda.in_proj", "mla.q_b_proj", "moe.shared_gate_up",
                                   "kda.o_proj"])
def test_boundary_is_one_launch(shape, device):
    """Every epilogue kind is one launch, merged outputs included (no host-side tensor)."""
    from k3lab.boundaries import dense
    from k3lab.config import preset
    from k3lab.profile import count_launches

    inputs = dense.BOUNDARY.make_inputs(preset("tiny"), device, 0, M=1, shape=shape)
    assert count_launches(dense.fused, inputs).count == 1


@pytest.mark.gpu
def test_gpu_merged_outputs_in_graph():
    splits = (1536, 1536, 1536, 128, 12, 1536)
    x, w = _data(1, sum(splits), 7168, 10)
    x, w = x.cuda(), w.cuda()
    want = dense_gemv(x, w, splits=splits)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = dense_gemv(x, w, splits=splits)
    g.replay()
    torch.cuda.synchronize()
    for a, b in zip(outs, want, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("shape", ["moe.latent_up", "kda.o_proj", "lm_head"])
def test_boundary_e4m3_weight_format(shape, device):
    """weight_format "e4m3": the boundary's fused launch and its reference (the weight
    dequantized to bf16) both meet the fp32 truth of the scaled e4m3 rows; the bytes count one
    byte a weight element plus the row scales; shapes with merged outputs or an activation say
    they take no e4m3 weight."""
    from k3lab.boundaries import dense
    from k3lab.config import preset

    cfg = preset("tiny")
    b = dense.BOUNDARY
    bf16 = b.make_inputs(cfg, device, 0, M=1, shape=shape)
    e4m3 = b.make_inputs(cfg, device, 0, M=1, shape=shape, weight_format="e4m3")
    w, scale = e4m3["weight"], e4m3["kwargs"]["weight_scale"]
    assert w.dtype == torch.float8_e4m3fn and scale.shape == (w.shape[0],)
    assert dense.bytes_moved(bf16) - dense.bytes_moved(e4m3) == w.numel() - scale.nbytes
    for fn in (dense.fused, dense.reference):
        out = fn(e4m3)
        dense.check(out, out, e4m3)  # raises when off the truth
    with pytest.raises(AssertionError):  # the check can fail: an output off by one
        dense.check(dense.fused(bf16) + 1.0, None, e4m3)
    for bad in ("moe.shared_gate_up", "kda.in_proj"):
        with pytest.raises(ValueError, match="weight_format: 'e4m3' serves"):
            b.make_inputs(cfg, device, 0, shape=bad, weight_format="e4m3")
    with pytest.raises(ValueError, match="weight_format: expected one of"):
        b.make_inputs(cfg, device, 0, shape=shape, weight_format="fp8")
