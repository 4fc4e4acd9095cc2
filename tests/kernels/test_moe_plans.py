"""MoE launchers and the route plan they are given: the atomic stage 2 owns its zeroing (a dirty
``plan.out`` or a second call on one plan adds nothing old), plans are validated on entry (cheap
checks always; the values of the plan's tensors on host tensors always and on a GPU with
validate="full"), and the deterministic stage 2 is a config field."""

import dataclasses

import pytest
import torch

from k3lab.boundaries import assert_close
from k3lab.config import preset
from k3lab.kernels import moe_block, moe_stage1, moe_stage2
from k3lab.kernels.moe import MoEConfig
from k3lab.kernels.moe import launch as moe_launch
from k3lab.reference import moe as ref
from k3lab.reference.route import route_sort_reference
from k3lab.weights import hidden_states, make_generator, moe_weights

# stage 2 against its fp32 reference (as tests/kernels/test_moe.py)
Y_ATOL, Y_RTOL = 2e-5, 1e-5
MMA_TILES = MoEConfig(interpret_gpu_tiles=True, target_programs=1)


def _setup(device, M=2, block_m=1, fmt="bf16", seed=0):
    cfg = preset("tiny")
    gen = make_generator(seed, device)
    w = moe_weights(cfg, gen, expert_format=fmt)
    x = hidden_states(cfg, M, gen)
    plan = route_sort_reference(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                                block_m=block_m, out_dim=cfg.moe_in)
    z = torch.randn(M, cfg.moe_in, generator=gen, device=device).to(torch.bfloat16)
    return cfg, w, x, plan, z


@pytest.mark.parametrize("block_m,fmt,config", [(1, "bf16", None), (3, "bf16", None),
                                                (1, "mxfp4", MMA_TILES)],
                         ids=["bm1", "bm3", "mxfp4-mma-tiles"])
def test_atomic_stage2_owns_its_zeroing(block_m, fmt, config, device):
    """plan.out full of garbage (NaN, then 1e6): stage 2 still gives the reference; called
    three times on one plan, the same result each time; the counters are back at 0."""
    cfg, w, x, plan, z = _setup(device, block_m=block_m, fmt=fmt)
    w2, w13 = w["w2"], w["w13"]
    a = moe_stage1(z, plan, w13, config=config)
    want = ref.moe_stage2_reference(a, plan, w2)
    for fill in (float("nan"), 1e6, None, None):
        if fill is not None:
            plan.out.fill_(fill)
        y = moe_stage2(a, plan, w2, config=config)
        assert y is plan.out
        assert_close("y", y, want, atol=Y_ATOL, rtol=Y_RTOL)
    assert not moe_launch._ZERO_COUNTERS[a.device].any()


def test_atomic_stage2_without_a_buffer(device):
    cfg, w, x, plan, z = _setup(device)
    a = moe_stage1(z, plan, w["w13"])
    want = ref.moe_stage2_reference(a, plan, w["w2"])
    bare = dataclasses.replace(plan, out=None)
    for _ in range(2):
        assert_close("y", moe_stage2(a, bare, w["w2"]), want, atol=Y_ATOL, rtol=Y_RTOL)


def test_stage2_launch_count(device):
    """The self-zeroing stage 2 is one launch and no memset, with or without plan.out."""
    from k3lab.profile import count_launches
    torch.use_deterministic_algorithms(False)  # no NaN fill kernels behind torch.empty
    cfg, w, x, plan, z = _setup(device)
    a = moe_stage1(z, plan, w["w13"])
    moe_stage2(a, plan, w["w2"])  # creates the device's counters (a memset, once)
    for p in (plan, dataclasses.replace(plan, out=None)):
        launches = count_launches(lambda i: moe_stage2(i["a"], i["plan"], i["w2"]),
                                  {"a": a, "plan": p, "w2": w["w2"]})
        assert launches.count == 1, launches.kernels


def _set(t, index, value):
    t = t.clone()
    t.view(-1)[index] = value
    return t


