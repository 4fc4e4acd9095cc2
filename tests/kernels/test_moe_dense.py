"""The MoE block with its dense projections as dense GEMV launches
(``MoEConfig(dense_projections=True)``) against the fp32 reference given the same plan, and its
launch count; GPU: K3 tp 8 against the default block and inside a CUDA graph."""

from dataclasses import replace

import pytest
import torch

from k3lab.boundaries import get
from k3lab.config import preset
from k3lab.kernels import moe_block
from k3lab.kernels.moe import MoEConfig
from k3lab.profile import count_launches

B = get("moe")
DENSE = MoEConfig(dense_projections=True)
STAGE1 = MoEConfig(shared_down_launch="stage1")


def _inputs(cfg, device, m, fmt, block_m=1, seed=0):
    return B.make_inputs(cfg, device, seed, M=m, expert_format=fmt, block_m=block_m)


def _replays_give(run, xs, want, replays=20):
    """A CUDA graph of run(x) over every x (after a warm-up call on a side stream), replayed
    ``replays`` times: every output equals ``want`` bit for bit each time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        run(xs[0])
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [run(x) for x in xs]
    for _ in range(replays):
        graph.replay()
        torch.cuda.synchronize()
        for out, ref in zip(outs, want, strict=True):
            assert torch.equal(out, ref)


@pytest.mark.parametrize("fmt,m,block_m,det", [("bf16", 1, 1, False), ("mxfp4", 1, 1, True),
                                               ("mxfp4", 5, 4, False), ("bf16", 8, 1, True)])
def test_dense_projections_match_the_reference(fmt, m, block_m, det, device):
    cfg = preset("tiny", 1)
    inp = _inputs(cfg, device, m, fmt, block_m)
    w = inp["weights"].fused
    out = moe_block(inp["x"], w, cfg=cfg, plan=inp["plan"], deterministic=det, config=DENSE)
    B.check(out, None, inp)  # raises past the block tolerance
    default = moe_block(inp["x"], w, cfg=cfg, plan=inp["plan"], deterministic=det)
    # two roundings of the same fp32 math apart: well inside the block tolerance of each
    assert (out.float() - default.float()).abs().max() < 0.05


def test_dense_projections_with_routing_and_repeated_calls(device):
    """Routing inside the block, and the plan's buffers re-zeroed on every call."""
    cfg = preset("tiny", 1)
    inp = {**_inputs(cfg, device, 2, "mxfp4"), "route": True, "config": DENSE}
    first = B.variant("fused+dense").fn(inp)
    B.check(first, None, inp)
    again = B.variant("fused+dense").fn(inp)
    assert torch.equal(first, again) or (first.float() - again.float()).abs().max() < 1e-2


def test_dense_projections_launches(device):
    """Front GEMV (latent down + shared gate/up), stage 1, stage 2, tail GEMV (norm, up, shared
    down): 4 given a plan."""
    cfg = preset("tiny", 1)
    inp = {**_inputs(cfg, device, 1, "bf16"), "config": DENSE}
    names = count_launches(B.variant("fused+dense").fn, inp).kernels
    if device.type == "cpu":
        names = [n for n in names if n.startswith("triton::")]
    assert len(names) == 4, names


@pytest.mark.parametrize("fmt,m,det", [("bf16", 1, True), ("mxfp4", 3, False)])
def test_shared_gate_up_beside_stage1(fmt, m, det, device):
    """MoEConfig.shared_beside_stage1: the front is the latent down alone and the shared
    gate/up a launch of its own between the stages (5 given a plan); the output meets the
    reference, and equals the merged front's where stage 2 is deterministic (the same sums)."""
    cfg = preset("tiny", 1)
    inp = _inputs(cfg, device, m, fmt)
    w = inp["weights"].fused
    beside = MoEConfig(dense_projections=True, shared_beside_stage1=True)
    out = moe_block(inp["x"], w, cfg=cfg, plan=inp["plan"], deterministic=det, config=beside)
    B.check(out, None, inp)
    merged = moe_block(inp["x"], w, cfg=cfg, plan=inp["plan"], deterministic=det, config=DENSE)
    assert torch.equal(out, merged) if det else (out.float() - merged.float()).abs().max() < 0.05
    names = count_launches(lambda x: moe_block(x, w, cfg=cfg, plan=inp["plan"], config=beside),
                           inp["x"]).kernels
    if device.type == "cpu":
        names = [n for n in names if n.startswith("triton::")]
    assert len(names) == 5, names


