"""The persistent single-launch MoE (kernels/moe/persistent*.py) against the fp32 reference: W4A16
(bf16 activations) and A8W4 (e4m3 activations quantized in the kernel) with bf16 and MXFP4
experts, M = 1, 4, 16 at the tiny preset and its tp shards, atomic and deterministic stage 2,
the fp8 latent tail, the tensor-core dot mode (emulated under the interpreter), routing inside
(2 launches, or 1 with the route's programs as work items), the e4m3 rounding against torch's
cast, bad input; GPU: K3 at tp 1, 8 and 16, CUDA graphs, real concurrency.

Under the interpreter programs run one by one, so the ticket order is tested as a schedule but
races are not: the GPU tests cover those."""

import dataclasses

import pytest
import torch
import triton
import triton.language as tl

from k3lab.boundaries import assert_close
from k3lab.config import preset
from k3lab.kernels import route_sort
from k3lab.kernels.moe.front_route import FRONT_ROUTE_CONFIG
from k3lab.kernels.moe.persistent import (
    FP8Rows,
    PersistentMoEConfig,
    fp8_rows_quantize,
    moe_persistent,
    persistent_kernel_weights,
)
from k3lab.kernels.moe.persistent_gemv import pow2_scales, round_e4m3
from k3lab.kernels.moe.persistent_kernel import SYNC_HEADER
from k3lab.kernels.mxfp4 import mxfp4_layout
from k3lab.kernels.route.config import RouteConfig
from k3lab.profile import count_launches
from k3lab.reference import moe as ref
from k3lab.reference.route import route_sort_reference
from k3lab.weights import hidden_states, make_generator, moe_weights

# Tolerances against the fp32 truth (reference.latent_moe_from_plan_reference, dtype fp32).
# W4A16: the kernel rounds z, a, the shared activation and the output to bf16 (2^-9 relative
# each, carried through D-, I- and S-long dot products); MXFP4 adds no error (the reference
# dequantizes the same codes): elementwise, as test_moe.py's block.
W4A16_ATOL, W4A16_RTOL = 0.03, 0.01
# A8W4: e4m3 keeps 3 mantissa bits, so rounding an element errs by at most 2^-4 of it, about
# 2^-3 / sqrt(12) ~ 0.036 of it rms over a binade (0.026 averaged over magnitudes). Stage 1's
# gate and up outputs then err by ~0.026 of their rms (independent errors add like the signal
# over a dot product), the activation carries both (~0.037), its own rounding adds 0.026: a, and
# so y, err by ~0.045 of their rms; the RMSNorm removes scale only and the up-projection keeps
# the relative error; the shared term adds signal and no error. So the output errs by <= 0.045
# of its norm (Frobenius, relative), bounded here with 2x; elementwise the error is ~Gaussian
# with sigma <= 0.045 rms(out), and 6 sigma bounds the largest of a few thousand elements.
A8W4_FRO, A8W4_ELEM = 0.09, 0.27  # relative norm error; elementwise, times rms(truth)
# the fp8 tail: e4m3 weights with per-channel scales add ~0.026 of the routed term's rms
# (sqrt(0.045^2 + 0.026^2) = 0.052 with fp8 activations; 0.026 with bf16 ones), 2x and 6 sigma
FP8_TAIL_FRO, FP8_TAIL_ELEM = 0.1, 0.31
W4A16_FP8_TAIL_FRO, W4A16_FP8_TAIL_ELEM = 0.052, 0.16
# against the reference that quantizes the same way (latent_moe_a8_from_plan_reference, or the
# fp32 truth with the fp8 tail's dequantized weight): the W4A16 sources minus the roundings
# the reference repeats; a z or a element whose bf16 rounding differs (accumulation order)
# may round to another e4m3 value, one element of a D- or I-long dot product: within them.
SAME_QUANT_ATOL, SAME_QUANT_RTOL = W4A16_ATOL, W4A16_RTOL

# few, large work items under the interpreter (every program and item costs Python time), each
# masked at the tiny preset's sizes; test_block_gpu_tiles_several_programs runs the GPU tiles
BIG = PersistentMoEConfig(front_block_n=128, expert_block_n=128, tail_block_n=256, block_k=256,
                          max_products=1 << 22)


def _setup(device, *, name="tiny", tp=1, M=1, fmt="bf16", seed=0, crowd=False, **changes):
    cfg = preset(name, tp)
    if changes:
        cfg = dataclasses.replace(cfg, **changes)
    gen = make_generator(seed, device)
    w = moe_weights(cfg, gen, expert_format=fmt)
    if crowd:  # every token to the first top_k experts: M tokens an expert
        w["correction_bias"][: cfg.top_k] += 10.0
    return cfg, w, hidden_states(cfg, M, gen)


def _plan(cfg, x, w, block_m=1):
    return route_sort_reference(
        x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k, n_group=cfg.n_group,
        topk_group=cfg.topk_group, renormalize=cfg.renormalize,
        routed_scaling_factor=cfg.routed_scaling, block_m=block_m, out_dim=cfg.moe_in)


