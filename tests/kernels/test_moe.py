"""Latent MoE boundary: front (latent down + shared gate/up), stage 1 direct tile, stage 2
(atomic and deterministic), tail (norm + up + shared) and the composed block against the
op-by-op fp32 reference (kernels/moe/ vs k3lab/reference/moe.py); the reference against an
independent dense formulation; bf16 and MXFP4 experts (vs the dequantized reference), the MXFP4
K-lane and tensor-core tiles in either code layout; SiTU and SiLU; M up to 16 with several
tokens per expert and block_m 1 and larger; tiny and Kimi-K3 tp 8 sizes; stage 2 and the tail as
one ticket-ordered launch (the default) and as two; bad input and bad configs; GPU: K3 tp 8 and
tp 1, atomics vs deterministic, CUDA graphs, PDL back to back.

Kernel variants are chosen by passing a MoEConfig; ``GPU_TILES`` runs the GPU's tiling (and the
tensor-core tiles, their mma emulated lane by lane) under the interpreter.

The block routing itself is compared with the reference loop given the plan the block routed
with (route_sort's): which expert a near-tie picks is the route tests' business."""

import dataclasses

import pytest
import torch

from k3lab.boundaries import assert_close, get
from k3lab.config import preset
from k3lab.kernels import (
    latent_down,
    latent_moe_tail,
    moe_block,
    moe_experts,
    moe_kernel_weights,
    moe_stage1,
    moe_stage2,
    route_sort,
)
from k3lab.kernels.moe import MAX_TOKENS, MoEConfig, mma_prepare_x
from k3lab.kernels.mxfp4 import MXFP4, mxfp4_dequantize, mxfp4_quantize
from k3lab.kernels.plan import RoutePlan
from k3lab.profile import count_launches
from k3lab.reference import moe as ref
from k3lab.reference.route import route_sort_reference
from k3lab.weights import hidden_states, make_generator, moe_weights, randn

# Tolerances against the fp32 reference, elementwise |got - want| <= ATOL + RTOL * |want|.
# bf16 outputs (z, a, out) carry one bf16 rounding: 2^-8 relative at most (half an ulp of an
# 8-bit significand); ATOL covers fp32 accumulation order and tanh written via exp (~1e-6).
# MXFP4 and bf16 experts use the same tolerances: the reference dequantizes the same codes exactly.
Z_ATOL, Z_RTOL = 1e-3, 2 ** -8           # front: z = x @ W_down^T, bf16
A_ATOL, A_RTOL = 1e-3, 2 ** -8           # stage 1: a, bf16 (same z in both)
Y_ATOL, Y_RTOL = 2e-5, 1e-5              # stage 2: y fp32 (same a in both): accumulation order only
# atomic vs deterministic stage 2: the same fp32 partials added in another order. With top_k <= 16
# partial sums below 4 in magnitude the two orders differ by at most (top_k - 1) roundings of at
# most half an ulp of 4 (2.4e-7) each: 3.6e-6; the bound leaves 2x for partials up to 8.
ATOMIC_VS_DETERMINISTIC_ATOL = 8e-6
TAIL_ATOL, TAIL_RTOL = 1e-3, 2 ** -8     # tail, shared given as a tensor: the output rounding
# tail with the shared MLP computed by the kernels: the shared activation is also rounded to bf16
# (2^-8 relative, carried through the S-long down GEMV).
TAIL_SHARED_ATOL, TAIL_SHARED_RTOL = 0.02, 2 ** -7
# whole block vs the fp32 reference given the same plan: z, a and the shared activation are bf16
# inside the kernels (2^-9 relative each, carried through D-, I- and S-long dot products) and so
# is the output; MXFP4 adds no error here (the reference dequantizes the same codes).
BLOCK_ATOL, BLOCK_RTOL = 0.03, 0.01
# reference loop vs the dense all-experts formulation (both fp32)
DENSE_ATOL = 1e-4

# The GPU's tiling under the interpreter (small tiles, K steps, the token loop of the GEMVs for
# M > 1, the tensor-core tiles for one-token plan tiles); target_programs 1 keeps the tiles at
# their largest (fewer programs to interpret).
GPU_TILES = MoEConfig(interpret_gpu_tiles=True)
KLANE_TILES = MoEConfig(mma=False, interpret_gpu_tiles=True, target_programs=1, klane_words=8)
MMA_TILES = MoEConfig(interpret_gpu_tiles=True, target_programs=1)


def _route_kw(cfg, block_m, out=True):
    return dict(top_k=cfg.top_k, n_group=cfg.n_group, topk_group=cfg.topk_group,
                renormalize=cfg.renormalize, routed_scaling_factor=cfg.routed_scaling,
                block_m=block_m, out_dim=cfg.moe_in if out else None)


def _fused_plan(cfg, x, w, block_m=1):
    """The plan moe_block routes with when it is given none (route_sort is deterministic: the
    same inputs give the same plan)."""
    return route_sort(x, w["gate_weight"], w["correction_bias"], **_route_kw(cfg, block_m))


def _plan(cfg, x, w, block_m=1, out=True):
    return route_sort_reference(x, w["gate_weight"], w["correction_bias"],
                                **_route_kw(cfg, block_m, out))


def _setup(device, *, name="tiny", tp=1, M=1, fmt="bf16", seed=0, crowd=False, **changes):
    """(cfg, weights, x). crowd: a large correction bias on the first top_k experts sends every
    token to them (M tokens per expert)."""
    cfg = preset(name, tp)
    if changes:
        cfg = dataclasses.replace(cfg, **changes)
    gen = make_generator(seed, device)
    w = moe_weights(cfg, gen, expert_format=fmt)
    if crowd:
        w["correction_bias"][: cfg.top_k] += 10.0
    return cfg, w, hidden_states(cfg, M, gen)


def _act(cfg):
    return dict(activation=cfg.activation, situ_beta=cfg.situ_beta,
                situ_linear_beta=cfg.situ_linear_beta)


def _ref_act(g, u, cfg):
    return ref.activate(g, u, cfg.activation, cfg.situ_beta, cfg.situ_linear_beta)


def no_latent(**kw):
    """tiny without latent: SiLU, routed scaling, grouped routing (4 groups, keep 2)."""
    return dict(latent=0, activation="silu", routed_scaling=2.827, n_group=4, topk_group=2, **kw)


# ---------------------------------------------------------------------------------------------
# the reference


def test_reference_dequantize_matches_weights():
    gen = make_generator(3, "cpu")
    w = randn((5, 7, 96), gen, dtype=torch.float32)
    w[0, 0, :32] = 0.0  # an all-zero group
    q = mxfp4_quantize(w)
    torch.testing.assert_close(ref.dequantize_mxfp4(q.packed, q.scales), mxfp4_dequantize(q),
                               rtol=0, atol=0)


def test_reference_situ_formula():
    g = torch.linspace(-30, 30, 101)
    u = torch.linspace(-80, 80, 101)
    want = 4.0 * torch.tanh(g / 4.0) * torch.sigmoid(g) * 25.0 * torch.tanh(u / 25.0)
    torch.testing.assert_close(ref.situ(g, u), want)
    torch.testing.assert_close(ref.activate(g, u, "silu"), g * torch.sigmoid(g) * u)
    with pytest.raises(ValueError, match="activation"):
        ref.activate(g, u, "gelu")


