"""KDA decode: the fused kernel against the op-by-op reference, the reference against a plain loop.

CPU runs use the Triton interpreter at preset ``tiny`` (6 heads x 32) and awkward variants of it
(3 and 5 heads, f rank 24) and KDAConfig choices; GPU tests (``-m gpu``) run Kimi-K3 shards at tp 1
and 8, 64 steps and CUDA-graph capture.
"""

import dataclasses

import pytest
import torch

from k3lab.boundaries import assert_close, clone_inputs
from k3lab.boundaries import kda as kda_boundary
from k3lab.config import preset
from k3lab.kernels import KDAConfig
from k3lab.ops import KDA_OPS
from k3lab.reference.kda import (
    kda_decode_loop,
    kda_decode_reference,
    kda_layer_reference,
    kda_recurrent_loop,
    short_conv_step,
)
from k3lab.weights import hidden_states, kda_cache, kda_weights, make_generator

# o, state and gated-output tolerances: the boundary's own (stated and reasoned there)
O_BF16_ATOL, O_BF16_RTOL = kda_boundary.O_ATOL, kda_boundary.O_RTOL
STATE_ATOL, STATE_RTOL = kda_boundary.STATE_ATOL, kda_boundary.STATE_RTOL
O_GATED_ATOL, O_GATED_RTOL = kda_boundary.O_GATED_ATOL, kda_boundary.O_GATED_RTOL
# The two fp32 formulations of the reference (vectorized vs loop) agree to rounding.
REF_FP32_ATOL = 1e-6
# The whole layer's output [M, hidden] (|y| up to about 2): the fused path's bf16 gated o (two ulps)
# summed over Hl*d products in o_proj; measured about 5e-3 at tiny.
LAYER_ATOL = 1e-2
LAYER_RTOL = 1e-2

STEPS = 64


def tiny(heads: int | None = None, **changes):
    cfg = preset("tiny")
    if heads is not None:
        changes["kda_heads"] = heads
    return dataclasses.replace(cfg, **changes)


def _args(inputs, q=None, k=None, v=None):
    return (inputs["q"] if q is None else q, inputs["k"] if k is None else k,
            inputs["v"] if v is None else v, inputs["f_low"], inputs["f_b"], inputs["A_log"],
            inputs["dt_bias"], inputs["b_logits"], inputs["state"])


def _kernels():
    from k3lab.kernels import KDAConv, KDAOutGate, kda_decode
    return kda_decode, KDAConv, KDAOutGate


CASES = {  # id -> (preset, M)
    "M1-H6-d32-R16": (tiny(), 1),
    "M3-H5-d32-R16": (tiny(5), 3),
    "M2-H3-d32-R24": (tiny(3, kda_f_rank=24), 2),
    "M64-H3-d32-R16": (tiny(3), 64),
    "M2-H5-d16-R16": (tiny(5, kda_head_dim=16), 2),
}


# ---------------------------------------------------------------------------------------------
# the reference against the plain loop formulation


def test_reference_matches_loop_over_steps():
    fixed, tokens = kda_boundary.decode_stream(tiny(5), "cpu", seed=1, M=2, steps=12)
    s_ref, s_loop = fixed["state"].clone(), fixed["state"].clone()
    steps = [{**fixed, **tok} for tok in tokens]
    o_loop = kda_recurrent_loop(steps, s_loop, lower_bound=fixed["lower_bound"])
    for t, inp in enumerate(steps):
        o_ref = kda_decode_reference(*_args({**inp, "state": s_ref}),
                                     lower_bound=inp["lower_bound"])
        assert_close(f"o[step {t}]", o_ref, o_loop[t], atol=REF_FP32_ATOL)
    assert_close("state", s_ref, s_loop, atol=REF_FP32_ATOL)


def test_reference_loop_sees_a_wrong_gate():
    """The loop is an independent check: change the bound and the two disagree."""
    inp = kda_boundary.make_inputs(tiny(), "cpu", seed=2, M=1)
    o_ref = kda_decode_reference(*_args(clone_inputs(inp)), lower_bound=-5.0)
    o_loop = kda_decode_loop(*_args(clone_inputs(inp)), lower_bound=-4.0)
    with pytest.raises(AssertionError, match="o"):
        assert_close("o", o_ref, o_loop, atol=REF_FP32_ATOL)


