"""The decode token's measurement (k3lab.studies.decode_token, decode_bytes, decode_step): the
labelling, segment and extrapolation logic on hand-made timelines, the bytes floor against the
shapes, one interpreted token on the CPU, and on a GPU the marked graph's labels."""

import dataclasses
import math

import pandas as pd
import pytest
import torch

from k3lab import profile, stack
from k3lab.config import preset
from k3lab.reference import layer as ref_layer
from k3lab.studies import decode_step as study
from k3lab.studies import decode_token as dt
from k3lab.studies.decode_bytes import MXFP4_BYTES, expert_bytes_per_token, token_bytes


def _launch(kernel, start, dur):
    return {"kernel": kernel, "start_us": float(start), "end_us": float(start + dur),
            "dur_us": float(dur), "stream": "s"}


def test_labels_follow_the_markers_and_drop_them():
    tags = ["segment embed", "dense projections", "segment layer 1", "AttnRes", "KDA"]
    rows, t = [], 0.0
    for kernel in ["mark", "mark", "gather", "mark", "mark", "read", "mark", "kda", "kda2"]:
        rows.append(_launch(f"lgamma_{kernel}" if kernel == "mark" else kernel, t, 1.0))
        t += 2.0
    lab = dt._labels(pd.DataFrame(rows), tags)
    assert lab["kernel"].tolist() == ["gather", "read", "kda", "kda2"]
    assert lab["segment"].tolist() == ["embed", "layer 1", "layer 1", "layer 1"]
    assert lab["category"].tolist() == ["dense projections", "AttnRes", "KDA", "KDA"]
    with pytest.raises(RuntimeError, match="markers"):
        dt._labels(pd.DataFrame(rows[:3]), tags)


def _token(cfg, layer_ids):
    return {"cfg": cfg, "layer_ids": layer_ids}


def test_segments_put_the_gaps_inside_and_add_up_to_the_graph_time():
    lab = pd.DataFrame([
        {**_launch("a", 0, 2), "segment": "embed", "category": "dense projections"},
        {**_launch("b", 4, 3), "segment": "layer 0", "category": "KDA"},
        {**_launch("c", 8, 1), "segment": "layer 0", "category": "AttnRes"},
        {**_launch("d", 10, 2), "segment": "head", "category": "dense projections"},
    ])
    seg = dt.segments(lab, window_us=24.0)  # the profiled replay spans 12 us: scaled by 2
    assert seg["span_us"].tolist() == [8.0, 12.0, 4.0]
    assert seg.loc["layer 0", "KDA"] == 3.0 and seg.loc["layer 0", "AttnRes"] == 1.0
    assert seg.loc["layer 0", dt.GAPS] == 12.0 - 4.0
    assert seg["launches"].tolist() == [1, 2, 1]


def test_overlapping_launches_count_their_overlap_once():
    """A launch that starts inside its predecessor (PDL) and one nested in it: their shares are
    the union's, and the segment's gaps stay non-negative."""
    lab = pd.DataFrame([
        {**_launch("a", 0, 4), "segment": "layer 0", "category": "MoE experts"},
        {**_launch("b", 3, 5), "segment": "layer 0", "category": "MoE experts"},   # 3..8
        {**_launch("c", 5, 1), "segment": "layer 0", "category": "dense projections"},
        {**_launch("d", 10, 2), "segment": "layer 0", "category": "dense projections"},
    ])
    assert dt.busy_us(lab).tolist() == [4.0, 4.0, 0.0, 2.0]
    seg = dt.segments(lab, window_us=12.0)
    assert seg.loc["layer 0", "MoE experts"] == 8.0
    assert seg.loc["layer 0", "dense projections"] == 2.0
    assert seg.loc["layer 0", dt.GAPS] == 2.0