@pytest.mark.parametrize("changes", [{}, no_latent()], ids=["tiny", "tiny-nolatent-silu"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_reference_matches_dense(changes, fmt):
    """The per-selected-expert loop against every expert run densely, weighted by a scattered
    [M, E] routing matrix (zero for unselected experts)."""
    if fmt == "mxfp4" and changes:
        pytest.skip("hidden 200 is not a multiple of 32: no MXFP4 without a latent")
    cfg, w, x = _setup("cpu", M=5, fmt=fmt, **changes)
    plan = _plan(cfg, x, w)
    got = ref.latent_moe_from_plan_reference(x, plan, w, cfg)

    def full(t):
        return mxfp4_dequantize(t) if isinstance(t, MXFP4) else t.float()

    z = x.float() @ w["latent_down"].float().T if cfg.latent else x.float()
    gu = torch.einsum("md,erd->mer", z, full(w["w13"]))
    i = cfg.moe_intermediate
    a = _ref_act(gu[..., :i], gu[..., i:], cfg)
    ye = torch.einsum("mei,edi->med", a, full(w["w2"]))
    route = torch.zeros(x.shape[0], cfg.n_experts).scatter(1, plan.topk_ids.long(),
                                                           plan.topk_weights)
    y = (route[..., None] * ye).sum(1)
    if cfg.latent:
        n = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + cfg.rms_eps) * w["latent_norm"]
        y = n @ w["latent_up"].float().T
    s = x.float() @ w["shared_w13"].float().T
    sh = cfg.shared_intermediate
    want = y + _ref_act(s[:, :sh], s[:, sh:], cfg) @ w["shared_w2"].float().T
    assert_close("out", got, want, atol=DENSE_ATOL, rtol=1e-5)


# ---------------------------------------------------------------------------------------------
# the config


@pytest.mark.parametrize("field,value", [
    ("mma", 1), ("pdl", None), ("x_prepared", "yes"), ("interpret_gpu_tiles", 0),
    ("stage1_mma_tile", (1, 2, 1)), ("stage1_mma_tile", (2, 3, 1)), ("stage2_mma_tile", (2, 2)),
    ("stage2_mma_tile", (2, 2, 8)), ("stage2_mma_tile", [2, 2, 1]),
    ("stage1_klane_stages", -1), ("stage2_klane_stages", 8), ("klane_words", 48),
    ("klane_words", 2), ("klane_rows", 0), ("target_programs", 0),
    ("front_target_programs", 2.5), ("stage2_evict_first", "no"), ("tiled_weights", None),
    ("front_overlaps_route", 1), ("front_triggers_last", "on"), ("shared_beside_stage1", 0),
    ("tail_second_first", 1)])
def test_bad_config(field, value):
    """A bad MoEConfig field is a ValueError naming it, before anything runs."""
    with pytest.raises(ValueError, match=f"^{field}: expected"):
        MoEConfig(**{field: value})


def test_config_argument_checked(device):
    cfg, w, x = _setup(device, M=1)
    with pytest.raises(ValueError, match="config: expected a MoEConfig or None, got dict"):
        latent_down(x, w["latent_down"], config={"mma": False})
    with pytest.raises(ValueError, match="config: expected a MoEConfig"):
        moe_block(x, w, cfg=cfg, plan=_plan(cfg, x, w), config="default")
    assert MoEConfig() == MoEConfig(mma=True, pdl=True, x_prepared=True)  # defaults compare


# ---------------------------------------------------------------------------------------------
# stages at tiny (and with the GPU tiling)

STAGE_CASES = [
    # id, M, block_m, fmt, crowd, preset changes
    ("M1-bm1-bf16", 1, 1, "bf16", False, {}),
    ("M1-bm1-mxfp4", 1, 1, "mxfp4", False, {}),
    ("M3-bm3-bf16", 3, 3, "bf16", False, {}),
    ("M2-bm2-mxfp4-crowd", 2, 2, "mxfp4", True, {}),
    ("M3-bm4-mxfp4-crowd", 3, 4, "mxfp4", True, {}),  # a padding row in every tile
    ("M16-bm1-mxfp4", 16, 1, "mxfp4", False, {}),
    ("M16-bm4-bf16-crowd", 16, 4, "bf16", True, {}),
    ("M13-bm16-mxfp4-crowd", 13, 16, "mxfp4", True, {}),
    ("M7-bm2-silu", 7, 2, "bf16", False, {"activation": "silu"}),
    ("M5-bm1-nolatent", 5, 1, "bf16", False, no_latent()),
]


# the GPU tiling (small tiles, and the token loop of the GEMVs for M > 1, which stops after the
# last valid row of a tile) is slow under the interpreter: small cases only
GPU_TILE_CASES = ("M1-bm1-bf16", "M1-bm1-mxfp4", "M2-bm2-mxfp4-crowd", "M3-bm4-mxfp4-crowd",
                  "M3-bm3-bf16")
# several tokens a tile on the GPU tiles: 20-30 s each under the interpreter; the same plans run
# on the interpreter tiles in the default selection and on the GPU in test_gpu_k3_tp8_block
GPU_TILE_SLOW = ("M2-bm2-mxfp4-crowd", "M3-bm4-mxfp4-crowd", "M3-bm3-bf16")


def _gpu_tile_param(case):
    marks = pytest.mark.slow if case[0] in GPU_TILE_SLOW else ()
    return pytest.param(case, "gpu", marks=marks)


@pytest.mark.parametrize("case,tiles", [(c, "interp") for c in STAGE_CASES]
                         + [_gpu_tile_param(c) for c in STAGE_CASES if c[0] in GPU_TILE_CASES],
                         ids=[f"{c[0]}-interp-tiles" for c in STAGE_CASES]
                         + [f"{c}-gpu-tiles" for c in GPU_TILE_CASES])
def test_stages(case, tiles, device):
    """front, stage 1, stage 2 (atomic and deterministic) each against the reference of the
    same inputs; ``gpu`` runs the GPU tile sizes under the interpreter (M1-bm1-mxfp4: the
    tensor-core tiles)."""
    _, M, block_m, fmt, crowd, changes = case
    config = GPU_TILES if tiles == "gpu" else None
    cfg, w, x = _setup(device, M=M, fmt=fmt, crowd=crowd, **changes)
    plan = _plan(cfg, x, w, block_m)
    if crowd:
        assert int(plan.topk_ids.eq(plan.topk_ids[0, 0]).sum()) == M
    z, sa = latent_down(x, w.get("latent_down"), w["shared_w13"], config=config, **_act(cfg))
    if cfg.latent:
        assert_close("z", z, ref._mm(x, w["latent_down"], torch.float32), atol=Z_ATOL,
                     rtol=Z_RTOL)
    else:
        assert z is None
        z = x
    s = ref._mm(x, w["shared_w13"], torch.float32)
    want_sa = _ref_act(s[:, :cfg.shared_intermediate], s[:, cfg.shared_intermediate:], cfg)
    assert_close("shared_a", sa, want_sa, atol=A_ATOL, rtol=A_RTOL)

    plan.out.fill_(float("nan"))  # stage 1 must zero stage 2's accumulator
    a = moe_stage1(z, plan, w["w13"], config=config, **_act(cfg))
    assert a.shape == (M * cfg.top_k, cfg.moe_intermediate) and a.dtype == torch.bfloat16
    assert_close("a", a, ref.moe_stage1_reference(z, plan, w["w13"], **_act(cfg)), atol=A_ATOL,
                 rtol=A_RTOL)
    y = moe_stage2(a, plan, w["w2"], config=config)
    assert y.data_ptr() == plan.out.data_ptr()
    y_ref = ref.moe_stage2_reference(a, plan, w["w2"])
    assert_close("y", y, y_ref, atol=Y_ATOL, rtol=Y_RTOL)
    y = y.clone()
    y_det = moe_stage2(a, plan, w["w2"], deterministic=True, config=config)
    assert_close("y_det", y_det, y_ref, atol=Y_ATOL, rtol=Y_RTOL)
    assert_close("atomic vs deterministic", y, y_det, atol=ATOMIC_VS_DETERMINISTIC_ATOL)


# MXFP4 expert tiles at the GPU tiling: K-lane tiles (K steps of klane_words words; the K loops'
# pipeline stages change nothing under the interpreter, but the paths run) and the tensor-core
# tiles with the tile rule's pick or fixed (R, WARPS_K, L2 prefetch) tiles per stage (the mma
# emulated lane by lane).
VARIANTS = {
    "klane": KLANE_TILES,
    "klane-stages": dataclasses.replace(KLANE_TILES, stage1_klane_stages=0,
                                        stage2_klane_stages=2, klane_rows=32),
    "mma": MMA_TILES,
    "mma-wk1": dataclasses.replace(MMA_TILES, stage1_mma_tile=(2, 1, 0),
                                   stage2_mma_tile=(2, 1, 0)),
    "mma-wk4-r1": dataclasses.replace(MMA_TILES, stage1_mma_tile=(2, 4, 2),
                                      stage2_mma_tile=(1, 4, 2)),
    "mma-r1wk1": dataclasses.replace(MMA_TILES, stage1_mma_tile=(2, 2, 1),
                                     stage2_mma_tile=(1, 1, 1)),
}
VARIANT_CASES = [(c, v) for c in STAGE_CASES if c[0] in ("M1-bm1-mxfp4", "M3-bm4-mxfp4-crowd")
                 for v in ("klane", "klane-stages")] + [
    (c, v) for c in STAGE_CASES if c[0] == "M1-bm1-mxfp4" for v in VARIANTS if "mma" in v]


@pytest.mark.parametrize("case,variant", VARIANT_CASES,
                         ids=[c[0] + "-" + v for c, v in VARIANT_CASES])
def test_stages_mxfp4_tiles(case, variant, device):
    """Stage 1 and both stage-2 modes against the reference for each of VARIANTS (the tensor-core
    tiles serve one-token plan tiles: stage 1 and the atomic stage 2 at M1-bm1)."""
    _, M, block_m, fmt, crowd, changes = case
    config = VARIANTS[variant]
    cfg, w, x = _setup(device, M=M, fmt=fmt, crowd=crowd, **changes)
    plan = _plan(cfg, x, w, block_m)
    z = randn((M, cfg.moe_in), make_generator(1, device))
    a = moe_stage1(z, plan, w["w13"], config=config, **_act(cfg))
    a_ref = ref.moe_stage1_reference(z, plan, w["w13"], **_act(cfg))
    assert_close("a", a, a_ref, atol=A_ATOL, rtol=A_RTOL)
    y_ref = ref.moe_stage2_reference(a, plan, w["w2"])
    assert_close("y", moe_stage2(a, plan, w["w2"], config=config), y_ref, atol=Y_ATOL,
                 rtol=Y_RTOL)
    assert_close("y_det", moe_stage2(a, plan, w["w2"], deterministic=True, config=config), y_ref,
                 atol=Y_ATOL, rtol=Y_RTOL)


DECODE_CONFIGS = {
    "interpreter-tiles": MoEConfig(),
    "klane-gpu-tiles": dataclasses.replace(KLANE_TILES, klane_words=4),  # 1 group a step: 2
    "klane-gpu-tiles-stages": dataclasses.replace(KLANE_TILES, klane_words=4,
                                                  stage2_klane_stages=2),
    "mma-gpu-tiles": MMA_TILES,
}


@pytest.mark.parametrize("variant", [
    pytest.param(v, marks=pytest.mark.slow) if v == "klane-gpu-tiles-stages" else v
    for v in DECODE_CONFIGS])  # the staged loads read the codes klane-gpu-tiles reads
def test_mxfp4_decode_exact(variant, device):
    """Every E2M1 code at every position of a group, under E8M0 scales from 2^-20 to 2^10, read
    back exactly through stage 2: token t (top_k 1, weight 1) carries the one-hot a = e_k, so
    y[t] is column k of the dequantized expert. K = 64 (two groups, so the K-lane layout's
    per-group factors are told apart)."""
    config = DECODE_CONFIGS[variant]
    n, k = 128, 64
    o_n = torch.arange(n)[:, None]
    o_p = torch.arange(k // 2)[None, :]
    lo, hi = (o_n + 2 * o_p) % 16, (o_n + 2 * o_p + 1) % 16
    packed = (lo | (hi << 4)).to(torch.uint8)[None].contiguous().to(device)
    exps = torch.tensor([-20, -7, -1, 0, 1, 3, 6, 10])
    o_g = torch.arange(k // 32)[None, :]
    scales = (127 + exps[(torch.arange(n)[:, None] + 3 * o_g) % 8]).to(torch.uint8)[None]
    scales = scales.contiguous()
    w2 = MXFP4(packed, scales.to(device))
    want = mxfp4_dequantize(w2)[0].float()  # [n, k]
    m = MAX_TOKENS
    for k0 in range(0, k, m):
        a = torch.zeros((m, k), dtype=torch.bfloat16, device=device)
        a[torch.arange(m), k0 + torch.arange(m)] = 1.0
        ids = torch.zeros((m, 1), dtype=torch.int32, device=device)
        plan = RoutePlan(topk_ids=ids, topk_weights=torch.ones((m, 1), device=device),
                         sorted_ids=torch.arange(m, dtype=torch.int32, device=device),
                         sorted_weights=torch.ones(m, device=device),
                         block_expert_ids=torch.zeros(m, dtype=torch.int32, device=device),
                         num_valid=torch.tensor([m], dtype=torch.int32, device=device),
                         out=torch.zeros((m, n), device=device), block_m=1)
        y = moe_stage2(a, plan, w2, config=config)
        torch.testing.assert_close(y, want[:, k0:k0 + m].T, atol=0, rtol=0)


def test_mma_prepared_copies(device):
    """The producers write mma_prepare_x's layout exactly (latent_down's z_mma_out, stage 1's
    a_mma_out); the tensor-core tiles read those copies instead of the plain inputs (given
    another input's copy they compute that input's result), unless ``x_prepared`` is off."""
    cfg, w, x = _setup(device, M=1, fmt="mxfp4")
    plan = _plan(cfg, x, w)
    zp = torch.empty((1, cfg.moe_in), device=device, dtype=torch.bfloat16)
    z, _ = latent_down(x, w["latent_down"], None, z_mma_out=zp, config=MMA_TILES)
    assert torch.equal(zp, mma_prepare_x(z))
    z2 = randn((1, cfg.moe_in), make_generator(9, device))
    a = moe_stage1(z, plan, w["w13"], config=MMA_TILES, **_act(cfg))
    ap = torch.empty_like(a)
    a2 = moe_stage1(z2, plan, w["w13"], z_mma=zp, a_mma_out=ap, config=MMA_TILES, **_act(cfg))
    assert torch.equal(a2, a)  # read z's copy, not z2
    assert torch.equal(ap, mma_prepare_x(a))
    plain = dataclasses.replace(MMA_TILES, x_prepared=False)
    a3 = moe_stage1(z2, plan, w["w13"], z_mma=zp, config=plain, **_act(cfg))
    assert torch.equal(a3, moe_stage1(z2, plan, w["w13"], config=MMA_TILES, **_act(cfg)))
    y = moe_stage2(a, plan, w["w2"], config=MMA_TILES).clone()
    assert_close("y", y, ref.moe_stage2_reference(a, plan, w["w2"]), atol=Y_ATOL, rtol=Y_RTOL)
    plan.out.zero_()
    y2 = moe_stage2(a3, plan, w["w2"], a_mma=ap, config=MMA_TILES)
    assert_close("y (a's copy)", y2, y, atol=Y_ATOL, rtol=Y_RTOL)


def test_mma_prepared_block(device):
    """moe_block chains the prepared copies (front -> stage 1 -> stage 2) when the tensor-core
    tiles run: the same output as with ``x_prepared`` off."""
    cfg, w, x = _setup(device, M=1, fmt="mxfp4")
    plan = _plan(cfg, x, w)
    got = moe_block(x, w, cfg=cfg, plan=plan, config=MMA_TILES)
    plain = moe_block(x, w, cfg=cfg, plan=plan,
                      config=dataclasses.replace(MMA_TILES, x_prepared=False))
    assert_close("out", got.float(), plain.float(), atol=2e-2, rtol=2e-2)


def test_prepared_copies_bad_input(device):
    cfg, w, x = _setup(device, M=1, fmt="mxfp4")
    plan = _plan(cfg, x, w)
    z, _ = latent_down(x, w["latent_down"], None)
    with pytest.raises(ValueError, match="z_mma: expected a contiguous bf16"):
        moe_stage1(z, plan, w["w13"], z_mma=z[:, :8].contiguous(), **_act(cfg))
    with pytest.raises(ValueError, match="a_mma_out"):
        moe_stage1(z, plan, w["w13"], a_mma_out=torch.empty(3, device=device), **_act(cfg))
    a = moe_stage1(z, plan, w["w13"], **_act(cfg))
    with pytest.raises(ValueError, match="a_mma"):
        moe_stage2(a, plan, w["w2"], a_mma=a.float())
    with pytest.raises(ValueError, match="z_mma_out"):
        latent_down(x, None, w["shared_w13"], z_mma_out=z)


EXPERT_PAIR_CASES = [(c, "interp") for c in ("M1-bm1-mxfp4", "M3-bm4-mxfp4-crowd",
                                              "M7-bm2-silu", "M5-bm1-nolatent")] + [
    ("M1-bm1-mxfp4", "gpu")]  # the tensor-core tiles (prepared a, stage 2 by PDL on a GPU)


@pytest.mark.parametrize("case,tiles", EXPERT_PAIR_CASES,
                         ids=[f"{c}-{t}" for c, t in EXPERT_PAIR_CASES])
def test_experts_pair(case, tiles, device):
    """moe_experts (stage 1 zeroing plan.out for stage 2, which skips its own zeroing) equals
    the two stages launched alone, bit for bit for the deterministic stage 2, within the atomic
    bound otherwise; 2 launches; a dirty plan.out is zeroed."""
    _, M, block_m, fmt, crowd, changes = next(c for c in STAGE_CASES if c[0] == case)
    config = GPU_TILES if tiles == "gpu" else None
    cfg, w, x = _setup(device, M=M, fmt=fmt, crowd=crowd, **changes)
    plan = _plan(cfg, x, w, block_m)
    z = latent_down(x, w["latent_down"])[0] if cfg.latent else x
    a = moe_stage1(z, plan, w["w13"], config=config, **_act(cfg))
    want = ref.moe_stage2_reference(a, plan, w["w2"])
    alone = moe_stage2(a, plan, w["w2"], deterministic=True, config=config).clone()
    for det in (True, False):
        plan.out.fill_(float("nan"))
        y = moe_experts(z, plan, w["w13"], w["w2"], deterministic=det, config=config,
                        **_act(cfg))
        assert y.data_ptr() == plan.out.data_ptr()
        assert_close("y", y, want, atol=Y_ATOL, rtol=Y_RTOL)
        if det:
            assert torch.equal(y, alone)
        else:
            assert_close("atomic vs alone", y, alone, atol=ATOMIC_VS_DETERMINISTIC_ATOL)
    n = count_launches(lambda p: moe_experts(z, p, w["w13"], w["w2"], config=config,
                                             **_act(cfg)), plan).count
    assert n == 2


def test_experts_pair_bad_input(device):
    cfg, w, x = _setup(device, M=2)
    z, _ = latent_down(x, w["latent_down"])
    with pytest.raises(ValueError, match="plan.out"):
        moe_experts(z, _plan(cfg, x, w, out=False), w["w13"], w["w2"])
    with pytest.raises(ValueError, match="w2"):
        moe_experts(z, _plan(cfg, x, w), w["w13"], w["w2"][:, :-2])
    with pytest.raises(ValueError, match="z"):
        moe_experts(z.float(), _plan(cfg, x, w), w["w13"], w["w2"])


def test_stage2_without_plan_buffer(device):
    cfg, w, x = _setup(device, M=2)
    plan = _plan(cfg, x, w, out=False)
    z, _ = latent_down(x, w["latent_down"])
    a = moe_stage1(z, plan, w["w13"])
    want = ref.moe_stage2_reference(a, plan, w["w2"])
    for det in (False, True):
        assert_close("y", moe_stage2(a, plan, w["w2"], deterministic=det), want, atol=Y_ATOL,
                     rtol=Y_RTOL)


@pytest.mark.parametrize("shared", ["none", "tensor-bf16", "tensor-fp32", "weights", "act"])
@pytest.mark.parametrize("M", [1, 6])
def test_tail(shared, M, device):
    cfg, w, x = _setup(device, M=M)
    gen = make_generator(7, device)
    y = randn((M, cfg.moe_in), gen, std=0.3, dtype=torch.float32)
    weights = {"x": x, "w13": w["shared_w13"], "w2": w["shared_w2"], **_act(cfg)}
    sh_out = ref.shared_mlp_reference(x, w["shared_w13"], w["shared_w2"], **_act(cfg))
    arg, want_shared, atol, rtol = {
        "none": (None, None, TAIL_ATOL, TAIL_RTOL),
        "tensor-bf16": (sh_out.bfloat16(), sh_out.bfloat16(), TAIL_ATOL, TAIL_RTOL),
        "tensor-fp32": (sh_out, sh_out, TAIL_ATOL, TAIL_RTOL),
        "weights": (weights, weights, TAIL_SHARED_ATOL, TAIL_SHARED_RTOL),
        "act": (None, weights, TAIL_SHARED_ATOL, TAIL_SHARED_RTOL),
    }[shared]
    if shared == "act":
        _, sa = latent_down(x, None, w["shared_w13"], **_act(cfg))
        arg = {"a": sa, "w2": w["shared_w2"]}
    out = latent_moe_tail(y, w["latent_norm"], w["latent_up"], arg, eps=cfg.rms_eps)
    assert out.shape == (M, cfg.hidden) and out.dtype == torch.bfloat16
    want = ref.latent_moe_tail_reference(y, w["latent_norm"], w["latent_up"], want_shared,
                                         cfg.rms_eps)
    assert_close("out", out, want, atol=atol, rtol=rtol)


def test_tail_without_latent(device):
    cfg, w, x = _setup(device, M=3, **no_latent())
    y = randn((3, cfg.hidden), make_generator(1, device), dtype=torch.float32)
    shared = {"x": x, "w13": w["shared_w13"], "w2": w["shared_w2"], **_act(cfg)}
    out = latent_moe_tail(y, None, None, shared, eps=cfg.rms_eps)
    want = ref.latent_moe_tail_reference(y, None, None, shared, cfg.rms_eps)
    assert_close("out", out, want, atol=TAIL_SHARED_ATOL, rtol=TAIL_SHARED_RTOL)


# ---------------------------------------------------------------------------------------------
# the block

BLOCK_CASES = [
    # id, M, block_m, fmt, deterministic, crowd, preset changes
    ("M1-bm1-bf16", 1, 1, "bf16", False, False, {}),
    ("M1-bm1-mxfp4-det", 1, 1, "mxfp4", True, False, {}),
    ("M16-bm4-mxfp4", 16, 4, "mxfp4", False, False, {}),
    ("M9-bm8-bf16-crowd", 9, 8, "bf16", False, True, {}),
    ("M16-bm1-bf16-det", 16, 1, "bf16", True, False, {}),
    ("M4-bm2-silu-noshared", 4, 2, "bf16", False, False,
     {"activation": "silu", "shared_intermediate": 0}),
    ("M6-bm1-nolatent-silu", 6, 1, "bf16", False, False, no_latent()),
    ("M2-bm1-nolatent-noshared", 2, 1, "bf16", True, False, no_latent(shared_intermediate=0)),
]


def _check_block(x, w, cfg, *, block_m, det, fuse_tail, config=None):
    """moe_block routing itself against the reference loop given the plan the block routed with
    (route_sort's: a near-tie that fp32 summation order breaks differently in
    route_sort_reference would select another expert, which is the route tests' business, not
    the block's); with det, also bitwise equal to the block given that plan explicitly."""
    plan = _fused_plan(cfg, x, w, block_m)
    want = ref.latent_moe_from_plan_reference(x, plan, w, cfg)
    got = moe_block(x, w, cfg=cfg, block_m=block_m, deterministic=det, fuse_tail=fuse_tail,
                    config=config)
    assert got.shape == (x.shape[0], cfg.hidden) and got.dtype == torch.bfloat16
    assert_close("out", got, want, atol=BLOCK_ATOL, rtol=BLOCK_RTOL)
    if det:
        plan.out.fill_(float("nan"))
        given = moe_block(x, w, cfg=cfg, plan=plan, deterministic=det, fuse_tail=fuse_tail,
                          config=config)
        assert torch.equal(given, got), "moe_block(plan=route_sort(...)) differs from routing"
    return got


# the 16-token cases with the tail apart: ~9 s each under the interpreter; their fused-tail
# twins stay in the default selection, and test_fused_tail_matches_separate_launches ties the two
# (at 16 one-token tiles with pytest -m "")
_BLOCK_SLOW = {("M16-bm4-mxfp4", False), ("M16-bm1-bf16-det", False)}


@pytest.mark.parametrize("case,fuse_tail", [
    pytest.param(c, f, marks=pytest.mark.slow if (c[0], f) in _BLOCK_SLOW else (),
                 id=f"{c[0]}-{'fused-tail' if f else 'tail'}")
    for c in BLOCK_CASES for f in (False, True)])
def test_block(case, fuse_tail, device):
    """moe_block with its own routing (route_sort + 3 launches; 4 with stage 2 and the tail
    apart) against the reference given the same plan; and given the reference's plan."""
    _, M, block_m, fmt, det, crowd, changes = case
    cfg, w, x = _setup(device, M=M, fmt=fmt, seed=M, crowd=crowd, **changes)
    _check_block(x, w, cfg, block_m=block_m, det=det, fuse_tail=fuse_tail)
    plan = _plan(cfg, x, w, block_m)
    want = ref.latent_moe_from_plan_reference(x, plan, w, cfg)
    plan.out.fill_(float("nan"))
    again = moe_block(x, w, cfg=cfg, plan=plan, deterministic=det, fuse_tail=fuse_tail)
    assert_close("out (given plan)", again, want, atol=BLOCK_ATOL, rtol=BLOCK_RTOL)


# 16 one-token tiles (~15 s under the interpreter) run in the default selection's test_block;
# the ticket order is checked here at one and two tokens
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow)
                                  if c[0] == "M16-bm1-bf16-det" else c
                                  for c in BLOCK_CASES if c[4]],
                         ids=[c[0] for c in BLOCK_CASES if c[4]])