def test_short_conv_step_shifts_cache():
    gen = make_generator(3, "cpu")
    x = torch.randn(2, 10, generator=gen)
    cache = torch.randn(2, 10, 3, generator=gen)
    w = torch.randn(10, 4, generator=gen)
    old = cache.clone()
    y = short_conv_step(x, cache, w)
    window = torch.cat((old, x[..., None]), -1)
    torch.testing.assert_close(y, torch.nn.functional.silu((window * w).sum(-1)))
    torch.testing.assert_close(cache, window[..., 1:])


# ---------------------------------------------------------------------------------------------
# the fused kernel on CPU (interpreter)


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_fused_matches_reference(case, device):
    kda_decode, _, _ = _kernels()
    cfg, m = CASES[case]
    inp = kda_boundary.make_inputs(cfg, device, seed=0, M=m)
    ref_state = inp["state"].clone()
    o_ref = kda_decode_reference(*_args({**inp, "state": ref_state}),
                                 lower_bound=inp["lower_bound"])
    state = inp["state"].clone()
    o = kda_decode(*_args({**inp, "state": state}), lower_bound=inp["lower_bound"])
    assert o.dtype == torch.bfloat16 and o.shape == inp["q"].shape
    assert_close("o", o, o_ref, atol=O_BF16_ATOL, rtol=O_BF16_RTOL)
    assert_close("state", state, ref_state, atol=STATE_ATOL, rtol=STATE_RTOL)


@pytest.mark.parametrize("block_v", [8, 16, 32], ids=lambda b: f"BV{b}")
def test_fused_every_v_tile_width(block_v, device):
    kda_decode, _, _ = _kernels()
    inp = kda_boundary.make_inputs(tiny(5), device, seed=4, M=2)
    ref = kda_boundary._reference(clone_inputs(inp))
    state = inp["state"].clone()
    o = kda_decode(*_args({**inp, "state": state}), config=KDAConfig(block_v=block_v))
    assert_close("o", o, ref["o"], atol=O_BF16_ATOL, rtol=O_BF16_RTOL)
    assert_close("state", state, ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)


def test_fused_other_tiling_choices(device):
    """Narrow rank chunks, 16-wide auto tiles and 1 warp a program: the same result."""
    kda_decode, _, _ = _kernels()
    inp = kda_boundary.make_inputs(tiny(3, kda_f_rank=24), device, seed=4, M=2)
    ref = kda_boundary._reference(clone_inputs(inp))
    config = KDAConfig(block_r=8, min_block_v=16, max_block_v=16, tile_per_warp=4096)
    state = inp["state"].clone()
    o = kda_decode(*_args({**inp, "state": state}), config=config)
    assert_close("o", o, ref["o"], atol=O_BF16_ATOL, rtol=O_BF16_RTOL)
    assert_close("state", state, ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)


def test_fused_state_in_place_and_inputs_untouched(device):
    kda_decode, _, _ = _kernels()
    inp = kda_boundary.make_inputs(tiny(), device, seed=5, M=2)
    before = clone_inputs(inp)
    state = inp["state"]
    ptr = state.data_ptr()
    kda_decode(*_args(inp))
    assert inp["state"] is state and state.data_ptr() == ptr
    assert not torch.equal(state, before["state"])
    ref = kda_boundary._reference(before)
    assert_close("state", state, ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)
    for name in ("q", "k", "v", "f_low", "f_b", "A_log", "dt_bias", "b_logits"):
        assert torch.equal(inp[name], before[name]), name


@pytest.mark.parametrize("heads,m,steps", [(6, 1, STEPS), (5, 3, 12)],
                         ids=[f"H6-M1-{STEPS}steps", "H5-M3-12steps"])