def test_extrapolation_takes_each_kind_at_its_window_mean():
    cfg = preset("tiny")  # MLA at layers 3, 7, 11, 13: 9 KDA and 4 MLA layers after layer 0
    assert dt.model_layers(cfg) == {"kda": 9, "mla": 4}
    seg = pd.DataFrame({"span_us": [1.0, 10.0, 20.0, 40.0, 100.0, 2.0],
                        "launches": [1, 5, 6, 8, 9, 1]},
                       index=["embed", "layer 0", "layer 1", "layer 2", "layer 3", "head"])
    total, how = dt.extrapolate(seg, _token(cfg, [0, 1, 2, 3]))
    assert total["span_us"] == pytest.approx(1 + 10 + 2 + 9 * 30 + 4 * 100)
    assert total["launches"] == pytest.approx(2 + 5 + 9 * 7 + 4 * 9)
    assert "9 KDA layers at the mean of the window's 2" in "; ".join(how)
    with pytest.raises(ValueError, match="window: .* no MLA layer"):
        dt.extrapolate(seg.drop("layer 3"), _token(cfg, [0, 1, 2]))
    # without labels (the markers not found) the window is scaled as a whole: 14 / 4 layers
    whole = pd.DataFrame({"span_us": [400.0], "launches": [40]}, index=["window"])
    total, how = dt.extrapolate(whole, _token(cfg, [0, 1, 2, 3]))
    assert total["span_us"] == pytest.approx(1400.0) and "scaled to 14" in how[0]


def test_k3_layer_counts_and_all_reduces():
    k3 = preset("kimi-k3", 8)
    assert dt.model_layers(k3) == {"kda": 68, "mla": 24}
    assert dt.allreduces(k3) == 186 and dt.allreduces(preset("kimi-k3")) == 0


def test_bytes_floor_counts_the_shapes():
    k3 = preset("kimi-k3", 8)
    per_layer = 16 * 3 * 384 * 3584 * MXFP4_BYTES
    assert expert_bytes_per_token(k3, "mxfp4") == pytest.approx(per_layer)
    b = token_bytes(k3, 8192, "mxfp4")
    assert b["MoE experts"] == pytest.approx(92 * per_layer)
    assert b["routing"] == pytest.approx(92 * 896 * 7168 * 2)
    assert b["MLA"] > 24 * 8193 * 576 * 2
    assert token_bytes(k3, 8192, "bf16")["MoE experts"] > 3.5 * b["MoE experts"]
    assert token_bytes(k3, 131072)["MLA"] > 10 * b["MLA"]
    # the floor at 4.2 TB/s is about 150 tok/s at tp 8 (issue 25: 115 tok/s ~ 0.75 of it)
    assert 140 < 4.2e12 / sum(b.values()) < 170
    with pytest.raises(ValueError, match="expert_format"):
        token_bytes(k3, 8192, "int3")
    with pytest.raises(ValueError, match="context"):
        token_bytes(k3, 0)
    # the FP8 latent tail: the up-projection [7168, 3584] a byte a weight plus a row's fp32 scale
    fp8 = token_bytes(k3, 8192, "mxfp4", "e4m3")
    saved = b["dense projections"] - fp8["dense projections"]
    assert saved == pytest.approx(92 * (7168 * 3584 * (2 - 1) - 7168 * 4))
    assert {k: v for k, v in fp8.items() if k != "dense projections"} == {
        k: v for k, v in b.items() if k != "dense projections"}
    with pytest.raises(ValueError, match="latent_up_format"):
        token_bytes(k3, 8192, "mxfp4", "e5m2")
    tiny = preset("tiny")
    full = stack.compose(["fused-latent-tail", "fp8-latent-tail"])
    assert study.latent_up_format(full, tiny) == "e4m3"
    assert study.latent_up_format(stack.compose([]), tiny) == "bf16"
    assert study.latent_up_format(full, preset("kimi-k2")) == "bf16"  # no latent


def _figs(label, token_us, launches):
    cats = dict.fromkeys((*stack.CATEGORIES, dt.GAPS), token_us / 8)
    return dt.TokenFigures(label, pd.DataFrame(), token_us / 10, token_us, launches, cats)