def _check_quantized(name, got, truth, fro, elem):
    """Relative Frobenius error <= fro and elementwise |err| <= elem * rms(truth)."""
    got, truth = got.float(), truth.float()
    rel = float((got - truth).norm() / truth.norm())
    assert rel <= fro, f"{name}: relative norm error {rel:.4f} exceeds {fro}"
    assert_close(name, got, truth, atol=elem * float(truth.pow(2).mean().sqrt()))


def _check(x, w, cfg, plan, config, num_sms=None, refs=None):
    """Run the kernel; check it against the fp32 truth with its format's tolerances and, for
    quantized formats, against the reference that quantizes the same way. ``refs``: a dict that
    keeps the references computed for these inputs (several configs, one x). Returns the
    output."""
    refs = {} if refs is None else refs
    kw = persistent_kernel_weights(w, config)
    out = moe_persistent(x, kw, cfg=cfg, plan=plan, config=config, num_sms=num_sms)
    assert out.shape == x.shape and out.dtype == torch.bfloat16
    if "truth" not in refs:
        refs["truth"] = ref.latent_moe_from_plan_reference(x, plan, w, cfg)
    truth = refs["truth"]
    up = kw["latent_up_fp8"].dequantize() if config.tail_fp8 and cfg.latent else None
    key = (config.fp8, up is not None)
    if key not in refs:
        if config.fp8:
            refs[key] = ref.latent_moe_a8_from_plan_reference(x, plan, w, cfg, up_weight=up)
        elif up is not None:
            refs[key] = ref.latent_moe_from_plan_reference(x, plan, {**w, "latent_up": up}, cfg)
        else:
            refs[key] = None
    same = refs[key]
    if same is not None:
        assert_close("out vs same quantization", out, same, atol=SAME_QUANT_ATOL,
                     rtol=SAME_QUANT_RTOL)
    if config.fp8:
        fro, elem = (FP8_TAIL_FRO, FP8_TAIL_ELEM) if up is not None else (A8W4_FRO, A8W4_ELEM)
        _check_quantized("out", out, truth, fro, elem)
    elif up is not None:
        _check_quantized("out", out, truth, W4A16_FP8_TAIL_FRO, W4A16_FP8_TAIL_ELEM)
    else:
        assert_close("out", out, truth, atol=W4A16_ATOL, rtol=W4A16_RTOL)
    return out


# ---------------------------------------------------------------------------------------------
# the e4m3 rounding and scales (kernel helpers against torch)


@triton.jit
def _quant_probe(p_v, p_r, p_a, p_inv, p_sc, N: tl.constexpr):
    o = tl.arange(0, N)
    tl.store(p_r + o, round_e4m3(tl.load(p_v + o)))
    b_inv, b_sc = pow2_scales(tl.load(p_a + o))
    tl.store(p_inv + o, b_inv)
    tl.store(p_sc + o, b_sc)


def test_e4m3_rounding_and_scales_match_torch(device):
    """round_e4m3 is torch's float8_e4m3fn cast (nearest even) on bf16 inputs (what the kernel
    quantizes): every e4m3 value, every midpoint between neighbours (ties), the bf16 values
    next to them, subnormals and random values; any fp32 input of magnitude >= 2^-6; and
    pow2_scales is the reference's fp8_row_scales."""
    grid = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid) & (grid >= 0)].unique().sort().values
    mids = ((grid[1:] + grid[:-1]) / 2).to(torch.bfloat16)
    up, down = ((mids.view(torch.int16) + d).view(torch.bfloat16) for d in (1, -1))
    v = torch.cat([grid, *(t.float() for t in (mids, up, down))])
    rand = torch.rand(512, generator=make_generator(1, "cpu")) * 2 ** -6
    v = torch.cat([v, -v, torch.randn(4096, generator=make_generator(0, "cpu")) * 40 + 1,
                   rand.to(torch.bfloat16).float()])
    v = v[v.abs() <= 448]
    n = triton.next_power_of_2(v.numel())
    v = torch.cat([v, torch.zeros(n - v.numel())]).to(device)
    amax = torch.cat([torch.tensor([0.0, 448.0, 449.0, 1.0, 1.75, 1.7500001, 2.0 ** -140,
                                    3.0e38]),
                      torch.rand(n - 8, generator=make_generator(2, "cpu")) * 1e4]).to(device)
    r, inv, sc = (torch.empty(n, device=device) for _ in range(3))
    _quant_probe[(1,)](v, r, amax, inv, sc, N=n)
    assert torch.equal(r, v.to(torch.float8_e4m3fn).float())
    want = ref.fp8_row_scales(amax[:, None])[:, 0]
    assert torch.equal(sc, want) and torch.equal(inv * sc, torch.ones_like(sc))
    ok = amax[(amax > 2.0 ** -100) & (amax < 1e38)]
    s = ref.fp8_row_scales(ok[:, None])[:, 0]
    assert bool(((ok / s <= 448) & (ok / s > 224)).all())  # the smallest power of two


