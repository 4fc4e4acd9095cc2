"""The AttnRes read from its producer's sums (kernels/attn_res_sums.py): the dense GEMV's
epilogue leaves the sums, the read mixes; against the fp32 reference of the read over the
GEMV's own output, atomic and stored slots, clearing, bad input; GPU: K3's output projection."""

import pytest
import torch

from k3lab.kernels import GemvConfig, attn_res_norm_from_sums, dense_gemv, read_sums
from k3lab.kernels.attn_res import MAX_SEALED
from k3lab.kernels.attn_res_sums import sums_numel
from k3lab.kernels.dense import default_config
from k3lab.reference.attn_res import attn_res_norm_reference

# As tests/kernels/test_attn_res.py: h within one bf16 ulp of the fp32 mixture (the sums added
# in another order), h_normed two (its sum of squares is p^T G p, taken before h's rounding).
H_ATOL, H_RTOL = 1e-3, 2.0 ** -7
H_NORMED_ATOL, H_NORMED_RTOL = 1e-3, 2.0 ** -6


def _tiling(block_n, split_k=1):
    return GemvConfig(block_n=block_n, block_k=64, split_k=split_k, num_stages=1, pdl=False,
                      prefetch_steps=0)


def _case(n, m, hidden, k, device, seed=0):
    g = torch.Generator(device="cpu").manual_seed(seed)

    def r(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(device)

    # sealed rows of mixed sign and size, two of them equal (ties), one near zero
    bank = r(n, m, hidden, scale=2.0)
    if n >= 3:
        bank[1] = bank[0]
        bank[2] *= 1e-3
    return dict(bank=bank.bfloat16(), x=r(m, k).bfloat16(),
                w=r(hidden, k, scale=k ** -0.5).bfloat16(), res=r(m, hidden).bfloat16(),
                rn=(r(hidden).abs() + 0.5), rp=r(hidden).bfloat16(),
                nw=(r(hidden).abs() + 0.5).bfloat16())


def _run(c, *, slot_cols, atomic, block_n, split_k=1, norm=None, clear=None, residual=True):
    sums = read_sums(c["bank"], c["rn"], c["rp"], slot_cols=slot_cols, atomic=atomic)
    kw = dict(residual=c["res"] if residual else None, norm_weight=norm,
              config=_tiling(block_n, split_k))
    live = dense_gemv(c["x"], c["w"], read_sums=sums, **kw)
    assert torch.equal(live, dense_gemv(c["x"], c["w"], **kw))  # the output is untouched
    h, hn = attn_res_norm_from_sums(sums, live, c["nw"], return_h=True, clear=clear)
    return live, h, hn, sums


def _check(c, live, h, hn):
    rh, rhn = attn_res_norm_reference(c["bank"], live, c["rn"], c["rp"], c["nw"])
    torch.testing.assert_close(h.float(), rh.float(), atol=H_ATOL, rtol=H_RTOL)
    torch.testing.assert_close(hn.float(), rhn.float(), atol=H_NORMED_ATOL, rtol=H_NORMED_RTOL)


CASES = [  # (sealed rows, tokens, hidden, K, slot_cols, atomic, block_n)
    (0, 1, 96, 64, 32, True, 8),
    (1, 1, 37, 40, 8, False, 8),
    (3, 1, 200, 48, 64, True, 16),
    (8, 1, 520, 72, 512, True, 8),
    (8, 2, 130, 40, 16, False, 16),
    (4, 3, 72, 33, 16, True, 16),
    (MAX_SEALED, 1, 48, 16, 16, True, 8),
]


@pytest.mark.parametrize("n,m,hidden,k,slot_cols,atomic,block_n", CASES,
                         ids=[f"N{c[0]}-M{c[1]}-H{c[2]}-{'atomic' if c[5] else 'stored'}"
                              for c in CASES])
def test_matches_reference(device, n, m, hidden, k, slot_cols, atomic, block_n):
    c = _case(n, m, hidden, k, device)
    _check(c, *_run(c, slot_cols=slot_cols, atomic=atomic, block_n=block_n)[:3])


def test_split_k_norm_and_no_residual(device):
    """The split-K GEMV's last program leaves the sums; with the RMSNorm prologue; without a
    residual (a block's first sublayer starts the live sum)."""
    c = _case(5, 1, 64, 256, device, seed=1)
    g = (torch.rand(256, device=device) + 0.5).bfloat16()
    _check(c, *_run(c, slot_cols=16, atomic=True, block_n=8, split_k=2, norm=g)[:3])
    _check(c, *_run(c, slot_cols=8, atomic=False, block_n=8, residual=False)[:3])


def test_stored_slots_are_deterministic_and_agree_with_atomic(device):
    c = _case(6, 1, 160, 48, device, seed=2)
    a = _run(c, slot_cols=16, atomic=False, block_n=16)
    b = _run(c, slot_cols=16, atomic=False, block_n=16)
    assert torch.equal(a[3].buffer, b[3].buffer) and torch.equal(a[2], b[2])
    t = _run(c, slot_cols=64, atomic=True, block_n=16)
    torch.testing.assert_close(t[2].float(), a[2].float(), atol=H_NORMED_ATOL,
                               rtol=H_NORMED_RTOL)


def test_clear_zeroes_the_next_buffer_and_a_wrong_sum_fails(device):
    c = _case(2, 1, 100, 32, device, seed=3)
    nxt = torch.full((sums_numel(1, 100, 5, 16) + 3,), 7.0, device=device)
    live, h, hn, sums = _run(c, slot_cols=16, atomic=True, block_n=8, clear=nxt)
    assert int(nxt.count_nonzero()) == 0 and int(sums.buffer.count_nonzero()) > 0
    with pytest.raises(ValueError, match="clear: the read's own sums"):
        attn_res_norm_from_sums(sums, live, c["nw"], clear=sums.buffer)
    # the sums left by an earlier call are added into: the read is then wrong, and the check
    # says so (buffers must be zero before the producer)
    dense_gemv(c["x"], c["w"], residual=c["res"], read_sums=sums, config=_tiling(8))
    with pytest.raises(AssertionError):
        _check(c, live, *attn_res_norm_from_sums(sums, live, c["nw"], return_h=True))


def _bad_gemv(c, **kw):
    sums = kw.pop("sums", None) or read_sums(c["bank"], c["rn"], c["rp"], slot_cols=16)
    args = dict(residual=c["res"], config=_tiling(8), read_sums=sums)
    args.update(kw)
    dense_gemv(c["x"], c["w"], **args)


def test_bad_input(device):
    c = _case(2, 1, 64, 32, device)
    with pytest.raises(ValueError, match="read_sums: the output must be one bf16"):
        _bad_gemv(c, out_dtype=torch.float32)
    with pytest.raises(ValueError, match="read_sums: expected a bank of"):
        _bad_gemv(c, sums=read_sums(c["bank"][:, :, :32].contiguous(), c["rn"][:32],
                                    c["rp"][:32]))
    with pytest.raises(ValueError, match="slot_cols=12 must be a multiple"):
        _bad_gemv(c, sums=read_sums(c["bank"], c["rn"], c["rp"], slot_cols=12))
    with pytest.raises(ValueError, match="equal to it without atomic"):
        _bad_gemv(c, sums=read_sums(c["bank"], c["rn"], c["rp"], slot_cols=16, atomic=False))
    with pytest.raises(ValueError, match="read_sums: expected a ReadSums"):
        _bad_gemv(c, sums=object())
    with pytest.raises(ValueError, match="bank: expected bf16"):
        read_sums(c["bank"].float(), c["rn"], c["rp"])
    with pytest.raises(ValueError, match="at most MAX_SEALED"):
        read_sums(torch.zeros(MAX_SEALED + 1, 1, 64, dtype=torch.bfloat16, device=device),
                  c["rn"], c["rp"])
    with pytest.raises(ValueError, match="res_proj_weight: expected shape"):
        read_sums(c["bank"], c["rn"], c["rp"][:10])
    with pytest.raises(ValueError, match="slot_cols: expected a positive int"):
        read_sums(c["bank"], c["rn"], c["rp"], slot_cols=0)
    with pytest.raises(ValueError, match="buffer: expected a contiguous fp32 tensor of at"):
        read_sums(c["bank"], c["rn"], c["rp"], buffer=torch.zeros(3, device=device))
    sums = read_sums(c["bank"], c["rn"], c["rp"], slot_cols=16)
    with pytest.raises(ValueError, match=r"live: expected \[M, H\] = \[1, 64\]"):
        attn_res_norm_from_sums(sums, c["res"][:, :32], c["nw"])
    with pytest.raises(ValueError, match="sums: expected a ReadSums"):
        attn_res_norm_from_sums(c["bank"], c["res"], c["nw"])
    with pytest.raises(ValueError, match="norm_weight: expected shape"):
        attn_res_norm_from_sums(sums, c["res"], c["nw"][:5])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [0, 4, 8])
