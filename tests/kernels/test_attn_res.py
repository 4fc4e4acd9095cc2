"""AttnRes read + RMSNorm kernel (kernels/attn_res.py) against the fp32 reference; the per-token
schedule and a whole token replayed through every layer; AttnResConfig choices; the boundary; bad
input and bad configs; GPU: K3 sizes, one launch, no host sync, a CUDA graph of a whole token's
reads."""

import dataclasses

import pytest
import torch

from k3lab.boundaries import assert_close, get
from k3lab.config import preset
from k3lab.kernels import AttnResConfig, attn_res_norm
from k3lab.kernels.attn_res import MAX_SEALED
from k3lab.ops import ATTN_RES_OPS
from k3lab.profile import count_launches
from k3lab.reference.attn_res import (
    attn_res_norm_reference,
    replay_token,
    replay_weights,
    token_schedule,
)
from k3lab.weights import attn_res_inputs, attn_res_weights, make_generator

# Outputs are bf16 whatever the weight dtype (bf16 or fp32 weights are both read into fp32).
# h: the fp32 mixture summed in another order rounds to the neighbouring bf16 value at worst (one
# ulp, 2^-7 relative), plus a floor for values that cancel to ~0.
H_ATOL, H_RTOL = 1e-3, 2.0 ** -7
# h_normed inherits h's one-ulp difference and is rounded once more: two bf16 steps (2^-6).
H_NORMED_ATOL, H_NORMED_RTOL = 1e-3, 2.0 ** -6
# A replayed token whose sublayer outputs feed on h_normed: one-ulp differences early on are
# carried through ~2 x n_layers reads. Norm-relative error of every read's h; measured 0 at tiny,
# 4e-3 at K3 (the fp32 reference itself drifts 3e-3 from an fp64 one over 93 layers).
REPLAY_NORM_RTOL = 1e-2

TINY = preset("tiny")
K3 = preset("kimi-k3")
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _inputs(cfg, n_sealed, m, device, *, wdtype="bf16", seed=0, hidden=None):
    if hidden is not None:
        cfg = dataclasses.replace(cfg, hidden=hidden)
    gen = make_generator(seed, device)
    w = attn_res_weights(cfg, gen, dtype=WEIGHT_DTYPES[wdtype])
    x = attn_res_inputs(cfg, n_sealed, m, gen)
    return (x["bank"], x["live"], w["res_norm_weight"], w["res_proj_weight"],
            w["norm_weight"])


def _check(args, eps=1e-5, config=None):
    h, hn = attn_res_norm(*args, eps=eps, config=config)
    rh, rhn = attn_res_norm_reference(*args, eps=eps)
    M, H = args[1].shape
    for t in (h, hn):
        assert t.shape == (M, H) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert_close("h", h, rh, atol=H_ATOL, rtol=H_RTOL)
    assert_close("h_normed", hn, rhn, atol=H_NORMED_ATOL, rtol=H_NORMED_RTOL)
    return h, hn


# (id, preset, N sealed rows, M tokens, weight dtype, hidden override)
CASES = [(f"tiny-N{n}-M1-bf16", TINY, n, 1, "bf16", None) for n in range(10)] + [
    ("tiny-N0-M3-fp32", TINY, 0, 3, "fp32", None),
    ("tiny-N5-M3-fp32", TINY, 5, 3, "fp32", None),
    ("tiny-N9-M64-bf16", TINY, 9, 64, "bf16", None),
    ("tiny-N3-M64-fp32", TINY, 3, 64, "fp32", None),
    ("tiny-N16-M2-bf16", TINY, MAX_SEALED, 2, "bf16", None),    # the widest bank block
    ("H1-N2-M2-bf16", TINY, 2, 2, "bf16", 1),
    ("H37-N7-M3-fp32", TINY, 7, 3, "fp32", 37),
    ("H8200-N0-M1-bf16", TINY, 0, 1, "bf16", 8200),             # two norm-pass chunks
    ("H8200-N3-M2-fp32", TINY, 3, 2, "fp32", 8200),
    ("k3-N0-M1-bf16", K3, 0, 1, "bf16", None),
    ("k3-N1-M1-bf16", K3, 1, 1, "bf16", None),
    ("k3-N8-M1-bf16", K3, 8, 1, "bf16", None),
    ("k3-N8-M1-fp32", K3, 8, 1, "fp32", None),
    ("k3-N9-M3-bf16", K3, 9, 3, "bf16", None),
    ("k3-N5-M3-fp32", K3, 5, 3, "fp32", None),
]