def test_fused_tail_matches_separate_launches(case, device):
    """Deterministic stage 2: the ticket-ordered stage-2 + tail launch computes exactly what the
    two separate launches do (every ticket ran its tile, once), on every call (the counters
    restart from zero: stage 1 resets them; the test allocator fills fresh memory with NaN/max)."""
    _, M, block_m, fmt, _, crowd, changes = case
    cfg, w, x = _setup(device, M=M, fmt=fmt, seed=M, crowd=crowd, **changes)
    plan = _plan(cfg, x, w, block_m)
    apart = moe_block(x, w, cfg=cfg, plan=plan, deterministic=True, fuse_tail=False)
    for _ in range(2):
        fused = moe_block(x, w, cfg=cfg, plan=plan, deterministic=True)
        assert torch.equal(fused, apart)


# the bar: route-sort + down-projection + stage 1 + stage 2 + tail in at most 5 launches
MAX_BLOCK_LAUNCHES = 5


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_block_launches(fmt, device):
    """Given a plan: front, stage 1, stage 2 + tail: 3 launches (4 with stage 2 and the tail
    apart); with routing route_sort's launches come on top, at most MAX_BLOCK_LAUNCHES in all."""
    torch.use_deterministic_algorithms(False)  # no NaN-fill kernels behind torch.empty (CUDA)
    cfg = preset("kimi-k3" if device.type == "cuda" else "tiny", 8 if device.type == "cuda" else 1)
    boundary = get("moe")
    fused = boundary.variant("fused")
    routed = boundary.make_inputs(cfg, device, 0, expert_format=fmt, route=True)
    n_route = count_launches(lambda i: _fused_plan(i["cfg"], i["x"], i["weights"]), routed)
    assert n_route.count >= 1, n_route.kernels
    with_route = count_launches(fused.fn, routed)
    assert with_route.count == n_route.count + 3, with_route.kernels
    assert with_route.count <= MAX_BLOCK_LAUNCHES, with_route.kernels
    default = count_launches(lambda i: moe_block(i["x"], i["weights"], cfg=cfg), routed)
    assert default.count == with_route.count, default.kernels
    inputs = boundary.make_inputs(cfg, device, 0, expert_format=fmt)
    given = count_launches(fused.fn, inputs)
    assert given.count == 3, given.kernels
    apart = count_launches(
        lambda i: moe_block(i["x"], i["weights"], cfg=cfg, plan=i["plan"], fuse_tail=False),
        inputs)
    assert apart.count == 4, apart.kernels