def test_rates_waterfall_breakdown_and_headline_tables():
    k3 = preset("kimi-k3", 8)
    figs = {"engine baseline": _figs("e", 20000.0, 4000), "full stack": _figs("f", 8000.0, 900)}
    fl = {"roofline tok/s": 150.0, "floor_us": 1e6 / 150, "copy bandwidth": 4.2e12}
    r = study.rates(figs, fl, k3, allreduce_us=10.0)
    full = r.set_index("stack").loc["full stack"]
    assert full["tok/s (comm excluded)"] == pytest.approx(125.0)
    assert full["tok/s (comm included)"] == pytest.approx(1e6 / (8000 + 1860))
    assert full["fraction of floor"] == pytest.approx((1e6 / 150) / 8000)
    steps = [("engine baseline", figs["engine baseline"], ""),
             ("x", figs["full stack"], ""), ("persistent-moe", figs["full stack"], "skipped")]
    t = study.waterfall_table(steps)
    assert t["vs engine baseline"].tolist() == pytest.approx([1.0, 2.5, 2.5])
    assert t["launches per token"].tolist() == [4000, 900, 900]
    b = study.breakdown(figs, 1860.0)
    assert b.loc["all-reduce (modeled)", "full stack"] == 1860.0
    assert b["full stack"].drop("all-reduce (modeled)").sum() == pytest.approx(8000.0)
    assert study.FLOOR_LABEL not in b
    fl_b = {**fl, "bytes": {"dense projections": 21e9, "MoE experts": 4.2e9}}
    b = study.breakdown(figs, 1860.0, fl_b)
    floor_us = b[study.FLOOR_LABEL]
    assert floor_us["dense projections"] == pytest.approx(5000.0)
    assert floor_us["MoE experts"] == pytest.approx(1000.0)
    assert floor_us.drop(["dense projections", "MoE experts"]).eq(0.0).all()
    assert b["full stack"].equals(study.breakdown(figs, 1860.0)["full stack"])
    with pytest.raises(ValueError, match="fl: bytes of categories"):
        study.breakdown(figs, 1860.0, {**fl, "bytes": {"lm head": 1.0}})
    head = study.headline(r, fl, {"integration": t})
    assert head["full stack tok/s (comm excluded)"] == 125.0
    assert "full stack roofline tok/s" not in head  # one floor: the model's
    # each stack's own floor (the FP8 tail's fewer bytes): its roofline and fraction
    own = {"engine baseline": fl, "full stack": {**fl, "roofline tok/s": 160.0,
                                                 "floor_us": 1e6 / 160, "latent up": "e4m3"}}
    r2 = study.rates(figs, own, k3, allreduce_us=10.0).set_index("stack")
    assert r2.loc["full stack", "fraction of floor"] == pytest.approx((1e6 / 160) / 8000)
    assert r2.loc["full stack", "latent up"] == "e4m3"
    assert r2.loc["engine baseline", "roofline tok/s"] == 150.0
    head2 = study.headline(r2.reset_index(), fl, {})
    assert head2["full stack roofline tok/s"] == 160.0 and head2["roofline tok/s"] == 150.0
    assert head["seed anchor tok/s (MI355X, 8 GPUs, comm included)"] == 60.909
    assert not math.isnan(head["integration stack end tok/s"])


def test_one_interpreted_token_end_to_end(device):
    """The engine baseline's token on the tiny preset: labelled launches, finite figures that
    add up, and the truth check."""
    if device.type == "cuda":
        pytest.skip("the GPU test below covers the graph path")
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=3, context=24, expert_format="bf16")
    f = dt.measure_token(stack.compose([]), tok, device, configs=study.configs_for(device))
    assert set(f.timeline["segment"]) == {"embed", "layer 0", "layer 1", "layer 2", "layer 3",
                                          "head"}
    assert f.token_us > f.window_us > 0 and f.launches > 0
    assert sum(f.categories.values()) == pytest.approx(f.token_us)
    check = study.check_token(tok, {"engine": stack.compose([])}, study.configs_for(device), 4)
    assert bool(check["ok"].iloc[0])


@pytest.mark.gpu
def test_graph_token_is_labelled_launch_for_launch(device):
    """On a GPU: the marked graph labels every launch of the timed graph (same launches), the
    segments add up to the graph time, and the full stack matches the truth."""
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=3, context=64, expert_format="mxfp4")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    for st in (stack.compose([]), full):
        f = dt.measure_token(st, tok, device, configs=study.configs_for(device))
        assert not any("marked graph launched" in n for n in f.notes), f.notes
        assert f.segments["span_us"].sum() == pytest.approx(f.window_us, rel=1e-6)
        assert set(f.timeline["category"]) <= set(stack.CATEGORIES)
    check = study.check_token(tok, {"full": full}, study.configs_for(device), 4)
    assert bool(check["ok"].iloc[0]), check


