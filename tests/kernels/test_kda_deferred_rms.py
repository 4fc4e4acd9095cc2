"""KDA decode with the output gate's RMS left to the consumer (``KDAOutGate.rms_by_consumer``)
and the conv's ticket taken early (``KDAConfig.early_ticket``), against the op-by-op reference,
under the interpreter on CPU (the whole layer with the RMS in o_proj's prologue: test_kda.py's
layer test)."""

import dataclasses

import pytest
import torch

from k3lab.boundaries import assert_close, clone_inputs
from k3lab.boundaries import kda as kda_boundary
from k3lab.config import preset
from k3lab.kernels import KDAConfig, KDAConv, KDAOutGate, kda_decode

# the boundary's own tolerances (stated and reasoned there); the deferred path rounds the gated
# o to bf16 before its rsqrt instead of after, the same one rounding of the output's size
O_BF16_ATOL, O_BF16_RTOL = kda_boundary.O_ATOL, kda_boundary.O_RTOL
STATE_ATOL, STATE_RTOL = kda_boundary.STATE_ATOL, kda_boundary.STATE_RTOL
O_GATED_ATOL, O_GATED_RTOL = kda_boundary.O_GATED_ATOL, kda_boundary.O_GATED_RTOL
# the whole layer's output (as test_kda.py's layer check): bf16 gated o over Hl*d products
LAYER_ATOL = LAYER_RTOL = 1e-2

# v-tiles: a whole head at tiny's d = 32 (one program a head), 8 and 16 wide (4 and 2)
TILES = {"default": None, "BV8": 8, "BV16": 16}


def tiny(heads: int | None = None):
    cfg = preset("tiny")
    return cfg if heads is None else dataclasses.replace(cfg, kda_heads=heads)


def _args(inputs, q=None, k=None, v=None):
    return (inputs["q"] if q is None else q, inputs["k"] if k is None else k,
            inputs["v"] if v is None else v, inputs["f_low"], inputs["f_b"], inputs["A_log"],
            inputs["dt_bias"], inputs["b_logits"], inputs["state"])


def _finish(o, sums, eps):
    """The consumer's side: each head of the gated o over sqrt(mean of its o^2 + eps)."""
    d = o.shape[-1]
    return o.float() * torch.rsqrt(sums.sum(-1, keepdim=True) / d + eps)


@pytest.mark.parametrize("tile", list(TILES))
@pytest.mark.parametrize("m", [1, 3], ids=lambda m: f"M{m}")
def test_out_gate_rms_by_consumer(m, device, tile):
    inp = kda_boundary.make_inputs(tiny(5), device, seed=8, M=m)
    ref = kda_boundary.reference_out_gate(clone_inputs(inp))
    state = inp["state"].clone()
    o, sums = kda_decode(*_args({**inp, "state": state}),
                         out_gate=KDAOutGate(inp["g_logits"], inp["o_norm"], inp["eps"],
                                             rms_by_consumer=True),
                         config=KDAConfig(block_v=TILES[tile]))
    d = o.shape[-1]
    assert sums.shape == (m, 5, d // (TILES[tile] or d)) and sums.dtype == torch.float32
    assert (sums >= 0).all()
    assert_close("o_gated", _finish(o, sums, inp["eps"]), ref["o_gated"].float(),
                 atol=O_GATED_ATOL, rtol=O_GATED_RTOL)
    assert_close("state", state, ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)


def _conv_steps(cfg, device, m, steps, block_v, defer):
    """The conv fused with the ticket taken early over ``steps`` tokens: the caches exactly the
    reference's after every token (the tickets reset each launch; a race shows as a wrong
    cache), o within tolerance, with or without the deferred gate."""
    config = KDAConfig(block_v=block_v, early_ticket=True)
    fixed, tokens = kda_boundary.decode_stream(cfg, device, seed=7, M=m, steps=steps)
    ref, fused = clone_inputs(fixed), clone_inputs(fixed)
    conv = KDAConv(*(fused[f"{n}_conv_state"] for n in "qkv"),
                   *(fused[f"{n}_conv"] for n in "qkv"))
    gate = None
    if defer:  # gate logits of 40 (sigmoid 1 in fp32), a unit norm weight: the conv's o, normed
        m, h, d = tokens[0]["q_pre"].shape
        gate = KDAOutGate(torch.full((m, h, d), 40.0, device=device),
                          torch.ones(d, device=device), 1e-5, rms_by_consumer=True)
    for t, tok in enumerate(tokens):
        out_ref = kda_boundary.reference_conv({**ref, **tok})
        o = kda_decode(*_args({**fused, **tok}, tok["q_pre"], tok["k_pre"], tok["v_pre"]),
                       conv=conv, out_gate=gate, config=config)
        if defer:
            o, sums = o
            want = out_ref["o"].float()
            want = want * torch.rsqrt(want.pow(2).mean(-1, keepdim=True) + 1e-5)
            assert_close(f"o[step {t}]", _finish(o, sums, 1e-5), want, atol=O_GATED_ATOL,
                         rtol=O_GATED_RTOL)
        else:
            assert_close(f"o[step {t}]", o, out_ref["o"], atol=O_BF16_ATOL, rtol=O_BF16_RTOL)
        for n in "qkv":
            assert_close(f"{n}_conv_state[step {t}]", fused[f"{n}_conv_state"],
                         ref[f"{n}_conv_state"], atol=0.0)
    assert_close("state", fused["state"], ref["state"], atol=STATE_ATOL, rtol=STATE_RTOL)


@pytest.mark.parametrize("tile", ["BV8", "BV16"])
@pytest.mark.parametrize("defer", [False, True], ids=["conv-only", "deferred-gate"])
def test_early_ticket_conv_over_steps(device, tile, defer):
    _conv_steps(tiny(5), device, 2, 6, TILES[tile], defer)


@pytest.mark.gpu
@pytest.mark.parametrize("block_v", [None, 16], ids=["default", "BV16"])
@pytest.mark.parametrize("m", [1, 64], ids=lambda m: f"M{m}")
def test_gpu_k3_tp8_early_ticket_steps(m, block_v):
    _conv_steps(preset("kimi-k3", 8), torch.device("cuda"), m, 16, block_v, True)


def test_bad_flags_are_named(device):
    inp = kda_boundary.make_inputs(tiny(), device, seed=1, M=1)
    with pytest.raises(ValueError, match="out_gate.rms_by_consumer: expected a bool"):
        kda_decode(*_args(inp), out_gate=KDAOutGate(inp["g_logits"], inp["o_norm"], 1e-5,
                                                    rms_by_consumer=1))
    with pytest.raises(ValueError, match="early_ticket: expected a bool"):
        KDAConfig(early_ticket="yes")