def test_fp8_rows_quantize():
    w = torch.randn(40, 96, generator=make_generator(3, "cpu")).to(torch.bfloat16)
    w[5] = 0.0
    q = fp8_rows_quantize(w)
    assert q.values.dtype == torch.float8_e4m3fn and q.scales.shape == (40,)
    assert float(q.values.float().abs().amax(1)[:5].min()) == 448.0
    amax = w.float().abs().amax(1, keepdim=True).clamp_min(1e-30)
    rel = (q.dequantize() - w.float()).abs() / amax
    assert float(rel.max()) <= 16 / 448 + 1e-6  # half an ulp of [256, 448] (32) over 448
    assert float(q.dequantize()[5].abs().max()) == 0.0


# ---------------------------------------------------------------------------------------------
# the block at tiny (interpreter)

CASES = [  # M, expert format, activations, deterministic
    pytest.param(1, "bf16", "bf16", False, id="M1-bf16-w16a16-atomic"),
    pytest.param(1, "mxfp4", "bf16", True, id="M1-mxfp4-w4a16-det"),
    pytest.param(1, "mxfp4", "fp8", False, id="M1-mxfp4-a8w4-atomic"),
    pytest.param(4, "mxfp4", "bf16", False, id="M4-mxfp4-w4a16-atomic"),
    pytest.param(4, "mxfp4", "fp8", True, id="M4-mxfp4-a8w4-det"),
    pytest.param(4, "bf16", "fp8", False, id="M4-bf16-a8w16-atomic"),
    pytest.param(16, "mxfp4", "bf16", False, id="M16-mxfp4-w4a16-atomic"),
    pytest.param(16, "mxfp4", "fp8", True, id="M16-mxfp4-a8w4-det"),
]


@pytest.mark.parametrize("M,fmt,acts,det", CASES)
def test_block_tiny(M, fmt, acts, det, device):
    cfg, w, x = _setup(device, M=M, fmt=fmt, seed=M)
    config = dataclasses.replace(BIG, activations=acts, deterministic=det)
    _check(x, w, cfg, _plan(cfg, x, w), config)


@pytest.mark.parametrize("tp,fmt,acts,det", [(3, "mxfp4", "bf16", False),
                                             (3, "mxfp4", "fp8", True),
                                             (2, "bf16", "bf16", True),
                                             (6, "bf16", "fp8", False)])
def test_block_tiny_tp_shards(tp, fmt, acts, det, device):
    """tp shards of tiny (expert intermediate 32, 48, 16; shared 40, 60, 20): MXFP4 where the
    shard is a multiple of 32."""
    cfg, w, x = _setup(device, tp=tp, M=2, fmt=fmt, seed=tp)
    _check(x, w, cfg, _plan(cfg, x, w), dataclasses.replace(BIG, activations=acts,
                                                            deterministic=det))


def test_block_gpu_tiles_several_programs(device):
    """The default (GPU-sized) tiles, many work items a phase, over 3 SMs x 2 programs, called
    twice on new inputs: the counters restart from zero (the last program zeroes them)."""
    cfg, w, x = _setup(device, M=1, fmt="mxfp4", seed=7)
    config = PersistentMoEConfig(programs_per_sm=2, activations="fp8")
    _check(x, w, cfg, _plan(cfg, x, w), config, num_sms=3)
    x2 = hidden_states(cfg, 1, make_generator(8, device))
    _check(x2, w, cfg, _plan(cfg, x2, w), config, num_sms=3)
    from k3lab.kernels.moe import persistent as mod
    assert int(mod._SYNC[x.device][:SYNC_HEADER + cfg.top_k].abs().sum()) == 0


@pytest.mark.parametrize("det", [False, True], ids=["atomic", "det"])
def test_stage2_items_sized_apart_from_stage1(det, device):
    """stage2_block_n: stage 2's D rows a work item (and the deterministic reduce's) apart from
    stage 1's I rows, wider and narrower, K-lane and fma; expert_block_k: the experts' K step
    apart from the front's and the tail's: the same block."""
    cfg, w, x = _setup(device, M=2, fmt="mxfp4", seed=4)
    plan, refs = _plan(cfg, x, w), {}
    for multiply, n1, n2, k in (("klane", 16, 64, None), ("fma", 64, 8, None),
                                ("klane", 8, 32, 32)):
        config = dataclasses.replace(BIG, multiply=multiply, expert_block_n=n1,
                                     stage2_block_n=n2, expert_block_k=k, deterministic=det)
        _check(x, w, cfg, plan, config, num_sms=2, refs=refs)


def test_block_plan_tiles_of_several_tokens(device):
    """block_m 4 with every token on the same experts: tiles of 3 entries and a padding row."""
    cfg, w, x = _setup(device, M=3, fmt="mxfp4", crowd=True)
    plan = _plan(cfg, x, w, block_m=4)
    assert int(plan.topk_ids.eq(plan.topk_ids[0, 0]).sum()) == 3
    for det in (False, True):
        _check(x, w, cfg, plan, dataclasses.replace(BIG, deterministic=det, activations="fp8"))


