"""The AttnRes read as the dense GEMV's prologue (``dense_gemv(read_input=...)``,
kernels/dense/mix.py): the projection of the read's h_normed, mixed from the sums its producer
left, against the same projection of the mix launch's h_normed (one GEMV input, so its output
within a bf16 ulp) and of the fp32 reference read; merged, gated and several-token
projections, the next read's sums zeroed, bad input named; GPU: K3 tp 8's KDA input
projection over CUDA-graph replays."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_attn_res_sums import _case as _sums_case
from test_attn_res_sums import _tiling

from k3lab.kernels import GemvConfig, attn_res_norm_from_sums, dense_gemv, read_input, read_sums
from k3lab.reference.attn_res import attn_res_norm_reference

# the mix launch's h_normed and the prologue's are the same values (same sums, same weights and
# rstd), so the two projections agree but for their fp32 sums' order: a bf16 ulp of the output.
# Against the reference read, h_normed is within two bf16 ulps (tests/kernels/
# test_attn_res_sums.py), so the projection within 2^-6 of sum_k |w_k| |x_k| per output.
ULP = 2.0 ** -7


def _case(n, m, hidden, rows, device, seed=0):
    """test_attn_res_sums' case (its GEMV's weight is wp here), and the consumer's weight w."""
    c = _sums_case(n, m, hidden, 48, device, seed)
    c["wp"] = c.pop("w")
    g = torch.Generator(device="cpu").manual_seed(seed + 1)
    c["w"] = (torch.randn(rows, hidden, generator=g) * hidden ** -0.5).to(device).bfloat16()
    return c


def _produce(c, slot_cols=16):
    sums = read_sums(c["bank"], c["rn"], c["rp"], slot_cols=slot_cols)
    live = dense_gemv(c["x"], c["wp"], residual=c["res"], read_sums=sums,
                      config=_tiling(8 if c["x"].shape[0] == 1 else 16))
    return sums, live


def _check(c, y, via_launch, live, w=None, **kw):
    """y against the projection of the mix launch's h_normed and of the reference read."""
    w = c["w"] if w is None else w
    rhn = attn_res_norm_reference(c["bank"], live, c["rn"], c["rp"], c["nw"])[1].float()
    truth = rhn @ w.float().T
    bound = (rhn.abs() @ w.float().abs().T) * 2.0 ** -6 + 1e-3
    if kw.get("activation"):  # gate and up halves: compare the halves, the activation after
        return
    assert ((y.float() - truth).abs() <= bound + ULP * truth.abs()).all()
    torch.testing.assert_close(y.float(), via_launch.float(), atol=1e-3, rtol=ULP)


CASES = [  # (sealed rows, tokens, hidden, rows, block_n, split_k)
    (0, 1, 96, 40, 8, 1),
    (1, 1, 200, 24, 8, 1),
    (3, 1, 130, 33, 16, 2),
    (8, 1, 264, 16, 8, 1),
    (4, 3, 72, 48, 16, 1),
    (2, 16, 64, 32, 16, 1),
]


@pytest.mark.parametrize("n,m,hidden,rows,block_n,split_k", CASES,
                         ids=[f"N{c[0]}-M{c[1]}-H{c[2]}-R{c[3]}-S{c[5]}" for c in CASES])
def test_matches_the_mix_launch_and_the_reference(device, n, m, hidden, rows, block_n, split_k):
    c = _case(n, m, hidden, rows, device)
    sums, live = _produce(c)
    clear = torch.full((100,), 7.0, device=device)
    y = dense_gemv(live, c["w"], config=_tiling(block_n, split_k),
                   read_input=read_input(sums, c["nw"], clear=clear))
    hn = attn_res_norm_from_sums(sums, live, c["nw"])[1]
    _check(c, y, dense_gemv(hn, c["w"], config=_tiling(block_n, split_k)), live)
    assert int(clear.count_nonzero()) == 0  # the next read's sums zeroed
    assert int(sums.buffer.count_nonzero()) > 0  # its own left for the mix launch above


def test_merged_and_gated_projections(device):
    """Merged outputs (splits) and a gated projection (both halves' K loops mix)."""
    c = _case(2, 1, 96, 40, device, seed=3)
    sums, live = _produce(c)
    hn = attn_res_norm_from_sums(sums, live, c["nw"])[1]
    ri = read_input(sums, c["nw"])
    got = dense_gemv(live, c["w"], splits=[8, 31, 1], config=_tiling(8), read_input=ri)
    want = dense_gemv(hn, c["w"], splits=[8, 31, 1], config=_tiling(8))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=ULP)
    got = dense_gemv(live, c["w"], splits=[16, 24], activation="silu", config=_tiling(8),
                     read_input=ri)  # plain rows, then gate/up rows
    want = dense_gemv(hn, c["w"], splits=[16, 24], activation="silu", config=_tiling(8))
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=ULP)
    got = dense_gemv(live, c["w"], activation="silu", config=_tiling(8), read_input=ri)
    want = dense_gemv(hn, c["w"], activation="silu", config=_tiling(8))
    torch.testing.assert_close(got.float(), want.float(), atol=1e-3, rtol=ULP)


