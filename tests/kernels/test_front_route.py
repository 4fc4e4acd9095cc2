"""front_route: route_sort and the MoE front's dense GEMV in one launch give bitwise the plan
and the outputs of the two launches (the same programs in one grid), across routing shapes,
token counts, front tilings and merged-output layouts; bad input names its parameter."""

import pytest
import torch

from k3lab.kernels import GemvConfig, RouteConfig, dense_gemv, front_route, route_sort
from k3lab.kernels.moe.front_route import FRONT_ROUTE_CONFIG, front_tiling
from k3lab.profile import count_launches

PLAN_FIELDS = ("topk_ids", "topk_weights", "sorted_ids", "sorted_weights", "block_expert_ids",
               "num_valid", "out")


def _inputs(device, m, h, e, front_rows, seed=0, crowded=False):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, h, generator=g).to(torch.bfloat16)
    gate = (torch.randn(e, h, generator=g) / h ** 0.5).to(torch.bfloat16)
    if crowded:  # many experts tie on their gate rows: ties break toward the lower expert
        gate[1::2] = gate[0::2][: gate[1::2].shape[0]]
    bias = torch.randn(e, generator=g) * 0.1
    front = (torch.randn(front_rows, h, generator=g) / h ** 0.5).to(torch.bfloat16)
    return [t.to(device) for t in (x, gate, bias, front)]


def _same_plan(a, b):
    for f in PLAN_FIELDS:
        ta, tb = getattr(a, f), getattr(b, f)
        assert (ta is None) == (tb is None), f
        if ta is not None:
            assert torch.equal(ta, tb), f