def test_fused_steps_state_carried(heads, m, steps, device):
    kda_decode, _, _ = _kernels()
    fixed, tokens = kda_boundary.decode_stream(tiny(heads), device, seed=6, M=m, steps=steps)
    s_ref, s_fused = fixed["state"].clone(), fixed["state"].clone()
    for t, tok in enumerate(tokens):
        inp = {**fixed, **tok}
        o_ref = kda_decode_reference(*_args({**inp, "state": s_ref}))
        o = kda_decode(*_args({**inp, "state": s_fused}))
        assert_close(f"o[step {t}]", o, o_ref, atol=O_BF16_ATOL, rtol=O_BF16_RTOL)
    assert_close(f"state after {steps} steps", s_fused, s_ref, atol=STATE_ATOL, rtol=STATE_RTOL)
    # the state really moved: a stale state would fail
    assert (s_ref - fixed["state"]).abs().max() > 100 * STATE_ATOL


# v-tiles of a fused conv / out gate: the default (a whole head at tiny's d = 32: no ticket),
# 8 and 16 wide (4 and 2 programs a head, meeting through the tickets)
FUSED_TILES = {"default": None, "BV8": 8, "BV16": 16}


@pytest.mark.parametrize("tile", list(FUSED_TILES))
def test_fused_conv_over_steps(device, tile):
    """Short conv fused in front, conv caches carried by the kernel for 8 tokens; the truth
    convolves the same pre-conv projections in fp32."""
    kda_decode, KDAConv, _ = _kernels()
    config = KDAConfig(block_v=FUSED_TILES[tile])
    fixed, tokens = kda_boundary.decode_stream(tiny(5), device, seed=7, M=2, steps=8)
    ref, fused = clone_inputs(fixed), clone_inputs(fixed)
    conv = KDAConv(*(fused[f"{n}_conv_state"] for n in "qkv"),
                   *(fused[f"{n}_conv"] for n in "qkv"))
    for t, tok in enumerate(tokens):
        out_ref = kda_boundary.reference_conv({**ref, **tok})
        o = kda_decode(*_args({**fused, **tok}, tok["q_pre"], tok["k_pre"], tok["v_pre"]),
                       conv=conv, config=config)
        assert_close(f"o[step {t}]", o, out_ref["o"], atol=O_BF16_ATOL, rtol=O_BF16_RTOL)
        for n in "qkv":
            assert_close(f"{n}_conv_state[step {t}]", fused[f"{n}_conv_state"],
                         ref[f"{n}_conv_state"], atol=0.0)
    assert_close("state", fused["state"], ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)


@pytest.mark.parametrize("tile", list(FUSED_TILES))
@pytest.mark.parametrize("m", [1, 3], ids=lambda m: f"M{m}")
def test_fused_out_gate(m, device, tile):
    kda_decode, _, KDAOutGate = _kernels()
    inp = kda_boundary.make_inputs(tiny(5), device, seed=8, M=m)
    ref = kda_boundary.reference_out_gate(clone_inputs(inp))
    state = inp["state"].clone()
    o = kda_decode(*_args({**inp, "state": state}),
                   out_gate=KDAOutGate(inp["g_logits"], inp["o_norm"], inp["eps"]),
                   config=KDAConfig(block_v=FUSED_TILES[tile]))
    assert_close("o_gated", o, ref["o_gated"], atol=O_GATED_ATOL, rtol=O_GATED_RTOL)
    assert_close("state", state, ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)


