"""The MoE notebook's studies (20_moe): the fused latent MoE block against the fp32 reference,
its variants with and without routing, each stage alone, and sweeps over tp, expert format and
tokens, cold.

Import after :func:`k3lab.studies.setup` (it imports ``k3lab.kernels``).
"""

from __future__ import annotations

import functools
import gc
import math

import matplotlib.pyplot as plt
import pandas as pd
import torch

from k3lab import boundaries, config, plots, profile
from k3lab.boundaries import moe as bmoe
from k3lab.kernels import moe_block, moe_stage1, moe_stage2
from k3lab.kernels.mxfp4 import MXFP4
from k3lab.reference import moe as ref
from k3lab.studies import Setup

__all__ = ["valid_tp", "default_sweep_tps", "default_tokens", "correctness", "variants",
           "variant_table", "launch_lists", "stage_copies", "time_stages", "stage_plot",
           "timelines", "bar", "tp_sweep", "tp_plot", "token_sweep", "token_plot", "headline",
           "tidy_records"]

STAGE1_ATOL, STAGE1_RTOL = 1e-3, 2 ** -8  # stage 1 alone vs its reference (bf16 a)
STAGE2_ATOL, STAGE2_RTOL = 2e-5, 1e-5     # stage 2 alone vs its reference (fp32 y)


def valid_tp(preset: str, tp: int, fmt: str = "bf16") -> bool:
    """Whether ``preset`` shards at ``tp`` (and, for MXFP4, into whole 32-wide scale blocks)."""
    try:
        c = config.preset(preset, tp)
    except ValueError:
        return False
    return fmt == "bf16" or (c.moe_in % 32 == 0 and c.moe_intermediate % 32 == 0)


def default_sweep_tps(s: Setup) -> list[int]:
    """K3: tp 1 and 8; another preset: its valid tps among 1, 3 and 8 (under the interpreter,
    among 1 and 8: the sweep only shows that each shard runs there)."""
    if s.cfg.name == "kimi-k3":
        return [1, 8]
    return [t for t in ((1, 3, 8) if s.on_gpu else (1, 8)) if valid_tp(s.cfg.name, t)]


def default_tokens(s: Setup) -> list[int]:
    """1..16 tokens on a GPU; 1 and 8 under the interpreter."""
    return [1, 2, 4, 8, 16] if s.on_gpu else [1, 8]


def describe(s: Setup) -> str:
    c = s.cfg
    return (f"{s.describe()}: hidden {c.hidden}, latent {c.latent or '-'}, {c.n_experts} experts "
            f"top-{c.top_k}, expert {c.moe_in} -> 2x{c.moe_intermediate} -> {c.moe_in}, shared "
            f"{c.shared_intermediate}, {c.activation}; timed in {'/'.join(s.modes)} mode")


def _act(c) -> dict:
    return dict(activation=c.activation, situ_beta=c.situ_beta,
                situ_linear_beta=c.situ_linear_beta)