def test_block_no_latent(device):
    """K2-style: no latent (z is x), SiLU, grouped routing and a routed scaling factor."""
    cfg, w, x = _setup(device, M=2, latent=0, activation="silu", routed_scaling=2.827,
                       n_group=4, topk_group=2)
    for acts in ("bf16", "fp8"):
        _check(x, w, cfg, _plan(cfg, x, w), dataclasses.replace(BIG, activations=acts))


@pytest.mark.parametrize("acts", ["bf16", "fp8"])
def test_block_fp8_tail(acts, device):
    cfg, w, x = _setup(device, M=2, fmt="mxfp4", seed=11)
    _check(x, w, cfg, _plan(cfg, x, w), dataclasses.replace(BIG, activations=acts,
                                                            tail_fp8=True))


@pytest.mark.parametrize("acts", ["bf16", "fp8"])
def test_block_dot_mode(acts, device):
    """tl.dot tiles (e4m3 x e4m3 a group at a time for A8W4, bf16 for W4A16), interpreted on fp32
    operands of the same values."""
    cfg, w, x = _setup(device, M=1, fmt="mxfp4", seed=12)
    _check(x, w, cfg, _plan(cfg, x, w), dataclasses.replace(BIG, activations=acts,
                                                            multiply="dot"))


@pytest.mark.parametrize("fmt,latent,M,block_m,acts", [
    ("mxfp4", 256, 1, 1, "bf16"), ("bf16", 96, 3, 4, "bf16"), ("mxfp4", 256, 1, 1, "fp8"),
    ("mxfp4", 96, 4, 2, "fp8")],
    ids=["mxfp4-tiled-w13", "bf16-tiles-of-3", "a8w4-tiled-w13", "a8w4-tiles-of-2"])
def test_block_klane(fmt, latent, M, block_m, acts, device):
    """The stages' K-lane GEMVs inside the persistent launch (multiply='klane'): MXFP4 with w13
    in the tiled layout (a latent of 256 allows it), bf16 experts with tiles of several
    tokens; A8W4 (e4m3 activations quantized as they load, per token inside a tile), against
    the fp32 truth and the reference that quantizes the same way."""
    cfg, w, x = _setup(device, M=M, fmt=fmt, latent=latent, crowd=block_m > 1)
    config = dataclasses.replace(BIG, multiply="klane", block_k=64, activations=acts)
    if fmt == "mxfp4":
        want = "tiled" if latent == 256 else "rows"
        assert persistent_kernel_weights(w, config)["w13"].layout == want
    _check(x, w, cfg, _plan(cfg, x, w, block_m), config)


def test_tiles_fit_the_product_budget():
    """The fma GEMVs' K step shrinks (down to one MXFP4 group) until tokens x rows x K products
    fit config.max_products; the fp8 dot steps one group; shapes cap the blocks."""
    from k3lab.kernels.moe.persistent import _tiles
    k3 = (7168, 3584, 384, 768)
    C32 = PersistentMoEConfig(front_block_n=32, expert_block_n=32, tail_block_n=32, block_k=128)
    t = _tiles(C32, 16, 1, k3, True)
    assert (t["BLOCK_MT"], t["BLOCK_NF"], t["BLOCK_KF"]) == (16, 32, 32)
    assert (t["BLOCK_ME"], t["BLOCK_NE"], t["BLOCK_KE"]) == (1, 32, 128)
    assert _tiles(C32, 1, 1, k3, True)["BLOCK_KF"] == 128
    assert _tiles(C32, 4, 16, k3, True)["BLOCK_KE"] == 32
    dot = _tiles(dataclasses.replace(C32, multiply="dot", activations="fp8"), 1, 1, k3, True)
    assert (dot["BLOCK_ME"], dot["BLOCK_NE"], dot["BLOCK_KE"]) == (16, 32, 32)
    wide = _tiles(dataclasses.replace(C32, expert_block_k=1024, max_products=1 << 16), 1, 1,
                  k3, True)
    assert (wide["BLOCK_KF"], wide["BLOCK_KE"]) == (128, 1024)
    tiny = _tiles(C32, 1, 1, (200, 96, 96, 120), True)
    assert (tiny["BLOCK_KF"], tiny["BLOCK_KE"]) == (128, 128)


def test_atomic_and_deterministic_agree(device):
    """Atomic and deterministic stage 2 sum the same partials in other orders: outputs within a
    bf16 rounding of each other; the deterministic one bitwise the same call after call."""
    cfg, w, x = _setup(device, M=2, fmt="mxfp4", seed=5)
    plan = _plan(cfg, x, w)
    det = moe_persistent(x, w, cfg=cfg, plan=plan, config=dataclasses.replace(
        BIG, deterministic=True))
    assert torch.equal(det, moe_persistent(x, w, cfg=cfg, plan=plan, config=dataclasses.replace(
        BIG, deterministic=True)))
    atomic = moe_persistent(x, w, cfg=cfg, plan=plan, config=BIG)
    assert_close("atomic vs deterministic", atomic, det, atol=1e-3, rtol=2 ** -7)