@pytest.mark.parametrize("deferred", [False, True], ids=["gate-here", "rms-in-o_proj"])
@pytest.mark.parametrize("tile", list(FUSED_TILES))
def test_layer_reference_vs_fused_conv_and_out_gate(device, tile, deferred):
    """The whole KDA attention of two tokens: the op-by-op layer against projections + one
    kda_decode with both the conv and the output gate fused + o_proj (deferred: the gate's
    RMS left to o_proj's prologue, KDAOutGate.rms_by_consumer, and the conv's ticket early)."""
    from k3lab.kernels.dense import dense_gemv
    kda_decode, KDAConv, KDAOutGate = _kernels()
    cfg, m = tiny(5), 2
    gen = make_generator(9, device)
    w, cache = kda_weights(cfg, gen), kda_cache(cfg, m, gen)
    fused_cache = clone_inputs(cache)
    hl, d = cfg.kda_heads, cfg.kda_head_dim
    conv = KDAConv(*(fused_cache[f"{n}_conv_state"] for n in "qkv"),
                   *(w[f"{n}_conv"] for n in "qkv"))
    for step in range(2):
        x = hidden_states(cfg, m, gen)
        y_ref = kda_layer_reference(x, w, cache, cfg)
        xf = x.float()

        def proj(name):  # fp32 accumulation rounded to bf16, as in the reference layer
            return (xf @ w[name].float().T).to(x.dtype)

        pre = {n: proj(f"{n}_proj").view(m, hl, d) for n in ("q", "k", "v", "g")}
        o = kda_decode(pre["q"], pre["k"], pre["v"], proj("f_a"), w["f_b"],
                       w["A_log"], w["dt_bias"], proj("b_proj"),
                       fused_cache["state"], lower_bound=cfg.kda_lower_bound, conv=conv,
                       out_gate=KDAOutGate(pre["g"], w["o_norm"], cfg.rms_eps,
                                           rms_by_consumer=deferred),
                       config=KDAConfig(block_v=FUSED_TILES[tile], early_ticket=deferred))
        if deferred:
            o, sums = o
            y = dense_gemv(o.reshape(m, hl * d), w["o_proj"], head_sums=sums, head_dim=d,
                           eps=cfg.rms_eps).float()
        else:
            y = o.float().reshape(m, hl * d) @ w["o_proj"].float().T
        assert_close(f"layer out[step {step}]", y, y_ref, atol=LAYER_ATOL, rtol=LAYER_RTOL)
    assert_close("state", fused_cache["state"], cache["state"], atol=STATE_ATOL,
                 rtol=STATE_RTOL)


# ---------------------------------------------------------------------------------------------
# the boundary


@pytest.mark.parametrize("m", [1, 3], ids=lambda m: f"M{m}")
def test_boundary_variants_pass_check(device, m):
    b = kda_boundary.BOUNDARY
    inp = b.make_inputs(tiny(5), device, seed=10, M=m)
    ref = b.reference.fn(clone_inputs(inp))
    ran = []
    for v in b.available_variants(device):
        if v.name == "torch.compile":
            continue
        errs = b.check(v.fn(clone_inputs(inp)), ref, inp)
        assert "state" in errs
        ran.append(v.name)
    assert {"reference", "fused", "fused+conv", "fused+out_gate"} <= set(ran)
    # the fused variants pass inputs' config
    for name in ("fused", "fused+conv", "fused+out_gate"):
        with pytest.raises(ValueError, match="config"):
            b.variant(name).fn({**clone_inputs(inp), "config": {"block_r": 32}})
    b.check(b.variant("fused").fn({**clone_inputs(inp), "config": KDAConfig(block_v=8)}), ref,
            inp)


def test_boundary_check_rejects_a_wrong_output():
    b = kda_boundary.BOUNDARY
    inp = b.make_inputs(tiny(), "cpu", seed=11, M=1)
    ref = b.reference.fn(clone_inputs(inp))
    bad = {"o": ref["o"].clone(), "state": ref["state"].clone()}
    bad["state"][0, 2, 5, 7] += 1e-3
    with pytest.raises(AssertionError, match="state"):
        b.check(bad, ref, inp)
    stale = b.reference.fn(clone_inputs(inp))
    stale["o"] = stale["o"] * 1.05
    with pytest.raises(AssertionError, match="o"):
        b.check(stale, ref, inp)