def test_cublas_stack_is_the_full_stack_without_the_gemv():
    """Every change of the full stack's last step but dense-gemv and the FP8 latent tail: each
    projection op stays with the engine baseline's F.linear, every other op keeps its fused
    owner, every weight as the model stores it."""
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    cublas, _ = study.cublas_stack()
    assert "dense-gemv" in full.names and "dense-gemv" not in cublas.names
    assert set(full.names) - set(cublas.names) == {"dense-gemv", "fp8-latent-tail"}
    assert study.latent_up_format(cublas, preset("kimi-k3")) == "bf16"
    for op in stack.DENSE_OPS:
        assert not cublas.owner.get(op), op
    moved = {op for op, o in full.owner.items() if o != cublas.owner.get(op)}
    assert moved and moved <= set(stack.DENSE_OPS)


def test_breakdown_plot_zooms_past_a_slow_stack():
    """A stack far slower than the others gets the whole-scale panel; the others a panel of
    their own; negative launch gaps draw as nothing."""
    cats = [*stack.CATEGORIES, dt.GAPS]
    b = pd.DataFrame({"engine baseline": dict.fromkeys(cats, 5000.0),
                      "full stack": {**dict.fromkeys(cats, 100.0), dt.GAPS: -50.0},
                      "reviewed stack": dict.fromkeys(cats, 120.0)})
    fig = study.breakdown_plot(b, "t")
    assert len(fig.axes) == 2
    assert [t.get_text() for t in fig.axes[1].get_xticklabels()] == ["full stack",
                                                                      "reviewed stack"]
    heights = [p.get_height() for p in fig.axes[1].patches]
    assert min(heights) == 0.0
    assert len(study.breakdown_plot(b[["full stack", "reviewed stack"]], "t").axes) == 1


def test_token_passes_its_configs_to_the_small_launchers(device):
    """Configs.attn_res reaches the AttnRes reads, Configs.kda the KDA decode, Configs.mla the
    MLA decode and Configs.moe the expert stages (a config that is not one is refused by the
    launcher, naming it); with PDL
    configs the full stack's logits stay within the truth's tolerance."""
    from k3lab import kernels

    cfg = preset("tiny")
    tok = study.build(cfg, device, window=3, context=24, expert_format="bf16")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    base = study.configs_for(device)
    for field, cls in (("attn_res", "AttnResConfig"), ("kda", "KDAConfig"),
                       ("mla", "MLAConfig"), ("moe", "MoEConfig")):
        with pytest.raises(ValueError, match=f"config: expected an? {cls}"):
            stack.run_token(full, tok, configs=dataclasses.replace(base, **{field: "pdl"}))
    configs = dataclasses.replace(base, attn_res=kernels.AttnResConfig(pdl=True),
                                  kda=kernels.KDAConfig(pdl=True),
                                  mla=kernels.MLAConfig(split_pdl=True))
    check = study.check_token(tok, {"plain": full, "pdl": full}, {"plain": base, "pdl": configs}, 4)
    assert check["stack"].tolist() == ["plain", "pdl"] and check["ok"].all(), check
    if device.type != "cuda":  # the interpreter runs plain launches: nothing to compare
        assert study.launch_choices(tok, device, full, configs=base, num_splits=4).empty


def test_moe_launch_choices_meet_the_truth(device):
    """Every MoE launch choice of the table (the router apart from the front, the front after
    it, the shared gate/up beside stage 1, the tail's second product before its wait) runs the
    full stack's token within the truth's tolerance."""
    from k3lab import kernels

    cfg = preset("tiny")
    tok = study.build(cfg, device, window=2, context=24, expert_format="mxfp4")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    base = study.configs_for(device)
    choices = {label: dataclasses.replace(base, moe=kernels.MoEConfig(**changes))
               for label, field, _, changes in study.CONFIG_CHOICES if field == "moe"}
    assert len(choices) == 4
    check = study.check_token(tok, dict.fromkeys(choices, full), choices, 4)
    assert check["ok"].all(), check