def test_routing_inside_is_two_launches(device):
    """Without a plan the launcher routes (route_sort) first: 2 launches for the block, and the
    result is the reference's given route_sort's plan."""
    cfg, w, x = _setup(device, M=1, fmt="mxfp4", seed=2)

    outs = []

    def run(inp):
        outs.append(moe_persistent(inp["x"], inp["w"], cfg=cfg, config=BIG))

    lc = count_launches(run, {"x": x, "w": w})  # the warm-up makes the per-device counters
    assert lc.count <= 2, lc.kernels
    plan = route_sort(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                      n_group=cfg.n_group, topk_group=cfg.topk_group,
                      renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)
    assert_close("out", outs[-1], ref.latent_moe_from_plan_reference(x, plan, w, cfg),
                 atol=W4A16_ATOL, rtol=W4A16_RTOL)
    assert count_launches(lambda i: moe_persistent(x, w, cfg=cfg, plan=i, config=BIG),
                          plan, warmup=False).count == 1


@pytest.mark.parametrize("M,block_m,crowd", [(1, 1, False), (3, 4, False), (4, 2, True)],
                         ids=["M1", "M3-bm4", "M4-crowded"])
def test_route_items_are_one_launch(M, block_m, crowd, device):
    """With route_items the router's programs are the launch's first work items: 1 launch for
    the block with routing, and bitwise the output of route_sort's launch (same route config)
    and then the launch given its plan (deterministic stage 2), including crowded experts and
    plan tiles of several tokens."""
    cfg, w, x = _setup(device, M=M, fmt="mxfp4", seed=11, crowd=crowd)
    items = dataclasses.replace(BIG, deterministic=True, route_items=True)
    outs = []

    def run(inp):
        outs.append(moe_persistent(inp["x"], w, cfg=cfg, block_m=block_m, config=items))

    lc = count_launches(run, {"x": x})
    assert lc.count == 1, lc.kernels
    plan = route_sort(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                      n_group=cfg.n_group, topk_group=cfg.topk_group,
                      renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling,
                      block_m=block_m, config=FRONT_ROUTE_CONFIG)
    apart = moe_persistent(x, w, cfg=cfg, plan=plan, block_m=block_m,
                           config=dataclasses.replace(items, route_items=False))
    assert torch.equal(outs[-1], apart)
    assert_close("out", outs[-1], ref.latent_moe_from_plan_reference(x, plan, w, cfg),
                 atol=W4A16_ATOL, rtol=W4A16_RTOL)


def test_route_items_fall_back_where_the_selection_is_a_launch(device):
    """Where route_sort spreads its selection over a launch of its own (over 256 experts,
    more tokens than a selection block), route items would leave stage 1 waiting on a plan
    nobody selects: the launcher routes apart instead (2 launches), with the same output."""
    cfg, w, x = _setup(device, M=16, fmt="bf16", seed=4, n_experts=300)
    items = dataclasses.replace(BIG, deterministic=True, route_items=True,
                                route_config=RouteConfig())
    lc = count_launches(lambda i: moe_persistent(i, w, cfg=cfg, config=items), x)
    assert lc.count == 3, lc.kernels  # route_sort's GEMV, its selection, the block
    plan = route_sort(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                      n_group=cfg.n_group, topk_group=cfg.topk_group,
                      renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)
    assert torch.equal(moe_persistent(x, w, cfg=cfg, config=items),
                       moe_persistent(x, w, cfg=cfg, plan=plan, config=items))


# ---------------------------------------------------------------------------------------------
# the moe boundary's persistent variants


def test_boundary_tolerances_are_the_derived_ones():
    from k3lab.boundaries import moe as bmoe
    assert bmoe.QUANTIZED_TOLERANCES == {
        "a8w4": (A8W4_FRO, A8W4_ELEM), "a8w4+fp8 tail": (FP8_TAIL_FRO, FP8_TAIL_ELEM),
        "w4a16+fp8 tail": (W4A16_FP8_TAIL_FRO, W4A16_FP8_TAIL_ELEM)}


@pytest.mark.parametrize("name", ["persistent", "persistent_a8w4", "persistent_fp8_tail"])
def test_boundary_variants(name, device):
    """Registered on the moe boundary: the boundary's check passes (with the format's
    tolerances), and the launches are the boundary's LAUNCHES (1 given the plan, 2 routing)."""
    from k3lab.boundaries import clone_inputs, get
    from k3lab.boundaries import moe as bmoe
    b = get("moe")
    inputs = b.make_inputs(preset("tiny", 1), device, 3, M=1, expert_format="mxfp4",
                           route=True)
    v = b.variant(name)
    assert v.role == "fused"
    inputs = {**inputs, "config": BIG}
    out = v.fn(clone_inputs(inputs))
    assert getattr(out, "k3lab_numerics", None) == {
        "persistent": None, "persistent_a8w4": "a8w4",
        "persistent_fp8_tail": "w4a16+fp8 tail"}[name]
    b.check(out, None, inputs)
    lc = count_launches(v.fn, clone_inputs(inputs), warmup=False)
    assert lc.count == bmoe.LAUNCHES[name][1], lc.kernels
    given = {**inputs, "route": False}
    assert count_launches(v.fn, given, warmup=False).count == bmoe.LAUNCHES[name][0]