def _check_case(s: Setup, fmt: str, m: int, bm: int, det: bool,
                launches_only: bool = False) -> dict | None:
    """One case of :func:`correctness`; ``launches_only``: the fused launches alone, unchecked
    (for ``Setup.compile_ahead``)."""
    cfg, B = s.cfg, s.boundary
    if fmt == "mxfp4" and not valid_tp(cfg.name, cfg.tp, "mxfp4"):
        return None
    inputs = B.make_inputs(cfg, s.device, s.seed + m, M=m, expert_format=fmt, block_m=bm)
    w, plan = inputs["weights"], inputs["plan"]
    wf = w.fused  # the experts as the fused kernels read them (the tiled MXFP4 layout)
    out = moe_block(inputs["x"], wf, cfg=cfg, plan=plan, deterministic=det)
    apart = moe_block(inputs["x"], wf, cfg=cfg, plan=plan, deterministic=det, fuse_tail=False)
    if launches_only:
        a = moe_stage1(bmoe.stage_inputs(inputs)["z"], plan, wf["w13"], **_act(cfg))
        for d in (False, True):
            moe_stage2(a, plan, wf["w2"], deterministic=d)
        return None
    truth = bmoe.truth(inputs)
    row = {"format": fmt, "M": m, "block_m": bm, "stage 2": "deterministic" if det else "atomic",
           "fused layout (w13, w2)": ", ".join(wf[k].layout if isinstance(wf[k], MXFP4)
                                               else "bf16" for k in ("w13", "w2")),
           "unique experts": int(plan.topk_ids.unique().numel()),
           "block err": bmoe.check_truth(out, truth)["out"],
           "block err (fuse_tail=False)": bmoe.check_truth(apart, truth)["out"]}
    st = bmoe.stage_inputs(inputs)
    a = moe_stage1(st["z"], plan, wf["w13"], **_act(cfg))
    row["stage1 err"] = boundaries.assert_close(
        "a", a, ref.moe_stage1_reference(st["z"], plan, w["w13"], **_act(cfg)),
        atol=STAGE1_ATOL, rtol=STAGE1_RTOL)
    y = moe_stage2(a, plan, wf["w2"]).clone()
    row["stage2 err"] = boundaries.assert_close(
        "y", y, ref.moe_stage2_reference(a, plan, w["w2"]), atol=STAGE2_ATOL, rtol=STAGE2_RTOL)
    y_det = moe_stage2(a, plan, wf["w2"], deterministic=True)
    row["atomic - deterministic"] = float((y - y_det).abs().max())
    row["reference(bf16) err"] = bmoe.check_truth(B.reference.fn(inputs), truth)["out"]
    row["grouped err"] = bmoe.check_truth(B.variant("grouped").fn(inputs), truth)["out"]
    return row


def correctness(s: Setup) -> pd.DataFrame:
    """The fused block (stage 2 + tail as one launch and as two) and each stage alone against
    the fp32 reference: bf16 and MXFP4 experts, M 1 and many (16), block_m 1, 4 and 16, atomic
    and deterministic stage 2: every combination on a GPU; interpreted, four cases that cover
    each format, tile height and stage-2 mode (M 8; the tests run the rest). A failed check
    raises."""
    if s.on_gpu:
        cases = [(f, m, bm, det) for f in ("bf16", "mxfp4")
                 for m, bm, det in ((1, 1, False), (1, 1, True), (16, 1, False), (16, 4, True),
                                    (16, 16, False))]
    else:
        cases = [("bf16", 1, 1, False), ("mxfp4", 1, 1, True), ("bf16", 8, 4, True),
                 ("mxfp4", 8, 16, False)]
    s.compile_ahead([functools.partial(_check_case, s, *c, launches_only=True) for c in cases])
    return pd.DataFrame([r for c in cases if (r := _check_case(s, *c)) is not None])


def variants(s: Setup, params: dict) -> pd.DataFrame:
    """``profile.measure`` given the plan and with routing (``scope`` column)."""
    recs = []
    for scope, extra in (("given the plan", {}), ("with routing", {"route": True})):
        rec = profile.measure(s.boundary, s.cfg, s.device, seed=s.seed, params={**params, **extra},
                              repeats=s.repeats, modes=s.modes)
        rec["scope"] = scope
        recs.append(rec)
    records = pd.concat(recs, ignore_index=True)
    records["boundary"] = "moe (" + records["scope"] + ")"
    return records


def variant_table(records: pd.DataFrame) -> pd.DataFrame:
    keep = ("launches", "latency_us", "roofline_frac", "speedup_vs_reference", "max_abs_err")
    t = records.pivot_table(index=["scope", "variant"], columns=["metric", "mode"],
                            values="value", aggfunc="first")
    return t.loc[:, [c for c in t.columns if c[0] in keep]]


def launch_lists(s: Setup, inputs: dict) -> dict[str, list[str]]:
    """The kernels each non-reference variant launches for one call."""
    return {v.name: profile.count_launches(v.fn, boundaries.clone_inputs(inputs)).kernels
            for v in s.boundary.available_variants(s.device) if v.name != "reference"}