class _ConfigReadError(Exception):
    pass


class _Probe(dict):
    """Inputs that stop the variant when it asks for its "config" (as a benchmark sweep asks)."""

    def get(self, key, default=None):
        if key == "config":
            raise _ConfigReadError
        return super().get(key, default)


def test_grouped_dequantize_is_the_reference_in_bf16(device):
    """The grouped peer's bf16 dequantization (byte lookup, one multiply) gives bitwise the
    reference's fp32 values rounded to bf16: every code byte, under every finite E8M0 scale
    (the smallest make bf16 subnormals), in a leading-dims layout."""
    from k3lab.boundaries.moe import dequantize_mxfp4_bf16
    from k3lab.reference.moe import dequantize_mxfp4

    packed = torch.arange(256, dtype=torch.uint8, device=device).repeat(255, 1)   # [255, 256]
    scales = torch.arange(255, dtype=torch.uint8, device=device)[:, None].repeat(1, 16)
    got = dequantize_mxfp4_bf16(packed, scales)
    want = dequantize_mxfp4(packed, scales).to(torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.shape == (255, 512)
    assert torch.equal(got.view(torch.int16), want.view(torch.int16))
    lead = dequantize_mxfp4_bf16(packed.view(5, 51, 256), scales.view(5, 51, 16))
    assert torch.equal(lead.view(255, 512).view(torch.int16), want.view(torch.int16))


def test_boundary(device):
    boundary = get("moe")
    assert boundary.owns == ("moe.latent_down", "moe.stage1", "moe.stage2", "moe.latent_norm",
                             "moe.latent_up", "moe.shared", "moe.shared_add")
    inputs = boundary.make_inputs(preset("tiny"), device, 2, M=3, expert_format="mxfp4",
                                  block_m=2)
    out_ref = boundary.reference.fn(inputs)
    for name in ("reference", "fused", "grouped"):
        errs = boundary.check(boundary.variant(name).fn(inputs), out_ref, inputs)
        assert errs["out"] < BLOCK_ATOL
    # the fused variant passes inputs["config"] on (a sweep's MoEConfig)
    with pytest.raises(_ConfigReadError):
        boundary.variant("fused").fn(_Probe(inputs))
    for config in (MoEConfig(tiled_weights=False), KLANE_TILES):
        errs = boundary.check(boundary.variant("fused").fn({**inputs, "config": config}),
                              out_ref, inputs)
        assert errs["out"] < BLOCK_ATOL
    bad = boundary.variant("fused").fn(inputs).float()
    bad[1, 5] += 0.2
    with pytest.raises(AssertionError, match="out"):
        boundary.check(bad, out_ref, inputs)
    w = inputs["weights"]
    nbytes = boundary.bytes_moved(inputs)
    assert nbytes > w["latent_down"].nbytes + w["latent_up"].nbytes
    assert nbytes < w["latent_down"].nbytes * 4 + w["w13"].packed.nbytes + w["w2"].packed.nbytes


def test_boundary_stages(device):
    from k3lab.boundaries.moe import STAGES, stage_bytes, stage_fns, stage_inputs

    boundary = get("moe")
    inputs = stage_inputs(boundary.make_inputs(preset("tiny"), device, 0, M=2))
    for stage in STAGES:
        fns = stage_fns(stage)
        outs = {}
        for k, f in fns.items():  # stage 2's fused variants add into the plan's accumulator
            if inputs["plan"].out is not None:
                inputs["plan"].out.zero_()
            o = f(inputs)
            outs[k] = (tuple(None if t is None else t.clone() for t in o)
                       if isinstance(o, tuple) else o.clone())
        assert stage_bytes(stage, inputs) > 0
        first = outs["reference"]
        for name, o in outs.items():
            for got, want in zip(o if isinstance(o, tuple) else (o,),
                                 first if isinstance(first, tuple) else (first,), strict=True):
                assert_close(f"{stage}/{name}", got.float(), want.float(), atol=BLOCK_ATOL,
                             rtol=BLOCK_RTOL)


@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_stage_inputs_prepare_only_for_mxfp4(fmt, device):
    """The per-stage inputs carry the prepared copies only where the MXFP4 tensor-core tiles read
    them (a request for bf16 experts would only change how stage 1 compiles)."""
    from k3lab.boundaries import moe as bmoe

    cfg = preset("tiny", 1)
    s = bmoe.stage_inputs(bmoe.make_inputs(cfg, device, 0, M=1, expert_format=fmt))
    if fmt == "bf16":
        assert s["z_mma"] is None and s["a_mma"] is None
    else:
        assert torch.equal(s["z_mma"], mma_prepare_x(s["z"]))
        assert torch.equal(s["a_mma"], mma_prepare_x(s["a"]))


# ---------------------------------------------------------------------------------------------
# Kimi-K3 tp 8 sizes (D 3584, I 384, E 896, top 16) at M = 1


def _sparse_experts(n_experts, rows, cols, ids, fmt, gen):
    """[E, rows, cols] experts where only ``ids`` hold weights (the rest is never read and never
    touched, so the 896-expert tensors cost only the selected experts' memory)."""
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    try:
        if fmt == "bf16":
            w = torch.empty((n_experts, rows, cols), dtype=torch.bfloat16, device=gen.device)
        else:
            w = MXFP4(torch.empty((n_experts, rows, cols // 2), dtype=torch.uint8,
                                  device=gen.device),
                      torch.empty((n_experts, rows, cols // 32), dtype=torch.uint8,
                                  device=gen.device))
    finally:
        torch.utils.deterministic.fill_uninitialized_memory = fill
    for e in ids:
        v = randn((rows, cols), gen, std=cols ** -0.5, dtype=torch.float32)
        if fmt == "bf16":
            w[e] = v.bfloat16()
        else:
            q = mxfp4_quantize(v)
            w.packed[e], w.scales[e] = q.packed, q.scales
    return w


def _k3_inputs(device, fmt, M=1, seed=0, crowd=False, block_m=1):
    """K3 tp 8 weights with only the experts x routes to filled; crowd: every token routed to
    the same top_k experts (tiles of M tokens of one expert)."""
    cfg = preset("kimi-k3", 8)
    gen = make_generator(seed, device)
    h, d, i, s, e = cfg.hidden, cfg.moe_in, cfg.moe_intermediate, cfg.shared_intermediate, \
        cfg.n_experts
    w = {"gate_weight": randn((e, h), gen, std=2.0 / h ** 0.5),
         "correction_bias": torch.rand(e, generator=gen, device=device) * 0.1,
         "latent_down": randn((d, h), gen, std=h ** -0.5),
         "latent_norm": torch.rand(d, generator=gen, device=device) * 0.4 + 0.8,
         "latent_up": randn((h, d), gen, std=d ** -0.5),
         "shared_w13": randn((2 * s, h), gen, std=h ** -0.5),
         "shared_w2": randn((h, s), gen, std=s ** -0.5)}
    if crowd:
        w["correction_bias"][: cfg.top_k] += 10.0
    x = hidden_states(cfg, M, gen)
    plan = _plan(cfg, x, w, block_m)
    ids = sorted(set(plan.topk_ids.flatten().tolist()))
    w["w13"] = _sparse_experts(e, 2 * i, d, ids, fmt, gen)
    w["w2"] = _sparse_experts(e, d, i, ids, fmt, gen)
    return cfg, w, x, plan


# ~30 s under the interpreter: the same stages run at K3 tp 8 size inside test_k3_tp8_block
# (MXFP4) and at tiny size in test_stages (bf16); on the GPU in the GPU-marked K3 tests
@pytest.mark.parametrize("fmt", [pytest.param("bf16", marks=pytest.mark.slow)])
def test_k3_tp8_stages(fmt, device):
    cfg, w, x, plan = _k3_inputs(device, fmt)
    gen = make_generator(5, device)
    z = randn((1, cfg.moe_in), gen)
    a = moe_stage1(z, plan, w["w13"])
    assert_close("a", a, ref.moe_stage1_reference(z, plan, w["w13"]), atol=A_ATOL, rtol=A_RTOL)
    y = moe_stage2(a, plan, w["w2"]).clone()
    y_ref = ref.moe_stage2_reference(a, plan, w["w2"])
    assert_close("y", y, y_ref, atol=Y_ATOL, rtol=Y_RTOL)
    y_det = moe_stage2(a, plan, w["w2"], deterministic=True)
    assert_close("atomic vs deterministic", y, y_det, atol=ATOMIC_VS_DETERMINISTIC_ATOL)


K3_BLOCK_CASES = [
    # id, M, block_m, crowd, fmt, fuse_tail
    ("M1-bm1-bf16", 1, 1, False, "bf16", True),
    ("M1-bm1-mxfp4", 1, 1, False, "mxfp4", True),
    ("M1-bm16-mxfp4", 1, 16, False, "mxfp4", True),
    ("M16-bm16-crowd-bf16", 16, 16, True, "bf16", True),
    ("M16-bm16-crowd-mxfp4", 16, 16, True, "mxfp4", True),
]


# the two many-token K3 cases take ~100 s under the interpreter; the same tiles (block_m 16,
# crowded experts) run at tiny size in test_stages, so they are slow-marked (pytest -m ""), as
# are the one-token cases (20-30 s each on the CI machine): the same kernels run at tiny size in
# test_block and test_stages, and at K3 tp 8 on the GPU (test_gpu_k3_tp8_block and the 20_moe
# report)
_K3_SLOW = {c[0] for c in K3_BLOCK_CASES}


@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.slow) if c[0] in _K3_SLOW
                                  else c for c in K3_BLOCK_CASES],
                         ids=[c[0] for c in K3_BLOCK_CASES])
