"""Synthetic weights and MXFP4 packing."""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from k3lab.config import preset
from k3lab.kernels.mxfp4 import (
    E2M1_VALUES,
    MXFP4,
    mxfp4_dequantize,
    mxfp4_layout,
    mxfp4_quantize,
    mxfp4_tiled_codes,
)
from k3lab.weights import kda_weights, make_generator, mla_cache, moe_weights, router_weights


def _representable(rows, groups, gen):
    """A tensor whose every element is an E2M1 value times its group's power-of-two scale."""
    table = torch.tensor(E2M1_VALUES)
    codes = torch.randint(0, 8, (rows, groups, 32), generator=gen)
    sign = torch.randint(0, 2, (rows, groups, 32), generator=gen) * 2 - 1
    codes[..., 0] = 7  # every group holds its max magnitude 6 so the scale is recovered exactly
    scale = torch.exp2(torch.randint(-10, 10, (rows, groups, 1), generator=gen).float())
    return (table[codes] * sign * scale).reshape(rows, groups * 32)


@pytest.mark.parametrize("rows,groups", [(1, 1), (3, 5), (17, 12)], ids=lambda v: str(v))
def test_mxfp4_round_trip_exact_on_representable_values(rows, groups):
    w = _representable(rows, groups, torch.Generator().manual_seed(rows * 7 + groups))
    q = mxfp4_quantize(w)
    assert q.packed.dtype == torch.uint8 and q.packed.shape == (rows, groups * 16)
    assert q.scales.shape == (rows, groups) and q.shape == (rows, groups * 32)
    assert torch.equal(mxfp4_dequantize(q), w)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(1, 4), st.floats(1e-3, 1e3), st.integers(0, 2**31 - 1))
def test_mxfp4_error_is_bounded(rows, groups, std, seed):
    w = torch.randn(rows, groups * 32, generator=torch.Generator().manual_seed(seed)) * std
    d = mxfp4_quantize(w).dequantize()
    amax = w.reshape(rows, groups, 32).abs().amax(-1, keepdim=True)
    scale = torch.exp2(torch.floor(torch.log2(amax)) - 2)
    # Rounding error is at most half the E2M1 step at that magnitude (step 2 between 4 and 6 ->
    # 1 scale unit); saturation above 6 * scale loses at most (8 - 6) * scale.
    err = (d - w).reshape(rows, groups, 32).abs()
    assert (err <= 2.0 * scale + 1e-12).all()


def test_mxfp4_nibble_order_even_element_low():
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 1.0, -6.0  # amax 6 -> scale 1: codes 2 (1.0) and 8|7 (-6.0)
    q = mxfp4_quantize(w)
    assert int(q.packed[0, 0]) == (2 | (15 << 4))
    assert int(q.scales[0, 0]) == 127


def test_mxfp4_needs_groups_of_32():
    with pytest.raises(ValueError, match="multiple of 32"):
        mxfp4_quantize(torch.zeros(2, 48))


def test_mxfp4_tiled_layout_order_and_round_trip():
    """The tiled layout: 16-byte pieces (one group of one row) of each 16-row x 256-column block
    stored as [row half, step half, row, quarter], blocks in (row tile, step) order; the row
    layout comes back exactly, and the values are the row layout's."""
    n, k = 32, 512
    q = mxfp4_quantize(torch.randn(2, n, k, generator=torch.Generator().manual_seed(0)))
    t = mxfp4_layout(q, "tiled")
    assert t.layout == "tiled" and t.scales is q.scales and t.packed.shape == q.packed.shape
    assert not torch.equal(t.packed, q.packed)
    assert torch.equal(mxfp4_dequantize(t), mxfp4_dequantize(q))
    assert torch.equal(mxfp4_layout(t, "rows").packed, q.packed)
    assert mxfp4_layout(t, "tiled") is t
    piece = t.packed.reshape(2, -1, 16)  # [E, pieces, 16 bytes]
    for row, grp in [(0, 0), (0, 7), (9, 2), (17, 13), (31, 15)]:
        step, g8 = divmod(grp, 8)
        rr = row % 16
        at = (((row // 16) * (k // 256) + step) * 4 + rr // 8 * 2 + g8 // 4) * 32 + rr % 8 * 4 \
            + g8 % 4
        assert torch.equal(piece[1, at], q.packed[1, row, 16 * grp:16 * grp + 16]), (row, grp)


def test_mxfp4_tiled_layout_bad_input():
    with pytest.raises(ValueError, match="packed: the tiled layout needs .* N a multiple of 16"):
        mxfp4_tiled_codes(torch.zeros(24, 128, dtype=torch.uint8))
    with pytest.raises(ValueError, match="K of 256"):
        mxfp4_tiled_codes(torch.zeros(16, 64, dtype=torch.uint8))
    q = mxfp4_quantize(torch.randn(16, 256))
    with pytest.raises(ValueError, match="layout: expected one of"):
        mxfp4_layout(q, "cols")
    with pytest.raises(ValueError, match="layout: expected one of"):
        MXFP4(q.packed, q.scales, "swizzled")


def test_weights_are_deterministic_from_the_seed():
    cfg = preset("tiny")
    a = kda_weights(cfg, make_generator(3, "cpu"))
    b = kda_weights(cfg, make_generator(3, "cpu"))
    c = kda_weights(cfg, make_generator(4, "cpu"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["q_proj"], c["q_proj"])


def test_moe_weights_shapes_at_k3_tp8_are_the_sharded_expert():
    cfg = preset("kimi-k3", 8)
    w = moe_weights(cfg.__class__(**{**cfg.__dict__, "n_experts": 2}), make_generator(0, "cpu"),
                    expert_format="mxfp4")
    assert isinstance(w["w13"], MXFP4) and w["w13"].shape == (2, 768, 3584)
    assert w["w2"].shape == (2, 3584, 384) and w["w2"].scales.shape == (2, 3584, 12)
    assert w["shared_w13"].shape == (2 * 768, 7168)


def test_router_logits_give_a_non_degenerate_top_k():
    cfg = preset("kimi-k3")
    gen = make_generator(0, "cpu")
    w = router_weights(cfg, gen)
    x = torch.randn(8, cfg.hidden, generator=torch.Generator().manual_seed(1))
    s = torch.sigmoid(x @ w["gate_weight"].float().T)
    top = s.topk(cfg.top_k, dim=-1).values
    # scores spread over (0, 1) and the chosen experts differ between tokens
    assert 0.05 < float(s.std()) < 0.45
    ids = (s + w["correction_bias"]).topk(cfg.top_k, dim=-1).indices
    assert len(set(ids.flatten().tolist())) > 2 * cfg.top_k
    assert float(top.min()) > float(s.median())


def test_mla_cache_rejects_lengths_out_of_range():
    with pytest.raises(ValueError, match="seq_lens"):
        mla_cache(preset("tiny"), 2, 16, [4, 17], make_generator(0, "cpu"))
    c = mla_cache(preset("tiny"), 2, 16, [4, 16], make_generator(0, "cpu"))
    assert c["kv_cache"].shape == (2, 16, 80) and c["seq_lens"].dtype == torch.int32
    assert math.isclose(float(c["kv_cache"].float().pow(2).mean()), 1.0, rel_tol=0.1)