@pytest.mark.parametrize("cfg,n,m,wdtype,hidden", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_matches_reference(device, cfg, n, m, wdtype, hidden):
    _check(_inputs(cfg, n, m, device, wdtype=wdtype, hidden=hidden))


# Other tilings of the one-program-per-token kernel: several H chunks a pass (narrow bank tiles,
# narrow norm chunks), fewer warps; and the split schedule at narrow chunks (many programs a
# token, a ragged last chunk).
CONFIGS = [AttnResConfig(tile_elems=1024, split_h=0),
           AttnResConfig(max_block_h=256, num_warps=4, split_h=0),
           AttnResConfig(tile_elems=4096, max_block_h=1024, num_warps=2, split_h=0),
           AttnResConfig(split_h=16, split_min_candidates=1),
           AttnResConfig(split_h=128, split_warps=2, split_min_candidates=1),
           AttnResConfig(split_h=64, split_min_candidates=6),
           AttnResConfig(split_h=0, one_chunk_elems=0),
           AttnResConfig(split_h=0, one_chunk_elems=1 << 20, one_chunk_min_candidates=1)]


@pytest.mark.parametrize("config", CONFIGS, ids=["tile1k", "h256-w4", "tile4k-h1k-w2",
                                                 "split16", "split128-w2", "split64-from6",
                                                 "no-one-chunk", "one-chunk-wide"])
@pytest.mark.parametrize("n,hidden", [(0, 37), (5, None), (9, 1000)], ids=["N0", "N5", "N9"])
def test_configs_match_reference(device, config, n, hidden):
    _check(_inputs(TINY, n, 2, device, wdtype="fp32" if n == 5 else "bf16", hidden=hidden),
           config=config)


@pytest.mark.parametrize("n", [0, 8])
def test_split_matches_one_program(device, n):
    """The split schedule (many programs a token over two launches) and the one-program kernel
    read the same candidates: each within the reference's tolerance, h within a rounding of
    each other (their fp32 sums add in different orders); the split launches are bitwise the
    same call after call (partial sums added in a fixed order)."""
    args = _inputs(K3, n, 2, device, seed=5)
    split = AttnResConfig(split_h=1024, split_min_candidates=1)
    h_s, hn_s = _check(args, config=split)
    h_1, hn_1 = _check(args, config=AttnResConfig(split_h=0))
    assert (h_s.float() - h_1.float()).abs().max() <= 2 ** -7 * h_1.float().abs().max()
    again = attn_res_norm(*args, config=split)
    assert torch.equal(again[0], h_s) and torch.equal(again[1], hn_s)
    names = count_launches(lambda a: attn_res_norm(*a, config=split), args).kernels
    assert len(names) == 2 and "sums" in names[0] and "mix" in names[1], names


@pytest.mark.parametrize("config", [AttnResConfig(split_h=0),
                                    AttnResConfig(split_min_candidates=1),
                                    AttnResConfig(split_h=0, one_chunk_elems=0)],
                         ids=["one-chunk", "split", "chunks"])
def test_return_h_false(device, config):
    """return_h=False gives h as None and the same h_normed, bit for bit, on every path."""
    args = _inputs(K3, 2, 2, device, seed=3)  # 3 candidates: the one-chunk path by default
    _, hn = _check(args, config=config)
    h_none, hn_only = attn_res_norm(*args, config=config, return_h=False)
    assert h_none is None and torch.equal(hn_only, hn)


@pytest.mark.parametrize("n,launches", [(0, 1), (1, 1), (2, 1), (3, 1), (4, 1), (5, 2), (8, 2)])
def test_default_schedule_by_depth(device, n, launches):
    """The defaults: one program below split_min_candidates candidates, the split from it."""
    assert AttnResConfig().split_min_candidates == 6
    args = _inputs(K3, n, 1, device, seed=n)
    assert count_launches(lambda a: attn_res_norm(*a), args).count == launches


def test_k3_m64(device):
    _check(_inputs(K3, 8, 64, device, seed=3))


def test_only_live_is_live(device):
    """N = 0: the softmax of one candidate is 1, so h is live bit for bit."""
    args = _inputs(TINY, 0, 3, device)
    h, _ = _check(args)
    assert torch.equal(h, args[1])


def test_eps_is_used(device):
    """A large eps changes both norms; the kernel follows the reference there too."""
    _check(_inputs(TINY, 4, 2, device), eps=0.5)


def test_strided_views(device):
    """Bank and live as views into one residual buffer with a token stride (every other token)."""
    bank, live, *w = _inputs(TINY, 5, 6, device)
    rows = torch.cat([bank, live[None]])                           # [6, 6, H]
    args = (rows[:5, ::2], rows[5, ::2], *w)
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    _check(args)


def test_tolerance_can_fail(device):
    """A read that drops the live candidate, or softmaxes the un-normalized scores, is caught."""
    bank, live, *w = _inputs(TINY, 4, 2, device)
    h, hn = attn_res_norm(bank, live, *w)
    wrong = attn_res_norm_reference(bank[:-1], bank[-1], *w)      # live left out
    with pytest.raises(AssertionError, match="h:"):
        assert_close("h", h, wrong[0], atol=H_ATOL, rtol=H_RTOL)
    ones = torch.ones_like(w[0])
    wrong = attn_res_norm_reference(bank, live, ones, w[1], w[2])  # res_norm_weight ignored
    with pytest.raises(AssertionError, match="h:"):
        assert_close("h", h, wrong[0], atol=H_ATOL, rtol=H_RTOL)


def _bad(device, **change):
    bank, live, rn, rp, nw = _inputs(TINY, 3, 2, device)
    args = dict(bank=bank, live=live, res_norm_weight=rn, res_proj_weight=rp, norm_weight=nw,
                eps=1e-5)
    for k, v in change.items():
        args[k] = v(args) if callable(v) else v
    eps, config = args.pop("eps"), args.pop("config", None)
    return_h = args.pop("return_h", True)
    return attn_res_norm(*args.values(), eps=eps, config=config, return_h=return_h)


BAD = [
    ("bank-fp32", "bank", dict(bank=lambda a: a["bank"].float())),
    ("live-fp16", "live", dict(live=lambda a: a["live"].half())),
    ("live-3d", "live", dict(live=lambda a: a["live"][None])),
    ("live-list", "live", dict(live=lambda a: a["live"].tolist())),
    ("live-M0", "live", dict(live=lambda a: a["live"][:0], bank=lambda a: a["bank"][:, :0])),
    ("bank-2d", "bank", dict(bank=lambda a: a["bank"][0])),
    ("bank-M-mismatch", "bank", dict(bank=lambda a: a["bank"][:, :1])),
    ("bank-H-mismatch", "bank", dict(bank=lambda a: a["bank"][..., :-1])),
    ("bank-too-deep", "bank",
     dict(bank=lambda a: a["bank"][:1].expand(MAX_SEALED + 1, -1, -1).contiguous())),
    ("bank-H-strided", "bank",
     dict(bank=lambda a: torch.stack([a["bank"], a["bank"]], -1).flatten(-2)[..., ::2])),
    ("live-H-strided", "live",
     dict(live=lambda a: torch.stack([a["live"], a["live"]], -1).flatten(-2)[..., ::2])),
    ("res_norm_weight-shape", "res_norm_weight", dict(res_norm_weight=lambda a: a["live"])),
    ("res_proj_weight-fp16", "res_proj_weight",
     dict(res_proj_weight=lambda a: a["res_proj_weight"].half())),
    ("norm_weight-short", "norm_weight", dict(norm_weight=lambda a: a["norm_weight"][:-1])),
    ("norm_weight-meta", "norm_weight",
     dict(norm_weight=lambda a: torch.empty_like(a["norm_weight"], device="meta"))),
    ("norm_weight-strided", "norm_weight",
     dict(norm_weight=lambda a: a["norm_weight"].repeat(2)[::2])),
    ("eps-zero", "eps", dict(eps=0.0)),
    ("eps-nan", "eps", dict(eps=float("nan"))),
    ("eps-tensor", "eps", dict(eps=lambda a: torch.tensor(1e-5))),
    ("config-dict", "config", dict(config={"num_warps": 4})),
    ("return_h-str", "return_h", dict(return_h="no")),
    ("live-meta", "live: expected a cuda", dict(**{n: lambda a, n=n: a[n].to("meta") for n in (
        "bank", "live", "res_norm_weight", "res_proj_weight", "norm_weight")})),
]


@pytest.mark.parametrize("param,change", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_input(device, param, change):
    with pytest.raises(ValueError, match=param):
        _bad(device, **change)


@pytest.mark.parametrize("field,value", [("tile_elems", 1000), ("tile_elems", 0),
                                         ("max_block_h", True), ("num_warps", 8.0),
                                         ("split_h", 100), ("split_h", -512),
                                         ("split_h", False), ("max_split_programs", 0),
                                         ("split_min_candidates", 0), ("split_pdl", None),
                                         ("split_min_candidates", True), ("pdl", 1),
                                         ("one_chunk_elems", 100), ("one_chunk_elems", True),
                                         ("one_chunk_min_candidates", 0),
                                         ("bank_before_wait", 1)])
def test_bad_config(field, value):
    with pytest.raises(ValueError, match=field):
        AttnResConfig(**{field: value})


# ---------------------------------------------------------------------------------------------
# the per-token schedule and a replayed token


def test_schedule_k3():
    reads = token_schedule(K3)
    assert len(reads) == 2 * 93 and [r.site for r in reads[:2]] == ["attn", "ffn"]
    for r in reads:
        assert r.n_sealed == 1 + r.layer // 12                     # embedding + sealed blocks
        block_start = r.layer % 12 == 0 and r.site == "attn"
        assert r.n_candidates == r.n_sealed + (0 if block_start else 1)
    counts = [r.n_candidates for r in reads]
    assert max(counts) == 9 == K3.max_attn_res_candidates
    assert counts[:3] == [1, 2, 2] and counts[-1] == 9
    # per block of 12 layers: its first read sees the sealed rows only, 23 reads add live
    for b in range(8):
        block = counts[24 * b: 24 * (b + 1)]
        assert block[0] == b + 1 and set(block[1:]) == {b + 2}


@pytest.mark.parametrize("name", ["tiny", "kimi-k3"])
def test_schedule_max_matches_preset(name):
    cfg = preset(name)
    assert max(r.n_candidates for r in token_schedule(cfg)) == cfg.max_attn_res_candidates


def test_schedule_needs_attn_res():
    with pytest.raises(ValueError, match="cfg"):
        token_schedule(preset("kimi-k2"))


def test_replay_passes_the_schedule(device):
    """Every read gets contiguous views of the residual buffer, as many rows as scheduled, and a
    sealed row never changes after sealing."""
    seen = []

    def spy(bank, live, *w, eps):
        seen.append((bank.shape[0] + 1, bank.is_contiguous() and live.is_contiguous()))
        return attn_res_norm_reference(bank, live, *w, eps=eps)

    out = replay_token(TINY, spy, m=2, device=device)
    reads = token_schedule(TINY)
    assert [s[0] for s in seen] == [r.n_candidates for r in reads] and all(s[1] for s in seen)
    assert out.n_sealed == TINY.max_attn_res_candidates - 1
    again = replay_token(TINY, spy, m=2, device=device)
    assert torch.equal(out.rows, again.rows)                       # deterministic from the seed


def _replay_errors(cfg, m, device):
    """Norm-relative error of every read's h, fused against reference, in a replay whose sublayer
    outputs feed on h_normed, as in the model."""
    ref = replay_token(cfg, attn_res_norm_reference, m=m, device=device)
    fused = replay_token(cfg, attn_res_norm, m=m, device=device)
    return [(r, float((a.float() - b.float()).norm() / b.float().norm()))
            for r, a, b in zip(ref.reads, fused.h, ref.h, strict=True)]


def test_replay_tiny(device):
    # independent sublayer outputs: every read sees the same inputs on both sides
    ref = replay_token(TINY, attn_res_norm_reference, m=3, device=device, out_gain=0.0)
    fused = replay_token(TINY, attn_res_norm, m=3, device=device, out_gain=0.0)
    assert torch.equal(ref.rows, fused.rows)
    for i, (a, b, c, d) in enumerate(zip(fused.h, ref.h, fused.h_normed, ref.h_normed,
                                         strict=True)):
        assert_close(f"h[read {i}]", a, b, atol=H_ATOL, rtol=H_RTOL)
        assert_close(f"h_normed[read {i}]", c, d, atol=H_NORMED_ATOL, rtol=H_NORMED_RTOL)
    for read, err in _replay_errors(TINY, 3, device):
        assert err <= REPLAY_NORM_RTOL, f"{read}: norm error {err:.3g}"


def test_replay_k3(device):
    """K3 width; on CPU the first 25 layers (two seals, 3 sealed rows + live), on the GPU all 93."""
    cfg = K3 if torch.device(device).type == "cuda" else dataclasses.replace(K3, n_layers=25)
    for read, err in _replay_errors(cfg, 1, device):
        assert err <= REPLAY_NORM_RTOL, f"{read}: norm error {err:.3g}"


# ---------------------------------------------------------------------------------------------
# the boundary


def test_boundary(device):
    b = get("attn_res")
    assert b.owns == ATTN_RES_OPS
    assert b.applies(K3) and not b.applies(preset("kimi-k2"))
    assert {v.role for v in b.variants} == {"reference", "fused", "peer"}
    inp = b.make_inputs(TINY, device, 0, M=3)
    assert inp["bank"].shape == (TINY.max_attn_res_candidates - 1, 3, TINY.hidden)
    assert b.make_inputs(preset("kimi-k2"), device, 0)["bank"].shape[0] == 8
    H = TINY.hidden
    assert b.bytes_moved(inp) == (4 + 1) * 3 * H * 2 + 3 * H * 2 + 2 * 3 * H * 2
    ref = b.reference.fn(inp)
    errs = b.check(b.variant("fused").fn(inp), ref, inp)
    assert set(errs) == {"h", "h_normed"}
    inp32 = b.make_inputs(TINY, device, 0, n_sealed=0, weight_dtype="fp32")
    assert inp32["norm_weight"].dtype == torch.float32 and inp32["bank"].shape[0] == 0
    b.check(b.variant("fused").fn(inp32), b.reference.fn(inp32), inp32)
    with pytest.raises(AssertionError, match="h"):
        b.check(attn_res_norm_reference(inp["bank"][1:], inp["live"], inp["res_norm_weight"],
                                        inp["res_proj_weight"], inp["norm_weight"]), ref, inp)
    with pytest.raises(ValueError, match="weight_dtype"):
        b.make_inputs(TINY, device, 0, weight_dtype="fp8")
    # the fused variant passes inputs' config
    b.check(b.variant("fused").fn({**inp, "config": CONFIGS[0]}), ref, inp)
    with pytest.raises(ValueError, match="config"):
        b.variant("fused").fn({**inp, "config": {"num_warps": 4}})


def test_one_launch(device):
    from k3lab.profile import count_launches

    b = get("attn_res")
    for n in (0, 8):
        inp = b.make_inputs(TINY, device, 0, n_sealed=n)
        launches = count_launches(b.variant("fused").fn, inp)
        assert launches.count == 1, launches.kernels


# ---------------------------------------------------------------------------------------------
# GPU


GPU_CONFIGS = {"default": AttnResConfig(), "one": AttnResConfig(split_h=0),
               "split-all": AttnResConfig(split_min_candidates=1),
               "chunks": AttnResConfig(split_h=0, one_chunk_elems=0),
               "one-plain": AttnResConfig(split_h=0, pdl=False, one_chunk_min_candidates=1),
               "chunks-plain": AttnResConfig(split_h=0, pdl=False, one_chunk_elems=0),
               "one-chunk-wide": AttnResConfig(split_h=0, one_chunk_elems=32768,
                                               one_chunk_min_candidates=1),
               "split1024-nopdl": AttnResConfig(split_h=1024, split_pdl=False,
                                                split_min_candidates=1),
               "bank-early": AttnResConfig(bank_before_wait=True),
               "bank-early-one": AttnResConfig(split_h=0, one_chunk_min_candidates=1,
                                               bank_before_wait=True),
               "bank-early-split": AttnResConfig(split_min_candidates=1, bank_before_wait=True),
               "one-pass-deep": AttnResConfig(one_chunk_elems=32768, split_min_candidates=6,
                                              num_warps=16, bank_before_wait=True)}


@pytest.mark.gpu
@pytest.mark.parametrize("config", list(GPU_CONFIGS))
@pytest.mark.parametrize("m", [1, 64])
def test_gpu_k3_every_depth(m, config):
    for n in range(10):
        _check(_inputs(K3, n, m, "cuda", seed=n), config=GPU_CONFIGS[config])


@pytest.mark.gpu
def test_gpu_no_host_sync():
    args = _inputs(K3, 8, 1, "cuda")
    attn_res_norm(*args)                                           # compile outside the check
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        attn_res_norm(*args)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("config", ["default", "one", "split-all", "bank-early"])
def test_gpu_graph_of_a_token(config):
    """A whole K3 token's 186 reads captured in one CUDA graph (every depth 1..9 candidates):
    replays equal eager calls, and follow the residual buffer when it changes in place."""
    cfg = GPU_CONFIGS[config]
    rows = replay_token(K3, attn_res_norm, device="cuda").rows     # a realistic residual buffer
    reads = token_schedule(K3)
    weights = replay_weights(K3, make_generator(1, "cuda"))

    def token():
        return [attn_res_norm(rows[:r.n_candidates - 1], rows[r.n_candidates - 1],
                              w["res_norm_weight"], w["res_proj_weight"], w["norm_weight"],
                              eps=K3.rms_eps, config=cfg)
                for r, w in zip(reads, weights, strict=True)]

    token()                                                        # compile every depth
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = token()
    for step in range(2):
        if step:
            rows.mul_(-0.5)                                        # new residuals, same buffer
        graph.replay()
        torch.cuda.synchronize()
        expected = token()
        for i, ((h, hn), (eh, ehn)) in enumerate(zip(outs, expected, strict=True)):
            assert torch.equal(h, eh) and torch.equal(hn, ehn), f"step {step} read {i}"


@pytest.mark.gpu
def test_gpu_torch_compile_peer():
    b = get("attn_res")
    inp = b.make_inputs(K3, "cuda", 0)
    b.check(b.variant("torch.compile").fn(inp), b.reference.fn(inp), inp)
