"""The dense notebook's studies (30_dense): every projection shape of a preset at several tp
degrees, checked, counted and timed against the engine's cuBLAS call and torch.compile, with the
bytes-only skeleton of each weight beside it.

Import after :func:`k3lab.studies.setup` (it imports ``k3lab.kernels``).
"""

from __future__ import annotations

import math

import pandas as pd

from k3lab import config, floors, plots, profile
from k3lab.boundaries import dense as dense_boundary
from k3lab.studies import Setup

__all__ = ["BIG_WEIGHT_MB", "CPU_SHAPES", "FP8_SHAPE", "default_shapes", "shape_table", "sweep",
           "summary", "fraction_plot", "headline", "fp8_tail"]

BIG_WEIGHT_MB = 20.0  # weights at least this large are expected near the copy bandwidth
# On the CPU one shape of each launch kind (merged outputs, norm prologue, activation, residual,
# fp32 out, plain): the interpreter's figures are no GPU figures, every code path is.
CPU_SHAPES = ("kda.in_proj", "mla.q_b_proj", "moe.shared_gate_up", "kda.o_proj", "moe.router",
              "lm_head")
FP8_SHAPE = "moe.latent_up"  # the seed's FP8 latent tail (#18): this projection in e4m3


def default_shapes(s: Setup) -> list[str] | None:
    """Every projection on a GPU (None), :data:`CPU_SHAPES` on the CPU."""
    return None if s.on_gpu else list(CPU_SHAPES)


def shape_table(s: Setup, tps) -> pd.DataFrame:
    """Name, rows, K, weight MB and what each projection is, per tp."""
    rows = []
    for tp in tps:
        cfg = config.preset(s.cfg.name, tp)
        for name, sh in dense_boundary.shapes(cfg).items():
            rows.append(dict(tp=tp, shape=name, rows=sh["rows"], K=sh["K"],
                             weight_MB=round(sh["rows"] * sh["K"] * 2 / 1e6, 2), what=sh["what"]))
    return pd.DataFrame(rows)


def sweep(s: Setup, tps, shapes=None, variants=None, skeleton: bool = True) -> pd.DataFrame:
    """``profile.measure`` of every (tp, shape) at the setup's M, plus, on a GPU, the graph
    latency of the bytes-only skeleton of the same bytes (``floors.stream_floor_us``), and for
    weights of at least BIG_WEIGHT_MB the skeleton that, as a projection on its input, waits
    for the previous launch before its loads (``after``: programmatic dependent launch). A
    skeleton is timed once per byte count: shapes that tp leaves whole share theirs."""
    out, floors_us = [], {}

    def floor_us(nbytes: int, after: bool) -> float:
        if (nbytes, after) not in floors_us:
            floors_us[nbytes, after] = floors.stream_floor_us(nbytes, s.device, after=after)
        return floors_us[nbytes, after]

    table = shape_table(s, tps)
    if shapes:
        table = table[table["shape"].isin(shapes)]
    s.compile_ahead(s.fused_calls([(config.preset(s.cfg.name, int(r["tp"])),
                                    {"M": s.M, "shape": r["shape"]})
                                   for _, r in table.iterrows()]))
    for _, r in table.iterrows():
        cfg = config.preset(s.cfg.name, int(r["tp"]))
        rec = profile.measure(s.boundary, cfg, s.device, variants=variants, seed=s.seed,
                              params={"M": s.M, "shape": r["shape"]}, repeats=s.repeats,
                              modes=s.modes)
        rec["shape"], rec["weight_MB"] = r["shape"], r["weight_MB"]
        out.append(rec)
        if skeleton and s.on_gpu:
            nbytes = int(profile.value(rec, "fused", "bytes"))
            rows = [("skeleton", floor_us(nbytes, False), "bytes-only stream")]
            if r["weight_MB"] >= BIG_WEIGHT_MB:
                rows.append(("dependent skeleton", floor_us(nbytes, True),
                             "bytes-only stream after a PDL wait for the previous launch"))
            out.append(pd.DataFrame([{**s.base, "tp": cfg.tp, "variant": v, "role": "floor",
                                      "mode": "graph", "metric": "latency_us", "value": t,
                                      "unit": "us", "note": note, "shape": r["shape"],
                                      "weight_MB": r["weight_MB"]} for v, t, note in rows]))
    return pd.concat(out, ignore_index=True)