def stage_copies(s: Setup, cfg, fmt: str, m: int, block_m: int) -> list[dict]:
    """Cold per-stage input copies that share the expert tensors but route different tokens,
    enough that one pass touches twice the L2 (one copy on the CPU)."""
    first = s.boundary.make_inputs(cfg, s.device, s.seed, M=m, expert_format=fmt,
                                   block_m=block_m)
    smallest = min(bmoe.stage_bytes(st, first) for st in bmoe.STAGES)
    n = 1 if not s.on_gpu else max(1, min(16, math.ceil(2 * profile.l2_bytes(s.device)
                                                         / smallest)))
    return [bmoe.stage_inputs(i) for i in bmoe.copies_sharing_experts(first, n, s.seed)]


def _expert_weight_bytes(stage: str, inputs: dict) -> int:
    w, n = inputs["weights"], int(inputs["plan"].topk_ids.unique().numel())
    return bmoe.expert_bytes(w["w13" if stage == "stage1" else "w2"], n)


def _base(s: Setup, c0: dict, label: str, stage: str, name: str, mode: str, t, nbytes: int,
          ncopies: int) -> dict:
    return {"boundary": "moe", "preset": s.cfg.name, "device": s.device.type,
            "tp": c0["cfg"].tp, "M": c0["x"].shape[0], "format": c0["expert_format"],
            "sweep": label, "stage": stage, "variant": name, "mode": mode,
            "latency_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us, "bytes": nbytes,
            "copies": ncopies}


def _with_bandwidth(s: Setup, df: pd.DataFrame) -> pd.DataFrame:
    sec = df["latency_us"] * 1e-6
    df["tbps"] = df["bytes"] / sec / 1e12
    df["frac_of_copy"] = df["bytes"] / sec / s.copy_bw
    if "expert_bytes" in df:
        df["expert_tbps"] = df["expert_bytes"] / sec / 1e12
        df["expert_frac_of_copy"] = df["expert_bytes"] / sec / s.copy_bw
    return df


def time_stages(s: Setup, copies: list[dict], label: str, stages=bmoe.STAGES,
                variants=("reference", "grouped", "fused")) -> pd.DataFrame:
    """Each stage alone over ``copies``: latency per variant and mode, its minimum bytes and, for
    stages 1 and 2, the selected experts' weight bytes. A capture failure is printed, not
    raised (a finding, not a crash)."""
    rows, c0 = [], copies[0]
    for st in stages:
        fns = bmoe.stage_fns(st)
        nbytes = bmoe.stage_bytes(st, c0)
        ebytes = _expert_weight_bytes(st, c0) if st in ("stage1", "stage2") else None
        for name in variants:
            if name not in fns:  # "fused (no PDL)": stages 1 and 2 only
                continue
            for mode in s.modes:
                try:
                    t = profile.time_variant(fns[name], copies, mode=mode, repeats=s.repeats)
                except Exception as exc:
                    print(f"{label} {st} {name} {mode}: {type(exc).__name__}: {exc}"[:200])
                    continue
                rows.append({**_base(s, c0, label, st, name, mode, t, nbytes, len(copies)),
                             "expert_bytes": ebytes})
    return _with_bandwidth(s, pd.DataFrame(rows))


def stage_plot(s: Setup, stages: pd.DataFrame, fmt: str):
    tidy = pd.concat([
        pd.DataFrame({"boundary": stages["stage"], "variant": stages["variant"],
                      "mode": stages["mode"], "metric": "latency_us",
                      "value": stages["latency_us"], "role": "fused", "device": s.device.type}),
        pd.DataFrame({"boundary": stages["stage"], "variant": stages["variant"],
                      "mode": stages["mode"], "metric": "bytes", "value": stages["bytes"],
                      "device": s.device.type})])
    return plots.bandwidth_bars(tidy, s.copy_bw, title=f"MoE stages: achieved TB/s vs copy "
                                f"bandwidth, {s.cfg.describe()}, {fmt}, M={s.M}{s.note}")