# (id, field, fn(plan) -> new value, message)
BAD_PLANS = [
    ("topk-id-E", "topk_ids", lambda p: _set(p.topk_ids, 0, 24), "plan.topk_ids: expected expert"),
    ("topk-id-negative", "topk_ids", lambda p: _set(p.topk_ids, 3, -1), "plan.topk_ids"),
    ("topk-id-repeated", "topk_ids", lambda p: _set(p.topk_ids, 1, int(p.topk_ids[0, 0])),
     "plan.topk_ids: a token's experts must be distinct"),
    ("sorted-id-past-sentinel", "sorted_ids", lambda p: _set(p.sorted_ids, 0, 10_000),
     "plan.sorted_ids: expected entries"),
    ("sorted-id-negative", "sorted_ids", lambda p: _set(p.sorted_ids, -1, -5), "plan.sorted_ids"),
    ("sorted-id-twice", "sorted_ids",
     lambda p: _set(p.sorted_ids, 1, int(p.sorted_ids[0])), "plan.sorted_ids: "),
    ("block-expert-E", "block_expert_ids", lambda p: _set(p.block_expert_ids, 0, 24),
     "plan.block_expert_ids: expected experts"),
    ("block-expert-other", "block_expert_ids",
     lambda p: _set(p.block_expert_ids, 0, (int(p.block_expert_ids[0]) + 1) % 24),
     "plan.block_expert_ids: .* another expert"),
    ("block-expert-none", "block_expert_ids", lambda p: _set(p.block_expert_ids, 0, -1),
     "plan.block_expert_ids: .* no expert"),
    ("num-valid-past-cap", "num_valid", lambda p: p.num_valid + 10_000, "plan.num_valid"),
    ("num-valid-not-multiple", "num_valid", lambda p: p.num_valid - 1, "plan.num_valid"),
    ("weight-nan", "topk_weights", lambda p: _set(p.topk_weights, 0, float("nan")),
     "plan.topk_weights: 1 non-finite"),
    ("too-long-for-E", "sorted_ids", lambda p: torch.cat([p.sorted_ids, p.sorted_ids]),
     "plan: sorted_ids has"),
]