def test_tail_second_first_keeps_the_tokens_bits(device):
    """MoEConfig.tail_second_first in the full stack's token (the tail's shared down and
    residual before its wait): the logits of the default order (bitwise under the interpreter,
    whose fp32 atomics add in one order; within the truth's tolerance on the GPU)."""
    from k3lab import kernels

    cfg = preset("tiny")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    # the shared down-projection as the tail's second product, not the token's stage-1 launch
    base = dataclasses.replace(study.configs_for(device), moe=kernels.MoEConfig())
    first = dataclasses.replace(base, moe=kernels.MoEConfig(tail_second_first=True))

    def token():  # a token's run advances its caches: each run gets a fresh one
        return study.build(cfg, device, window=2, context=24, expert_format="mxfp4")

    want = stack.run_token(full, token(), num_splits=4, configs=base)
    got = stack.run_token(full, token(), num_splits=4, configs=first)
    if kernels.INTERPRETED:
        assert torch.equal(got, want)
    check = study.check_token(token(), {"first": full}, first, 4)
    assert check["ok"].all(), check


def test_tail_choice_is_k3s_bf16_tail_tiling_and_reaches_the_tail(device):
    """The launch choice of the MoE tail's tiling is the bf16 tail's table entry at K3 (the e4m3
    tail has its own); Configs.tail reaches the tail's launch (a config it refuses is named
    there) and the token with another tail tiling meets the truth."""
    from k3lab import kernels
    from k3lab.kernels.dense import default_config

    (label, field, cls, changes), = [c for c in study.CONFIG_CHOICES if c[1] == "tail"]
    tail = dataclasses.replace(getattr(kernels, cls)(), **changes)
    assert tail == default_config(1, 7168, 3584)
    assert default_config(1, 7168, 3584, e4m3=True) != tail
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=3, context=24, expert_format="mxfp4")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    base = study.configs_for(device)
    with pytest.raises(ValueError, match="config: expected a GemvConfig"):
        stack.run_token(full, tok, num_splits=4,
                        configs=dataclasses.replace(base, tail="not a config"))
    mine = dataclasses.replace(tail, block_n=8, block_k=32, split_k=2)
    check = study.check_token(tok, {"tail": full}, dataclasses.replace(base, tail=mine), 4)
    assert check["ok"].all(), check


def test_waterfalls_measure_each_distinct_stack_once(monkeypatch):
    """Every step is measured unless an earlier step (of either waterfall) ran the same stack; a
    change that owns no op but changes how its owner runs (fp8-latent-tail) is a step of its
    own."""
    measured = []

    def fake(st, token, device, *, label, **kw):
        measured.append(tuple(st.names))
        return _figs(label, 1000.0 + len(measured), 10)

    monkeypatch.setattr(study, "measure_token", fake)
    cache: dict = {}
    a = study.waterfall({}, "cpu", ["fused-latent-tail", "fp8-latent-tail"], configs=None,
                        num_splits=4, cache=cache)
    assert [added for added, _, _ in a] == ["engine baseline", "fused-latent-tail",
                                            "fp8-latent-tail"]
    assert len(measured) == 3 and len({id(f) for _, f, _ in a}) == 3
    b = study.waterfall({}, "cpu", ["fused-latent-tail"], configs=None, num_splits=4,
                        cache=cache)
    assert len(measured) == 3 and b[-1][1] is a[1][1]  # shared with the first waterfall


def test_split_override_is_the_kernels_count_at_the_longest_context_served(monkeypatch):
    """The graph's fixed MLA split count: the kernel's own count at GRAPH_CONTEXT, or at a
    longer context the run measures; compare and check_token run each label at its own."""
    from k3lab.kernels.mla import default_num_splits

    cfg = preset("kimi-k3", 8)
    at = default_num_splits(1, cfg.mla_heads, study.GRAPH_CONTEXT, "cpu")
    assert study.split_override(cfg, "cpu") == at
    assert study.split_override(cfg, "cpu", [4096]) == at
    assert study.split_context() == study.split_context([4096, 8192]) == study.GRAPH_CONTEXT
    assert study.split_context([4 * study.GRAPH_CONTEXT, 8192]) == 4 * study.GRAPH_CONTEXT
    for bad in ([0], [4096, -1]):
        with pytest.raises(ValueError, match="contexts"):
            study.split_override(cfg, "cpu", bad)

    seen = {}

    def fake(st, token, device, *, label, num_splits, **kw):
        seen[label] = num_splits
        return _figs(label, 1000.0, 10)

    monkeypatch.setattr(study, "measure_token", fake)
    out = study.compare({}, "cpu", {"a": None, "b": None}, {"a": None, "b": None},
                        num_splits={"a": 3, "b": 7})
    assert seen == {"a": 3, "b": 7} and out["choice"].tolist() == ["a", "b"]
    study.compare({}, "cpu", {"a": None}, {"a": None}, num_splits=5)
    assert seen["a"] == 5


