"""Property tests of route_sort (hypothesis) over the whole input range: correction biases that
are negative, mixed-sign, tiny or subnormal, and scores crowded on a few values (gate rows and
biases drawn from small palettes, so many experts tie exactly). Every plan must satisfy the
RoutePlan invariants on its own and equal the reference field by field, whichever selection
path (arg-max loop, threshold, threshold with its fallback) the config takes."""

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from k3lab.boundaries import assert_close
from k3lab.kernels import RouteConfig, route_sort
from k3lab.kernels.plan import RoutePlan, plan_capacity
from k3lab.reference.route import route_sort_by_sorting, route_sort_reference

# as tests/kernels/test_route.py: fp32 weights from fp32 logits summed in another order
WEIGHTS_ATOL, WEIGHTS_RTOL = 2e-6, 1e-5
SORTING_WEIGHTS_ATOL = 1e-6
CONFIGS = {
    "default": None,
    "threshold": RouteConfig(threshold_min_top_k=1, threshold_min_experts=1),
    "threshold-cap1x": RouteConfig(threshold_min_top_k=1, threshold_min_experts=1,
                                   candidates_per_slot=1),
}
# interpreted route_sort calls cost ~0.1-0.5 s: few examples, no deadline
SETTINGS = settings(max_examples=12, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.function_scoped_fixture])