def test_k3_tp8_block(case, device):
    """The block at K3 tp 8 sizes given the plan (stage 2 + tail fused by default), against the
    reference of that plan: M = 1, and M = 16 crowded onto 16 experts (full 16-token tiles)."""
    _, M, block_m, crowd, fmt, fuse_tail = case
    cfg, w, x, plan = _k3_inputs(device, fmt, M=M, crowd=crowd, block_m=block_m)
    if crowd:
        assert int(plan.topk_ids.unique().numel()) == cfg.top_k
    want = ref.latent_moe_from_plan_reference(x, plan, w, cfg)
    got = moe_block(x, w, cfg=cfg, plan=plan, fuse_tail=fuse_tail)
    assert_close("out", got, want, atol=BLOCK_ATOL, rtol=BLOCK_RTOL)


# ---------------------------------------------------------------------------------------------
# bad input


def _bad_cases():
    return [
        # (id, function, change, match)
        ("z-fp32", "stage1", {"z": lambda c: c["z"].float()}, "z"),
        ("z-1d", "stage1", {"z": lambda c: c["z"][0]}, "z"),
        ("z-noncontig", "stage1", {"z": lambda c: torch.cat([c["z"], c["z"]], 1)[:, ::2]}, "z"),
        ("z-M17", "stage1", {"z": lambda c: c["z"][:1].expand(17, -1).contiguous()}, "z"),
        ("z-D", "stage1", {"z": lambda c: c["z"][:, :-2].contiguous()}, "w13"),
        ("plan-type", "stage1", {"plan": lambda c: vars(c["plan"])}, "plan"),
        ("plan-M", "stage1", {"z": lambda c: c["z"][:1].contiguous()}, "plan"),
        ("plan-ids-int64", "stage1",
         {"plan": lambda c: dataclasses.replace(c["plan"], topk_ids=c["plan"].topk_ids.long())},
         "plan.topk_ids"),
        ("plan-sorted-short", "stage1",
         {"plan": lambda c: dataclasses.replace(c["plan"], sorted_ids=c["plan"].sorted_ids[:3])},
         "plan"),
        ("plan-out-shape", "stage1",
         {"plan": lambda c: dataclasses.replace(c["plan"], out=c["plan"].out[:, :-1])},
         "plan.out"),
        ("plan-block_m-0", "stage1",
         {"plan": lambda c: dataclasses.replace(c["plan"], block_m=0)}, "plan.block_m"),
        ("w13-fp32", "stage1", {"w13": lambda c: c["w"]["w13"].float()}, "w13"),
        ("w13-rows-odd", "stage1", {"w13": lambda c: c["w"]["w13"][:, :-2].contiguous()},
         "w13"),
        ("w13-2d", "stage1", {"w13": lambda c: c["w"]["w13"][0]}, "w13"),
        ("w13-mxfp4-scales", "stage1",
         {"w13": lambda c: MXFP4(c["q13"].packed, c["q13"].scales[..., :-1].contiguous())},
         "w13"),
        ("w13-mxfp4-packed-int8", "stage1",
         {"w13": lambda c: MXFP4(c["q13"].packed.view(torch.int8), c["q13"].scales)},
         "w13.packed"),
        ("activation", "stage1", {"activation": lambda c: "gelu"}, "activation"),
        ("stage1-config", "stage1", {"config": lambda c: "tiles"}, "config"),
        ("a-fp32", "stage2", {"a": lambda c: c["a"].float()}, "a"),
        ("a-rows", "stage2", {"a": lambda c: c["a"][:-1].contiguous()}, "a"),
        ("a-I", "stage2", {"a": lambda c: c["a"][:, :-2].contiguous()}, "a"),
        ("w2-shape", "stage2", {"w2": lambda c: c["w"]["w2"][:, :-1].contiguous()}, "plan.out"),
        ("w2-E", "stage2", {"w2": lambda c: c["w"]["w2"][:2].contiguous()}, "plan"),
        ("stage2-config", "stage2", {"config": lambda c: {}}, "config"),
        ("y-bf16", "tail", {"y": lambda c: c["y"].bfloat16()}, "y"),
        ("norm-missing", "tail", {"norm_weight": lambda c: None}, "norm_weight"),
        ("up-D", "tail", {"up_weight": lambda c: c["w"]["latent_up"][:, :-2].contiguous()},
         "up_weight"),
        ("shared-shape", "tail", {"shared": lambda c: c["y"]}, "shared"),
        ("shared-dict-keys", "tail", {"shared": lambda c: {"x": c["x"]}}, "shared"),
        ("shared-list", "tail", {"shared": lambda c: [c["y"]]}, "shared"),
        ("down-H", "front", {"down_weight": lambda c: c["w"]["latent_down"][:, :-2].contiguous()},
         "down_weight"),
        ("x-int", "front", {"x": lambda c: c["x"].int()}, "x"),
        ("block-x-H", "block", {"x": lambda c: c["x"][:, :-2].contiguous()}, "x"),
        ("block-missing", "block",
         {"weights": lambda c: {k: v for k, v in c["w"].items() if k != "latent_up"}},
         "weights"),
        ("block-w2-I", "block",
         {"weights": lambda c: {**c["w"], "w2": c["w"]["w2"][..., :-2].contiguous()}}, "w13"),
    ]


