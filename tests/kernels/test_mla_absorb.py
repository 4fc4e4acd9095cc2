"""MLA decode's neighbours (kernels/mla_absorb.py) against the fp32 references, under the
interpreter on CPU; the same cases on the GPU, plus a graph capture."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3lab.kernels import MLAConfig, mla_absorb_out, mla_absorb_q, mla_decode
from k3lab.reference.mla import (
    mla_absorb_out_reference,
    mla_absorb_q_reference,
    mla_decode_reference,
    mla_decode_unabsorbed,
    split_kv_b,
)

# Tolerance, derived as for the dense GEMV: each output is one bf16 rounding of an fp32 sum
# (2^-8 relative on the GPU; the interpreter's cast truncates: 2^-7), the sum's fp32 error is
# at most about n * 2^-24 of sum |terms| (n <= 512 terms: below 2^-14, bounded by 2^-12). The
# gate multiplies by sigmoid in (0, 1) after the sum, so the bound scales with it.
BF16_OUT = 2.0 ** -7
FP32_SUM = 2.0 ** -12


def _close(name, got, want, terms):
    err = (got.float().cpu() - want.float().cpu()).abs()
    bound = BF16_OUT * want.float().cpu().abs() + FP32_SUM * terms.cpu() + 1e-6
    assert torch.isfinite(got.float()).all(), name
    assert (err <= bound).all(), f"{name}: max excess {(err - bound).max().item():.3g}"


def _inputs(m, heads, nope, r, v, c, l_max, seed, device, *, scale=1.0):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape, s=1.0):
        return (torch.randn(*shape, generator=gen) * s).to(device)

    q = rnd(m, heads, nope + r, s=scale).bfloat16()
    kv = rnd(m, c + r, s=scale).bfloat16()
    norm = (torch.rand(c, generator=gen) * 0.4 + 0.8).to(device)
    kv_b = rnd(heads * (nope + v), c, s=c ** -0.5).bfloat16()
    pos = torch.randint(0, l_max, (m,), generator=gen).to(device)
    cache = rnd(m, l_max, c + r).bfloat16()
    return q, kv, norm, kv_b, pos, cache


def _rotation_terms(x):
    """|x1| + |x2| on both halves: the scale of a rotated pair's fp32 error (cos and sin to an
    ulp or so), which a cancellation leaves in an output near zero."""
    a = x.float().abs()
    half = a.shape[-1] // 2
    s = a[..., :half] + a[..., half:]
    return torch.cat([s, s], -1).cpu()


def _check_q(m, heads, nope, r, v, c, l_max, seed, device, rope, scale=1.0):
    q, kv, norm, kv_b, pos, cache = _inputs(m, heads, nope, r, v, c, l_max, seed, device,
                                            scale=scale)
    lens = torch.zeros(m, dtype=torch.int32, device=device)
    cache_ref, lens_ref = cache.clone(), lens.clone()
    kw = dict(qk_nope=nope, v_head=v, eps=1e-6, rope=rope)
    q_lat, q_rope = mla_absorb_q(q, kv, norm, kv_b, pos, cache, lens, **kw)
    want_lat, want_rope = mla_absorb_q_reference(q, kv, norm, kv_b, pos, cache_ref, lens_ref,
                                                 **kw)
    assert q_lat.dtype == q_rope.dtype == cache.dtype
    w_uk, _ = split_kv_b(kv_b.float(), heads, nope, v)
    terms = torch.einsum("mhn,hnc->mhc", q[..., :nope].float().abs(), w_uk.abs())
    _close("q_lat", q_lat, want_lat, terms)
    _close("q_rope", q_rope, want_rope, _rotation_terms(q[..., nope:]))
    assert torch.equal(lens, lens_ref) and torch.equal(lens.long(), pos + 1)
    rows = torch.arange(m, device=device)
    untouched = torch.ones(cache.shape[:2], dtype=torch.bool, device=device)
    untouched[rows, pos] = False
    assert torch.equal(cache[untouched], cache_ref[untouched])  # no other row written
    _close("cache row", cache[rows, pos], cache_ref[rows, pos],
           torch.cat([torch.zeros(m, c), _rotation_terms(kv[:, c:]).cpu()], -1))


CASES = [  # id, M, heads, nope, R, V, C
    ("tiny", 1, 6, 32, 16, 32, 64),
    ("K3-tp8", 1, 12, 128, 64, 128, 512),
    ("odd-sizes", 3, 5, 24, 6, 40, 100),
    ("no-rope-columns", 2, 3, 16, 0, 8, 48),
]


@pytest.mark.parametrize("rope", [False, True], ids=["no-rope", "rope"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_absorb_q(case, rope, device):
    _, m, heads, nope, r, v, c = case
    _check_q(m, heads, nope, r, v, c, 40, 1, device, rope)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_absorb_out(case, device):
    _, m, heads, nope, _, v, c = case
    gen = torch.Generator().manual_seed(2)
    o_lat = torch.randn(m, heads, c, generator=gen).bfloat16().to(device)
    kv_b = (torch.randn(heads * (nope + v), c, generator=gen) * c ** -0.5).bfloat16().to(device)
    g = (torch.randn(m, heads * v, generator=gen) * 3).bfloat16().to(device)
    got = mla_absorb_out(o_lat, kv_b, g, qk_nope=nope, v_head=v)
    want = mla_absorb_out_reference(o_lat, kv_b, g, qk_nope=nope, v_head=v)
    _, w_uv = split_kv_b(kv_b.float(), heads, nope, v)
    terms = torch.einsum("mhc,hvc->mhv", o_lat.float().abs(), w_uv.abs()).reshape(m, -1)
    _close("o", got, want, terms * torch.sigmoid(g.float()))
    assert mla_absorb_out(o_lat, kv_b, g, qk_nope=nope, v_head=v,
                          out_dtype=torch.float32).dtype == torch.float32


def test_absorbed_pair_is_mla(device):
    """Independent of the absorbed algebra: the two kernels around the absorbed reference
    attention give what per-head keys and values through SDPA give (mla_decode_unabsorbed)."""
    m, heads, nope, r, v, c, l_max = 2, 4, 32, 16, 32, 64, 24
    q, kv, norm, kv_b, pos, cache = _inputs(m, heads, nope, r, v, c, l_max, 3, device)
    lens = torch.zeros(m, dtype=torch.int32, device=device)
    q_lat, q_rope = mla_absorb_q(q, kv, norm, kv_b, pos, cache, lens, qk_nope=nope, v_head=v,
                                 eps=1e-6)
    scale = (nope + r) ** -0.5
    o_lat = mla_decode_reference(q_lat.float(), q_rope.float(), cache, lens, sm_scale=scale)
    g = torch.full((m, heads * v), 30.0, device=device)  # sigmoid(30) = 1 - 1e-13
    got = mla_absorb_out(o_lat, kv_b, g, qk_nope=nope, v_head=v, out_dtype=torch.float32)
    w_uk, w_uv = split_kv_b(kv_b.float(), heads, nope, v)
    want = mla_decode_unabsorbed(q[..., :nope].float(), q_rope.float(), cache, lens, w_uk, w_uv,
                                 sm_scale=scale).reshape(m, -1)
    # q_lat is rounded to bf16 before the attention (relative 2^-8 of each score term)
    assert torch.allclose(got.cpu(), want.float().cpu(), atol=3e-2, rtol=3e-2)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(m=st.integers(1, 4), heads=st.integers(1, 5), nope=st.integers(1, 40),
       half=st.integers(0, 9), v=st.integers(1, 40), c=st.integers(2, 130),
       scale=st.sampled_from([1e-2, 1.0, 30.0]), rope=st.booleans(), seed=st.integers(0, 999))
def test_property_any_shape(m, heads, nope, half, v, c, scale, rope, seed):
    """Any head count and widths (not multiples of a block), tiny and large values."""
    _check_q(m, heads, nope, 2 * half, v, c, 7, seed, _DEVICE, rope, scale)


# the property test's device (hypothesis runs the body many times; a fixture would be reused)
_DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _bad_q(device, **change):
    q, kv, norm, kv_b, pos, cache = _inputs(1, 2, 8, 4, 8, 16, 5, 0, device)
    args = dict(q=q, kv=kv, kv_a_norm=norm, kv_b=kv_b, position=pos, kv_cache=cache,
                seq_lens=torch.zeros(1, dtype=torch.int32, device=device), qk_nope=8,
                v_head=8, eps=1e-6, validate="full")  # full: positions checked on the GPU too
    args.update({k: v.to(device) if isinstance(v, torch.Tensor) else v
                 for k, v in change.items()})
    return args


BAD_Q = [
    (dict(q=torch.zeros(1, 2, 12)), "q: expected dtype"),
    (dict(q=torch.zeros(1, 2, 13).bfloat16()), "even R"),
    (dict(kv=torch.zeros(2, 20).bfloat16()), "kv: expected"),
    (dict(kv_a_norm=torch.ones(15)), "kv_a_norm"),
    (dict(kv_b=torch.zeros(31, 16).bfloat16()), "kv_b: expected"),
    (dict(position=torch.zeros(1, dtype=torch.float32)), "position: expected dtype"),
    (dict(position=torch.tensor([5])), r"position: expected cache rows in \[0, L_max=5\)"),
    (dict(position=torch.tensor([-1])), "position: expected cache rows"),
    (dict(kv_cache=torch.zeros(1, 5, 19).bfloat16()), "kv_cache: expected"),
    (dict(seq_lens=torch.zeros(1, dtype=torch.int64)), "seq_lens: expected dtype"),
    (dict(eps=0.0), "eps"),
    (dict(qk_nope=0), "qk_nope"),
    (dict(v_head=True), "v_head"),
]


@pytest.mark.parametrize("change,match", BAD_Q, ids=[m for _, m in BAD_Q])
def test_absorb_q_bad_input(change, match, device):
    with pytest.raises(ValueError, match=match):
        mla_absorb_q(**_bad_q(device, **change))


def test_absorb_out_bad_input(device):
    o_lat = torch.zeros(1, 2, 16, device=device).bfloat16()
    kv_b = torch.zeros(32, 16, device=device).bfloat16()
    g = torch.zeros(1, 16, device=device).bfloat16()
    with pytest.raises(ValueError, match="kv_b: expected"):
        mla_absorb_out(o_lat, kv_b[:30], g, qk_nope=8, v_head=8)
    with pytest.raises(ValueError, match="g: expected"):
        mla_absorb_out(o_lat, kv_b, g[:, :15], qk_nope=8, v_head=8)
    with pytest.raises(ValueError, match="out_dtype"):
        mla_absorb_out(o_lat, kv_b, g, qk_nope=8, v_head=8, out_dtype=torch.float16)
    with pytest.raises(ValueError, match="o_lat: expected a contiguous"):
        mla_absorb_out(torch.zeros(1, 2, 32, device=device).bfloat16()[..., :16], kv_b, g,
                       qk_nope=8, v_head=8)


@pytest.mark.gpu
def test_gpu_in_graph_and_bad_position():
    """Both launches captured in a CUDA graph and replayed at a new position; a position past
    the cache writes nothing and leaves a length the attention refuses with NaN."""
    dev = torch.device("cuda")
    m, heads, nope, r, v, c, l_max = 1, 12, 128, 64, 128, 512, 64
    q, kv, norm, kv_b, pos, cache = _inputs(m, heads, nope, r, v, c, l_max, 4, dev)
    lens = torch.zeros(m, dtype=torch.int32, device=dev)
    g = torch.randn(m, heads * v, device=dev).bfloat16()
    kw = dict(qk_nope=nope, v_head=v, eps=1e-6)
    mla_absorb_q(q, kv, norm, kv_b, pos, cache, lens, **kw)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q_lat, q_rope = mla_absorb_q(q, kv, norm, kv_b, pos, cache, lens, **kw)
        o = mla_absorb_out(q_lat, kv_b, g, qk_nope=nope, v_head=v)
    pos.fill_(l_max - 1)
    graph.replay()
    ref_cache, ref_lens = cache.clone(), lens.clone()
    want, _ = mla_absorb_q_reference(q, kv, norm, kv_b, pos, ref_cache, ref_lens, **kw)
    assert int(lens[0]) == l_max
    _close("q_lat", q_lat, want, want.abs() * 0 + want.abs().max())
    torch.testing.assert_close(o.float(), mla_absorb_out_reference(q_lat, kv_b, g, qk_nope=nope,
                                                                   v_head=v), atol=2e-2,
                               rtol=2e-2)
    before = cache.clone()
    pos.fill_(l_max)
    graph.replay()
    assert torch.equal(cache, before) and int(lens[0]) == -1


def test_absorb_config(device):
    """``MLAConfig.absorb_pdl`` changes how the two launch, not what they compute (the
    interpreter runs them plainly); anything but an MLAConfig is refused by name."""
    m, heads, nope, r, v, c, l_max = 1, 3, 16, 8, 16, 32, 6
    q, kv, norm, kv_b, pos, cache = _inputs(m, heads, nope, r, v, c, l_max, 5, device)
    g = torch.randn(m, heads * v).bfloat16().to(device)
    kw = dict(qk_nope=nope, v_head=v, eps=1e-6)
    outs = []
    for config in (MLAConfig(absorb_pdl=False), None):
        cache_c, lens = cache.clone(), torch.zeros(m, dtype=torch.int32, device=device)
        q_lat, q_rope = mla_absorb_q(q, kv, norm, kv_b, pos, cache_c, lens, **kw, config=config)
        o = mla_absorb_out(q_lat, kv_b, g, qk_nope=nope, v_head=v, config=config)
        outs.append((q_lat, q_rope, cache_c, lens, o))
    for a, b in zip(*outs, strict=True):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="config: expected an MLAConfig"):
        mla_absorb_q(q, kv, norm, kv_b, pos, cache, lens, **kw, config={"absorb_pdl": True})
    with pytest.raises(ValueError, match="config: expected an MLAConfig"):
        mla_absorb_out(q_lat, kv_b, g, qk_nope=nope, v_head=v, config=MLAConfig)
    with pytest.raises(ValueError, match="absorb_pdl: expected a bool"):
        MLAConfig(absorb_pdl=1)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 8])
def test_gpu_absorb_pdl_chain_keeps_the_bits(num_splits):
    """q absorb, attention and v absorb by PDL (each absorb's kv_b tile loaded before its
    wait), captured after a kernel that writes q, kv and g, replayed over fresh inputs: the
    same bits as the plain launches, one split (its kernel lets the v absorb launch) or a
    combine."""
    dev = torch.device("cuda")
    m, heads, nope, r, v, c, l_max = 1, 12, 128, 64, 128, 512, 512
    q, kv, norm, kv_b, pos, cache = _inputs(m, heads, nope, r, v, c, l_max, 6, dev)
    pos.fill_(l_max - 1)
    g = torch.randn(m, heads * v, device=dev).bfloat16()
    src = [t.clone() for t in (q, kv, g)]
    kw = dict(qk_nope=nope, v_head=v, eps=1e-6)
    outs = {}
    for pdl in (False, True):
        config = MLAConfig(absorb_pdl=pdl, split_pdl=pdl)
        cache_c, lens = cache.clone(), torch.zeros(m, dtype=torch.int32, device=dev)

        def step(cache_c=cache_c, lens=lens, config=config):
            for t, s in zip((q, kv, g), src, strict=True):  # the previous grid writes them
                t.copy_(s * 1.5)
            q_lat, q_rope = mla_absorb_q(q, kv, norm, kv_b, pos, cache_c, lens, **kw,
                                         config=config)
            o_lat = mla_decode(q_lat, q_rope, cache_c, lens, sm_scale=0.07,
                               num_splits=num_splits, config=config)
            return mla_absorb_out(o_lat, kv_b, g, qk_nope=nope, v_head=v, config=config)

        step()
        for t in (q, kv, g):
            t.zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o = step()
        for t in (q, kv, g):
            t.zero_()
        graph.replay()
        torch.cuda.synchronize()
        outs[pdl] = (o.clone(), cache_c.clone(), lens.clone())
    for a, b in zip(outs[False], outs[True], strict=True):
        assert torch.equal(a, b)
    assert outs[True][0].abs().sum() > 0