@pytest.mark.interpreter
@settings(max_examples=6, deadline=None)
@given(n=st.integers(0, 6), m=st.integers(1, 3), hidden=st.integers(17, 140),
       rows=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_property_any_depth_and_shape(n, m, hidden, rows, seed):
    """Any depth, token count and awkward sizes: the projection of the read, as above."""
    c = _case(n, m, hidden, rows, "cpu", seed=seed)
    sums, live = _produce(c, slot_cols=16)
    block_n = 8 if m == 1 else 16
    y = dense_gemv(live, c["w"], config=_tiling(block_n), read_input=read_input(sums, c["nw"]))
    hn = attn_res_norm_from_sums(sums, live, c["nw"])[1]
    _check(c, y, dense_gemv(hn, c["w"], config=_tiling(block_n)), live)


def test_bad_input_is_named(device):
    c = _case(2, 1, 64, 16, device)
    sums, live = _produce(c)
    ri = read_input(sums, c["nw"])
    with pytest.raises(ValueError, match="read_input: expected a ReadInput"):
        dense_gemv(live, c["w"], read_input=sums)
    with pytest.raises(ValueError, match="read_input: the read's norm is the prologue"):
        dense_gemv(live, c["w"], read_input=ri, norm_weight=c["nw"])
    with pytest.raises(ValueError, match=r"read_input: x is the read's live sum"):
        dense_gemv(live[:, :32].contiguous(), c["w"][:, :32].contiguous(), read_input=ri)
    with pytest.raises(ValueError, match=r"read_input: x is the read's live sum"):
        dense_gemv(live.float(), c["w"], read_input=ri)
    with pytest.raises(ValueError, match="config: wait_last reads x before the wait"):
        dense_gemv(live, c["w"], read_input=ri,
                   config=GemvConfig(block_n=8, pdl=True, wait_last=True))
    stored = read_sums(c["bank"], c["rn"], c["rp"], slot_cols=8, atomic=False)
    with pytest.raises(ValueError, match="sums: a projection's read takes atomic sums"):
        read_input(stored, c["nw"])
    with pytest.raises(ValueError, match="clear: the read's own sums"):
        read_input(sums, c["nw"], clear=sums.buffer)
    with pytest.raises(ValueError, match="clear: expected None or a contiguous fp32"):
        read_input(sums, c["nw"], clear=torch.zeros(8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="eps"):
        read_input(sums, c["nw"], eps=0.0)
    with pytest.raises(ValueError, match="norm_weight"):
        read_input(sums, c["nw"][:10])


@pytest.mark.gpu
def test_gpu_k3_tp8_kda_input_projection_graph():
    """K3 tp 8's merged KDA input projection at its call tiling capped at 128 registers (the
    stack's), mixing 1 and 5 sealed rows, inside a CUDA graph: every replay within a bf16 ulp
    of the mix launch's projection (atomic sums: not bitwise), the next sums zeroed each time."""
    from dataclasses import replace

    from k3lab.kernels.dense import call_config
    dev = "cuda"
    splits = [1536, 1536, 1536, 128, 12, 1536]
    for n in (1, 5):
        c = _case(n, 1, 7168, sum(splits), dev, seed=n)
        config = replace(call_config(None, 1, sum(splits), 7168), max_registers=128)
        sums = read_sums(c["bank"], c["rn"], c["rp"])
        clear = torch.zeros(4096, device=dev)
        ri = read_input(sums, c["nw"], clear=clear)
        live = torch.empty(1, 7168, dtype=torch.bfloat16, device=dev)

        def step():
            sums.buffer.zero_()
            live.copy_(dense_gemv(c["x"], c["wp"], residual=c["res"], read_sums=sums))
            return dense_gemv(live, c["w"], splits=splits, config=config, read_input=ri)

        outs = step()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step()
        for _ in range(3):
            clear.fill_(1.0)
            graph.replay()
            torch.cuda.synchronize()
            assert int(clear.count_nonzero()) == 0
            hn = attn_res_norm_from_sums(sums, live, c["nw"])[1]
            want = dense_gemv(hn, c["w"], splits=splits)
            for a, b in zip(outs, want, strict=True):
                torch.testing.assert_close(a.float(), b.float(), atol=2e-3, rtol=ULP)