def test_boundary_inputs_and_bytes():
    b = kda_boundary.BOUNDARY
    cfg = tiny()
    inp = b.make_inputs(cfg, "cpu", seed=0, M=2)
    hl, d = cfg.kda_heads, cfg.kda_head_dim
    assert inp["q"].shape == (2, hl, d) and inp["q"].dtype == torch.bfloat16
    assert inp["state"].shape == (2, hl, d, d) and inp["state"].dtype == torch.float32
    assert inp["q_conv_state"].shape == (2, hl * d, cfg.kda_conv - 1)
    # q really is SiLU(conv) of q_pre over the cache
    q = short_conv_step(inp["q_pre"].view(2, hl * d), inp["q_conv_state"].clone(), inp["q_conv"])
    assert torch.equal(q.to(torch.bfloat16).view(2, hl, d), inp["q"])
    state = 2 * 2 * hl * d * d * 4
    assert kda_boundary.state_bytes(inp) == state
    small = 4 * 2 * hl * d * 2 + hl * d * cfg.kda_f_rank * 2 + 2 * cfg.kda_f_rank * 2 \
        + hl * 4 + hl * d * 4 + 2 * hl * 2
    assert b.bytes_moved(inp) == state + small
    assert set(b.owns) <= set(KDA_OPS)


# ---------------------------------------------------------------------------------------------
# bad input


def _bad_cases():
    def mutate(name, fn):
        return lambda a, kw: (a.__setitem__(name, fn(a[name])), kw)[1]

    def kw(name, value):
        return lambda a, k: {**k, name: value}

    return {
        "q-2d": (mutate("q", lambda t: t[0]), "q"),
        "q-headdim-24": (lambda a, k: ([a.__setitem__(n, a[n][..., :24].contiguous())
                                        for n in ("q", "k", "v")], k)[1], "q"),
        "q-M65": (lambda a, k: ([a.__setitem__(n, a[n][:1].expand(65, *a[n].shape[1:])
                                               .contiguous()) for n in ("q", "k", "v")], k)[1],
                  "q"),
        "q-int": (mutate("q", lambda t: t.to(torch.int32)), "q"),
        "k-noncontig": (mutate("k", lambda t: t.transpose(0, 1).contiguous().transpose(0, 1)),
                        "k"),
        "v-shape": (mutate("v", lambda t: t[:, :-1].contiguous()), "v"),
        "k-device": (mutate("k", lambda t: torch.empty_like(t, device="meta")), "k"),
        "f_low-1d": (mutate("f_low", lambda t: t[0]), "f_low"),
        "f_b-rank": (mutate("f_b", lambda t: t[:, :-1].contiguous()), "f_b"),
        "A_log-bf16": (mutate("A_log", lambda t: t.to(torch.bfloat16)), "A_log"),
        "dt_bias-shape": (mutate("dt_bias", lambda t: t[:-1].contiguous()), "dt_bias"),
        "b_logits-shape": (mutate("b_logits", lambda t: t[:, :1].contiguous()), "b_logits"),
        "state-bf16": (mutate("state", lambda t: t.to(torch.bfloat16)), "state"),
        "state-noncontig": (mutate("state", lambda t: t.transpose(2, 3)), "state"),
        "scale-negative": (kw("scale", -1.0), "scale"),
        "lower_bound-str": (kw("lower_bound", "-5"), "lower_bound"),
        "block_v-64": (kw("config", KDAConfig(block_v=64)), "block_v"),
        "config-dict": (kw("config", {"block_v": 16}), "config"),
        "conv-type": (kw("conv", (1, 2)), "conv"),
        "out_gate-type": (kw("out_gate", 1.0), "out_gate"),
    }


BAD = _bad_cases()


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input(case, device):
    kda_decode, _, _ = _kernels()
    inp = kda_boundary.make_inputs(tiny(), device, seed=12, M=2)
    mutate, match = BAD[case]
    kwargs = mutate(inp, {})
    with pytest.raises(ValueError, match=match):
        kda_decode(*_args(inp), **kwargs)