def check_plan_invariants(plan: RoutePlan, n_experts: int, allowed=None) -> None:
    """Everything a RoutePlan promises (kernels/plan.py), checked from the plan alone.
    allowed: bool [M, E] of the experts each token may take (grouped routing), or None."""
    ids, w = plan.topk_ids.cpu().long(), plan.topk_weights.cpu()
    m, k = ids.shape
    n, bm = m * k, plan.block_m
    assert ((ids >= 0) & (ids < n_experts)).all(), f"topk_ids outside [0, {n_experts}): {ids}"
    assert all(len(set(row)) == k for row in ids.tolist()), f"repeated expert: {ids}"
    if allowed is not None:
        assert allowed.gather(1, ids).all(), "an expert of a dropped group"
    cap = plan_capacity(m, k, n_experts, bm)
    sorted_ids, sorted_w = plan.sorted_ids.cpu().long(), plan.sorted_weights.cpu()
    blocks, num_valid = plan.block_expert_ids.cpu().long(), int(plan.num_valid.item())
    assert sorted_ids.shape == (cap,) and sorted_w.shape == (cap,) and blocks.shape == (cap // bm,)
    counts = torch.bincount(ids.flatten(), minlength=n_experts)
    padded = (counts + bm - 1) // bm * bm
    assert num_valid == int(padded.sum()), (num_valid, padded)
    pos = 0
    for e in range(n_experts):
        run = sorted_ids[pos:pos + int(padded[e])].tolist()
        entries = [j for j in range(n) if ids.flatten()[j] == e]
        assert run == entries + [n] * (len(run) - len(entries)), f"expert {e}: {run}"
        assert blocks[pos // bm:(pos + len(run)) // bm].tolist() == [e] * (len(run) // bm)
        pos += len(run)
    assert (sorted_ids[num_valid:] == n).all() and (blocks[num_valid // bm:] == -1).all()
    real = sorted_ids < n
    assert (sorted_w[~real] == 0).all()
    assert torch.equal(sorted_w[real], w.flatten()[sorted_ids[real]])
    if plan.out is not None:
        assert not plan.out.any()


@st.composite
def routing_problems(draw):
    """(hidden, gate_weight, bias, kwargs, config name): E experts, M tokens, crowded scores and
    a bias of one of four kinds."""
    n_group, group_size = draw(st.sampled_from([(1, 6), (1, 24), (1, 37), (1, 130), (4, 6),
                                                (3, 8), (5, 4)]))
    E = n_group * group_size
    topk_group = draw(st.integers(1, n_group))
    kept = E if n_group == 1 else topk_group * group_size
    top_k = draw(st.integers(1, min(kept, 10)))
    M = draw(st.sampled_from([1, 2, 5, 17]))
    H = 16
    seed = draw(st.integers(0, 2**16))
    gen = torch.Generator().manual_seed(seed)
    # gate rows from a palette of 1-4 rows (crowded, tied logits), a few random rows, or zeros
    rows = draw(st.sampled_from(["palette", "random", "zero"]))
    if rows == "zero":
        gate = torch.zeros(E, H)
    else:
        n_rows = draw(st.integers(1, 4)) if rows == "palette" else E
        palette = torch.randn(n_rows, H, generator=gen) * draw(st.sampled_from([0.05, 1.0, 4.0]))
        gate = palette[torch.randint(0, n_rows, (E,), generator=gen)]
    kind = draw(st.sampled_from(["negative", "mixed", "tiny", "palette"]))
    f32 = dict(width=32, allow_nan=False, allow_infinity=False)
    if kind == "negative":  # s + bias < 0 for every expert: the sign fix-up of the sort key
        values = st.floats(-8.0, -1.0, **f32)
    elif kind == "mixed":
        values = st.floats(-2.0, 2.0, **f32)
    elif kind == "tiny":  # around zero, subnormals included
        values = st.floats(-(2.0 ** -20), 2.0 ** -20, **f32)
    else:
        values = st.sampled_from(draw(st.lists(st.floats(-3.0, 3.0, **f32), min_size=1,
                                               max_size=3)))
    bias = torch.tensor(draw(st.lists(values, min_size=E, max_size=E)), dtype=torch.float32)
    hidden = torch.randn(M, H, generator=gen).to(draw(st.sampled_from([torch.bfloat16,
                                                                       torch.float32])))
    kwargs = dict(top_k=top_k, n_group=n_group, topk_group=topk_group,
                  renormalize=draw(st.booleans()),
                  routed_scaling_factor=draw(st.sampled_from([1.0, 2.5])),
                  block_m=draw(st.sampled_from([1, 3, 4])),
                  out_dim=draw(st.sampled_from([None, 8])))
    return hidden, gate, bias, kwargs, draw(st.sampled_from(sorted(CONFIGS)))


def _allowed(hidden, gate, bias, n_group, topk_group):
    """bool [M, E]: experts of the groups the reference keeps."""
    biased = torch.sigmoid(hidden.float() @ gate.float().t()) + bias
    m, e = biased.shape
    if n_group == 1:
        return torch.ones(m, e, dtype=torch.bool)
    gscore = biased.view(m, n_group, -1).topk(2, dim=-1).values.sum(-1)
    keep = torch.sort(gscore, dim=1, descending=True, stable=True).indices[:, :topk_group]
    groups = torch.zeros(m, n_group, dtype=torch.bool).scatter_(1, keep, True)
    return groups.repeat_interleave(e // n_group, dim=1)


def _compare(plan, ref, atol=WEIGHTS_ATOL, rtol=WEIGHTS_RTOL):
    for name, want in ref.tensors().items():
        got = plan.tensors()[name]
        if want.dtype == torch.float32 and name != "out":
            assert_close(name, got.cpu(), want.cpu(), atol=atol, rtol=rtol)
        else:
            assert torch.equal(got.cpu(), want.cpu()), (name, got, want)


@SETTINGS
@given(problem=routing_problems())
def test_route_sort_properties(problem, device):
    hidden, gate, bias, kwargs, config = problem
    E = gate.shape[0]
    gate = gate.to(torch.bfloat16) if hidden.dtype == torch.bfloat16 else gate
    plan = route_sort(hidden.to(device), gate.to(device), bias.to(device), **kwargs,
                      config=CONFIGS[config])
    ref = route_sort_reference(hidden, gate, bias, **kwargs)
    allowed = _allowed(hidden, gate, bias, kwargs["n_group"], kwargs["topk_group"])
    check_plan_invariants(plan, E, allowed)
    check_plan_invariants(ref, E, allowed)
    _compare(plan, ref)


@SETTINGS
@given(problem=routing_problems())
def test_reference_properties(problem):
    """The reference over the same range, against the Python-sorted formulation (ungrouped:
    its group sums are float64, the reference's fp32)."""
    hidden, gate, bias, kwargs, _ = problem
    ref = route_sort_reference(hidden, gate, bias, **kwargs)
    check_plan_invariants(ref, gate.shape[0],
                          _allowed(hidden, gate, bias, kwargs["n_group"], kwargs["topk_group"]))
    if kwargs["n_group"] == 1:
        _compare(ref, route_sort_by_sorting(hidden, gate, bias, **kwargs),
                 atol=SORTING_WEIGHTS_ATOL, rtol=0.0)


def test_invariants_catch_a_bad_plan():
    """The invariant checker itself fails on a plan with an out-of-range expert, a misplaced
    entry, a wrong tile expert or a wrong count."""
    hidden, gate = torch.randn(3, 16), torch.randn(6, 16)
    plan = route_sort_reference(hidden, gate, torch.zeros(6), top_k=2, block_m=2)
    check_plan_invariants(plan, 6)
    bad_ids = plan.topk_ids.clone()
    bad_ids[0, 0] = 6
    bad_blocks = plan.block_expert_ids.clone()
    bad_blocks[0] = bad_blocks[0] + 1
    for change in (dict(topk_ids=bad_ids), dict(sorted_ids=plan.sorted_ids.roll(1)),
                   dict(block_expert_ids=bad_blocks), dict(num_valid=plan.num_valid + 2)):
        with pytest.raises(AssertionError):
            check_plan_invariants(RoutePlan(**{**vars(plan), **change}), 6)
