"""The notebooks' study helpers (k3lab.studies) on the CPU: their tables from hand-made records,
and the few that drive a boundary with stand-in variants (the references in the fused slots), so
no kernel runs under the interpreter here; the kernels' own tests check those."""

import dataclasses
import math

import pandas as pd
import pytest
import torch

from k3lab import boundaries, config, studies
from k3lab.boundaries import Variant
from k3lab.boundaries import kda as kda_boundary
from k3lab.studies import attn_res as attn_res_study
from k3lab.studies import kda as kda_study
from k3lab.studies import mla as mla_study
from k3lab.studies import overview
from k3lab.studies import route as route_study


def _setup(name, preset="tiny", tp=1, M=1, fused=None) -> studies.Setup:
    """A CPU Setup whose fused variants are replaced by ``fused`` {name: fn} (the references)."""
    b = boundaries.get(name)
    if fused:
        b = dataclasses.replace(b, variants=tuple(
            Variant(v.name, v.role, fused[v.name]) if v.name in fused else v
            for v in b.variants))
    return studies.Setup(b, config.preset(preset, tp), torch.device("cpu"), seed=0, M=M,
                         _copy_bw=1e10)


def _records(rows) -> pd.DataFrame:
    return pd.DataFrame([{"mode": "", **r} for r in rows])


# ---------------------------------------------------------------- setup

def test_setup_names_the_presets_that_have_the_boundary(monkeypatch):
    # the device itself is k3lab.device's to check; leave the process's interpreter setting be
    monkeypatch.setattr(studies.k3device, "use_device", torch.device)
    with pytest.raises(ValueError, match=r"kimi-k2 has no kda boundary; use one of "
                                         r"\['kimi-k3', 'kimi-linear', 'tiny'\]"):
        studies.setup("kda", "kimi-k2", 1, "cpu")
    s = studies.setup("route", "tiny", 1, "cpu", seed=3, repeats=0, M=2)
    assert (s.mode, s.modes, s.repeats, s.seed) == ("eager", ("eager",), None, 3)
    assert s.note == studies.CPU_NOTE
    assert s.base == {"boundary": "route", "preset": "tiny", "tp": 1, "device": "cpu", "M": 2}
    (one,) = s.copies(M=2, block_m=4)  # one copy on the CPU: the L2 is moot there
    assert one["hidden"].shape[0] == 2 and one["block_m"] == 4


# ---------------------------------------------------------------- route

def test_group_count():
    assert [route_study.group_count(e) for e in (896, 24, 12, 6)] == [8, 8, 4, 2]
    with pytest.raises(ValueError, match="n_experts"):
        route_study.group_count(3)


def test_route_check_case_compares_every_field_and_the_sorting_formulation():
    s = _setup("route", fused={"fused": boundaries.get("route").reference.fn})
    row = route_study.check_case(s, 3, 4, n_group=2, topk_group=1, sorting=True)
    assert (row["M"], row["block_m"], row["groups"]) == (3, 4, "2/1")
    assert row["reference == sorting"] is True and row["topk_weights err"] == 0


def test_route_bar_on_the_cpu_checks_launches_only():
    s = _setup("route")
    rec = _records([
        {"variant": "fused", "metric": "launches", "value": 1},
        {"variant": "reference", "metric": "launches", "value": 40},
        {"variant": "fused", "metric": "latency_us", "mode": "eager", "value": 10.0},
        {"variant": "reference", "metric": "latency_us", "mode": "eager", "value": 50.0}])
    table, f = route_study.bar(s, rec, gate_bytes=10_000)
    assert table.ok.tolist()[0] is True and table.ok.tolist()[1:] == [None, None, None]
    assert table.measured.iloc[1] == 5.0 and f["gate_floor_us"] == pytest.approx(1.0)
    assert math.isnan(f["comp_us"]) and math.isnan(f["floor_us"])  # no graphs, no compile
    with pytest.raises(ValueError, match="tokens or experts"):
        route_study.sweep(s)