def summary(s: Setup, records: pd.DataFrame) -> pd.DataFrame:
    """One row per (tp, shape): launches, latency of each variant in the headline mode, the
    fused kernel's fraction of the copy bandwidth and its speedup over cuBLAS and the best peer."""
    mode = s.mode
    rows = []
    for (tp, shape), d in records.groupby(["tp", "shape"], sort=False):
        def at(v, metric, m=mode, d=d):
            return profile.value(d, v, metric, m)
        row = {"tp": tp, "shape": shape, "weight MB": d["weight_MB"].iloc[0],
               "launches cuBLAS": at("reference", "launches", ""),
               "launches fused": at("fused", "launches", ""),
               f"cuBLAS us ({mode})": at("reference", "latency_us"),
               f"fused us ({mode})": at("fused", "latency_us")}
        peers = [v for v in d.loc[d.role == "peer", "variant"].unique()]
        for p in peers:
            row[f"{p} us ({mode})"] = at(p, "latency_us")
        row["skeleton us (graph)"] = at("skeleton", "latency_us", "graph")
        row["dependent skeleton us (graph)"] = at("dependent skeleton", "latency_us", "graph")
        row["fused frac of copy bw"] = at("fused", "roofline_frac")
        row["speedup vs cuBLAS"] = at("fused", "speedup_vs_reference")
        best_peer = min((at(p, "latency_us") for p in peers), default=math.nan)
        row["speedup vs best peer"] = (best_peer / row[f"fused us ({mode})"]
                                       if not math.isnan(best_peer) else math.nan)
        rows.append(row)
    return pd.DataFrame(rows)


def fraction_plot(s: Setup, table: pd.DataFrame):
    """Fraction of the copy bandwidth against weight size, per tp: fused and cuBLAS."""
    fig, ax = plots.subplots(figsize=(7.5, 4.2))
    mode = s.mode
    for tp, d in table.groupby("tp"):
        frac_ref = (d["fused frac of copy bw"] * d[f"fused us ({mode})"]
                    / d[f"cuBLAS us ({mode})"])
        ax.scatter(d["weight MB"], d["fused frac of copy bw"], label=f"fused, tp {tp}")
        ax.scatter(d["weight MB"], frac_ref, marker="x", label=f"cuBLAS, tp {tp}")
    ax.set_xscale("log")
    ax.axvline(BIG_WEIGHT_MB, color="grey", lw=0.8, ls=":")
    ax.set_xlabel("weight MB")
    ax.set_ylabel(f"fraction of copy bandwidth ({mode})")
    return plots.finish(fig, f"dense projections, M = {s.M}{s.note}", legend=True)


