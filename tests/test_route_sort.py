"""Route boundary: the fused route-sort kernel (kernels/route_sort.py) against the op-by-op
reference, and the reference against an independent sort-based formulation; every RoutePlan
field; ties; several tokens per expert; grouped routing; padding; bad input; GPU: K3 sizes,
CUDA-graph capture, no host sync, at most 2 launches."""

import pytest
import torch

from k3lab.boundaries import assert_close, get
from k3lab.boundaries.route import make_inputs
from k3lab.config import preset
from k3lab.kernels import route_sort
from k3lab.kernels.route_sort import MAX_TOKENS
from k3lab.plan import RoutePlan, plan_capacity
from k3lab.profile import count_launches
from k3lab.reference.route_sort import route_sort_by_sorting, route_sort_reference
from k3lab.weights import make_generator, randn

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


def _all(args, kwargs, device):
    """fused, reference and sort-based plans (the last always on CPU, moved back)."""
    cpu_args = tuple(a.cpu() for a in args)
    srt = route_sort_by_sorting(*cpu_args, **kwargs)
    srt = RoutePlan(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v)
                       for k, v in vars(srt).items()})
    return route_sort(*args, **kwargs), route_sort_reference(*args, **kwargs), srt


def test_hand_computed_plan(device):
    """Six experts, three tokens, top-2, block_m 2: the whole plan written out by hand."""
    hidden = torch.tensor([[0, 2, 0, 0, 3, 0], [0, 3, 0, 0, 2, 0], [2, 3, 0, 0, 0, 0]],
                          dtype=torch.bfloat16, device=device)
    gate = torch.eye(6, dtype=torch.float32, device=device)
    bias = torch.zeros(6, device=device)
    for plan in _all((hidden, gate, bias), dict(top_k=2, block_m=2, out_dim=3), device):
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
    """At most two launches (one GEMV, one selection + sort), no ATen op around them."""
    torch.use_deterministic_algorithms(False)  # no NaN fill kernels behind torch.empty here
    cfg = preset("kimi-k3" if device.type == "cuda" else "tiny")
    boundary = get("route")
    fused = boundary.variant("fused")
    launches = count_launches(fused.fn, boundary.make_inputs(cfg, device, 0, M=1))
    assert launches.count <= 2, launches.kernels
    assert all("gate_gemv" in k or "route_select_sort" in k for k in launches.kernels)


def test_boundary_check_catches_errors(device):
    boundary = get("route")
    inputs = boundary.make_inputs(preset("tiny"), device, 1, M=3, block_m=4)
    ref = boundary.reference.fn(inputs)
    out = boundary.variant("fused").fn(inputs)
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
        ("tile-not-pow2", dict(gemv_block_k=48), "gemv_block_k"),
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


@pytest.mark.gpu
@pytest.mark.parametrize("M", [1, 8])
def test_gpu_cuda_graph_no_sync(M):
    """Captured once, replayed on new hidden states: matches the reference each time; the
    launcher performs no host synchronization (sync debug mode 'error')."""
    cfg = preset("kimi-k3", 8)
    inp = make_inputs(cfg, "cuda", 0, M=M, block_m=16)
    kwargs = {k: inp[k] for k in ("top_k", "n_group", "topk_group", "renormalize",
                                  "routed_scaling_factor", "block_m", "out_dim")}
    args = _args(inp)
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
    for seed in (1, 2):
        fresh = make_inputs(cfg, "cuda", seed, M=M, block_m=16)
        args[0].copy_(fresh["hidden"])
        plan.out.fill_(1.0)  # the replay must zero it again
        graph.replay()
        torch.cuda.synchronize()
        compare(plan, route_sort_reference(*args, **kwargs))


@pytest.mark.gpu
def test_gpu_device_mismatch():
    inp = _custom("cuda", 24, 40, 2)
    with pytest.raises(ValueError, match="gate_weight"):
        route_sort(inp["hidden"], inp["gate_weight"].cpu(), inp["correction_bias"], top_k=4)