BAD = _bad_cases()


@pytest.mark.parametrize("case", BAD, ids=[c[0] for c in BAD])
def test_bad_input(case, device):
    _, fn, change, match = case
    cfg, w, x = _setup(device, M=2)
    plan = _plan(cfg, x, w)
    z, _ = latent_down(x, w["latent_down"])
    a = moe_stage1(z, plan, w["w13"])
    c = {"z": z, "plan": plan, "w": w, "x": x, "a": a, "q13": mxfp4_quantize(w["w13"]),
         "y": torch.zeros(2, cfg.moe_in, device=device)}
    args = {
        "stage1": dict(z=z, plan=plan, w13=w["w13"]),
        "stage2": dict(a=a, plan=plan, w2=w["w2"]),
        "tail": dict(y=c["y"], norm_weight=w["latent_norm"], up_weight=w["latent_up"],
                     shared=None, eps=1e-5),
        "front": dict(x=x, down_weight=w["latent_down"]),
        "block": dict(x=x, weights=w, cfg=cfg, plan=plan),
    }[fn]
    args.update({k: f(c) for k, f in change.items()})
    launcher = {"stage1": moe_stage1, "stage2": moe_stage2, "tail": latent_moe_tail,
                "front": latent_down, "block": moe_block}[fn]
    with pytest.raises(ValueError, match=match):
        launcher(**args)