def headline(s: Setup, table: pd.DataFrame, fp8: pd.DataFrame | None = None) -> dict:
    """The bars of the dense boundary: big weights' worst fraction, worst speedups; with
    ``fp8`` (:func:`fp8_tail`'s table) the e4m3 tail's speedup over bf16."""
    big = table[table["weight MB"] >= BIG_WEIGHT_MB]
    small = table[table["weight MB"] < BIG_WEIGHT_MB]
    mode = s.mode
    out = {
        f"min frac of copy bw, weights >= {BIG_WEIGHT_MB:g} MB ({mode})":
            round(float(big["fused frac of copy bw"].min()), 3) if len(big) else math.nan,
        f"min speedup vs cuBLAS ({mode})": round(float(table["speedup vs cuBLAS"].min()), 3),
        f"min speedup vs cuBLAS, weights < {BIG_WEIGHT_MB:g} MB ({mode})":
            round(float(small["speedup vs cuBLAS"].min()), 3) if len(small) else math.nan,
        "shapes": len(table),
        "max fused launches": int(table["launches fused"].max()),
    }
    # the bar's shards: K3 at tp 8 and 16
    bar = table[table["tp"].isin((8, 16))]
    bar_big = bar[bar["weight MB"] >= BIG_WEIGHT_MB]
    if len(bar):
        bar_small = bar[bar["weight MB"] < BIG_WEIGHT_MB]
        out[f"tp 8, 16: min frac of copy bw, weights >= {BIG_WEIGHT_MB:g} MB ({mode})"] = (
            round(float(bar_big["fused frac of copy bw"].min()), 3) if len(bar_big) else math.nan)
        out[f"tp 8, 16: min speedup vs cuBLAS ({mode})"] = round(
            float(bar["speedup vs cuBLAS"].min()), 3)
        out[f"tp 8, 16: min speedup vs cuBLAS, weights < {BIG_WEIGHT_MB:g} MB ({mode})"] = (
            round(float(bar_small["speedup vs cuBLAS"].min()), 3) if len(bar_small)
            else math.nan)
    if len(bar_big) and bar_big["dependent skeleton us (graph)"].notna().any():
        # the dependent skeleton's own fraction: the fused kernel's scaled by the time ratio
        frac = (bar_big["fused frac of copy bw"] * bar_big[f"fused us ({mode})"]
                / bar_big["dependent skeleton us (graph)"])
        out[f"tp 8, 16: min dependent-skeleton frac of copy bw, weights >= "
            f"{BIG_WEIGHT_MB:g} MB (graph)"] = round(float(frac.min()), 3)
    for tp, d in table[table["shape"] == "kda.in_proj"].groupby("tp"):
        out[f"kda.in_proj us, tp {tp} ({mode})"] = round(float(d[f"fused us ({mode})"].iloc[0]), 2)
    if fp8 is not None and len(fp8):
        out[f"{FP8_SHAPE} e4m3 speedup vs bf16 ({mode})"] = round(
            float(fp8["fused speedup vs bf16"].iloc[-1]), 3)
    return out


def fp8_tail(s: Setup, variants=None) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The seed's FP8 latent tail (#18) against bf16, in one run: :data:`FP8_SHAPE` (the
    RMSNorm prologue, not sharded by tp) with its weight in bf16 and as e4m3 rows with fp32
    scales (the boundary's ``weight_format``), each measured as the shapes are, beside the
    bytes-only skeleton of its bytes. Returns (records, table: one row a format; empty where
    the preset has no latent)."""
    if FP8_SHAPE not in dense_boundary.shapes(s.cfg):
        return pd.DataFrame(), pd.DataFrame()
    mode, recs, rows = s.mode, [], []
    for fmt in dense_boundary.WEIGHT_FORMATS:
        params = {"M": s.M, "shape": FP8_SHAPE, "weight_format": fmt}
        rec = profile.measure(s.boundary, s.cfg, s.device, variants=variants, seed=s.seed,
                              params=params, repeats=s.repeats, modes=s.modes)
        skel = (floors.stream_floor_us(int(profile.value(rec, "fused", "bytes")), s.device)
                if s.on_gpu else math.nan)
        recs.append(rec)
        if s.on_gpu:
            recs.append(pd.DataFrame([{**s.base, "tp": s.cfg.tp, "variant": "skeleton",
                                       "role": "floor", "mode": "graph", "metric": "latency_us",
                                       "value": skel, "unit": "us", "note": "bytes-only stream",
                                       "shape": FP8_SHAPE, "weight_format": fmt}]))
        rows.append({"weight": fmt, "MB moved": profile.value(rec, "fused", "bytes") / 1e6,
                     "launches fused": profile.value(rec, "fused", "launches"),
                     f"engine us ({mode})": profile.value(rec, "reference", "latency_us", mode),
                     f"fused us ({mode})": profile.value(rec, "fused", "latency_us", mode),
                     "skeleton us (graph)": skel,
                     "fused frac of copy bw": profile.value(rec, "fused", "roofline_frac",
                                                            mode)})
    table = pd.DataFrame(rows)
    table["fused speedup vs bf16"] = table[f"fused us ({mode})"].iloc[0] / table[
        f"fused us ({mode})"]
    return pd.concat(recs, ignore_index=True), table