CASES = [  # (M, H, E, top_k, n_group, topk_group, block_m, splits, activation, tiling)
    (1, 256, 64, 8, 1, 1, 1, (96, 64), "silu", None),
    (1, 320, 48, 6, 4, 2, 1, (40, 24), "situ", GemvConfig(block_n=8, block_k=64)),
    (1, 256, 32, 4, 1, 1, 1, (72,), None, GemvConfig(block_n=16, block_k=64, split_k=2)),
    (3, 192, 40, 5, 1, 1, 4, (48, 16), "silu", GemvConfig(block_n=16, block_k=64)),
    (5, 128, 24, 3, 2, 1, 2, (33, 7), None, None),
    # 6 tokens over 600 experts span two selection blocks: the selection is a launch of its own
    (6, 64, 600, 8, 1, 1, 2, (24, 16), "silu", None),
]


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("crowded", [False, True])
def test_one_launch_equals_the_two(case, crowded, device):
    m, h, e, top_k, n_group, topk_group, block_m, splits, act, tiling = case
    x, gate, bias, front = _inputs(device, m, h, e, sum(splits), crowded=crowded)
    route = dict(top_k=top_k, n_group=n_group, topk_group=topk_group, block_m=block_m,
                 out_dim=17, routed_scaling_factor=2.5)
    kw = dict(splits=splits if len(splits) > 1 else None, activation=act)
    if act and len(splits) == 1:
        kw["splits"] = None
    plan, out = front_route(x, gate, bias, front, **route, **kw, gemv_config=tiling)
    ref_plan = route_sort(x, gate, bias, **route, config=FRONT_ROUTE_CONFIG)
    rows = splits[0] + splits[1] // 2 if act and len(splits) == 2 else sum(splits)
    ref_out = dense_gemv(x, front, **kw, config=tiling or front_tiling(m, rows, h, bool(act)))
    _same_plan(plan, ref_plan)
    outs = out if isinstance(out, tuple) else (out,)
    refs = ref_out if isinstance(ref_out, tuple) else (ref_out,)
    assert len(outs) == len(refs)
    for a, b in zip(outs, refs, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_repeated_calls_reset_the_counters(device):
    """The route's ticket and the GEMV's split-K tickets are left at zero by every call."""
    x, gate, bias, front = _inputs(device, 1, 256, 64, 64)
    tiling = GemvConfig(block_n=16, block_k=64, split_k=2)
    first = front_route(x, gate, bias, front, top_k=8, out_dim=9, gemv_config=tiling)
    for _ in range(2):
        again = front_route(x, gate, bias, front, top_k=8, out_dim=9, gemv_config=tiling)
        _same_plan(first[0], again[0])
        assert torch.equal(first[1], again[1])


def test_one_launch(device):
    x, gate, bias, front = _inputs(device, 1, 128, 32, 48)
    launches = count_launches(
        lambda inp: front_route(*inp, top_k=4, splits=(32, 16), activation="silu"),
        (x, gate, bias, front))
    assert launches.count == 1, launches
    assert "_front_route_kernel" in launches.kernels[0], launches


def test_spread_selection_is_a_second_launch(device):
    x, gate, bias, front = _inputs(device, 6, 64, 600, 40)
    launches = count_launches(
        lambda inp: front_route(*inp, top_k=8, splits=(24, 16), activation="silu"),
        (x, gate, bias, front))
    assert launches.count == 2 and "_route_select_kernel" in launches.kernels[1], launches


def test_route_config_shapes(device):
    """Other GEMV shapes of the route (split-K tiles, row programs over more K splits) give
    the same plan as route_sort with the same config."""
    x, gate, bias, front = _inputs(device, 1, 256, 64, 40, seed=3)
    for rc in (RouteConfig(gemv_row_programs=0), RouteConfig(gemv_row_splits=4),
               RouteConfig(gemv_row_programs=16)):
        plan, out = front_route(x, gate, bias, front, top_k=8, route_config=rc)
        _same_plan(plan, route_sort(x, gate, bias, top_k=8, config=rc))
        assert torch.equal(out, dense_gemv(x, front, config=front_tiling(1, 40, 256, False)))


@pytest.mark.parametrize("bad,match", [
    (dict(route_config=GemvConfig()), "route_config"),
    (dict(gemv_config=RouteConfig()), "gemv_config"),
    (dict(top_k=0), "top_k"),
    (dict(splits=(10, 10)), "splits"),
    (dict(splits=("a", 14), activation="silu"), "splits"),
    (dict(activation="gelu"), "activation"),
    (dict(max_registers=8), "max_registers"),
    (dict(max_registers=True), "max_registers"),
])
def test_bad_input_names_its_parameter(bad, match, device):
    x, gate, bias, front = _inputs(device, 1, 64, 16, 24)
    kw = {"top_k": 4, **bad}
    with pytest.raises(ValueError, match=match):
        front_route(x, gate, bias, front, **kw)


def test_bad_front_weight(device):
    x, gate, bias, front = _inputs(device, 1, 64, 16, 24)
    with pytest.raises(ValueError, match="weight"):
        front_route(x, gate, bias, front[:, :32].contiguous(), top_k=4)
    with pytest.raises(ValueError, match="weight"):
        front_route(x, gate, bias, front.float(), top_k=4)


@pytest.mark.parametrize("m,rc", [(1, None), (1, RouteConfig(gemv_row_programs=0)),
                                  (3, None), (4, RouteConfig(gemv_dot_min_tokens=2))],
                         ids=["rows", "split-K-tiles", "M3", "M4-tensor-cores"])
def test_read_input_is_the_mix_launchs_read(m, rc, device):
    """read_input: x is an AttnRes read's live sum, and both GEMVs take that read mixed from its
    producer's sums: the plan and the front's outputs are those of front_route over the mix
    launch's h_normed (the same values; on the GPU the sums' reduction may differ by a bf16
    ulp of the outputs); the next read's sums zeroed."""
    from k3lab.kernels import attn_res_norm_from_sums, read_input, read_sums

    h, e = 192, 48
    live, gate, bias, front = _inputs(device, m, h, e, 40, seed=m)
    g = torch.Generator().manual_seed(9)
    bank = (torch.randn(3, m, h, generator=g) * 2).to(torch.bfloat16).to(device)
    rn, rp, nw = (torch.rand(h, generator=g).to(device) + 0.5 for _ in range(3))
    sums = read_sums(bank, rn, rp, slot_cols=64)  # live's producer leaves them
    live = dense_gemv((torch.randn(m, 16, generator=g) * 0.1).bfloat16().to(device),
                      torch.randn(h, 16, generator=g).bfloat16().to(device), residual=live,
                      read_sums=sums, config=GemvConfig(block_n=16, block_k=16))
    hn = attn_res_norm_from_sums(sums, live, nw)[1]
    clear = torch.ones(50, device=device)
    kw = dict(top_k=6, splits=(24, 16), activation="silu", route_config=rc, out_dim=11)
    plan, out = front_route(live, gate, bias, front, **kw,
                            read_input=read_input(sums, nw, clear=clear))
    ref_plan, ref_out = front_route(hn, gate, bias, front, **kw)
    _same_plan(plan, ref_plan)
    for a, b in zip(out, ref_out, strict=True):
        if device == "cpu":
            assert torch.equal(a, b)
        else:  # the slots' sums reduced over other tile shapes: a bf16 ulp
            torch.testing.assert_close(a.float(), b.float(), atol=1e-3, rtol=2.0 ** -7)
    assert int(clear.count_nonzero()) == 0
    with pytest.raises(ValueError, match="read_input: expected a ReadInput"):
        front_route(live, gate, bias, front, **kw, read_input=sums)