def timelines(s: Setup, inputs: dict, fmt: str, traces=None):
    """One call with routing of every variant but torch.compile: printed spans and the Gantt
    plots (all variants; the fused launches alone). traces: a :class:`k3lab.traces.Traces`
    each variant's Perfetto trace is written to (its name as the label)."""
    frames = {}
    for v in s.boundary.available_variants(s.device):
        if v.name == "torch.compile":
            continue
        path = traces.path(v.name) if traces is not None else None
        t = profile.timeline(v.fn, boundaries.clone_inputs(inputs), trace_path=path)
        t["stream"] = v.name
        frames[v.name] = t
        print(f"{v.name:>10}: {len(t)} launches, span {t.end_us.max():.1f} us")
    both = plots.timeline_gantt(pd.concat(frames.values(), ignore_index=True), rows="stream",
                                title=f"moe block with routing, one call each, "
                                f"{s.cfg.describe()}, M={s.M}, {fmt}{s.note}")
    fused = plots.timeline_gantt(frames["fused"],
                                 title="fused: route-sort, front, stage 1, stage 2 + tail")
    return both, fused


def _lat(df: pd.DataFrame, variant: str, mode: str) -> float:
    return profile.value(df, variant, "latency_us", mode)


def _stage_lat(df: pd.DataFrame, stage: str, variant: str, mode: str) -> float:
    d = df[(df.stage == stage) & (df.variant == variant) & (df["mode"] == mode)]
    return float(d.latency_us.iloc[0]) if len(d) else float("nan")


def _frac(df: pd.DataFrame, tp: int, fmt: str, stage: str, mode: str,
          variant: str = "fused") -> float | None:
    d = df[(df.tp == tp) & (df.format == fmt) & (df.stage == stage) & (df.variant == variant)
           & (df["mode"] == mode)]
    return round(float(d.expert_frac_of_copy.iloc[0]), 4) if len(d) else None


def _count(v: float) -> int | None:
    return None if v != v else int(v)


def _is_bar(s: Setup) -> bool:
    return s.on_gpu and s.cfg.name == "kimi-k3"


def bar(s: Setup, records: pd.DataFrame, stages: pd.DataFrame, kernels: dict,
        sweep_tf: pd.DataFrame | None = None) -> pd.DataFrame:
    """The block's bar (informational off the H200 K3 preset): at most 5 launches with routing,
    at tp 8 the block 3x the reference and every stage faster than grouped; with ``sweep_tf``
    the tp 1 stages 1 and 2 at 0.70 of the copy bandwidth on the expert bytes."""
    mode, rec_route = s.mode, records[records.scope == "with routing"]
    at_tp8 = _is_bar(s) and s.cfg.tp == 8
    n = int(profile.value(rec_route, "fused", "launches"))
    speed = _lat(rec_route, "reference", mode) / _lat(rec_route, "fused", mode)
    rows = [
        {"check": "route-sort + down + stage 1 + stage 2 + tail launches <= 5", "measured": n,
         "target": 5, "ok": n <= 5 if s.on_gpu else None, "note": f"{kernels['fused']}"},
        {"check": f"whole block speedup vs reference ({mode}, tp {s.cfg.tp})",
         "measured": speed, "target": 3.0, "ok": speed >= 3.0 if at_tp8 else None}]
    fused_us = _lat(rec_route, "fused", mode)
    dense_us = _lat(rec_route, "fused+dense", mode)
    rows.append({"check": f"fused+dense block with routing >= 1.3x faster than fused ({mode}, "
                 f"tp {s.cfg.tp})", "measured": fused_us / dense_us, "target": 1.3,
                 "ok": fused_us / dense_us >= 1.3 if at_tp8 else None,
                 "note": f"fused {fused_us:.1f} us, fused+dense {dense_us:.1f} us"})
    for v in bmoe.PERSISTENT_VARIANTS:
        n_v, us = profile.value(rec_route, v, "launches"), _lat(rec_route, v, mode)
        if not math.isnan(n_v):  # the variant ran
            rows.append({"check": f"{v}: <= 2 launches and <= 55 us with routing ({mode}, "
                         f"tp {s.cfg.tp})", "measured": us, "target": 55.0,
                         "ok": (n_v <= 2 and us <= 55.0) if at_tp8 else None,
                         "note": f"{int(n_v)} launches"})
    for st in bmoe.STAGES:
        f, g = _stage_lat(stages, st, "fused", mode), _stage_lat(stages, st, "grouped", mode)
        rows.append({"check": f"{st}: fused faster than grouped ({mode}, tp {s.cfg.tp})",
                     "measured": g / f, "target": 1.0, "ok": g / f > 1.0 if at_tp8 else None,
                     "note": f"fused {f:.1f} us, grouped {g:.1f} us"})
    if sweep_tf is not None:
        for fmt in ("bf16", "mxfp4"):
            for st in ("stage1", "stage2"):
                f = _frac(sweep_tf, 1, fmt, st, mode)
                rows.append({"check": f"tp 1 {fmt} {st}: expert bytes / latency >= 0.70 of "
                             f"copy bw ({mode})", "measured": f, "target": 0.70,
                             "ok": (f or 0.0) >= 0.70 if _is_bar(s) else None})
    return pd.DataFrame(rows)