# ---------------------------------------------------------------------------------------------
# MXFP4 tiled layout (kernels.mxfp4.mxfp4_tiled_codes; moe_kernel_weights lays the experts out in
# it): every kernel path reads it. tiny with K and N the layout's multiples (D = I = 256).

TILED_CHANGES = dict(latent=256, moe_intermediate=256)
TILED_PATHS = {"mma-gpu-tiles": MMA_TILES, "klane-gpu-tiles": KLANE_TILES,
               "klane-interpreter-tiles": MoEConfig(mma=False)}
# the tensor-core tiles take one-token plan tiles (block_m 1); the K-lane tiles also several
# tokens a tile (test_moe_mma.py covers every tensor-core tile shape on its own)
TILED_CASES = [("mma-gpu-tiles", 1, 1), ("klane-gpu-tiles", 1, 1),
               ("klane-interpreter-tiles", 1, 1), ("klane-interpreter-tiles", 3, 4)]


# the K-lane GPU tiles on tiled codes: ~35 s under the interpreter; the same layout runs on the
# interpreter tiles here and on the GPU in test_gpu_k3_tiled_layout; several tokens a tile on
# the interpreter tiles (~10 s) with pytest -m ""
@pytest.mark.parametrize("path,M,block_m", [
    pytest.param(p, m, b, id=f"{p}-M{m}-bm{b}",
                 marks=pytest.mark.slow if p == "klane-gpu-tiles" or m > 1 else ())
    for p, m, b in TILED_CASES])
def test_tiled_layout_every_path(path, M, block_m, device):
    """Stage 1, the atomic and the deterministic stage 2, and the block on tiled codes give the
    row layout's outputs (bitwise, but for the order of GPU atomics) and match the reference."""
    config = TILED_PATHS[path]
    cfg, w, x = _setup(device, M=M, fmt="mxfp4", **TILED_CHANGES)
    wt = moe_kernel_weights(w)
    assert wt["w13"].layout == wt["w2"].layout == "tiled" and w["w2"].layout == "rows"
    plan = _plan(cfg, x, w, block_m)
    z = randn((M, cfg.moe_in), make_generator(1, device))
    a = moe_stage1(z, plan, w["w13"], config=config, **_act(cfg))
    assert torch.equal(moe_stage1(z, plan, wt["w13"], config=config, **_act(cfg)), a)
    assert_close("a", a, ref.moe_stage1_reference(z, plan, w["w13"], **_act(cfg)), atol=A_ATOL,
                 rtol=A_RTOL)
    y_ref = ref.moe_stage2_reference(a, plan, w["w2"])
    for det in (False, True):
        plan.out.zero_()
        y = moe_stage2(a, plan, w["w2"], deterministic=det, config=config).clone()
        plan.out.zero_()
        yt = moe_stage2(a, plan, wt["w2"], deterministic=det, config=config).clone()
        if det or device.type == "cpu":
            assert torch.equal(yt, y)
        assert_close("y", yt, y_ref, atol=Y_ATOL, rtol=Y_RTOL)
    out = moe_block(x, w, cfg=cfg, plan=plan, config=config)
    assert_close("out", moe_block(x, wt, cfg=cfg, plan=plan, config=config).float(), out.float(),
                 atol=1e-6, rtol=0 if device.type == "cpu" else 2 ** -8)


def test_moe_kernel_weights(device):
    """MXFP4 experts whose shapes allow it go to the tiled layout (a copy of the codes, the
    scales shared); bf16 experts, other weights and other shapes stay as given;
    ``tiled_weights`` off leaves everything."""
    _, w, _ = _setup(device, fmt="mxfp4", **TILED_CHANGES)
    k = moe_kernel_weights(w)
    assert k["w13"].layout == "tiled" and k["w13"].scales is w["w13"].scales
    assert torch.equal(mxfp4_dequantize(k["w2"]), mxfp4_dequantize(w["w2"]))
    assert k["latent_down"] is w["latent_down"] and w["w13"].layout == "rows"
    _, w96, _ = _setup(device, fmt="mxfp4")  # K = 96: not a multiple of 256
    assert moe_kernel_weights(w96)["w2"] is w96["w2"]
    _, wb, _ = _setup(device, **TILED_CHANGES)
    assert moe_kernel_weights(wb)["w13"] is wb["w13"]
    assert moe_kernel_weights(w, MoEConfig(tiled_weights=False))["w13"] is w["w13"]


def test_boundary_fused_reads_tiled_experts(device):
    """The boundary's inputs hold the model's layout (reference, peers) and, for the fused
    variant, the kernels' (Weights.fused): the same values, shared by the cold copies."""
    from k3lab.boundaries import moe as bmoe

    boundary = get("moe")
    cfg = dataclasses.replace(preset("tiny"), **TILED_CHANGES)
    inputs = boundary.make_inputs(cfg, device, 1, M=2, expert_format="mxfp4")
    w = inputs["weights"]
    assert w["w2"].layout == "rows" and w.fused["w2"].layout == "tiled"
    assert w.fused["latent_up"] is w["latent_up"]
    assert w.for_kernels(MoEConfig(tiled_weights=False))["w2"].layout == "rows"
    out_ref = boundary.reference.fn(inputs)
    for name in ("fused", "grouped"):
        assert boundary.check(boundary.variant(name).fn(inputs), out_ref, inputs)["out"] < 0.03
    copies = bmoe.copies_sharing_experts(inputs, 2)
    assert copies[1]["weights"].fused["w13"] is w.fused["w13"]


def test_tiled_layout_bad_shape(device):
    """Codes marked tiled whose shape the layout cannot have: a clear error naming the
    weight."""
    cfg, w, x = _setup(device, M=1, fmt="mxfp4")  # K = 96
    plan = _plan(cfg, x, w)
    a = randn((cfg.top_k, cfg.moe_intermediate), make_generator(2, device))
    with pytest.raises(ValueError, match="w2: the tiled MXFP4 layout needs"):
        moe_stage2(a, plan, dataclasses.replace(w["w2"], layout="tiled"))


# ---------------------------------------------------------------------------------------------
# GPU


def _gpu_k3(fmt, M):
    cfg = preset("kimi-k3", 8)
    gen = make_generator(M, "cuda")
    w = moe_weights(cfg, gen, expert_format=fmt)
    return cfg, w, hidden_states(cfg, M, gen)


# ids read fuse_tail-block_m-M-fmt, e.g. test_gpu_k3_tp8_block[fused-tail-16-1-mxfp4] is
# block_m 16, M 1 (pytest joins the parameters innermost decorator first)
@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("M", [1, 4, 16])
@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("fuse_tail", [False, True], ids=["tail", "fused-tail"])
def test_gpu_k3_tp8_block(fmt, M, block_m, fuse_tail):
    """The whole block with its own routing against the reference given the same plan."""
    cfg, w, x = _gpu_k3(fmt, M)
    for det in (False, True):
        _check_block(x, w, cfg, block_m=block_m, det=det, fuse_tail=fuse_tail)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("M", [1, 16])