@pytest.mark.parametrize("fmt,m,det,routed,where", [("bf16", 1, True, False, "stage1"),
                                                    ("mxfp4", 3, False, True, "stage1"),
                                                    ("mxfp4", 1, True, True, "stage2"),
                                                    ("bf16", 2, False, False, "stage2")])
def test_shared_down_beside_a_stage(fmt, m, det, routed, where, device):
    """MoEConfig.shared_down_launch "stage1" / "stage2": the shared down-projection's GEMV
    programs run in that stage's launch and the tail adds their fp32 result (still 4 launches,
    that stage's the combined kernel); the output meets the reference and the default block's
    (the same products, summed in other K steps)."""
    cfg = preset("tiny", 1)
    down = MoEConfig(dense_projections=True, shared_down_launch=where)
    inp = _inputs(cfg, device, m, fmt)
    if routed:
        inp = {**inp, "route": True, "config": down}
    w = inp["weights"].for_kernels(down)
    plan = None if routed else inp["plan"]

    def run(x, conf):
        return moe_block(x, w, cfg=cfg, plan=plan, deterministic=det, config=conf)

    out = run(inp["x"], down)
    B.check(out, None, inp)
    assert (out.float() - run(inp["x"], DENSE).float()).abs().max() < 0.05
    names = count_launches(lambda x: run(x, down), inp["x"]).kernels
    if device.type == "cpu":
        names = [n for n in names if n.startswith("triton::")]
    assert len(names) == 4, names
    combined = f"_{where}_shared_down_kernel"
    assert sum(combined in n for n in names) == 1, names
    alone = "_moe_stage1_kernel" if where == "stage1" else "_moe_stage2_tail_kernel"
    assert not any(alone in n for n in names), names


@pytest.mark.parametrize("fmt,m,det", [("bf16", 1, True), ("mxfp4", 3, False),
                                       ("mxfp4", 1, False)])
def test_router_in_the_front_launch(fmt, m, det, device):
    """MoEConfig.front_routes (the default): route_sort's programs and the merged front's in one
    launch (4 with routing, 5 with it off); the output meets the reference with the block's
    routing, and repeated calls give the same bits where stage 2 is deterministic."""
    cfg = preset("tiny", 1)
    conf = MoEConfig(dense_projections=True)  # front_routes: the default
    inp = {**_inputs(cfg, device, m, fmt), "route": True, "config": conf}
    w = inp["weights"].for_kernels(conf)
    assert "front" in w

    def run(x):
        return moe_block(x, w, cfg=cfg, deterministic=det, config=conf)

    out = run(inp["x"])
    B.check(out, None, inp)
    if det:  # fp32 atomics may round differently from call to call
        assert torch.equal(run(inp["x"]), out)
    names = count_launches(run, inp["x"]).kernels
    if device.type == "cpu":
        names = [n for n in names if n.startswith("triton::")]
    assert len(names) == 4 and "front_route" in names[0], names


@pytest.mark.parametrize("fmt,m,where", [("bf16", 1, "tail"), ("mxfp4", 3, "tail"),
                                         ("mxfp4", 1, "stage1"), ("bf16", 2, "stage1")])
def test_tail_second_first_keeps_the_bits(fmt, m, where, device):
    """MoEConfig.tail_second_first with the router in the front's launch: the tail runs its
    shared down-projection before its latent up (before its PDL wait, compiled), or with the
    shared down-projection in stage 1's launch loads that sum, its residual, first; the bits of
    the same placement without it (deterministic stage 2), in the same 4 launches."""
    cfg = preset("tiny", 1)
    plain = MoEConfig(dense_projections=True, shared_down_launch=where)
    first = replace(plain, tail_second_first=True)
    inp = {**_inputs(cfg, device, m, fmt), "route": True, "config": first}
    w = inp["weights"].for_kernels(first)

    def run(x, conf):
        return moe_block(x, w, cfg=cfg, deterministic=True, config=conf)

    out = run(inp["x"], first)
    B.check(out, None, inp)
    assert torch.equal(out, run(inp["x"], plain))
    names = count_launches(lambda x: run(x, first), inp["x"]).kernels
    if device.type == "cpu":
        names = [n for n in names if n.startswith("triton::")]
    assert len(names) == 4 and "front_route" in names[0], names