def _free(s: Setup) -> None:
    gc.collect()
    if s.on_gpu:
        torch.cuda.empty_cache()


def _time_block(s: Setup, copies: list[dict], label: str,
                variants=("reference", "grouped", "fused")) -> pd.DataFrame:
    rows, c0 = [], copies[0]
    for name in variants:
        fn = s.boundary.variant(name).fn
        s.boundary.check(fn(c0), None, c0)  # no timing on red
        for mode in s.modes:
            t = profile.time_variant(fn, copies, mode=mode, repeats=s.repeats)
            rows.append(_base(s, c0, label, "block", name, mode, t, s.boundary.bytes_moved(c0),
                              len(copies)))
    return _with_bandwidth(s, pd.DataFrame(rows))


def tp_sweep(s: Setup, tps, formats, block_m: int) -> pd.DataFrame:
    """Stages 1 and 2 (grouped, fused, fused without PDL) and the whole block given the plan
    (reference, grouped, fused) per tp and format at M = 1; each point frees its tensors before
    the next is built (K3 tp 1 bf16 experts are 59 GB)."""
    _free(s)
    out = []
    for tp in tps:
        for fmt in formats:
            if not valid_tp(s.cfg.name, tp, fmt):
                continue
            copies = stage_copies(s, config.preset(s.cfg.name, tp), fmt, 1, block_m)
            out.append(time_stages(s, copies, "tp x format", stages=("stage1", "stage2"),
                                   variants=("grouped", "fused", "fused (no PDL)")))
            out.append(_time_block(s, copies, "tp x format"))
            del copies
            _free(s)
    return pd.concat(out, ignore_index=True)


def tp_plot(s: Setup, sweep_tf: pd.DataFrame):
    """Stages 1 and 2: expert bytes / latency per tp and format against the copy bandwidth."""
    st = sweep_tf[(sweep_tf.stage != "block") & (sweep_tf["mode"] == s.mode)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6), sharey=True)
    for ax, stage in zip(axes, ("stage1", "stage2"), strict=True):
        d = st[st.stage == stage]
        labels = [f"tp{r.tp}\n{r.format}" for r in d.drop_duplicates(["tp", "format"]).itertuples()]
        xs = range(len(labels))
        step = 0.8 / max(1, d.variant.nunique())
        for k, (name, g) in enumerate(d.groupby("variant", sort=False)):
            ax.bar([x + step * k for x in xs], g.expert_tbps, width=0.95 * step, label=name)
        ax.axhline(s.copy_bw / 1e12, color="tab:red", ls="--", lw=1, label="copy bandwidth")
        ax.axhline(0.7 * s.copy_bw / 1e12, color="tab:red", ls=":", lw=1,
                   label="70% (bar, tp 1)")
        ax.set_xticks([x + 0.4 - step / 2 for x in xs], labels)
        ax.set(title=stage, ylabel=f"expert bytes / latency (TB/s, {s.mode})")
    axes[0].legend(fontsize=7)
    fig.suptitle(f"{s.cfg.name}: stages vs tp and format, M=1{s.note}")
    fig.tight_layout()
    plt.close(fig)
    return fig