def test_bad_conv_and_out_gate_inputs(device):
    kda_decode, KDAConv, KDAOutGate = _kernels()
    inp = kda_boundary.make_inputs(tiny(), device, seed=13, M=2)
    states = [inp[f"{n}_conv_state"] for n in "qkv"]
    weights = [inp[f"{n}_conv"] for n in "qkv"]
    bad_state = KDAConv(states[0], states[1][:1].contiguous(), states[2], *weights)
    with pytest.raises(ValueError, match="conv.k_state"):
        kda_decode(*_args(inp), conv=bad_state)
    bad_dtype = KDAConv(states[0], states[1], states[2].float(), *weights)
    with pytest.raises(ValueError, match="conv.v_state"):
        kda_decode(*_args(inp), conv=bad_dtype)
    bad_w = KDAConv(*states, weights[0], weights[1][:, :3].contiguous(), weights[2])
    with pytest.raises(ValueError, match="conv.k_weight"):
        kda_decode(*_args(inp), conv=bad_w)
    with pytest.raises(ValueError, match="block_v"):
        kda_decode(*_args(inp), conv=KDAConv(*states, *weights), config=KDAConfig(block_v=64))
    with pytest.raises(ValueError, match="out_gate.logits"):
        kda_decode(*_args(inp), out_gate=KDAOutGate(inp["g_logits"][:1], inp["o_norm"]))
    with pytest.raises(ValueError, match="out_gate.weight"):
        kda_decode(*_args(inp), out_gate=KDAOutGate(inp["g_logits"], inp["o_norm"][:-1]))
    with pytest.raises(ValueError, match="out_gate"):
        kda_decode(*_args(inp), out_gate=KDAOutGate(inp["g_logits"], inp["o_norm"], 0.0))


@pytest.mark.parametrize("field,value", [
    ("block_v", 3), ("block_v", 0), ("min_programs", 0), ("max_block_v", 48),
    ("min_block_v", True), ("block_r", 24), ("tile_per_warp", 1.0), ("max_warps", 6),
    ("pdl", 1)])
def test_bad_config(field, value):
    with pytest.raises(ValueError, match=field):
        KDAConfig(**{field: value})


def test_refuses_other_devices():
    """Tensors on a device the kernels do not run on (meta): a clear error naming q (the
    launcher's device check, after the shape checks pass)."""
    kda_decode, _, _ = _kernels()
    inp = kda_boundary.make_inputs(tiny(), "cpu", seed=0, M=1)
    meta = {k: v.to("meta") if isinstance(v, torch.Tensor) else v for k, v in inp.items()}
    with pytest.raises(ValueError, match="q: expected a cuda"):
        kda_decode(*_args(meta))


# ---------------------------------------------------------------------------------------------
# GPU: Kimi-K3 shards, 64 steps, CUDA graphs, the fla-core peer


@pytest.mark.gpu
@pytest.mark.parametrize("tp,m", [(1, 1), (8, 1), (1, 16), (8, 64)],
                         ids=["tp1-M1-H96", "tp8-M1-H12", "tp1-M16-H96", "tp8-M64-H12"])
def test_gpu_k3_variants(tp, m):
    b = kda_boundary.BOUNDARY
    inp = b.make_inputs(preset("kimi-k3", tp), "cuda", seed=0, M=m)
    ref = b.reference.fn(clone_inputs(inp))
    for name in ("fused", "fused+conv", "fused+out_gate", "fused+conv+out_gate"):
        b.check(b.variant(name).fn(clone_inputs(inp)), ref, inp)


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [None, 16, 128], ids=["default", "BV16", "BVd"])
@pytest.mark.parametrize("tp,m", [(8, 1), (8, 64), (1, 1)], ids=["tp8-M1", "tp8-M64", "tp1-M1"])
def test_gpu_k3_whole_decode_steps(tp, m, block_v):
    """The conv and out gate fused over 16 steps, v-tiles meeting through tickets: the conv
    caches exact and the outputs within tolerance at every step (a race shows as a wrong
    cache)."""
    b = kda_boundary.BOUNDARY
    fixed, tokens = kda_boundary.decode_stream(preset("kimi-k3", tp), "cuda", seed=4, M=m,
                                               steps=16)
    ref, fused = clone_inputs(fixed), clone_inputs(fixed)
    fn = b.variant("fused+conv+out_gate").fn
    for t, tok in enumerate(tokens):
        want = kda_boundary.reference_conv_out_gate({**ref, **tok})
        got = fn({**fused, **tok, "config": KDAConfig(block_v=block_v)})
        for n in "qkv":
            key = f"{n}_conv_state"
            assert_close(f"{key}[step {t}]", got[key], want[key], atol=0.0)
        assert_close(f"o_gated[step {t}]", got["o_gated"], want["o_gated"], atol=O_GATED_ATOL,
                     rtol=O_GATED_RTOL)
    assert_close("state", fused["state"], ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8], ids=["tp1", "tp8"])
