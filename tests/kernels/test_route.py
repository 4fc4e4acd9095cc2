"""Route boundary: the fused route kernel (kernels/route/) against the op-by-op reference, and
the reference against an independent sort-based formulation; every RoutePlan field; ties;
several tokens per expert; grouped routing; padding; bad input and bad configs; one launch; the
completion counter (reset between calls, the capture guard); every RouteConfig choice; GPU: K3
sizes, real atomics, CUDA-graph capture and replay, no host sync."""

import functools

import pytest
import torch

from k3lab.boundaries import assert_close, get
from k3lab.boundaries.route import make_inputs
from k3lab.config import preset
from k3lab.kernels import RouteConfig, route_sort
from k3lab.kernels.plan import RoutePlan, plan_capacity
from k3lab.kernels.route import MAX_TOKENS
from k3lab.kernels.route import launch as route_launch
from k3lab.profile import count_launches
from k3lab.reference.route import route_sort_by_sorting, route_sort_reference
from k3lab.weights import make_generator, randn

# the threshold selection forced onto every size (tiny's 24 experts, top-4, ...)
THRESHOLD_EVERYWHERE = RouteConfig(threshold_min_top_k=1, threshold_min_experts=1)

# Kernel vs reference, topk_weights and sorted_weights (fp32 out of fp32 logits): the 7168-long
# dot products are summed in another order (split-K partials) and the kernel's sigmoid is
# 1 / (1 + exp(-x)); both move a weight by far less than this. Same for bf16 and fp32 gates.
WEIGHTS_ATOL = 2e-6
WEIGHTS_RTOL = 1e-5
# Reference vs the Python-sorted formulation (same fp32 scores; renormalized in float64).
SORTING_WEIGHTS_ATOL = 1e-6
# Everything else (ids, sorted ids, tile experts, num_valid, the zeroed out buffer): exact.
EXACT = ("topk_ids", "sorted_ids", "block_expert_ids", "num_valid", "out")


def compare(plan: RoutePlan, ref: RoutePlan, weights_atol: float = WEIGHTS_ATOL,
            weights_rtol: float = WEIGHTS_RTOL) -> None:
    got, want = plan.tensors(), ref.tensors()
    assert set(got) == set(want)
    assert plan.block_m == ref.block_m
    for name, expected in want.items():
        actual = got[name]
        assert actual.dtype == expected.dtype, f"{name}: {actual.dtype} != {expected.dtype}"
        assert actual.device == expected.device
        if name in EXACT:
            assert_close(name, actual, expected, atol=0.0)
        else:
            assert_close(name, actual, expected, atol=weights_atol, rtol=weights_rtol)


def _custom(device, E, H, M, seed=0, gate_dtype=torch.bfloat16) -> dict:
    """Router inputs for an expert count no preset has (gains as in k3lab.weights)."""
    gen = make_generator(seed, device)
    return {
        "hidden": randn((M, H), gen),
        "gate_weight": randn((E, H), gen, std=2.0 / H ** 0.5, dtype=gate_dtype),
        "correction_bias": torch.rand(E, generator=gen, device=device) * 0.1,
    }


def _args(inputs: dict) -> tuple:
    return inputs["hidden"], inputs["gate_weight"], inputs["correction_bias"]


# (id, preset name or (E, H), M, top_k (None = preset's), n_group, topk_group, block_m, extra)
CASES = [
    ("tiny-M1-E24-top4-bm1", "tiny", 1, None, 1, 1, 1, {}),
    ("tiny-M1-E24-top4-bm16", "tiny", 1, None, 1, 1, 16, {}),
    ("tiny-M5-E24-top4-bm3-fp32w", "tiny", 5, None, 1, 1, 3, {"gate_dtype": torch.float32}),
    ("tiny-M3-E24-top7-bm4-norenorm-x2.5", "tiny", 3, 7, 1, 1, 4,
     {"renormalize": False, "scale": 2.5}),
    ("tiny-M16-E24-top4-bm16", "tiny", 16, None, 1, 1, 16, {}),  # largest in-register sort
    ("tiny-M17-E24-top4-bm16", "tiny", 17, None, 1, 1, 16, {}),  # sort passes via memory
    ("tiny-M64-E24-top4-bm1", "tiny", 64, None, 1, 1, 1, {}),
    ("tiny-M64-E24-top4-bm16-out", "tiny", 64, None, 1, 1, 16, {}),
    ("E12-M64-top3-bm5", (12, 40), 64, 3, 1, 1, 5, {}),  # ~16 tokens per expert
    ("tiny-M2-E24-top24-bm2", "tiny", 2, 24, 1, 1, 2, {}),  # every expert chosen
    ("tiny-M3-E24-top1-bm1", "tiny", 3, 1, 1, 1, 1, {}),
    ("tiny-M13-E24-top4-g4k2-bm16", "tiny", 13, None, 4, 2, 16, {}),
    ("E20-M7-top5-g5k3-bm4", (20, 72), 7, 5, 5, 3, 4, {}),
    ("E20-M2-top10-g5k5-bm1-fp32w", (20, 72), 2, 10, 5, 5, 1, {"gate_dtype": torch.float32}),
    ("K3-M1-E896-top16-bm1", "kimi-k3", 1, None, 1, 1, 1, {}),
    ("K3-M1-E896-top16-bm16", "kimi-k3", 1, None, 1, 1, 16, {}),
    ("K3-M4-E896-top16-bm16", "kimi-k3", 4, None, 1, 1, 16, {}),
    ("K3-M9-E896-top16-bm16", "kimi-k3", 9, None, 1, 1, 16, {}),
    ("K3-M2-E896-top16-g8k3-bm1", "kimi-k3", 2, None, 8, 3, 1, {}),
    ("K2-M1-E384-top8-bm1", "kimi-k2", 1, None, 1, 1, 1, {}),
    ("K2-M3-E384-top8-g8k4-bm16", "kimi-k2", 3, None, 8, 4, 16, {}),
    ("KL-M1-E256-top8-bm1", "kimi-linear", 1, None, 1, 1, 1, {}),
    ("KL-M6-E256-top8-bm16", "kimi-linear", 6, None, 1, 1, 16, {}),
]


def _case_inputs(case, device) -> tuple[tuple, dict]:
    _, src, m, top_k, n_group, topk_group, block_m, extra = case
    if isinstance(src, str):
        cfg = preset(src)
        inp = make_inputs(cfg, device, 0, M=m, block_m=block_m)
        if extra.get("gate_dtype"):
            inp["gate_weight"] = inp["gate_weight"].to(extra["gate_dtype"])
        top_k = top_k or cfg.top_k
        scale, out_dim = cfg.routed_scaling, cfg.moe_in
    else:
        inp = _custom(device, *src, m, gate_dtype=extra.get("gate_dtype", torch.bfloat16))
        scale, out_dim = 1.0, None
    kwargs = dict(top_k=top_k, n_group=n_group, topk_group=topk_group,
                  renormalize=extra.get("renormalize", True),
                  routed_scaling_factor=extra.get("scale", scale), block_m=block_m,
                  out_dim=out_dim)
    return _args(inp), kwargs


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_fused_matches_reference(case, device):
    args, kwargs = _case_inputs(case, device)
    plan = route_sort(*args, **kwargs)
    ref = route_sort_reference(*args, **kwargs)
    compare(plan, ref)
    m, top_k = plan.topk_ids.shape
    assert plan.sorted_ids.shape == (plan_capacity(m, top_k, args[1].shape[0], plan.block_m),)