def tp_fractions(s: Setup, sweep_tf: pd.DataFrame) -> pd.DataFrame:
    st = sweep_tf[(sweep_tf.stage != "block") & (sweep_tf["mode"] == s.mode)]
    return (st.pivot_table(index=["tp", "format", "stage"], columns="variant",
                           values="expert_frac_of_copy", aggfunc="first")
            .rename(columns=lambda c: f"{c}: expert bytes / latency / copy bw"))


def _token_launches(s: Setup, m: int, fmt: str, block_m: int) -> None:
    """The fused launches :func:`token_sweep` times at M = ``m`` (for ``Setup.compile_ahead``)."""
    inputs = s.boundary.make_inputs(s.cfg, s.device, s.seed, M=m, expert_format=fmt,
                                    block_m=block_m)
    s.boundary.variant("fused").fn(inputs)
    st = bmoe.stage_inputs(inputs)
    for stage in ("stage1", "stage2"):
        bmoe.stage_fns(stage)["fused"](st)


def token_sweep(s: Setup, tokens, fmt: str, block_m: int) -> pd.DataFrame:
    """The whole block given the plan and stages 1 and 2 at the study's tp and ``fmt``, per M:
    the fused kernels and the grouped peer (the reference's loop over tokens and experts is
    timed at M = 1 only, by :func:`variants` and :func:`tp_sweep`)."""
    s.compile_ahead([functools.partial(_token_launches, s, m, fmt, block_m) for m in tokens])
    out = []
    for m in tokens:
        copies = stage_copies(s, s.cfg, fmt, m, block_m)
        out.append(time_stages(s, copies, "M", stages=("stage1", "stage2"),
                               variants=("grouped", "fused")))
        out.append(_time_block(s, copies, "M", variants=("grouped", "fused")))
        del copies
        _free(s)
    return pd.concat(out, ignore_index=True)


def token_plot(s: Setup, sweep_m: pd.DataFrame, fmt: str):
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for (stage, name), g in sweep_m[sweep_m["mode"] == s.mode].groupby(["stage", "variant"]):
        ax.plot(g.M, g.latency_us, "o-" if stage == "block" else "s--", label=f"{stage} {name}")
    ax.set(xscale="log", yscale="log", xlabel="M (tokens)", ylabel=f"latency (us, {s.mode})",
           title=f"MoE vs tokens, {s.cfg.describe()}, {fmt}{s.note}")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    plt.close(fig)
    return fig