def test_interleaved_ratios_per_round():
    """The base's time over each label's, per round: median, min and max over the rounds."""
    t = pd.DataFrame({"round": [0, 0, 1, 1, 2, 2], "label": ["d", "x"] * 3,
                      "us": [100.0, 50.0, 110.0, 100.0, 90.0, 100.0]})
    r = profile.interleaved_ratios(t, "d")
    assert r.loc["d"].tolist() == [1.0, 1.0, 1.0]
    assert r.loc["x", "min"] == pytest.approx(0.9) and r.loc["x", "max"] == 2.0
    assert r.loc["x", "median"] == pytest.approx(1.1)
    with pytest.raises(ValueError, match="base"):
        profile.interleaved_ratios(t, "y")
    with pytest.raises(ValueError, match="rounds"):
        profile.time_interleaved({"d": lambda _: None}, torch.zeros(1), rounds=0)
    with pytest.raises(ValueError, match="CUDA"):
        profile.time_interleaved({"d": lambda _: None}, torch.zeros(1))


def test_headline_takes_the_launch_choices():
    k3 = preset("kimi-k3", 8)
    figs = {"full stack": _figs("f", 8000.0, 900)}
    fl = {"roofline tok/s": 150.0, "floor_us": 1e6 / 150, "copy bandwidth": 4.2e12}
    r = study.rates(figs, fl, k3, allreduce_us=10.0)
    choices = pd.DataFrame({"choice": ["defaults", "KDA decode by PDL"],
                            "tok/s": [100.0, 103.0], "vs defaults": [1.0, 1.03]})
    head = study.headline(r, fl, {}, choices)
    assert head["full stack, KDA decode by PDL: tok/s / defaults' (one run)"] == 1.03
    assert not any("defaults, defaults" in k for k in head)
    assert study.headline(r, fl, {}, pd.DataFrame()) == study.headline(r, fl, {})
    spread = choices.assign(**{"window vs defaults, interleaved min": [1.0, 0.99],
                               "window vs defaults, interleaved max": [1.0, 1.05]})
    head = study.headline(r, fl, {}, spread)
    key = "full stack, KDA decode by PDL: defaults' window / its, interleaved"
    assert (head[f"{key} min"], head[f"{key} max"]) == (0.99, 1.05)


@pytest.mark.gpu
def test_launch_choices_on_the_gpu(device):
    """Each launch and stack choice's token checked against the truth and timed, beside the
    defaults (the tiny preset's FP8 tail meets the truth, so no stack choice is dropped)."""
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=3, context=64, expert_format="mxfp4")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    t = study.launch_choices(tok, device, full, configs=study.configs_for(device), num_splits=4)
    assert t["choice"].tolist() == ["defaults", "AttnRes reads plain", "KDA decode by PDL",
                                    "all of them toggled"] + [
        c[0] for c in study.CONFIG_CHOICES] + list(study.stack_choices(full))
    assert (t["tok/s"] > 0).all() and t["vs defaults"].iloc[0] == 1.0
    lo, med, hi = (t[f"window vs defaults, interleaved {k}"] for k in ("min", "median", "max"))
    assert (lo > 0).all() and (lo <= med).all() and (med <= hi).all(), t
    assert lo.iloc[0] == hi.iloc[0] == 1.0  # the defaults against themselves