SORTING_CASES = [c for c in CASES if c[0] in (
    "tiny-M3-E24-top7-bm4-norenorm-x2.5", "tiny-M64-E24-top4-bm16-out", "E12-M64-top3-bm5",
    "tiny-M13-E24-top4-g4k2-bm16", "E20-M7-top5-g5k3-bm4", "K3-M2-E896-top16-g8k3-bm1",
    "K2-M3-E384-top8-g8k4-bm16")]


@pytest.mark.parametrize("case", SORTING_CASES, ids=[c[0] for c in SORTING_CASES])
def test_reference_matches_sorting(case):
    args, kwargs = _case_inputs(case, "cpu")
    compare(route_sort_reference(*args, **kwargs), route_sort_by_sorting(*args, **kwargs),
            weights_atol=SORTING_WEIGHTS_ATOL, weights_rtol=0.0)


def _all(args, kwargs, device, config=None):
    """fused, reference and sort-based plans (the last always on CPU, moved back)."""
    cpu_args = tuple(a.cpu() for a in args)
    srt = route_sort_by_sorting(*cpu_args, **kwargs)
    srt = RoutePlan(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                       for k, v in vars(srt).items()})
    return (route_sort(*args, **kwargs, config=config), route_sort_reference(*args, **kwargs),
            srt)


def test_hand_computed_plan(device, config=None):
    """Six experts, three tokens, top-2, block_m 2: the whole plan written out by hand."""
    hidden = torch.tensor([[0, 2, 0, 0, 3, 0], [0, 3, 0, 0, 2, 0], [2, 3, 0, 0, 0, 0]],
                          dtype=torch.bfloat16, device=device)
    gate = torch.eye(6, dtype=torch.float32, device=device)
    bias = torch.zeros(6, device=device)
    for plan in _all((hidden, gate, bias), dict(top_k=2, block_m=2, out_dim=3), device,
                     config):
        s = 6  # sentinel M * top_k
        assert plan.topk_ids.tolist() == [[4, 1], [1, 4], [1, 0]]
        assert plan.sorted_ids.tolist() == [5, s, 1, 2, 4, s, 0, 3, s, s, s, s]
        assert plan.block_expert_ids.tolist() == [0, 1, 1, 4, -1, -1]
        assert plan.num_valid.tolist() == [8]
        w = torch.sigmoid(torch.tensor([[3.0, 2.0], [3.0, 2.0], [3.0, 2.0]]))
        w = w / w.sum(-1, keepdim=True)
        assert_close("topk_weights", plan.topk_weights.cpu(), w, atol=WEIGHTS_ATOL)
        expect_sw = [w[2, 1], 0, w[0, 1], w[1, 0], w[2, 0], 0, w[0, 0], w[1, 1]] + [0] * 4
        assert_close("sorted_weights", plan.sorted_weights.cpu(), torch.tensor(expect_sw),
                     atol=WEIGHTS_ATOL)
        assert plan.out.shape == (3, 3) and not plan.out.any()


def test_ties_all_equal(device):
    """Zero tokens and a flat bias: every score ties, so experts 0..k-1 in order."""
    E, H, M, k = 24, 40, 3, 5
    inp = _custom(device, E, H, M)
    hidden = torch.zeros_like(inp["hidden"])
    bias = torch.zeros(E, device=device)
    plans = _all((hidden, inp["gate_weight"], bias), dict(top_k=k, block_m=4), device)
    for plan in plans:
        assert plan.topk_ids.tolist() == [list(range(k))] * M
        assert_close("topk_weights", plan.topk_weights, torch.full((M, k), 1 / k, device=device),
                     atol=WEIGHTS_ATOL)
    compare(plans[0], plans[1])