# ---------------------------------------------------------------------------------------------
# bad input


@pytest.mark.parametrize("field,value", [
    ("programs_per_sm", 0), ("deterministic", 1), ("activations", "fp4"), ("multiply", "mma"),
    ("tail_fp8", "yes"), ("front_block_n", 24), ("expert_block_n", 0), ("tail_block_n", 1024),
    ("block_k", 16), ("num_warps", 3), ("max_products", 0),
    ("stage2_block_n", 3), ("expert_block_k", 48), ("overlap_route", None),
    ("route_items", 1), ("route_config", {"gemv_row_splits": 4}), ("max_registers", 16)])
def test_bad_config(field, value):
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        PersistentMoEConfig(**{field: value})


def test_bad_input(device):
    cfg, w, x = _setup(device, M=1, fmt="mxfp4")
    plan = _plan(cfg, x, w)
    with pytest.raises(ValueError, match="config: expected a PersistentMoEConfig"):
        moe_persistent(x, w, cfg=cfg, plan=plan, config={"deterministic": True})
    cfg256, w256, _ = _setup(device, M=1, fmt="mxfp4", latent=256)  # w13 can be tiled
    with pytest.raises(ValueError, match="w13: moe_persistent reads MXFP4 in the row layout "
                       r"\(the tiled one with multiply='klane'\)"):
        moe_persistent(x, {**w256, "w13": mxfp4_layout(w256["w13"], "tiled")}, cfg=cfg256,
                       plan=_plan(cfg256, x, w256))
    with pytest.raises(ValueError, match="weights: config.tail_fp8 needs"):
        moe_persistent(x, w, cfg=cfg, plan=plan, config=PersistentMoEConfig(tail_fp8=True))
    bad_up = FP8Rows(w["latent_up"].to(torch.float8_e4m3fn)[:, :64].contiguous(),
                     torch.ones(cfg.hidden))
    with pytest.raises(ValueError, match="latent_up_fp8: expected values"):
        moe_persistent(x, {**w, "latent_up_fp8": bad_up}, cfg=cfg, plan=plan,
                       config=PersistentMoEConfig(tail_fp8=True))
    with pytest.raises(ValueError, match="num_sms: expected a positive int"):
        moe_persistent(x, w, cfg=cfg, plan=plan, num_sms=0)
    with pytest.raises(ValueError, match="x: expected dtype"):
        moe_persistent(x.float(), w, cfg=cfg, plan=plan)
    x17 = hidden_states(cfg, 17, make_generator(0, device))
    with pytest.raises(ValueError, match="x: expected 1 <= M <= 16"):
        moe_persistent(x17, w, cfg=cfg, plan=plan)
    with pytest.raises(ValueError, match="w2: w13 and w2 must both be"):
        moe_persistent(x, {**w, "w2": w["w2"].dequantize().to(torch.bfloat16)}, cfg=cfg,
                       plan=plan)
    bf16_experts = {**w, "w13": w["w13"].dequantize().to(torch.bfloat16),
                    "w2": w["w2"].dequantize().to(torch.bfloat16)}
    with pytest.raises(ValueError, match="w13: multiply='klane' quantizes activations to e4m3 "
                                         "only against MXFP4 experts"):
        moe_persistent(x, bf16_experts, cfg=cfg, plan=plan, config=PersistentMoEConfig(
            multiply="klane", activations="fp8"))
    with pytest.raises(ValueError, match="plan"):
        moe_persistent(x, w, cfg=cfg, plan=_plan(cfg, hidden_states(cfg, 2, make_generator(
            1, device)), w))


# ---------------------------------------------------------------------------------------------
# compiled for sm_90 without a GPU (a subprocess with the kernels imported compiled)

_COMPILE_SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "0"
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3lab.kernels.moe import persistent as P
import k3lab.kernels.runtime as rt
from k3lab.config import preset
from k3lab.weights import make_generator, moe_weights, hidden_states
from k3lab.reference.route import route_sort_reference
assert not P.INTERPRETED
rt.INTERPRETED = True  # the launcher's checks take CPU tensors; the kernel is compiled below
fn, seen = P.moe_persistent_kernel, {}

class Capture:
    def __getitem__(self, grid):
        return lambda *args, **kw: seen.update(args=args, kw=kw)

P.moe_persistent_kernel = Capture()
names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32",
         torch.uint8: "u8", torch.float8_e4m3fn: "fp8e4nv"}