@pytest.mark.gpu
def test_gpu_moe_front_overlapping_the_route_gives_the_sequential_logits(device):
    """With the route and the merged MoE front as two launches (MoEConfig.front_routes off),
    the front overlapping route_sort (front_overlaps_route) gives, bit for bit, the token's
    logits of the front launched after the route, and those with the expert pair launched
    plainly after the front (front_triggers_last off), eager and over replays of one captured
    token; and the router in the front's launch (front_routes, the default) gives its own bits
    again over the replays."""
    from k3lab.kernels import MoEConfig

    cfg = preset("tiny")
    tok = study.build(cfg, device, window=3, context=64, expert_format="mxfp4")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    base = study.configs_for(device)
    snap = study._snapshot(tok)
    logits = {}
    apart = MoEConfig(front_routes=False)
    orders = {"after": dataclasses.replace(apart, front_overlaps_route=False), "overlap": apart,
              "overlap, pair plain": dataclasses.replace(apart, front_triggers_last=False),
              "one launch": MoEConfig()}
    for overlap, moe_config in orders.items():
        configs = dataclasses.replace(base, moe=moe_config)
        study._restore(tok, snap)
        logits[overlap] = stack.run_token(full, tok, num_splits=4, configs=configs)
        out = []
        graph = dt._graph(lambda t, c=configs: out.append(
            stack.run_token(full, t, num_splits=4, configs=c)), tok)
        out = out[-1]
        for _ in range(10):
            study._restore(tok, snap)
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(out, logits[overlap])
    assert torch.equal(logits["overlap"], logits["after"])
    assert torch.equal(logits["overlap, pair plain"], logits["after"])


@pytest.mark.gpu
def test_gpu_projection_prefetch_keeps_the_bits(device):
    """Weights asked of L2 before the projections' PDL waits (stack.Configs.o_proj_prefetch /
    in_proj_prefetch with the KDA decode by PDL, the MoE front's first step) give the token's
    logits bit for bit, eager and over replays of one captured token."""
    from k3lab.kernels import KDAConfig, MoEConfig
    from k3lab.kernels.moe.front_route import FRONT_TILING_M1

    cfg = preset("kimi-k3", 8)
    tok = study.build(cfg, device, window=2, context=256, first_layer=2,
                      expert_format="mxfp4")
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    # the deterministic stage 2: the atomic one's sums are not bitwise from call to call
    base = dataclasses.replace(study.configs_for(device), in_proj_prefetch=None,
                               moe=MoEConfig(deterministic_stage2=True))
    early = dataclasses.replace(base, kda=KDAConfig(pdl=True), o_proj_prefetch=3,
                                in_proj_prefetch=1,
                                front=dataclasses.replace(FRONT_TILING_M1, prefetch_steps=1))
    snap = study._snapshot(tok)
    want = stack.run_token(full, tok, num_splits=4, configs=base)
    study._restore(tok, snap)
    assert torch.equal(stack.run_token(full, tok, num_splits=4, configs=early), want)
    out = []
    graph = dt._graph(lambda t: out.append(stack.run_token(full, t, num_splits=4,
                                                           configs=early)), tok)
    for _ in range(3):
        study._restore(tok, snap)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out[-1], want)


def test_fp8_latent_tail_runs_the_persistent_variant_with_the_fp8_tail(device, monkeypatch):
    """In the reviewed stack, fp8-latent-tail makes every MoE layer run the moe boundary's
    persistent_fp8_tail variant (persistent-moe alone: persistent), and the token still meets
    the truth check."""
    ran: list[str] = []
    persistent = stack.moe._persistent

    def spy(x, w, cfg, variant="persistent"):
        ran.append(variant)
        return persistent(x, w, cfg, variant)

    monkeypatch.setattr(stack.moe, "_persistent", spy)
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=1, context=24, expert_format="mxfp4")
    base = ["persistent-moe", "fused-latent-tail"]
    stacks = {"bf16 tail": stack.compose(base),
              "fp8 tail": stack.compose([*base, "fp8-latent-tail"])}
    check = study.check_token(tok, stacks, study.configs_for(device), 4)
    assert check["ok"].all(), check
    moe_layers = len(tok["layer_ids"]) - 1  # layer 0 has a dense MLP
    assert ran == ["persistent"] * moe_layers + ["persistent_fp8_tail"] * moe_layers


