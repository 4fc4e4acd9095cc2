"""Numeric launcher arguments (eps, betas, scales, bounds): NaN, inf, zero or negative where a
positive value belongs, and strings or bools where numbers belong are a ValueError naming the
parameter, raised before any kernel runs (kernels/runtime.py check_number)."""

import dataclasses

import pytest
import torch

from k3lab.boundaries import kda as kda_boundary
from k3lab.config import preset
from k3lab.kernels import (
    KDAOutGate,
    attn_res_norm,
    kda_decode,
    latent_down,
    latent_moe_tail,
    mla_decode,
    moe_block,
    moe_stage1,
    route_sort,
)
from k3lab.kernels.dense.launch import dense_gemv
from k3lab.reference.route import route_sort_reference
from k3lab.weights import hidden_states, make_generator, moe_weights

# the launchers get CPU tensors (the scalars are checked before the devices only in some)
pytestmark = pytest.mark.interpreter
NAN, INF = float("nan"), float("inf")
NOT_FINITE = [NAN, INF, -INF]
NOT_A_NUMBER = ["1.0", None, True, torch.tensor(1.0)]
NOT_POSITIVE = [0.0, -1.0, 0]


@pytest.fixture(scope="module")
def moe():
    cfg = preset("tiny")
    gen = make_generator(0, "cpu")
    w = moe_weights(cfg, gen)
    x = hidden_states(cfg, 2, gen)
    plan = route_sort_reference(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                                block_m=1, out_dim=cfg.moe_in)
    z = torch.zeros(2, cfg.moe_in, dtype=torch.bfloat16)
    return cfg, w, x, plan, z


@pytest.fixture(scope="module")
def kda():
    return kda_boundary.make_inputs(preset("tiny"), "cpu", 0, M=1)


def _kda_call(inp, **kw):
    return kda_decode(inp["q"], inp["k"], inp["v"], inp["f_low"], inp["f_b"], inp["A_log"],
                      inp["dt_bias"], inp["b_logits"], inp["state"].clone(), **kw)


CALLS = {
    # name -> (parameter, values that must be refused, fn(fixtures, value))
    "route_sort.routed_scaling_factor": (
        "routed_scaling_factor", NOT_FINITE + NOT_A_NUMBER + NOT_POSITIVE,
        lambda f, v: route_sort(f["moe"][2], f["moe"][1]["gate_weight"],
                                f["moe"][1]["correction_bias"], top_k=4,
                                routed_scaling_factor=v)),
    "latent_down.situ_beta": (
        "situ_beta", NOT_FINITE + NOT_A_NUMBER + NOT_POSITIVE,
        lambda f, v: latent_down(f["moe"][2], f["moe"][1]["latent_down"], situ_beta=v)),
    "latent_down.situ_linear_beta": (
        "situ_linear_beta", NOT_FINITE + NOT_A_NUMBER + NOT_POSITIVE,
        lambda f, v: latent_down(f["moe"][2], None, f["moe"][1]["shared_w13"],
                                 situ_linear_beta=v)),
    "moe_stage1.situ_beta": (
        "situ_beta", [0.0, NAN, "4"],
        lambda f, v: moe_stage1(f["moe"][4], f["moe"][3], f["moe"][1]["w13"], situ_beta=v)),
    "latent_moe_tail.eps": (
        "eps", NOT_FINITE + NOT_A_NUMBER + NOT_POSITIVE,
        lambda f, v: latent_moe_tail(torch.zeros(2, f["moe"][0].moe_in), f["moe"][1]["latent_norm"],
                                     f["moe"][1]["latent_up"], eps=v)),
    "moe_block.cfg.situ_beta": (
        "situ_beta", [0.0, NAN],
        lambda f, v: moe_block(f["moe"][2], f["moe"][1],
                               cfg=dataclasses.replace(f["moe"][0], situ_beta=v),
                               plan=f["moe"][3])),
    "moe_block.cfg.rms_eps": (
        "cfg.rms_eps", [0.0, NAN],
        lambda f, v: moe_block(f["moe"][2], f["moe"][1],
                               cfg=dataclasses.replace(f["moe"][0], rms_eps=v),
                               plan=f["moe"][3])),
    "kda_decode.scale": (
        "scale", NOT_FINITE + ["1.0", True] + NOT_POSITIVE,
        lambda f, v: _kda_call(f["kda"], scale=v)),
    "kda_decode.lower_bound": (
        "lower_bound", NOT_FINITE + NOT_A_NUMBER,
        lambda f, v: _kda_call(f["kda"], lower_bound=v)),
    "kda_decode.out_gate.eps": (
        "out_gate.eps", NOT_FINITE + NOT_A_NUMBER + NOT_POSITIVE,
        lambda f, v: _kda_call(f["kda"], out_gate=KDAOutGate(f["kda"]["g_logits"],
                                                             f["kda"]["o_norm"], eps=v))),
    "mla_decode.sm_scale": (
        "sm_scale", NOT_FINITE + NOT_A_NUMBER + NOT_POSITIVE,
        lambda f, v: mla_decode(torch.zeros(1, 2, 16, dtype=torch.bfloat16),
                                torch.zeros(1, 2, 16, dtype=torch.bfloat16),
                                torch.zeros(1, 4, 32, dtype=torch.bfloat16),
                                torch.ones(1, dtype=torch.int32), sm_scale=v)),
    "attn_res_norm.eps": (
        "eps", NOT_FINITE + NOT_A_NUMBER + NOT_POSITIVE,
        lambda f, v: attn_res_norm(torch.zeros(1, 1, 32, dtype=torch.bfloat16),
                                   torch.zeros(1, 32, dtype=torch.bfloat16), torch.ones(32),
                                   torch.ones(32), torch.ones(32), eps=v)),
    "dense_gemv.eps": (
        "eps", NOT_FINITE + NOT_A_NUMBER[:3] + NOT_POSITIVE,
        lambda f, v: dense_gemv(torch.zeros(1, 32, dtype=torch.bfloat16),
                                torch.zeros(16, 32, dtype=torch.bfloat16),
                                norm_weight=torch.ones(32), eps=v)),
}
PARAMS = [(name, v) for name, (_, values, _) in CALLS.items() for v in values]


@pytest.mark.parametrize("name,value", PARAMS, ids=[f"{n}={v!r}" for n, v in PARAMS])
def test_bad_number(name, value, moe, kda):
    param, _, fn = CALLS[name]
    with pytest.raises(ValueError, match=f"^{param}: expected"):
        fn({"moe": moe, "kda": kda}, value)