cfg = preset("tiny")
gen = make_generator(0, "cpu")
for fmt, spec in (("mxfp4", "PersistentMoEConfig(activations='fp8')"),
                  ("mxfp4", "PersistentMoEConfig(activations='fp8', multiply='dot')"),
                  ("mxfp4", "PersistentMoEConfig(multiply='klane', deterministic=True)"),
                  ("bf16", "PersistentMoEConfig(multiply='dot', tail_fp8=True)")):
    config = eval("P." + spec)
    w = moe_weights(cfg, gen, expert_format=fmt)
    x = hidden_states(cfg, 2, gen)
    plan = route_sort_reference(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                                block_m=1, out_dim=cfg.moe_in)
    P.moe_persistent(x, P.persistent_kernel_weights(w, config), cfg=cfg, plan=plan,
                     config=config)
    kw = dict(seen["kw"])
    warps = kw.pop("num_warps")
    values = list(seen["args"]) + [kw[p.name] for p in fn.params[len(seen["args"]):]]
    sig, const = {}, {}
    for p, v in zip(fn.params, values):
        if p.is_constexpr:
            sig[p.name], const[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + names[v.dtype]
        else:
            sig[p.name] = "fp32" if isinstance(v, float) else "i32"
    k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": warps})
    print("CONFIG", fmt, spec)
    print(k.asm["ptx"])
"""


@pytest.mark.slow
def test_compiles_for_sm90_with_its_memory_ordering():
    """Four configs compile for sm_90 (fma and dot A8W4, K-lane deterministic, bf16 dot with
    the fp8 tail), and each keeps the synchronization the schedule relies on: relaxed ticket
    adds, release increments, acquire RMWs after volatile polls, an acq_rel exit count, and
    (dot) tensor-core mma instructions."""
    import os
    import re
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], env=env, capture_output=True,
                         text=True, timeout=900)
    tail = run.stderr[-2000:]
    if (run.returncode and re.search(r"FileNotFoundError|No such file|not found", tail)
            and "CompilationError" not in tail):
        pytest.skip(f"no CUDA compiler backend here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    parts = run.stdout.split("CONFIG ")[1:]
    assert len(parts) == 4
    for part in parts:
        head = part.splitlines()[0]
        for pattern in (r"atom\.global\.gpu\.relaxed\.add", r"red\.global\.gpu\.release\.add",
                        r"atom\.global\.gpu\.acquire\.max", r"ld\.volatile\.global",
                        r"atom\.global\.gpu\.acq_rel\.add"):
            assert re.search(pattern, part), (head, pattern)
        if "multiply='dot'" in head:
            assert re.search(r"mma\.sync\.aligned", part), head


# ---------------------------------------------------------------------------------------------
# GPU: K3 shards, real concurrency, CUDA graphs

GPU_CONFIGS = {
    "w4a16": PersistentMoEConfig(),
    "w4a16-det": PersistentMoEConfig(deterministic=True),
    "a8w4": PersistentMoEConfig(activations="fp8"),
    "a8w4-det": PersistentMoEConfig(activations="fp8", deterministic=True),
    "a8w4-dot-fp8tail": PersistentMoEConfig(activations="fp8", multiply="dot", tail_fp8=True),
    "w4a16-dot": PersistentMoEConfig(multiply="dot"),
    "w4a16-klane": PersistentMoEConfig(multiply="klane"),
    "a8w4-klane": PersistentMoEConfig(multiply="klane", activations="fp8"),
}


def _k3(tp, M, fmt="mxfp4"):
    cfg = preset("kimi-k3", tp)
    gen = make_generator(M + tp, "cuda")
    w = moe_weights(cfg, gen, expert_format=fmt)
    return cfg, w, hidden_states(cfg, M, gen)


@pytest.mark.gpu
@pytest.mark.big_gpu
@pytest.mark.parametrize("tp", [1, 8, 16])
def test_gpu_k3_block(tp):
    """K3 shards with MXFP4 experts, M = 1, 4, 16: the block given route_sort's plan against the
    references, every GPU config."""
    cfg = preset("kimi-k3", tp)
    gen = make_generator(tp, "cuda")
    w = moe_weights(cfg, gen, expert_format="mxfp4")
    for M in (1, 4, 16):
        x = hidden_states(cfg, M, gen)
        plan = route_sort(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                          n_group=cfg.n_group, topk_group=cfg.topk_group,
                          renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)
        refs = {}
        for config in GPU_CONFIGS.values():
            _check(x, w, cfg, plan, config, refs=refs)
    del w
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_grid_beyond_residency():
    """64 programs an SM (far more than fit): programs that cannot start yet take later
    tickets when they do, so nothing waits on them; the result is right."""
    cfg, w, x = _k3(8, 4)
    plan = route_sort(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                      renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)
    for det in (False, True):
        _check(x, w, cfg, plan, PersistentMoEConfig(programs_per_sm=64, deterministic=det))


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_gpu_k3_tp8_launches_and_determinism(fmt):
    """With routing, one launch besides the route's: at one token 2 in all; at 16 the route
    takes its own selection launch too (``RouteConfig.select_programs_min_tokens``).
    Deterministic bitwise call after call; atomic within a bf16 rounding of it."""
    cfg, w, x = _k3(8, 16, fmt)
    det_cfg = PersistentMoEConfig(deterministic=True)

    def run(inp):
        return moe_persistent(inp["x"], w, cfg=cfg, config=inp["config"])

    def route(inp):
        return route_sort(inp["x"], w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                          n_group=cfg.n_group, topk_group=cfg.topk_group,
                          renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)

    one = x[:1].contiguous()
    assert count_launches(run, {"x": one, "config": det_cfg}).count == 2
    assert (count_launches(run, {"x": x, "config": det_cfg}).count
            == count_launches(route, {"x": x}).count + 1)
    det = run({"x": x, "config": det_cfg})
    for _ in range(5):
        assert torch.equal(run({"x": x, "config": det_cfg}), det)
        assert_close("atomic vs det", run({"x": x, "config": PersistentMoEConfig()}), det,
                     atol=1e-3, rtol=2 ** -7)


@pytest.mark.gpu
@pytest.mark.parametrize("change", [{"overlap_route": True}, {"route_items": True}],
                         ids=["overlap", "route-items"])
def test_gpu_routing_schedules_change_nothing(change):
    """K3 tp 8, routing in the launch, deterministic: the launch started while the route runs
    (overlap_route), or running the route's programs as its first items (route_items, with
    route_sort's config there), gives the bitwise output of the launch started after
    route_sort's, eager and in a CUDA graph of 16 calls on distinct x replayed 20 times."""
    cfg, w, _ = _k3(8, 1)
    xs = [hidden_states(cfg, 1, make_generator(100 + s, "cuda")) for s in range(16)]
    off = PersistentMoEConfig(deterministic=True, overlap_route=False,
                              route_config=RouteConfig())
    on = dataclasses.replace(off, **change)
    want = [moe_persistent(x, w, cfg=cfg, config=off).clone() for x in xs]
    for x, ref_out in zip(xs, want, strict=True):
        assert torch.equal(moe_persistent(x, w, cfg=cfg, config=on), ref_out)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_persistent(xs[0], w, cfg=cfg, config=on)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [moe_persistent(x, w, cfg=cfg, config=on) for x in xs]
    for _ in range(20):
        graph.replay()
        torch.cuda.synchronize()
        for out, ref_out in zip(outs, want, strict=True):
            assert torch.equal(out, ref_out)


@pytest.mark.gpu
@pytest.mark.parametrize("acts", ["bf16", "fp8"])
def test_gpu_cuda_graph(acts):
    """route_sort + the persistent launch captured once and replayed on new x, no host sync:
    right every replay (the counters restart from zero)."""
    cfg, w, x = _k3(8, 4)
    config = PersistentMoEConfig(activations=acts)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_persistent(x, w, cfg=cfg, config=config)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_persistent(x, w, cfg=cfg, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_persistent(x, w, cfg=cfg, config=config)
    for seed in (1, 2, 3):
        x.copy_(hidden_states(cfg, 4, make_generator(seed, "cuda")))
        graph.replay()
        torch.cuda.synchronize()
        plan = route_sort(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                          renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling)
        truth = ref.latent_moe_from_plan_reference(x, plan, w, cfg)
        if acts == "fp8":
            _check_quantized("out", out, truth, A8W4_FRO, A8W4_ELEM)
        else:
            assert_close("out", out, truth, atol=W4A16_ATOL, rtol=W4A16_RTOL)


# ---------------------------------------------------------------------------------------------
# the item trace


def test_trace_needs_the_compiled_kernel_and_a_bool(device):
    cfg, w, x = _setup(device, M=1, fmt="mxfp4")
    plan = _plan(cfg, x, w)
    with pytest.raises(ValueError, match="trace: expected a bool"):
        moe_persistent(x, w, cfg=cfg, plan=plan, config=BIG, trace=1)
    if device.type == "cpu":
        with pytest.raises(ValueError, match="trace: needs the compiled kernel"):
            moe_persistent(x, w, cfg=cfg, plan=plan, config=BIG, trace=True)


@pytest.mark.gpu
def test_trace_stamps_every_item_in_ticket_order():
    """Every ticket gets a start and an end on the GPU clock; an item of a later phase never
    ends before the first item of an earlier phase starts; the output is the untraced one."""
    cfg, w, x = _setup(torch.device("cuda"), name="kimi-k3", tp=8, M=1, fmt="mxfp4", seed=1)
    plan = _plan(cfg, x, w)
    config = PersistentMoEConfig(multiply="klane")
    out, tr = moe_persistent(x, w, cfg=cfg, plan=plan, config=config, trace=True)
    items = tr.items.cpu()
    assert items.shape == (tr.n_items, 4)
    start, end = items[:, 0], items[:, 1]
    assert bool((start > 0).all()) and bool((end >= start).all())
    assert list(tr.phases) == ["front", "stage1", "stage2", "reduce", "tail"]
    assert sorted(tr.phases.values()) == list(tr.phases.values())
    tail = tr.phases["tail"]
    assert int(end[tail:].min()) >= int(start[:tr.phases["stage1"]].min())
    assert_close("out", out, moe_persistent(x, w, cfg=cfg, plan=plan, config=config),
                 atol=W4A16_ATOL, rtol=W4A16_RTOL)