def test_fp8_latent_tail_in_the_dense_tail(device):
    """Without the persistent launch, fp8-latent-tail runs the fused tail's dense GEMV on the
    up-projection's e4m3 rows: other logits than the bf16 tail's, both within the truth check."""
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=2, context=24, expert_format="mxfp4")
    stacks = {"bf16 tail": stack.compose(["fused-latent-tail"]),
              "fp8 tail": stack.compose(["fused-latent-tail", "fp8-latent-tail"])}
    check = study.check_token(tok, stacks, study.configs_for(device), 4)
    assert check["ok"].all(), check
    snap = study._snapshot(tok)
    logits = {}
    for label, st in stacks.items():
        study._restore(tok, snap)
        logits[label] = stack.run_token(st, tok, num_splits=4, configs=study.configs_for(device))
    assert not torch.equal(logits["bf16 tail"], logits["fp8 tail"])


def test_fp8_tail_stacks_are_checked_against_their_own_weights(device):
    """A stack with fp8-latent-tail meets the truth that runs its e4m3 rows (dequantized), and
    is nearer to it than to the truth of the bf16 weight: the quantization is the model's
    change of numbers, the rest the kernels' rounding."""
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=2, context=24, expert_format="mxfp4")
    st = stack.compose(["fused-latent-tail", "fp8-latent-tail"])
    check = study.check_token(tok, {"fp8 tail": st, "bf16": stack.compose(["fused-latent-tail"])},
                              study.configs_for(device), 4)
    assert check["truth latent up"].tolist() == ["e4m3 rows", "bf16"]
    assert check["ok"].all(), check
    snap = study._snapshot(tok)
    chosen: list = []
    got = stack.run_token(st, tok, num_splits=4, configs=study.configs_for(device),
                          record=chosen).float()
    study._restore(tok, snap)
    bf16_truth = ref_layer.run_token(tok, topk_ids=chosen)
    err = float(check.loc[0, "max abs error"])
    assert err < float((got - bf16_truth).abs().max())


def test_stack_choices_add_or_take_out_one_change_of_the_full_stack(device, capsys):
    """The launch-choice table's stack choices: the full stack without a change it holds, or
    with one it lacks (each checked against the truth here, as the table checks every choice
    first); a change that cannot join is left out with a note."""
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    assert "fp8-latent-tail" in full.names
    got = study.stack_choices(full)
    held = [(label, name) for label, name, add in study.STACK_CHOICES if not add]
    assert list(got) == [label for label, _ in held]
    for (_, name), st in zip(held, got.values(), strict=True):
        assert set(st.names) == set(full.names) - {name}
    without = next(iter(got.values()))
    added = study.stack_choices(without)
    assert list(added) == [label for label, _, add in study.STACK_CHOICES if add]
    assert set(next(iter(added.values())).names) == set(full.names)
    assert study.stack_choices(stack.compose([])) == {}
    assert "left out" in capsys.readouterr().out
    cfg = preset("tiny")
    tok = study.build(cfg, device, window=2, context=24, expert_format="mxfp4")
    check = study.check_token(tok, {"full": full, **got}, study.configs_for(device), 4)
    assert check["ok"].all(), check
    assert check["truth latent up"].tolist() == ["e4m3 rows", "bf16"]


def test_a_stack_choice_off_the_truth_is_dropped_a_launch_choice_is_an_error(capsys):
    full, other = stack.compose([]), stack.compose(["dense-gemv"])

    def checks(oks):
        return pd.DataFrame({"stack": list(oks), "ok": list(oks.values()),
                             "max abs error": 1.0, "tolerance": 0.5})

    choices = {"defaults": 0, "plain": 1, "fp8": 2}
    stacks = {"defaults": full, "plain": full, "fp8": other}
    kept = study._checked(checks({"defaults": True, "plain": True, "fp8": False}), choices,
                          stacks, full)
    assert list(kept["stack"]) == list(choices) == list(stacks) == ["defaults", "plain"]
    assert "fp8: logits off the fp32 truth" in capsys.readouterr().out
    choices, stacks = {"defaults": 0, "plain": 1}, {"defaults": full, "plain": full}
    with pytest.raises(AssertionError, match="plain by 1"):
        study._checked(checks({"defaults": True, "plain": False}), choices, stacks, full)