def test_moe_experts_shared_inputs_are_checked(device):
    from k3lab.kernels import moe_experts

    cfg = preset("tiny", 1)
    inp = _inputs(cfg, device, 2, "bf16")
    w = inp["weights"].fused
    z = torch.zeros(2, cfg.moe_in, dtype=torch.bfloat16, device=device)
    x, w13s = inp["x"], w["shared_w13"]
    for kw, msg in [(dict(shared_x=x), "give both"),
                    (dict(shared_x=x.float(), shared_w13=w13s), "shared_x: expected"),
                    (dict(shared_x=x[:1], shared_w13=w13s), r"shared_w13: expected shared_x \[M=2"),
                    (dict(shared_x=x, shared_w13=w13s[:, :-1].contiguous()), "shared_w13")]:
        with pytest.raises(ValueError, match=msg):
            moe_experts(z, inp["plan"], w["w13"], w["w2"], **kw)


def test_moe_experts_shared_down_inputs_are_checked(device):
    from k3lab.kernels import GemvConfig, moe_experts

    cfg = preset("tiny", 1)
    inp = _inputs(cfg, device, 2, "bf16")
    w = inp["weights"].fused
    z = torch.zeros(2, cfg.moe_in, dtype=torch.bfloat16, device=device)
    s, h = cfg.shared_intermediate, cfg.hidden
    a = torch.zeros(2, s, dtype=torch.bfloat16, device=device)
    w2s, res = w["shared_w2"], torch.zeros(2, h, device=device)
    for kw, msg in [(dict(shared_a=a, shared_w2=w2s, config=MoEConfig()),
                     "shared_a: config.shared_down_launch is 'tail'"),
                    (dict(shared_a=a), "shared_a: give both"),
                    (dict(shared_residual=res), "shared_residual: shared_residual and"),
                    (dict(shared_a=a.float(), shared_w2=w2s), "shared_a: expected"),
                    (dict(shared_a=a[:1], shared_w2=w2s), r"shared_w2: expected shared_a \[M=2"),
                    (dict(shared_a=a[:, :-1].contiguous(), shared_w2=w2s), "shared_w2: expected"),
                    (dict(shared_a=a, shared_w2=w2s, shared_residual=res[:, :-1].contiguous()),
                     r"shared_residual: expected \[M, H\]"),
                    (dict(shared_a=a, shared_w2=w2s, shared_residual=res.long()),
                     "shared_residual: expected"),
                    (dict(shared_a=a, shared_w2=w2s, shared_config=GemvConfig(num_warps=8)),
                     "shared_config: its programs share an expert stage's launch"),
                    (dict(shared_a=a, shared_w2=w2s, shared_config="tiles"),
                     "shared_config: expected a GemvConfig"),
                    (dict(shared_a=a, shared_w2=w2s, shared_x=inp["x"],
                          shared_w13=w["shared_w13"]), "are exclusive")]:
        with pytest.raises(ValueError, match=msg):
            moe_experts(z, inp["plan"], w["w13"], w["w2"], **{"config": STAGE1, **kw})
    with pytest.raises(ValueError, match="shared_down_launch: expected one of"):
        MoEConfig(shared_down_launch="front")


@pytest.mark.gpu
@pytest.mark.parametrize("where", ["stage1", "stage2"])
def test_gpu_shared_down_beside_a_stage_k3(where):
    """K3 tp 8, MXFP4, routing in the front's launch, deterministic stage 2: the shared
    down-projection in stage 1's or stage 2's launch meets the block's reference and the
    default block, and gives the same bits call after call, eager and over 20 replays of a
    16-call CUDA graph."""
    cfg = preset("kimi-k3", 8)
    dev = torch.device("cuda")
    down = MoEConfig(dense_projections=True, shared_down_launch=where)
    inp = {**_inputs(cfg, dev, 1, "mxfp4"), "route": True, "config": down}
    xs = [_inputs(cfg, dev, 1, "mxfp4", seed=s)["x"] for s in range(16)]
    w = inp["weights"].for_kernels(down)

    def run(x, conf=down):
        return moe_block(x, w, cfg=cfg, deterministic=True, config=conf)

    out = run(inp["x"])
    B.check(out, None, inp)
    assert (out.float() - run(inp["x"], DENSE).float()).abs().max() < 0.05
    want = [run(x).clone() for x in xs]
    for x, ref in zip(xs, want, strict=True):
        assert torch.equal(run(x), ref)
    _replays_give(run, xs, want)