def test_token_explorer_places_every_slot_in_the_sorted_plan():
    s = _setup("route", fused={"fused": boundaries.get("route").reference.fn})
    ex = route_study.TokenExplorer(s, tokens=3, block_m=4)
    assert ex.num_tokens == 3 and ex.clamp(7) == 2 and ex.clamp(-1) == 0
    t = ex.table(1)
    k = s.cfg.top_k
    assert ex.sorted_ids[t["sorted position"]].tolist() == [k + j for j in range(k)]
    assert (t["tile"] == t["sorted position"] // 4).all()
    assert (t["weight (fused)"] == t["weight (reference)"]).all()
    assert t["biased score"].is_monotonic_decreasing


# ---------------------------------------------------------------- kda

def test_kda_sweep_tps():
    assert kda_study.sweep_tps(config.preset("kimi-k3")) == [1, 2, 4, 8]
    assert kda_study.sweep_tps(config.preset("tiny")) == [1, 2, 3, 6]  # 6 heads
    assert kda_study.sweep_tps(config.preset("tiny"), (2, 3)) == [2, 3]


def test_kda_steps_carry_each_variants_state():
    stand_ins = {"fused": boundaries.get("kda").reference.fn,
                 "fused+conv": kda_boundary.reference_conv,
                 "fused+out_gate": kda_boundary.reference_out_gate,
                 "fused+conv+out_gate": kda_boundary.reference_conv_out_gate}
    s = _setup("kda", fused=stand_ins)
    fixed, tokens = kda_boundary.decode_stream(s.cfg, s.device, 0, M=1, steps=3)
    errs = kda_study.run_steps(s, fixed, tokens, list(kda_study.STEP_VARIANTS), variant_steps=2)
    assert errs.groupby("variant", sort=False).size().to_dict() == {
        "fused": 3, "fused+conv": 2, "fused+out_gate": 2, "fused+conv+out_gate": 2}
    assert (errs.o_err == 0).all() and (errs.state_err == 0).all()
    assert errs.o_ok.all() and errs.state_ok.all()
    summary = kda_study.step_summary(errs)
    assert summary.loc["fused", "steps"] == 3 and summary.o_within_tol.all()
    assert set(kda_study.step_records(s, errs).metric) == {"step_o_err", "step_state_err"}


def test_kda_within_and_versus():
    atol, rtol = kda_study.TOL["o"]
    e = torch.ones(4)
    assert kda_study.within("o", e + atol + rtol * 0.5, e)
    assert not kda_study.within("o", e + 2 * (atol + rtol), e)
    assert not kda_study.within("o", e * float("nan"), e)
    s = _setup("kda")
    rec = _records([{"variant": v, "metric": "latency_us", "mode": "eager", "value": us}
                    for v, us in (("reference", 40.0), ("fused", 10.0),
                                  ("fused+conv", 20.0), ("fused+out_gate", 25.0))]
                   + [{"variant": "fused", "metric": "launches", "value": 1}])
    extra = _records([{"variant": "reference+conv", "metric": "latency_us", "mode": "eager",
                       "value": 80.0}])
    v = kda_study.versus(s, rec, extra).set_index("before")
    assert v.loc["reference", "eager speedup"] == 4.0
    assert v.loc["reference+conv", "eager speedup"] == 4.0
    assert math.isnan(v.loc["reference+out_gate", "eager speedup"])
    assert v.loc["reference", "launches after"] == 1


# ---------------------------------------------------------------- mla

def test_mla_split_choice_and_kv_bytes():
    rows = [{"context": c, "num_splits": ns, "heuristic": h, "latency_us": us, "kv_TBps": 1.0,
             "copy_frac": 0.5}
            for c, h, lat in ((64, 2, {1: 9.0, 2: 6.0, 4: 8.0}),
                              (1024, 4, {1: 30.0, 2: 12.0, 4: 16.0}))
            for ns, us in lat.items()]
    choice = mla_study.split_choice(pd.DataFrame(rows))
    assert choice.loc[64, "best splits"] == 2 and choice.loc[64, "heuristic / best"] == 1.0
    assert choice.loc[1024, "heuristic splits"] == 4 and choice.loc[1024, "best splits"] == 2
    assert choice.loc[1024, "best speedup vs 4 splits"] == pytest.approx(16 / 12)
    kv = torch.zeros(2, 10, 6, dtype=torch.bfloat16)
    assert mla_study.kv_bytes({"kv_cache": kv, "seq_lens": torch.tensor([3, 5])}) == 8 * 6 * 2
    s = _setup("mla")
    assert mla_study.skeletons(s, choice, pd.DataFrame(rows)).empty  # none on the CPU


# ---------------------------------------------------------------- attn_res

def test_attn_res_schedule_and_token_launches():
    s = _setup("attn_res")
    reads, per_depth = attn_res_study.schedule(s)
    assert len(reads) == 2 * s.cfg.n_layers == per_depth.reads.sum()
    assert per_depth.index.max() == attn_res_study.deepest(s) + 1
    per_read = pd.DataFrame([{"variant": "reference", "candidates": 2, "reads": 3,
                              "launches per read": 2}])
    fns = {"reference": lambda inp: [inp["x"] + 1 for _ in range(3) for _ in range(2)]}
    table = attn_res_study.launches_per_token(per_read, {"x": torch.ones(2)}, fns, 3)
    assert table.loc["reference"].tolist() == [6, 6, 3, True]
    sweep = pd.DataFrame([{"candidates": c, "mode": "eager", "variant": v, "latency_us": us}
                          for c in (1, 2) for v, us in (("reference", 10.0 * c),
                                                        ("fused", 2.0))])
    lat, speedup = attn_res_study.depth_tables(s, sweep)
    assert speedup["eager"].tolist() == [5.0, 10.0]


# ---------------------------------------------------------------- overview

def test_overview_owners_and_reference_table():
    owner = {"moe.sort": "route"}
    assert overview.owner_of("moe.sort", owner) == "route"
    assert overview.owner_of("attn_res.read@ffn", {"attn_res.read": "attn_res"}) == "attn_res"
    assert overview.owner_of("x.q_proj", owner) == overview.DENSE
    assert overview.owner_of("x.other", owner) == overview.UNOWNED
    table = overview.op_table(config.preset("kimi-k2"))
    assert set(table.layer) == {"mla"}  # no KDA layers
    assert table[table.op == "mla.attention"].owner.item() == "mla"
    rec = _records(
        [{"boundary": b, "metric": m, "value": v, "mode": mode}
         for b in ("route", "moe", "attn_res")
         for m, v, mode in (("launches", 30, ""), ("bytes", 100, ""),
                            ("latency_us", 12.34, "eager"), ("roofline_us", 0.5, "eager"))])
    t = overview.reference_table(rec)
    assert t.index.tolist() == ["route", "moe", "attn_res"]  # the registry's order, kept
    assert t.loc["moe"].tolist() == [30, 100, 12.34, 0.5]
    head = overview.headline(t, "kda", 77)
    assert head["moe reference launches"] == 30 and head["moe reference eager (us)"] == 12.3
    assert head["reference kda layer launches"] == 77


def test_dense_headline_scopes_the_bar_to_tp_8_and_16():
    """tp 1 rows do not enter the bar's figures; the dependent skeleton's fraction is the fused
    fraction scaled by the time ratio."""
    from k3lab.studies import dense as dense_study

    s = _setup("dense")
    mode = s.mode
    rows = [  # tp, shape, MB, fused us, cuBLAS us, frac, dependent skeleton us
        (1, "lm_head", 2349.0, 500.0, 480.0, 0.95, 490.0),
        (8, "kda.q_proj", 22.0, 7.0, 10.5, 0.75, 6.5),
        (8, "moe.router", 12.8, 5.4, 9.9, 0.56, math.nan),
        (16, "moe.latent_up", 51.4, 15.4, 33.9, 0.79, 14.0),
    ]
    table = pd.DataFrame([{"tp": tp, "shape": sh, "weight MB": mb, "launches fused": 1,
                           f"fused us ({mode})": f, f"cuBLAS us ({mode})": c,
                           "fused frac of copy bw": fr, "speedup vs cuBLAS": c / f,
                           "dependent skeleton us (graph)": dep}
                          for tp, sh, mb, f, c, fr, dep in rows])
    head = dense_study.headline(s, table)
    assert head[f"min speedup vs cuBLAS ({mode})"] == round(480 / 500, 3)
    assert head[f"tp 8, 16: min speedup vs cuBLAS ({mode})"] == round(10.5 / 7.0, 3)
    assert head[f"tp 8, 16: min frac of copy bw, weights >= 20 MB ({mode})"] == 0.75
    assert head[f"tp 8, 16: min speedup vs cuBLAS, weights < 20 MB ({mode})"] == round(
        9.9 / 5.4, 3)
    dep = head["tp 8, 16: min dependent-skeleton frac of copy bw, weights >= 20 MB (graph)"]
    assert dep == round(min(0.75 * 7.0 / 6.5, 0.79 * 15.4 / 14.0), 3)


def test_dense_fp8_tail_measures_both_formats_in_one_run():
    """The FP8 latent tail table: the bf16 row first (its speedup 1), the e4m3 row moving
    fewer bytes, both checked and counted; its speedup reaches the headline. A preset without
    a latent gives empty frames."""
    from k3lab.studies import dense as dense_study

    s = _setup("dense")
    recs, table = dense_study.fp8_tail(s, variants=["reference", "fused"])
    assert table["weight"].tolist() == ["bf16", "e4m3"]
    assert table["fused speedup vs bf16"].iloc[0] == 1.0
    assert table["MB moved"].iloc[1] < table["MB moved"].iloc[0]
    assert (table["launches fused"] == 1).all()
    checks = recs[recs["metric"] == "check"]
    assert set(checks["weight_format"]) == {"bf16", "e4m3"} and (checks["value"] == 1).all()
    one = pd.DataFrame([{"tp": 1, "shape": "lm_head", "weight MB": 1.0, "launches fused": 1,
                         f"fused us ({s.mode})": 2.0, "fused frac of copy bw": 0.5,
                         "speedup vs cuBLAS": 1.5, "dependent skeleton us (graph)": math.nan}])
    head = dense_study.headline(s, one, table)
    key = f"moe.latent_up e4m3 speedup vs bf16 ({s.mode})"
    assert head[key] == round(float(table["fused speedup vs bf16"].iloc[1]), 3)
    flat = _setup("dense", preset="kimi-linear")
    assert all(f.empty for f in dense_study.fp8_tail(flat))


@pytest.mark.gpu
def test_moe_compiled_peer_routes_then_reuses_the_block_graph():
    """torch.compile peer: given the plan one graph; with routing only the route's is added, and
    both scopes match the fp32 truth."""
    from torch._dynamo.utils import counters

    from k3lab.boundaries import moe as moe_boundary

    torch._dynamo.reset()
    counters.clear()
    cfg, dev = config.preset("tiny", 1), torch.device("cuda")
    fn = moe_boundary.BOUNDARY.variant("torch.compile").fn
    for route in (False, True, True):
        inputs = moe_boundary.BOUNDARY.make_inputs(cfg, dev, 3, M=2, expert_format="mxfp4",
                                                   route=route)
        moe_boundary.check(fn(inputs), None, inputs)
    assert counters["stats"]["unique_graphs"] == 2