def test_gpu_k3_output_projection(n):
    """K3 tp 8's output projection [7168, 1536] at its default tiling with the sums of a read of
    n sealed rows: atomic slots within the tolerance of the fp32 reference, stored slots
    bitwise the same twice, both in a CUDA graph with the read clearing the next buffer."""
    c = _case(n, 1, 7168, 1536, "cuda", seed=4)
    block_n = default_config(1, 7168, 1536).block_n
    for atomic in (True, False):
        slot_cols = 512 if atomic else block_n
        bufs = [torch.zeros(sums_numel(1, 7168, n, slot_cols), device="cuda") for _ in range(2)]
        sums = read_sums(c["bank"], c["rn"], c["rp"], slot_cols=slot_cols, atomic=atomic,
                         buffer=bufs[0])

        def step():
            live = dense_gemv(c["x"], c["w"], residual=c["res"], read_sums=sums)
            return live, attn_res_norm_from_sums(sums, live, c["nw"], return_h=True,
                                                 clear=bufs[1])

        live, (h, hn) = step()
        _check(c, live, h, hn)
        bufs[0].zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        outs = []
        for _ in range(2):
            bufs[0].zero_()
            graph.replay()
            torch.cuda.synchronize()
            outs.append(out[1][1].clone())
            assert int(bufs[1].count_nonzero()) == 0
        _check(c, out[0], *out[1])
        if not atomic:
            assert torch.equal(outs[0], outs[1])