def _bad_plan(plan, case):
    _, field, change, _ = case
    bad = dataclasses.replace(plan, **{field: change(plan)})
    if field == "sorted_ids" and bad.sorted_ids.numel() != plan.sorted_ids.numel():
        n = bad.sorted_ids.numel()
        bad = dataclasses.replace(bad, sorted_weights=torch.zeros_like(bad.sorted_ids,
                                                                       dtype=torch.float32),
                                  block_expert_ids=torch.full((n // plan.block_m,), -1,
                                                              dtype=torch.int32,
                                                              device=plan.sorted_ids.device))
    return bad


@pytest.mark.interpreter
@pytest.mark.parametrize("launcher", ["stage1", "stage2", "block"])
@pytest.mark.parametrize("case", BAD_PLANS, ids=[c[0] for c in BAD_PLANS])
def test_bad_plan_refused(case, launcher):
    """validate="full": the plan's values are checked before any kernel runs (the last case, a
    size, is a cheap check: always)."""
    cfg, w, x, plan, z = _setup("cpu", M=3, block_m=3)
    a = torch.zeros(3 * cfg.top_k, cfg.moe_intermediate, dtype=torch.bfloat16)
    bad = _bad_plan(plan, case)
    kw = {} if case[0] == "too-long-for-E" else {"validate": "full"}
    with pytest.raises(ValueError, match=case[3]):
        if launcher == "stage1":
            moe_stage1(z, bad, w["w13"], **kw)
        elif launcher == "stage2":
            moe_stage2(a, bad, w["w2"], **kw)
        else:
            moe_block(x, w, cfg=cfg, plan=bad, **kw)


@pytest.mark.interpreter
def test_good_plans_pass_the_full_check():
    """The full check accepts what route_sort and the reference build (every padding kind)."""
    from k3lab.kernels import route_sort
    from k3lab.kernels.moe.checks import check_plan
    cfg = preset("tiny")
    gen = make_generator(3, "cpu")
    w = moe_weights(cfg, gen)
    for m, block_m in ((1, 1), (5, 4), (16, 16)):
        x = hidden_states(cfg, m, gen)
        for build in (route_sort, route_sort_reference):
            plan = build(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                         block_m=block_m, out_dim=cfg.moe_in)
            check_plan(plan, m, cfg.n_experts, torch.device("cpu"), validate="full")


def test_validate_argument_checked(device):
    cfg, w, x, plan, z = _setup(device)
    with pytest.raises(ValueError, match="^validate"):
        moe_stage1(z, plan, w["w13"], validate="debug")
    with pytest.raises(ValueError, match="^deterministic"):
        moe_stage2(torch.zeros(2 * cfg.top_k, cfg.moe_intermediate, dtype=torch.bfloat16,
                               device=device), plan, w["w2"], deterministic=1)


def test_deterministic_stage2_from_the_config(device):
    """MoEConfig(deterministic_stage2=True) is deterministic=True where the launcher is not told;
    the boundary's make_inputs(deterministic_stage2=True) puts that config in inputs["config"],
    which the fused variant passes on."""
    cfg, w, x, plan, z = _setup(device, M=3)
    a = moe_stage1(z, plan, w["w13"])
    det = moe_stage2(a, plan, w["w2"], deterministic=True).clone()
    via_config = moe_stage2(a, plan, w["w2"], config=MoEConfig(deterministic_stage2=True))
    assert torch.equal(via_config, det)
    from k3lab.boundaries import get
    boundary = get("moe")
    assert boundary.params["deterministic_stage2"] is False
    inputs = boundary.make_inputs(cfg, device, 0, M=2, deterministic_stage2=True)
    assert inputs["config"] == MoEConfig(deterministic_stage2=True)
    boundary.check(boundary.variant("fused").fn(inputs), boundary.reference.fn(inputs), inputs)
    assert "config" not in boundary.make_inputs(cfg, device, 0, M=2)
    with pytest.raises(ValueError, match="deterministic_stage2"):
        boundary.make_inputs(cfg, device, 0, M=2, deterministic_stage2="yes")


@pytest.mark.gpu
def test_gpu_full_validation():
    """On the GPU the plan's values are checked with validate="full" only (one sync)."""
    cfg, w, x, plan, z = _setup("cuda", M=3, block_m=3)
    for case in BAD_PLANS[:-1]:
        with pytest.raises(ValueError, match=case[3]):
            moe_stage1(z, _bad_plan(plan, case), w["w13"], validate="full")
    a = moe_stage1(z, plan, w["w13"], validate="full")
    assert_close("y", moe_stage2(a, plan, w["w2"], validate="full"),
                 ref.moe_stage2_reference(a, plan, w["w2"]), atol=Y_ATOL, rtol=Y_RTOL)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
@pytest.mark.parametrize("pdl", [False, True])
def test_gpu_stage2_zeroing(fmt, pdl):
    """K3 tp 8: the self-zeroing atomic stage 2, eager back to back (PDL: a call's programs start
    during the previous call) and in a CUDA graph of several calls replayed on a dirty buffer;
    every result equals the reference; counters back at 0."""
    cfg = preset("kimi-k3", 8)
    gen = make_generator(0, "cuda")
    w = moe_weights(cfg, gen, expert_format=fmt)
    x = hidden_states(cfg, 1, gen)
    plan = route_sort_reference(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                                n_group=cfg.n_group, topk_group=cfg.topk_group,
                                routed_scaling_factor=cfg.routed_scaling, block_m=1,
                                out_dim=cfg.moe_in)
    z = torch.randn(1, cfg.moe_in, generator=gen, device="cuda").to(torch.bfloat16)
    a = moe_stage1(z, plan, w["w13"])
    want = ref.moe_stage2_reference(a, plan, w["w2"])
    outs = [moe_stage2(a, plan, w["w2"], pdl=pdl).clone() for _ in range(20)]
    for y in outs:
        assert_close("y", y, want, atol=Y_ATOL, rtol=Y_RTOL)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(8):
            y = moe_stage2(a, plan, w["w2"], pdl=pdl)
    for _ in range(3):
        plan.out.fill_(1e6)
        graph.replay()
        torch.cuda.synchronize()
        assert_close("y", y, want, atol=Y_ATOL, rtol=Y_RTOL)
    assert not moe_launch._ZERO_COUNTERS[a.device].any()