@pytest.mark.parametrize("src", ["tiny", "kimi-k3"])
def test_ties_subset(src, device):
    """A subset of experts (spread over E tiles) has zero gate rows and the same, dominant bias:
    they tie exactly; the top-k must be the lowest indices of the subset, in ascending order."""
    cfg = preset(src)
    inp = make_inputs(cfg, device, 3, M=4, block_m=8)
    E = cfg.n_experts
    tied = sorted({1, 5, E // 2, E // 2 + 1, 3 * E // 4, E - 2, E - 1}
                  | set(range(7, E, max(2, E // 24))))
    gate = inp["gate_weight"].clone()
    bias = inp["correction_bias"].clone()
    gate[tied] = 0
    bias[tied] = 2.0
    kwargs = dict(top_k=min(cfg.top_k, len(tied) - 2), block_m=8)
    plans = _all((inp["hidden"], gate, bias), kwargs, device)
    for plan in plans:
        assert plan.topk_ids.tolist() == [tied[:kwargs["top_k"]]] * 4
    compare(plans[0], plans[1])
    compare(plans[1], plans[2], weights_atol=SORTING_WEIGHTS_ATOL, weights_rtol=0.0)


def test_ties_groups(device):
    """Groups 0 and 2 tie on their top-2 sum (0.75 + 0.75 = 1.0 + 0.5 = 1.5, exact in fp32):
    the lower group is kept; inside it the two 0.75 experts, then the 0.5 ones by index."""
    E, H, M = 24, 40, 2
    inp = _custom(device, E, H, M)
    hidden = torch.zeros_like(inp["hidden"])  # every score 0.5
    bias = torch.zeros(E, device=device)
    bias[[2, 4]] = 0.25   # group 0 (experts 0..5): 0.75, 0.75
    bias[13] = 0.5        # group 2 (experts 12..17): 1.0, 0.5
    bias[8] = 0.125       # group 1: 0.625 + 0.5 = 1.125
    kwargs = dict(top_k=4, n_group=4, topk_group=1, block_m=1)
    plans = _all((hidden, inp["gate_weight"], bias), kwargs, device)
    for plan in plans:
        assert plan.topk_ids.tolist() == [[2, 4, 0, 1]] * M
    compare(plans[0], plans[1])
    kwargs["topk_group"] = 2  # groups 0 and 2 kept: 13 (1.0), then 2, 4 (0.75), then 0 (0.5)
    for plan in _all((hidden, inp["gate_weight"], bias), kwargs, device):
        assert plan.topk_ids.tolist() == [[13, 2, 4, 0]] * M


def test_several_tokens_per_expert(device):
    """M = 64 tokens on 6 experts, top-2: every expert gets many tokens; runs padded to 8."""
    inp = _custom(device, 6, 24, MAX_TOKENS, seed=5)
    kwargs = dict(top_k=2, block_m=8)
    plan, ref, srt = _all(_args(inp), kwargs, device)
    compare(plan, ref)
    compare(ref, srt, weights_atol=SORTING_WEIGHTS_ATOL, weights_rtol=0.0)
    counts = torch.zeros(6, dtype=torch.long)
    for e in plan.topk_ids.flatten().tolist():
        counts[e] += 1
    assert counts.max() > 8  # several tiles for one expert
    assert plan.num_valid.item() == int(((counts + 7) // 8 * 8).sum())


def test_launch_count(device):
    """One launch (GEMV, then selection + sort in the last program), no ATen op around it."""
    torch.use_deterministic_algorithms(False)  # no NaN fill kernels behind torch.empty here
    cfg = preset("kimi-k3" if device.type == "cuda" else "tiny")
    boundary = get("route")
    fused = boundary.variant("fused")
    launches = count_launches(fused.fn, boundary.make_inputs(cfg, device, 0, M=1))
    assert launches.count == 1, launches.kernels
    assert "route_sort_kernel" in launches.kernels[0], launches.kernels


# the selection as its own launch of one program per token block (select_programs_min_tokens, on
# by default): the threshold path over 3 programs, grouped over 6, and the arg-max loop (top-4 of
# 200: 3)
SPREAD = RouteConfig(select_programs_min_tokens=1)
SPREAD_CASES = [
    ("K3-M9-E896-top16-bm16", "kimi-k3", 9, None, 1, 1, 16, {}),
    ("K3-M21-E896-top16-g8k3-bm4", "kimi-k3", 21, None, 8, 3, 4, {}),
    ("K2-M20-E384-top8-bm1", "kimi-k2", 20, None, 1, 1, 1, {}),
    ("E200-M40-top4-bm2", (200, 64), 40, 4, 1, 1, 2, {}),
]


@pytest.mark.parametrize("case", SPREAD_CASES, ids=[c[0] for c in SPREAD_CASES])
def test_spread_selection(case, device):
    """Two launches, the second one program per token block; every plan field as the
    reference's and the sort-based formulation's, and the counter back at 0."""
    args, kwargs = _case_inputs(case, device)
    M, E, top_k = args[0].shape[0], args[1].shape[0], kwargs["top_k"]
    tiles = route_launch._select_tiles(E, M, top_k, SPREAD)
    assert route_launch._spread_selection(M, tiles, SPREAD) and 2 * tiles["BLOCK_T"] < M
    assert route_launch._spread_selection(M, tiles, RouteConfig())  # on by default
    assert not route_launch._spread_selection(M, tiles, RouteConfig(select_programs_min_tokens=0))
    launches = count_launches(lambda a: route_sort(*a, **kwargs, config=SPREAD), args)
    assert launches.count == 2, launches.kernels
    _check_all(args, kwargs, device, SPREAD)
    assert not route_launch._COUNTERS[args[0].device].any()


# the sort metadata in one program's registers (register_sort_max_entries): several tiles of one
# expert (E12, bm5), padding to a power of two (M17 x top-4 = 68 entries -> 128), grouped
# routing; in the GEMV launch's last program and after the spread
# selection
REG_SORT = RouteConfig(register_sort_max_entries=4096)
REG_SORT_CASES = [(c, REG_SORT) for c in CASES if c[0] in (
    "tiny-M17-E24-top4-bm16", "tiny-M64-E24-top4-bm1", "tiny-M64-E24-top4-bm16-out",
    "E12-M64-top3-bm5")]
REG_SORT_CASES += [(c, RouteConfig(select_programs_min_tokens=1, register_sort_max_entries=512))
                   for c in SPREAD_CASES if c[0] in ("K3-M9-E896-top16-bm16",
                                                     "K3-M21-E896-top16-g8k3-bm4",
                                                     "E200-M40-top4-bm2")]


@pytest.mark.parametrize("case,config", REG_SORT_CASES,
                         ids=[f"{c[0]}-{_cid}" for (c, cf) in REG_SORT_CASES
                              for _cid in ["spread" if cf.select_programs_min_tokens else "one"]])
def test_register_sort(case, config, device):
    """Every plan field as the reference's and the sort-based formulation's, with the register
    sort chosen (and below its limit the memory passes)."""
    args, kwargs = _case_inputs(case, device)
    M, E, top_k = args[0].shape[0], args[1].shape[0], kwargs["top_k"]
    tiles = route_launch._select_tiles(E, M, top_k, config)
    assert tiles["SORT_N"] >= M * top_k and not tiles["IN_REGS"]
    small = RouteConfig(register_sort_max_entries=tiles["SORT_N"] // 2)
    assert route_launch._select_tiles(E, M, top_k, small)["SORT_N"] == 0
    off = RouteConfig(register_sort_max_entries=0)
    assert route_launch._select_tiles(E, M, top_k, off)["SORT_N"] == 0
    _check_all(args, kwargs, device, config)
    assert not route_launch._COUNTERS[args[0].device].any()


# the split-K GEMV's tensor-core products (gemv_dot_min_tokens; by default from 4 tokens):
# several token blocks of DOT_M (M 64 over 16 experts a tile: 4 blocks), masked tokens
# (M 17 -> 2 blocks), grouped routing, K3
DOT = RouteConfig(gemv_dot_min_tokens=2)
NO_DOT = RouteConfig(gemv_dot_min_tokens=0)
DOT_CASES = [c for c in CASES if c[0] in (
    "tiny-M17-E24-top4-bm16", "E12-M64-top3-bm5", "tiny-M13-E24-top4-g4k2-bm16",
    "K2-M3-E384-top8-g8k4-bm16", "K3-M4-E896-top16-bm16")]


@pytest.mark.parametrize("case", DOT_CASES, ids=[c[0] for c in DOT_CASES])
def test_gemv_dot(case, device):
    """Every plan field as the reference's and the sort-based formulation's with the GEMV's
    tensor-core products and without them; they stay off for one token (row programs), fp32
    operands and 16-column tiles' neighbours (narrow expert tiles)."""
    args, kwargs = _case_inputs(case, device)
    M, H = args[0].shape
    E = args[1].shape[0]
    on_gpu = device.type == "cuda"
    block_e, block_k = route_launch._gemv_blocks(E, H, on_gpu, DOT)
    bf = (torch.bfloat16, torch.bfloat16)
    dot = functools.partial(route_launch._gemv_dot, on_gpu=on_gpu)
    assert dot(M, block_e, block_k, bf, DOT)["DOT_M"] == route_launch.DOT_M
    assert dot(1, block_e, block_k, bf, DOT)["DOT_M"] == 0
    assert dot(M, block_e, block_k, (torch.float32, torch.bfloat16), DOT)["DOT_M"] == 0
    assert dot(M, 8, block_k, bf, DOT)["DOT_M"] == 0
    assert dot(M, block_e, block_k, bf, NO_DOT)["DOT_M"] == 0
    _check_all(args, kwargs, device, DOT)
    _check_all(args, kwargs, device, NO_DOT)


def test_gemv_dot_shared_memory():
    """On the GPU the tensor-core products stay off where a tile's operands would overflow
    shared memory: K3's default 32 x 1024 tiles fit, 64- or 128-expert tiles of 1024 columns
    do not; under the interpreter there is no such limit."""
    bf = (torch.bfloat16, torch.bfloat16)
    dot = route_launch._gemv_dot
    assert dot(16, 32, 1024, bf, DOT, on_gpu=True)["DOT_M"] == route_launch.DOT_M
    assert dot(64, 32, 1024, bf, DOT, on_gpu=True)["DOT_M"] == route_launch.DOT_M
    for block_e in (64, 128):
        assert dot(16, block_e, 1024, bf, DOT, on_gpu=True)["DOT_M"] == 0
        assert dot(16, block_e, 1024, bf, DOT, on_gpu=False)["DOT_M"] == route_launch.DOT_M
    assert dot(16, 64, 512, bf, DOT, on_gpu=True)["DOT_M"] == route_launch.DOT_M


# cases of different grids (E tiles x K splits), selection paths and plan sizes, back to back
REPEAT_CASES = ["tiny-M1-E24-top4-bm1", "K3-M1-E896-top16-bm16", "tiny-M17-E24-top4-bm16",
                "E12-M64-top3-bm5", "K2-M3-E384-top8-g8k4-bm16", "tiny-M1-E24-top4-bm1"]


def test_repeated_calls_reset_the_counter(device):
    """The counter is back at 0 after every call: the same call twice gives identical plans, and
    a run of calls with different grids each matches the reference (a counter left non-zero
    would make no program, or the wrong one, run the selection)."""
    args, kwargs = _case_inputs(next(c for c in CASES if c[0] == REPEAT_CASES[0]), device)
    first = route_sort(*args, **kwargs)
    counter = route_launch._COUNTERS[args[0].device]
    assert counter.dtype == torch.int32 and not counter.any()
    again = route_sort(*args, **kwargs)
    for name, t in first.tensors().items():
        assert torch.equal(t, again.tensors()[name]), name
    for _ in range(2 if device.type == "cuda" else 1):  # the sequence repeats a grid already
        for case in (c for name in REPEAT_CASES for c in CASES if c[0] == name):
            args, kwargs = _case_inputs(case, device)
            compare(route_sort(*args, **kwargs), route_sort_reference(*args, **kwargs))
            assert not counter.any(), case[0]


def test_capture_guard(device):
    """Inside a CUDA-graph capture the counter cannot be created: a clear error; once it exists
    (a call before the capture), calls during capture are fine."""
    args, kwargs = _case_inputs(CASES[0], device)
    dev = args[0].device
    saved = dict(route_launch._COUNTERS)
    route_launch._COUNTERS.clear()
    try:
        with pytest.raises(ValueError,
                           match="call route_sort once on this device before capturing"):
            route_launch._counter(dev, capturing=True)
        assert not route_launch._COUNTERS
        route_sort(*args, **kwargs)  # warm-up: creates the counter
        assert route_launch._counter(dev, capturing=True) is route_launch._COUNTERS[dev]
        compare(route_sort(*args, **kwargs), route_sort_reference(*args, **kwargs))
    finally:
        route_launch._COUNTERS.clear()
        route_launch._COUNTERS.update(saved)


def test_boundary_check_catches_errors(device):
    boundary = get("route")
    inputs = boundary.make_inputs(preset("tiny"), device, 1, M=3, block_m=4)
    ref = boundary.reference.fn(inputs)
    out = boundary.variant("fused").fn(inputs)
    with pytest.raises(ValueError, match="config"):  # the fused variant passes inputs' config
        boundary.variant("fused").fn({**inputs, "config": {"num_warps": 8}})
    boundary.check(boundary.variant("fused").fn({**inputs, "config": THRESHOLD_EVERYWHERE}),
                   ref, inputs)
    errs = boundary.check(out, ref, inputs)
    assert set(errs) == set(ref.tensors())
    assert boundary.bytes_moved(inputs) > inputs["gate_weight"].nbytes
    bad = RoutePlan(**{**vars(out), "sorted_ids": out.sorted_ids.flip(0)})
    with pytest.raises(AssertionError, match="sorted_ids"):
        boundary.check(bad, ref, inputs)
    bad = RoutePlan(**{**vars(out), "topk_weights": out.topk_weights * (1 + 1e-4)})
    with pytest.raises(AssertionError, match="topk_weights"):
        boundary.check(bad, ref, inputs)


def _bad(device):
    inp = _custom(device, 24, 40, 2)
    h, w, b = _args(inp)
    return [
        ("hidden-3d", dict(hidden=h[None]), "hidden"),
        ("hidden-fp16", dict(hidden=h.half()), "hidden"),
        ("hidden-M0", dict(hidden=h[:0]), "hidden"),
        ("hidden-M65", dict(hidden=h[:1].expand(MAX_TOKENS + 1, -1).contiguous()), "hidden"),
        ("hidden-noncontig", dict(hidden=torch.cat([h, h], 1)[:, ::2]), "hidden"),
        ("gate-H", dict(gate_weight=w[:, :-1].contiguous()), "gate_weight"),
        ("gate-int", dict(gate_weight=w.to(torch.int32)), "gate_weight"),
        ("bias-bf16", dict(correction_bias=b.bfloat16()), "correction_bias"),
        ("bias-shape", dict(correction_bias=b[:-1]), "correction_bias"),
        ("bias-list", dict(correction_bias=b.tolist()), "correction_bias"),
        ("top_k-0", dict(top_k=0), "top_k"),
        ("top_k-gt-E", dict(top_k=25), "top_k"),
        ("top_k-float", dict(top_k=4.0), "top_k"),
        ("top_k-gt-kept", dict(top_k=13, n_group=4, topk_group=2), "top_k"),
        ("n_group-divides", dict(n_group=5), "n_group"),
        ("n_group-size1", dict(n_group=24, topk_group=2), "n_group"),
        ("topk_group-gt", dict(n_group=4, topk_group=5), "topk_group"),
        ("topk_group-0", dict(n_group=4, topk_group=0), "topk_group"),
        ("block_m-0", dict(block_m=0), "block_m"),
        ("out_dim-0", dict(out_dim=0), "out_dim"),
        ("scale-str", dict(routed_scaling_factor="2"), "routed_scaling_factor"),
        ("config-dict", dict(config={"gemv_block_k": 64}), "config"),
    ]


@pytest.mark.parametrize("which", [c[0] for c in _bad("cpu")])
def test_bad_input(which, device):
    _, change, match = next(c for c in _bad(device) if c[0] == which)
    inp = _custom(device, 24, 40, 2)
    kwargs = dict(hidden=inp["hidden"], gate_weight=inp["gate_weight"],
                  correction_bias=inp["correction_bias"], top_k=4)
    kwargs.update(change)
    with pytest.raises(ValueError, match=match):
        route_sort(**kwargs)


@pytest.mark.parametrize("field,value", [
    ("gemv_block_e", 24), ("gemv_block_k", 48), ("gemv_block_k", 0), ("gemv_min_programs", 0),
    ("gemv_row_programs", -1), ("gemv_row_chunk", 384), ("gemv_row_splits", 0),
    ("gemv_row_max_tokens", -1), ("num_warps", 3), ("num_warps", 4.0), ("scalar_keys", 1),
    ("cand_cache", ".cs"), ("threshold_min_top_k", 0), ("threshold_min_experts", True),
    ("buckets_per_slot", 3), ("candidates_per_slot", 0), ("early_dependents", "yes")])
def test_bad_config(field, value):
    with pytest.raises(ValueError, match=field):
        RouteConfig(**{field: value})


# ---------------------------------------------------------------------------------------------
# The threshold selection (_top_k_threshold: bucket maxima, threshold, compaction of the
# candidates, rank among them) and its fallback to the arg-max loop (more than CAP candidates)


def _route_kwargs(inp: dict) -> dict:
    return {k: inp[k] for k in ("top_k", "n_group", "topk_group", "renormalize",
                                "routed_scaling_factor", "block_m", "out_dim")}


def _candidate_counts(args, kwargs, config=None) -> tuple[list[int], int]:
    """The test's own model of the threshold selection: per token the number of candidates
    (keys >= the top_k-th largest bucket maximum, keys ordered by (score desc, expert asc),
    experts of dropped routing groups at -inf), and CAP. Tells which path (fast or fallback) a
    case takes."""
    hidden, gate, bias = (a.cpu() for a in args)
    E, M, top_k = gate.shape[0], hidden.shape[0], kwargs["top_k"]
    n_group, topk_group = kwargs.get("n_group", 1), kwargs.get("topk_group", 1)
    config = config or RouteConfig()
    bucket = route_launch._bucket_of(E, M, top_k, config)
    assert bucket is not None, "the threshold selection is not used for this case"
    biased = torch.sigmoid(hidden.float() @ gate.float().t()) + bias.float()
    if n_group > 1:
        grouped = biased.view(M, n_group, E // n_group)
        gscore = grouped.topk(2, dim=-1).values.sum(-1)
        kept = torch.sort(gscore, dim=1, descending=True, stable=True).indices[:, :topk_group]
        drop = torch.ones(M, n_group, dtype=torch.bool).scatter_(1, kept, False)
        biased = biased.masked_fill(drop.repeat_interleave(E // n_group, dim=1), float("-inf"))
    order = torch.sort(biased, dim=1, descending=True, stable=True).indices  # [M, E]
    counts = []
    for row in order.tolist():
        first = {}  # bucket -> position (in key order) of its maximum
        for pos, e in enumerate(row):
            first.setdefault(int(bucket[e]), pos)
        counts.append(sorted(first.values())[top_k - 1] + 1)
    return counts, route_launch._select_tiles(E, M, top_k, config)["CAP"]


def _check_all(args, kwargs, device, config=None):
    plan, ref, srt = _all(args, kwargs, device, config)
    compare(plan, ref)
    compare(ref, srt, weights_atol=SORTING_WEIGHTS_ATOL, weights_rtol=0.0)


@pytest.mark.parametrize("name", ["kimi-k3", "kimi-k2", "kimi-linear", "tiny"])
def test_threshold_selection_chosen(name):
    """The real presets' expert counts take the threshold selection (so the preset cases test
    it); small top_k keeps the arg-max loop."""
    cfg = preset(name)
    for m in (1, 4, MAX_TOKENS):
        tiles = route_launch._select_tiles(cfg.n_experts, m, cfg.top_k, RouteConfig())
        if name == "tiny":
            assert tiles["BUCKETS"] == 0
        else:
            assert cfg.top_k <= tiles["BUCKETS"] <= tiles["BLOCK_E"]
            assert cfg.top_k <= tiles["CAP"] <= tiles["BLOCK_E"]


@pytest.mark.parametrize("E,top_k", [(32, 8), (64, 8), (64, 16)])
def test_small_expert_counts_take_the_loop(E, top_k):
    """64 or fewer (padded) experts select with the arg-max loop: Triton 3.6's sm_90 compile of
    the threshold selection fails there at M = 1 (RouteConfig.threshold_min_experts)."""
    for m in (1, 2, MAX_TOKENS):
        assert route_launch._select_tiles(E, m, top_k, RouteConfig())["BUCKETS"] == 0
    assert route_launch._select_tiles(128, 1, top_k, RouteConfig())["BUCKETS"] > 0


# 6-14 s each under the interpreter: K3 and K2 at 64 tokens (test_threshold_fallback keeps K3's
# 64-token blocks in the default selection) and K2's one token (K3 and Kimi Linear's stay)
_PRESET_SLOW = {("kimi-k3", MAX_TOKENS), ("kimi-k2", MAX_TOKENS), ("kimi-k2", 1)}


@pytest.mark.parametrize("name,M", [
    pytest.param(n, m, id=f"{n}-{m}", marks=pytest.mark.slow if (n, m) in _PRESET_SLOW else ())
    for n in ("kimi-k3", "kimi-k2", "kimi-linear", "tiny") for m in (1, 4, MAX_TOKENS)])
def test_threshold_every_preset(name, M, device):
    """Every preset's expert count and top_k, one token (in registers), four (one block),
    64 (the general path, blocks of tokens): random routers stay on the fast path (at least 3
    in 4 tokens within CAP candidates: at 2 per slot about 0.2-0.9% of a preset's random tokens
    are above it, and their block takes the exact fallback) and match the reference. tiny is
    forced onto the threshold path."""
    config = THRESHOLD_EVERYWHERE if name == "tiny" else None
    inp = make_inputs(preset(name), device, M, M=M, block_m=16)
    args, kwargs = _args(inp), _route_kwargs(inp)
    counts, cap = _candidate_counts(args, kwargs, config)
    assert 4 * sum(c <= cap for c in counts) >= 3 * M, (counts, cap)
    compare(route_sort(*args, **kwargs, config=config), route_sort_reference(*args, **kwargs))


def _crowded(name, M, crowded, device, tie=False):
    """Router inputs whose tokens ``crowded`` have their top scores crowded into three buckets
    (buckets 1, 2, 3: 3 * E / BUCKETS experts > CAP): gate column 0 is 1 on those
    experts and 0 elsewhere; a crowded token is 64 * e_0 (score 1 on the crowded experts, 0.5
    elsewhere), the others keep random states without column 0. tie: zero hidden states and a
    flat bias instead (every crowded expert 0.75, every other one 0.5)."""
    cfg = preset(name)
    inp = make_inputs(cfg, device, 7, M=M, block_m=4)
    E = cfg.n_experts
    bucket = route_launch._bucket_of(E, M, cfg.top_k)
    crowd = ((bucket >= 1) & (bucket <= 3)).to(device)
    gate, hidden, bias = inp["gate_weight"].clone(), inp["hidden"].clone(), inp["correction_bias"]
    gate[:, 0] = crowd.to(gate.dtype)
    hidden[:, 0] = 0
    hidden[crowded] = 0
    hidden[crowded, 0] = 64
    if tie:
        hidden = torch.zeros_like(hidden)
        bias = torch.where(crowd, 0.25, 0.0)
    return (hidden, gate, bias), _route_kwargs(inp)


@pytest.mark.parametrize("name,M,crowded", [
    ("kimi-k3", 1, [0]), ("kimi-k3", 4, [2]), ("kimi-k3", MAX_TOKENS, [5, 63]),
    ("kimi-k2", 3, [0, 1, 2]), ("kimi-linear", 2, [1])],
    ids=["K3-M1", "K3-M4-one-of-four", "K3-M64-two-blocks", "K2-M3-all", "KL-M2-second"])
def test_threshold_fallback(name, M, crowded, device):
    """More than CAP candidates (top scores crowded into few buckets): the block falls back to
    the arg-max loop, which rewrites the candidate rows with the exact top-k. The other tokens
    of a block are redone by the loop too; tokens of other blocks keep the fast path."""
    args, kwargs = _crowded(name, M, crowded, device)
    counts, cap = _candidate_counts(args, kwargs)
    assert [t for t in range(M) if counts[t] > cap] == crowded, (counts, cap)
    _check_all(args, kwargs, device)


@pytest.mark.parametrize("config", [RouteConfig(cand_cache=".cg"), RouteConfig(scalar_keys=False),
                                    RouteConfig(cand_cache=".cg", scalar_keys=False)],
                         ids=["cand-l2", "vector-keys", "cand-l2-vector-keys"])
def test_threshold_fallback_configs(config, device):
    """The fallback under the selection's non-default choices (the defaults run in every other
    test): one crowded token of four (that block falls back, the others keep the fast path)."""
    args, kwargs = _crowded("kimi-k3", 4, [2], device)
    _check_all(args, kwargs, device, config)


# one token ~20 s under the interpreter; four tokens run the same tied fallback
@pytest.mark.parametrize("M", [pytest.param(1, marks=pytest.mark.slow), 4])
def test_threshold_fallback_ties(M, device):
    """Crowded and tied: every crowded expert scores exactly 0.75, every other 0.5; the top-k
    are the lowest-indexed crowded experts, found by the fallback."""
    args, kwargs = _crowded("kimi-k3", M, list(range(M)), device, tie=True)
    counts, cap = _candidate_counts(args, kwargs)
    assert min(counts) > cap, (counts, cap)
    bucket = route_launch._bucket_of(896, M, 16)
    expect = [e for e in range(896) if 1 <= bucket[e] <= 3][:16]
    for plan in _all(args, kwargs, device):
        assert plan.topk_ids.tolist() == [expect] * M
    _check_all(args, kwargs, device)


# one token: ~20 s each under the interpreter; every grid runs at four tokens (the same
# selection, one block) in the default selection, at one token with pytest -m ""
@pytest.mark.parametrize("M,levels", [
    pytest.param(m, lv, id=f"{m}-{name}", marks=pytest.mark.slow if m == 1 else ())
    for m in (1, 4) for lv, name in ((0, "all-equal"), (2, "3-levels"), (40, "41-ulps"))])
def test_threshold_near_ties(levels, M, device):
    """Zero hidden states (every score exactly 0.5) and biases on a grid of single fp32 ulps:
    biased score 0.75 + k * 2^-24, k random in [0, levels] (exact: Sterbenz). Exact ties and
    one-ulp neighbours everywhere, across every bucket; ties go to the lower expert."""
    cfg = preset("kimi-k3")
    inp = make_inputs(cfg, device, 11, M=M, block_m=8)
    gen = torch.Generator().manual_seed(levels)
    k = torch.randint(0, levels + 1, (cfg.n_experts,), generator=gen)
    target = 0.75 + k.double() * 2.0 ** -24
    bias = (target - 0.5).float()
    assert torch.equal(bias + 0.5, target.float())  # the grid survives fp32
    args = (torch.zeros_like(inp["hidden"]), inp["gate_weight"], bias.to(device))
    kwargs = _route_kwargs(inp)
    counts, cap = _candidate_counts(args, kwargs)
    assert max(counts) <= cap, counts  # the fast path, not the fallback
    if levels == 0:  # the lowest experts win, one a bucket: exactly top_k candidates
        assert counts == [cfg.top_k] * M, counts
    expect = sorted(range(cfg.n_experts), key=lambda e: (-int(k[e]), e))[:cfg.top_k]
    for plan in _all(args, kwargs, device):
        assert plan.topk_ids.tolist() == [expect] * M
    _check_all(args, kwargs, device)


@pytest.mark.parametrize("name,M,n_group,topk_group", [
    ("kimi-k3", 1, 8, 1), ("kimi-k3", 4, 8, 4), ("kimi-k2", MAX_TOKENS, 8, 4),
    ("kimi-linear", 1, 4, 2)], ids=["K3-M1-g8k1", "K3-M4-g8k4", "K2-M64-g8k4", "KL-M1-g4k2"])
def test_threshold_grouped(name, M, n_group, topk_group, device):
    """Grouped routing masks whole routing groups (-inf) before the threshold selection; the
    buckets (e % BUCKETS) cut across the routing groups, so the kept experts still fill every
    bucket (K3 g8k1: only 112 of 896 experts left) and random routers stay on the fast path."""
    inp = make_inputs(preset(name), device, 3, M=M, block_m=16)
    inp.update(n_group=n_group, topk_group=topk_group)
    args, kwargs = _args(inp), _route_kwargs(inp)
    counts, cap = _candidate_counts(args, kwargs)
    assert max(counts) <= cap, counts
    compare(route_sort(*args, **kwargs), route_sort_reference(*args, **kwargs))


SMALL_THRESHOLD_CASES = [c for c in CASES if c[0] in (
    "tiny-M1-E24-top4-bm1", "tiny-M5-E24-top4-bm3-fp32w", "tiny-M3-E24-top7-bm4-norenorm-x2.5",
    "tiny-M17-E24-top4-bm16", "tiny-M64-E24-top4-bm1", "E12-M64-top3-bm5",
    "tiny-M3-E24-top1-bm1", "tiny-M13-E24-top4-g4k2-bm16", "E20-M7-top5-g5k3-bm4")]


def test_one_expert_buckets_take_the_loop():
    """E = 20 at top-10 would give one padded expert per bucket (wrong on the H200): the loop."""
    assert route_launch._select_tiles(20, 2, 10, THRESHOLD_EVERYWHERE)["BUCKETS"] == 0
    assert route_launch._select_tiles(20, 2, 5, THRESHOLD_EVERYWHERE)["BUCKETS"] > 0


@pytest.mark.parametrize("per_slot", [4, 1], ids=["cap4x", "cap1x"])
@pytest.mark.parametrize("case", SMALL_THRESHOLD_CASES, ids=[c[0] for c in SMALL_THRESHOLD_CASES])
def test_threshold_small_sizes(case, per_slot, device):
    """The threshold path forced onto small, awkward sizes (few experts a bucket, padding,
    groups, top-1, one-token blocks); cap1x: CAP = padded top_k, so blocks fall back often
    while others do not."""
    config = RouteConfig(threshold_min_top_k=1, threshold_min_experts=1,
                         candidates_per_slot=per_slot)
    args, kwargs = _case_inputs(case, device)
    assert route_launch._select_tiles(args[1].shape[0], args[0].shape[0], kwargs["top_k"],
                                      config)["BUCKETS"]
    compare(route_sort(*args, **kwargs, config=config), route_sort_reference(*args, **kwargs))


def test_threshold_hand_computed(device):
    """The hand-computed plan through the threshold path (6 experts, top-2: 4 buckets)."""
    test_hand_computed_plan(device, THRESHOLD_EVERYWHERE)


# RouteConfig choices away from their defaults (the defaults run in every other test): the
# split-K tiles at B1 (row programs off), row programs at several tokens and other shapes (32
# programs: K2 gets 12 rows a program, BLOCK_E 16, 4 masked rows; one split, 1024-wide chunks),
# the candidate read-back from L2 and vector keys.
ALL_TOKENS_ROWS = RouteConfig(gemv_row_programs=32, gemv_row_splits=2,
                              gemv_row_max_tokens=MAX_TOKENS)
CONFIG_CASES = [
    (ALL_TOKENS_ROWS, ["K2-M3-E384-top8-g8k4-bm16", "tiny-M17-E24-top4-bm16"]),
    (RouteConfig(gemv_row_programs=0), ["tiny-M3-E24-top7-bm4-norenorm-x2.5",
                                        "tiny-M1-E24-top4-bm1"]),
    (RouteConfig(cand_cache=".cg"), ["KL-M6-E256-top8-bm16", "K3-M1-E896-top16-bm1"]),
    (RouteConfig(cand_cache=".cg", gemv_row_programs=0), ["K3-M1-E896-top16-bm16"]),
    (RouteConfig(scalar_keys=False), ["K3-M1-E896-top16-bm1", "tiny-M17-E24-top4-bm16",
                                      "K3-M2-E896-top16-g8k3-bm1", "tiny-M3-E24-top1-bm1"]),
    (RouteConfig(scalar_keys=False, gemv_row_chunk=1024, gemv_row_splits=1),
     ["K3-M1-E896-top16-bm16", "E20-M7-top5-g5k3-bm4"]),
]
CONFIG_PARAMS = [(cf, c) for cf, ids in CONFIG_CASES for c in CASES if c[0] in ids]
# ~11 s each under the interpreter; K3 size stays in the default selection for both choices
# (vector keys at K3-M2, the L2 read-back with row programs off at K3-M1-bm16)
_CONFIG_SLOW = {(RouteConfig(scalar_keys=False), "K3-M1-E896-top16-bm1"),
                (RouteConfig(cand_cache=".cg"), "K3-M1-E896-top16-bm1")}


def _config_id(config: RouteConfig) -> str:
    default = RouteConfig()
    return "-".join(f"{k}={v}" for k, v in vars(config).items() if getattr(default, k) != v)


@pytest.mark.parametrize("config,case", [
    pytest.param(cf, c, marks=pytest.mark.slow if (cf, c[0]) in _CONFIG_SLOW else ())
    for cf, c in CONFIG_PARAMS], ids=[_config_id(cf) + "-" + c[0] for cf, c in CONFIG_PARAMS])
def test_configs(config, case, device):
    """Every config gives the reference's plan, every field."""
    args, kwargs = _case_inputs(case, device)
    compare(route_sort(*args, **kwargs, config=config), route_sort_reference(*args, **kwargs))


def test_gemv_rows_shape():
    """Row programs: K3's 896 experts in 128 programs of 7 rows; the splits cut H; off: None."""
    rows = route_launch._gemv_rows
    assert rows(896, 7168, True, RouteConfig(gemv_row_programs=0)) is None  # the split-K tiles
    one = RouteConfig(gemv_row_splits=1)
    assert rows(896, 7168, True, one) == (7, 8, one.gemv_row_chunk,
                                          7168 // one.gemv_row_chunk, 1)
    n_rows, _, block_k, chunks, splits = rows(896, 7168, True, RouteConfig(gemv_row_splits=2))
    assert splits == 2 and chunks * block_k * splits >= 7168 and n_rows == 7
    assert rows(896, 7168, True, RouteConfig(gemv_row_programs=264,
                                             gemv_row_splits=1))[:2] == (4, 4)


# ---------------------------------------------------------------------------------------------
# GPU


@pytest.mark.gpu
@pytest.mark.parametrize("tp", [1, 8])
@pytest.mark.parametrize("M", [1, 2, 16, 64])
@pytest.mark.parametrize("block_m", [1, 16])
@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_gpu_k3(tp, M, block_m, gate_dtype):
    cfg = preset("kimi-k3", tp)
    inp = make_inputs(cfg, "cuda", M, M=M, block_m=block_m)
    inp["gate_weight"] = inp["gate_weight"].to(gate_dtype)
    boundary = get("route")
    compare(boundary.variant("fused").fn(inp), boundary.reference.fn(inp))


@pytest.mark.gpu
@pytest.mark.parametrize("config", [SPREAD, REG_SORT, RouteConfig(
    select_programs_min_tokens=1, register_sort_max_entries=4096), NO_DOT],
    ids=["spread", "register-sort", "spread-register-sort", "no-gemv-dot"])
@pytest.mark.parametrize("M", [9, 16, 64])
@pytest.mark.parametrize("block_m", [1, 16])
def test_gpu_spread_selection(M, block_m, config):
    """The selection as its own launch, the register sort and the GEMV's tensor-core products,
    compiled: K3 tp 8, every plan field."""
    inp = make_inputs(preset("kimi-k3", 8), "cuda", M, M=M, block_m=block_m)
    args, kwargs = _args(inp), _route_kwargs(inp)
    compare(route_sort(*args, **kwargs, config=config), route_sort_reference(*args, **kwargs))


@pytest.mark.gpu
@pytest.mark.parametrize("name,n_group,topk_group", [
    ("kimi-k2", 1, 1), ("kimi-linear", 1, 1), ("kimi-k2", 8, 4), ("kimi-k3", 8, 4),
    ("kimi-linear", 8, 3)], ids=lambda v: str(v))
@pytest.mark.parametrize("M", [1, 3, 64])
def test_gpu_expert_counts_and_groups(name, n_group, topk_group, M):
    """Every preset's expert count, and grouped routing (K3's 896 / 8 = 112 a group: not a
    power of two) compiled for the GPU."""
    cfg = preset(name)
    inp = make_inputs(cfg, "cuda", M, M=M, block_m=16)
    inp.update(n_group=n_group, topk_group=topk_group)
    boundary = get("route")
    compare(boundary.variant("fused").fn(inp), boundary.reference.fn(inp))


def _routing_call(name, device, M, block_m, seed=0, tp=1, **routing):
    """(args, kwargs) of one route_sort call for a preset; kwargs are the reference's too."""
    inp = make_inputs(preset(name, tp), device, seed, M=M, block_m=block_m)
    inp.update(routing)
    return _args(inp), _route_kwargs(inp)


def _gpu_call(name, tp, M, block_m, seed=0, **routing):
    """(args, kwargs) of one route_sort call on CUDA for a preset."""
    return _routing_call(name, "cuda", M, block_m, seed=seed, tp=tp, **routing)


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
def test_gpu_cuda_graph_no_sync(M):
    """Captured once, replayed several times on new hidden states: matches the reference, every
    field, each replay (the counter resets inside the graph); the launcher performs no host
    synchronization (sync debug mode 'error')."""
    cfg = preset("kimi-k3", 8)
    args, kwargs = _gpu_call("kimi-k3", 8, M, 16)
    torch.cuda.set_sync_debug_mode("error")
    try:
        route_sort(*args, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        route_sort(*args, **kwargs)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plan = route_sort(*args, **kwargs)
    for seed in range(1, 6):
        fresh = make_inputs(cfg, "cuda", seed, M=M, block_m=16)
        args[0].copy_(fresh["hidden"])
        plan.out.fill_(1.0)  # the replay must zero it again
        plan.sorted_ids.fill_(-7)  # and rewrite the padding
        graph.replay()
        torch.cuda.synchronize()
        compare(plan, route_sort_reference(*args, **kwargs))


@pytest.mark.gpu
def test_gpu_graph_of_several_calls():
    """One graph holding calls of different grids and plan sizes back to back (as the timing
    graphs and a decode step do): each call finds the counter at 0; replayed on new inputs."""
    calls = [_gpu_call("kimi-k3", 8, 1, 16), _gpu_call("kimi-k3", 1, 64, 1, seed=1),
             _gpu_call("kimi-k2", 1, 3, 16, seed=2, n_group=8, topk_group=4),
             _gpu_call("kimi-k3", 8, 1, 16, seed=3)]
    for args, kwargs in calls:
        route_sort(*args, **kwargs)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        plans = [route_sort(*args, **kwargs) for args, kwargs in calls]
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):
        for args, _ in calls:
            args[0].copy_(torch.randn(args[0].shape, generator=gen, device="cuda"))
        graph.replay()
        torch.cuda.synchronize()
        for plan, (args, kwargs) in zip(plans, calls, strict=True):
            compare(plan, route_sort_reference(*args, **kwargs))


def _tiles_and_counters(calls, config, device, replays=4, graph=False):
    """Run ``calls`` ([(args, kwargs)]: route_sort's and route_sort_reference's arguments) with
    ``config`` once eagerly, then ``replays`` times on new random hidden states (graph: one CUDA
    graph of all calls, replayed; else eager calls), every plan against the reference; every
    counter back at 0 at the end. The config goes to route_sort only (the reference takes
    none)."""

    def run():
        return [route_sort(*args, **kwargs, config=config) for args, kwargs in calls]

    plans = run()
    for plan, (args, kwargs) in zip(plans, calls, strict=True):
        compare(plan, route_sort_reference(*args, **kwargs))
    if graph:
        torch.cuda.synchronize()
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            plans = run()
    gen = make_generator(0, device)
    for _ in range(replays):
        for args, _ in calls:
            args[0].copy_(torch.randn(args[0].shape, generator=gen, device=device))
        if graph:
            cuda_graph.replay()
            torch.cuda.synchronize()
        else:
            plans = run()
        for plan, (args, kwargs) in zip(plans, calls, strict=True):
            compare(plan, route_sort_reference(*args, **kwargs))
    assert not route_launch._COUNTERS[calls[0][0][0].device].any()


def test_tiles_and_counters(device):
    """test_gpu_tiles_and_counters' sequence (eager, small shapes, explicit split-K tiles giving
    3 E tiles x 4 K splits at every M; top_k = 8: the threshold selection): catches a bug in its
    call / compare path on the CPU (the tile choices once reached route_sort_reference: a
    TypeError in every GPU case)."""
    calls = [_routing_call("tiny", device, 1, 16, top_k=8),
             _routing_call("tiny", device, 8, 1, seed=1, top_k=8),
             _routing_call("tiny", device, 3, 16, seed=2, top_k=8, n_group=4, topk_group=2)]
    config = RouteConfig(gemv_block_e=8, gemv_block_k=64, gemv_row_programs=0)
    _tiles_and_counters(calls, config, device, replays=2)


@pytest.mark.gpu
@pytest.mark.parametrize("tiles", [(16, 512, 4), (32, 1024, 4), (16, 1024, 2), (8, 1024, 1)],
                         ids=lambda t: "x".join(map(str, t)))
def test_gpu_tiles_and_counters(tiles):
    """The sweep's split-K tiles / warp counts (at every M): a graph of several calls (different
    grids) replayed on new inputs, every plan against the reference."""
    block_e, block_k, num_warps = tiles
    config = RouteConfig(gemv_block_e=block_e, gemv_block_k=block_k, num_warps=num_warps,
                         gemv_row_programs=0)
    calls = [_gpu_call("kimi-k3", 8, 1, 16), _gpu_call("kimi-k3", 1, 8, 1, seed=1),
             _gpu_call("kimi-k2", 1, 3, 16, seed=2, n_group=8, topk_group=4)]
    _tiles_and_counters(calls, config, "cuda", graph=True)


@pytest.mark.gpu
def test_gpu_back_to_back_calls():
    """Many eager calls of alternating grids, no synchronization between them: every plan
    matches the reference afterwards."""
    calls = [_gpu_call("kimi-k3", 8, 1, 1), _gpu_call("kimi-linear", 1, 64, 16, seed=1),
             _gpu_call("kimi-k3", 1, 2, 16, seed=2, n_group=8, topk_group=4)]
    plans = [(route_sort(*args, **kwargs), args, kwargs)
             for _ in range(20) for args, kwargs in calls]
    torch.cuda.synchronize()
    for plan, args, kwargs in plans:
        compare(plan, route_sort_reference(*args, **kwargs))


@pytest.mark.gpu
def test_gpu_capture_guard():
    """A first call inside a real capture (no counter yet on the device) raises clearly."""
    args, kwargs = _gpu_call("kimi-k3", 8, 1, 16)
    saved = dict(route_launch._COUNTERS)
    route_launch._COUNTERS.clear()
    try:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(ValueError, match="before capturing"), torch.cuda.graph(graph):
            route_sort(*args, **kwargs)
        assert not route_launch._COUNTERS
    finally:
        route_launch._COUNTERS.clear()
        route_launch._COUNTERS.update(saved)


@pytest.mark.gpu
def test_gpu_device_mismatch():
    inp = _custom("cuda", 24, 40, 2)
    with pytest.raises(ValueError, match="gate_weight"):
        route_sort(inp["hidden"], inp["gate_weight"].cpu(), inp["correction_bias"], top_k=4)


# the sweep's leading candidates (the sweep itself checks every variant at K3 B1)
GPU_CONFIGS = [RouteConfig(), RouteConfig(gemv_row_chunk=1024), RouteConfig(cand_cache=".cg"),
               RouteConfig(scalar_keys=False), ALL_TOKENS_ROWS,
               RouteConfig(gemv_row_programs=0, scalar_keys=False, cand_cache=".cg")]


@pytest.mark.gpu
@pytest.mark.parametrize("config", GPU_CONFIGS, ids=lambda c: _config_id(c) or "default")
def test_gpu_configs(config):
    """RouteConfig choices on the GPU: a graph of several calls (K3 B1, K3 M8, grouped K2)
    replayed on new inputs, every plan against the reference."""
    calls = [_gpu_call("kimi-k3", 8, 1, 16), _gpu_call("kimi-k3", 1, 8, 1, seed=1),
             _gpu_call("kimi-k2", 1, 3, 16, seed=2, n_group=8, topk_group=4)]
    _tiles_and_counters(calls, config, "cuda", graph=True)