def test_gpu_k3_64_steps(tp):
    from k3lab.kernels import kda_decode
    fixed, tokens = kda_boundary.decode_stream(preset("kimi-k3", tp), "cuda", seed=1, M=1,
                                               steps=STEPS)
    s_ref, s_fused = fixed["state"].clone(), fixed["state"].clone()
    for t, tok in enumerate(tokens):
        inp = {**fixed, **tok}
        o_ref = kda_decode_reference(*_args({**inp, "state": s_ref}))
        o = kda_decode(*_args({**inp, "state": s_fused}))
        assert_close(f"o[step {t}]", o, o_ref, atol=O_BF16_ATOL, rtol=O_BF16_RTOL)
    assert_close("state", s_fused, s_ref, atol=STATE_ATOL, rtol=STATE_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("variant", ["fused", "fused+conv", "fused+out_gate",
                                     "fused+conv+out_gate"])
def test_gpu_cuda_graph_capture(variant):
    """Captured once, replayed 3 times: each replay advances the state like 3 eager calls."""
    b = kda_boundary.BOUNDARY
    inp = b.make_inputs(preset("kimi-k3", 1), "cuda", seed=2, M=1)
    fn = b.variant(variant).fn
    eager = clone_inputs(inp)
    for _ in range(3):
        want = fn(eager)
    graphed = clone_inputs(inp)
    warm = clone_inputs(inp)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(warm)  # compile outside the capture, on other buffers
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = fn(graphed)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for key in want:
        assert torch.equal(got[key], want[key]), key


@pytest.mark.gpu
def test_gpu_next_projection_by_pdl_keeps_the_bits():
    """K3 tp 8: the decode by PDL, then the output projection by PDL reading its o, captured
    in a graph over fresh inputs and replayed: the bits of the plain decode and plain
    projection."""
    config = KDAConfig(pdl=True)
    from k3lab.kernels import GemvConfig, dense_gemv

    kda_decode, _, _ = _kernels()
    b = kda_boundary.BOUNDARY
    inp = b.make_inputs(preset("kimi-k3", 8), "cuda", seed=5, M=1)
    hl, d = inp["q"].shape[1], inp["q"].shape[2]
    gen = torch.Generator(device="cuda").manual_seed(6)
    w_o = (torch.randn(7168, hl * d, device="cuda", generator=gen) * 0.02).bfloat16()
    out = {}
    for label, kda_cfg, gemv_cfg in (("plain", KDAConfig(), GemvConfig()),
                                     ("early", config, GemvConfig(pdl=True))):
        run = clone_inputs(inp)
        src = run["q"].clone()

        def step(run=run, src=src, kda_cfg=kda_cfg, gemv_cfg=gemv_cfg):
            run["q"].copy_(src * 1.5)  # the launch before the decode writes one of its inputs
            o = kda_decode(*_args(run), config=kda_cfg)
            return dense_gemv(o.reshape(1, hl * d), w_o, config=gemv_cfg)

        step()
        run["q"].zero_()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            y = step()
        graph.replay()
        torch.cuda.synchronize()
        out[label] = (y.clone(), run["state"].clone())
    for a, c in zip(out["plain"], out["early"], strict=True):
        assert torch.equal(a, c)
    assert out["early"][0].abs().sum() > 0


@pytest.mark.gpu
def test_gpu_fla_peer():
    pytest.importorskip("fla.ops.kda.fused_recurrent")
    b = kda_boundary.BOUNDARY
    for tp in (1, 8):
        inp = b.make_inputs(preset("kimi-k3", tp), "cuda", seed=3, M=1)
        ref = b.reference.fn(clone_inputs(inp))
        b.check(b.variant("fla-core").fn(clone_inputs(inp)), ref, inp)