def headline(s: Setup, records: pd.DataFrame, stages: pd.DataFrame, sweep_tf: pd.DataFrame,
             correct: pd.DataFrame, bar_table: pd.DataFrame, tps, formats) -> dict:
    mode = s.mode
    plan_r = records[records.scope == "given the plan"]
    route_r = records[records.scope == "with routing"]
    h = {
        "fused launches with routing": int(profile.value(route_r, "fused", "launches")),
        "fused launches given the plan": int(profile.value(plan_r, "fused", "launches")),
        "reference launches with routing": int(profile.value(route_r, "reference", "launches")),
        **{f"{v} block us with routing ({mode})": round(_lat(route_r, v, mode), 2)
           for v in ("fused", "fused+dense", *bmoe.PERSISTENT_VARIANTS, "reference", "grouped")},
        **{f"{v} launches with routing": _count(profile.value(route_r, v, "launches"))
           for v in ("fused+dense", *bmoe.PERSISTENT_VARIANTS)},
        f"fused / fused+dense with routing ({mode})": round(
            _lat(route_r, "fused", mode) / _lat(route_r, "fused+dense", mode), 3),
        f"speedup vs reference with routing ({mode})": round(
            _lat(route_r, "reference", mode) / _lat(route_r, "fused", mode), 2),
        **{f"{st} fused us ({mode})": round(_stage_lat(stages, st, "fused", mode), 2)
           for st in bmoe.STAGES},
        **{f"{st} grouped / fused ({mode})": round(_stage_lat(stages, st, "grouped", mode)
                                                    / _stage_lat(stages, st, "fused", mode), 2)
           for st in bmoe.STAGES},
        "copy bandwidth TB/s": round(s.copy_bw / 1e12, 3),
        "all variants match the fp32 reference": bool(
            (records[records.metric == "check"].value == 1).all()),
        "max block error vs fp32 reference": float(correct["block err"].max()),
    }
    for tp in tps:
        for fmt in formats:
            for variant, what in (("fused", ""), ("fused (no PDL)", " without PDL")):
                for st in ("stage1", "stage2"):
                    f = _frac(sweep_tf, tp, fmt, st, mode, variant)
                    if f is not None:
                        h[f"tp{tp} {fmt} {st}{what} expert bytes / copy bw"] = f
    if s.on_gpu:
        h["torch.compile block us with routing"] = round(_lat(route_r, "torch.compile", mode), 2)
        h["bar met"] = bool(bar_table.ok.dropna().all()) if _is_bar(s) else None
    return h


def tidy_records(records: pd.DataFrame, *sweeps: pd.DataFrame) -> pd.DataFrame:
    """The variant records plus every sweep row as a tidy latency record (``moe/<stage>``)."""
    rows = [{**r, "boundary": f"moe/{r['stage']}", "metric": "latency_us",
             "value": r["latency_us"], "unit": "us"}
            for df in sweeps for r in df.to_dict(orient="records")]
    return pd.concat([records, pd.DataFrame(rows)], ignore_index=True)


def persistent_items(s: Setup, inputs: dict, config=None, routed: bool = False
                     ) -> pd.DataFrame:
    """Each work item of one persistent call given the plan (``routed``: routing itself, so
    with ``config.route_items`` the route's programs are items too) after an untraced call
    that compiles, under ``config`` (None: what the W4A16 ``persistent`` variant runs): phase,
    ticket, start and end in us from the first item's start on the GPU's global clock, SM and
    program. Empty on the CPU (the trace needs the compiled kernel)."""
    from k3lab.kernels.moe.persistent import moe_persistent

    if not s.on_gpu:
        return pd.DataFrame()
    config = bmoe.persistent_config("bf16", config)
    w = bmoe._persistent_weights(inputs["weights"], config)

    def call(trace):
        return moe_persistent(inputs["x"], w, cfg=inputs["cfg"],
                              plan=None if routed else inputs["plan"],
                              block_m=inputs["block_m"], config=config, trace=trace)

    call(False)
    _, tr = call(True)
    items = tr.items.cpu().numpy()
    df = pd.DataFrame(items, columns=["start", "end", "sm", "program"])
    df["ticket"] = range(len(df))
    first = sorted(tr.phases.items(), key=lambda kv: kv[1])
    df["phase"] = ""
    for name, start in first:
        df.loc[df["ticket"] >= start, "phase"] = name
    t0 = df["start"].min()
    df["start_us"], df["end_us"] = (df["start"] - t0) / 1e3, (df["end"] - t0) / 1e3
    df["dur_us"] = df["end_us"] - df["start_us"]
    return df.drop(columns=["start", "end"])


def persistent_phases(items: pd.DataFrame) -> pd.DataFrame:
    """Per phase of a :func:`persistent_items` trace: items, first start, last end, and the
    median and longest item (an item's time includes its waits for earlier phases)."""
    if items.empty:
        return pd.DataFrame()
    g = items.groupby("phase", sort=False)
    return pd.DataFrame({"items": g.size(), "first start us": g["start_us"].min(),
                         "last end us": g["end_us"].max(), "median item us": g["dur_us"].median(),
                         "longest item us": g["dur_us"].max(),
                         "programs": g["program"].nunique()}).round(2)