@pytest.mark.gpu
@pytest.mark.parametrize("fmt", ["bf16", "mxfp4"])
def test_dense_projections_k3_tp8_graph(fmt):
    """K3 tp 8 with routing: 4 launches (the router in the front's), no host synchronization,
    captured once and replayed on new x, right each time."""
    cfg = preset("kimi-k3", 8)
    inp = {**_inputs(cfg, torch.device("cuda"), 1, fmt), "route": True}
    fn = B.variant("fused+dense").fn
    B.check(fn(inp), None, inp)
    assert count_launches(fn, inp).count == 4  # front_route, stage 1, stage 2, tail
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn(inp)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(inp)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn(inp)
    for seed in (1, 2):
        inp["x"].copy_(_inputs(cfg, torch.device("cuda"), 1, fmt, seed=seed)["x"])
        graph.replay()
        torch.cuda.synchronize()
        B.check(out, None, inp)


@pytest.mark.gpu
def test_router_in_the_front_launch_k3_graph():
    """K3 tp 8, MXFP4, deterministic stage 2, front_routes (also capped at 96 registers): the
    reference met, the experts of the two-launch front's routing chosen, and the same bits
    eager and over 20 replays of a CUDA graph of 16 calls on distinct x."""
    cfg = preset("kimi-k3", 8)
    dev = torch.device("cuda")
    inp = _inputs(cfg, dev, 1, "mxfp4")
    xs = [_inputs(cfg, dev, 1, "mxfp4", seed=s)["x"] for s in range(16)]
    for regs in (0, 96):
        conf = MoEConfig(dense_projections=True, front_routes=True, front_route_registers=regs)
        w = inp["weights"].for_kernels(conf)

        def run(x, conf=conf, w=w):
            return moe_block(x, w, cfg=cfg, deterministic=True, config=conf)

        B.check(run(inp["x"]), None, {**inp, "route": True, "config": conf})
        want = [run(x).clone() for x in xs]
        _replays_give(run, xs, want)


@pytest.mark.gpu
@pytest.mark.parametrize("field", ["front_overlaps_route", "shared_beside_stage1",
                                   "front_triggers_last", "tail_second_first"])
def test_overlapping_launches_change_nothing(field):
    """K3 tp 8, MXFP4, routing in the block as its own launch (front_routes off), deterministic
    stage 2: the front launched while the route runs (MoEConfig.front_overlaps_route), the
    shared gate/up launched beside stage 1 (shared_beside_stage1; the same tiles' sums) and
    the expert pair launched by PDL after an overlapping front (front_triggers_last), and (with
    the router in the front's launch) the tail's shared down before its wait
    (tail_second_first) each give the bitwise output of the field off, eager and in a CUDA
    graph of 16 calls on distinct x replayed 20 times."""
    cfg = preset("kimi-k3", 8)
    dev = torch.device("cuda")
    inp = _inputs(cfg, dev, 1, "mxfp4")
    xs = [_inputs(cfg, dev, 1, "mxfp4", seed=s)["x"] for s in range(16)]
    # the tail's second product moves before its wait only after the route's launch
    routes = field == "tail_second_first"
    configs = {o: MoEConfig(dense_projections=True, front_routes=routes, **{field: o})
               for o in (False, True)}
    w = inp["weights"].for_kernels(configs[True])

    def run(x, overlap):
        return moe_block(x, w, cfg=cfg, deterministic=True, config=configs[overlap])

    want = [run(x, False).clone() for x in xs]
    for x, ref in zip(xs, want, strict=True):
        assert torch.equal(run(x, True), ref)
    _replays_give(lambda x: run(x, True), xs, want)