@pytest.mark.parametrize("block_m", [1, 4, 16])
def test_gpu_k3_tp8_stages_block_m(fmt, M, block_m):
    """Stage 1 and stage 2 (atomic, deterministic) on their own at K3 tp 8 for tiles of 1, 4 and
    16 entries (the multi-token GEMV paths), against the reference of the same inputs; the plan is
    route_sort's."""
    cfg, w, x = _gpu_k3(fmt, M)
    plan = _fused_plan(cfg, x, w, block_m)
    z = randn((M, cfg.moe_in), make_generator(5, "cuda"))
    a = moe_stage1(z, plan, w["w13"])
    assert_close("a", a, ref.moe_stage1_reference(z, plan, w["w13"]), atol=A_ATOL, rtol=A_RTOL)
    y_ref = ref.moe_stage2_reference(a, plan, w["w2"])
    y = moe_stage2(a, plan, w["w2"]).clone()
    assert_close("y", y, y_ref, atol=Y_ATOL, rtol=Y_RTOL)
    y_det = moe_stage2(a, plan, w["w2"], deterministic=True)
    assert_close("y_det", y_det, y_ref, atol=Y_ATOL, rtol=Y_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("M", [1, 16])
def test_gpu_k3_tp8_fused_tail_bitwise(fmt, M):
    """Real concurrency, K3 tp 8 (hundreds of stage-2 and tail programs in one grid): with the
    deterministic stage 2 the ticket-ordered launch gives bitwise what the two separate launches
    give, call after call (counters restart from zero every time)."""
    cfg, w, x = _gpu_k3(fmt, M)
    plan = _fused_plan(cfg, x, w)
    apart = moe_block(x, w, cfg=cfg, plan=plan, deterministic=True, fuse_tail=False)
    for _ in range(5):
        assert torch.equal(moe_block(x, w, cfg=cfg, plan=plan, deterministic=True), apart)


# the K-lane tiles (compiled: the token loop, pipelined stage-1 K loop) and the tensor-core tiles
GPU_VARIANTS = {"klane": MoEConfig(mma=False),
                "klane-stages": MoEConfig(mma=False, stage1_klane_stages=0,
                                          stage2_klane_stages=2),
                "mma": MoEConfig(),
                **{k: dataclasses.replace(v, interpret_gpu_tiles=False, target_programs=528)
                   for k, v in VARIANTS.items() if k.startswith("mma-")}}


@pytest.mark.gpu
@pytest.mark.big_gpu
@pytest.mark.parametrize("variant", GPU_VARIANTS)
@pytest.mark.parametrize("M", [1, 16])
def test_gpu_k3_tp1_mxfp4_stages(M, variant):
    """Full-size experts: w13 offsets pass 2^31 elements (int64 pointer arithmetic); the MXFP4
    K-lane and tensor-core tiles (GPU_VARIANTS; M = 1 plans have one-token tiles, so M 16
    too)."""
    config = GPU_VARIANTS[variant]
    cfg = preset("kimi-k3", 1)
    gen = make_generator(0, "cuda")
    w = moe_weights(cfg, gen, expert_format="mxfp4")
    x = hidden_states(cfg, M, gen)
    w["correction_bias"][-cfg.top_k:] += 10.0  # route to the last experts: the largest offsets
    plan = _plan(cfg, x, w)
    z = randn((M, cfg.moe_in), gen)
    a = moe_stage1(z, plan, w["w13"], config=config)
    a_ref = ref.moe_stage1_reference(z, plan, w["w13"])
    assert_close("a", a, a_ref, atol=A_ATOL, rtol=A_RTOL)
    y = moe_stage2(a, plan, w["w2"], config=config)
    y_ref = ref.moe_stage2_reference(a, plan, w["w2"])
    assert_close("y", y, y_ref, atol=Y_ATOL, rtol=Y_RTOL)


@pytest.mark.gpu
@pytest.mark.big_gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("M", [1, 16])
def test_gpu_k3_tiled_layout(tp, M):
    """K3 MXFP4 experts in the kernels' layout (moe_kernel_weights: w13 and w2 tiled at tp 1, w13
    at tp 8): stage 1 bitwise the row layout's, stage 2 and the block (stage 2 + tail fused, and
    apart with PDL) against the reference."""
    cfg = preset("kimi-k3", tp)
    gen = make_generator(M, "cuda")
    w = moe_weights(cfg, gen, expert_format="mxfp4")
    wt = moe_kernel_weights(w)
    assert wt["w13"].layout == "tiled" and wt["w2"].layout == ("tiled" if tp == 1 else "rows")
    x = hidden_states(cfg, M, gen)
    plan = _plan(cfg, x, w)
    z = randn((M, cfg.moe_in), gen)
    a = moe_stage1(z, plan, wt["w13"], **_act(cfg))
    assert torch.equal(a, moe_stage1(z, plan, w["w13"], **_act(cfg)))
    assert_close("a", a, ref.moe_stage1_reference(z, plan, w["w13"], **_act(cfg)), atol=A_ATOL,
                 rtol=A_RTOL)
    y = moe_stage2(a, plan, wt["w2"])
    assert_close("y", y, ref.moe_stage2_reference(a, plan, w["w2"]), atol=Y_ATOL, rtol=Y_RTOL)
    for fuse_tail in (True, False):
        _check_block(x, wt, cfg, block_m=1, det=False, fuse_tail=fuse_tail)
    del w, wt
    torch.cuda.empty_cache()


@pytest.mark.gpu
def test_gpu_atomic_vs_deterministic():
    """Real GPU atomics: within the stated bound of the fixed-order sum; the deterministic path
    is bitwise reproducible."""
    cfg, w, x, plan = _k3_inputs("cuda", "bf16", M=16)
    z = randn((16, cfg.moe_in), make_generator(1, "cuda"))
    a = moe_stage1(z, plan, w["w13"])
    det = moe_stage2(a, plan, w["w2"], deterministic=True).clone()
    assert torch.equal(moe_stage2(a, plan, w["w2"], deterministic=True), det)
    for _ in range(5):
        plan.out.zero_()
        y = moe_stage2(a, plan, w["w2"])
        assert_close("atomic vs deterministic", y, det, atol=ATOMIC_VS_DETERMINISTIC_ATOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("fuse_tail", [True, False], ids=["fused-tail", "tail"])
@pytest.mark.parametrize("M", [4, 16])
def test_gpu_cuda_graph(fmt, fuse_tail, M):
    """moe_block with routing captured once, replayed on new x: right each time (stage 1 zeroes
    the accumulator and the stage-2/tail counters), no host synchronization; M 16 routes in two
    launches (the selection spread over token blocks)."""
    cfg = preset("kimi-k3", 8)
    gen = make_generator(0, "cuda")
    w = moe_weights(cfg, gen, expert_format=fmt)
    x = hidden_states(cfg, M, gen)
    torch.cuda.set_sync_debug_mode("error")
    try:
        moe_block(x, w, cfg=cfg, fuse_tail=fuse_tail)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        moe_block(x, w, cfg=cfg, fuse_tail=fuse_tail)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_block(x, w, cfg=cfg, fuse_tail=fuse_tail)
    for seed in (1, 2, 3):
        x.copy_(hidden_states(cfg, M, make_generator(seed, "cuda")))
        graph.replay()
        torch.cuda.synchronize()
        want = ref.latent_moe_from_plan_reference(x, _fused_plan(cfg, x, w), w, cfg)
        assert_close("out", out, want, atol=BLOCK_ATOL, rtol=BLOCK_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [True, False], ids=["pdl", "no-pdl"])
def test_gpu_pdl_back_to_back(pdl):
    """Programmatic dependent launch (MoEConfig.pdl): launches that start during the previous
    one's last wave and read the plan before their wait. Two blocks of different tokens captured
    back to back in one graph and replayed (stage 1 after the front with PDL, stage 2 and the
    tail apart with PDL), and two stage-1 (without PDL: it lets the next launch start early) and
    stage-2 (pdl=True) calls back to back, each against the reference: a missed wait would read
    the other call's activations or accumulator."""
    config = MoEConfig(pdl=pdl)
    cfg, w, _ = _gpu_k3("mxfp4", 1)
    xs = [hidden_states(cfg, 1, make_generator(seed, "cuda")) for seed in (1, 2)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for x in xs:
            moe_block(x, w, cfg=cfg, fuse_tail=False, config=config)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [moe_block(x, w, cfg=cfg, fuse_tail=False, config=config) for x in xs]
    for seed in (3, 4):
        for k, x in enumerate(xs):
            x.copy_(hidden_states(cfg, 1, make_generator(10 * seed + k, "cuda")))
        graph.replay()
        graph.replay()
        torch.cuda.synchronize()
        for x, out in zip(xs, outs, strict=True):
            want = ref.latent_moe_from_plan_reference(x, _fused_plan(cfg, x, w), w, cfg)
            assert_close("out", out, want, atol=BLOCK_ATOL, rtol=BLOCK_RTOL)
    plans = [_fused_plan(cfg, x, w) for x in xs]
    zs = [randn((1, cfg.moe_in), make_generator(seed, "cuda")) for seed in (5, 6)]
    acts = [moe_stage1(z, plan, w["w13"], config=config) for z, plan in zip(zs, plans,
                                                                             strict=True)]
    ys = [moe_stage2(a, plan, w["w2"], pdl=True, config=config)
          for a, plan in zip(acts, plans, strict=True)]
    for a, plan, y in zip(acts, plans, ys, strict=True):
        assert_close("y", y, ref.moe_stage2_reference(a, plan, w["w2"]), atol=Y_ATOL,
                     rtol=Y_RTOL)


@pytest.mark.gpu
def test_gpu_device_mismatch():
    cfg, w, x = _setup("cuda", M=2)
    plan = _plan(cfg, x, w)
    z, _ = latent_down(x, w["latent_down"])
    with pytest.raises(ValueError, match="w13"):
        moe_stage1(z, plan, w["w13"].cpu())


@pytest.mark.gpu
@pytest.mark.parametrize("route", [False, True], ids=["given-plan", "routed"])
def test_gpu_compiled_peer(route):
    """The torch.compile peer (the grouped path compiled; with routing, the reference route's
    graph first) within the block's tolerance of the fp32 truth, MXFP4 experts, M 1 and 4 (one
    graph each)."""
    boundary = get("moe")
    for M in (1, 4):
        inputs = boundary.make_inputs(preset("tiny"), "cuda", 3, M=M, expert_format="mxfp4",
                                      route=route)
        out_ref = boundary.reference.fn(inputs)
        errs = boundary.check(boundary.variant("torch.compile").fn(inputs), out_ref, inputs)
        assert errs["out"] < BLOCK_ATOL
