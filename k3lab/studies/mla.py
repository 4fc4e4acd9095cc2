"""The MLA notebook's studies (50_mla): the kernel against the absorbed reference and the
absorbed form against the unabsorbed one, the context x split-count sweep, the split heuristic
against the best override and the 4 fixed splits of a serving engine, the bar against the
bytes-only skeletons, and one captured graph replayed at several lengths.

Every function takes the notebook's :class:`k3lab.studies.Setup` first. Importing this module
imports ``k3lab.kernels``: import it after :func:`k3lab.studies.setup`.
"""

from __future__ import annotations

import functools

import pandas as pd
import torch

from k3lab import floors, plots, profile
from k3lab.boundaries.mla import PEER_FIXED_SPLITS
from k3lab.kernels import mla_decode
from k3lab.kernels.mla import default_num_splits
from k3lab.reference.mla import mla_decode_reference, mla_decode_unabsorbed, split_kv_b
from k3lab.studies import Setup
from k3lab.weights import make_generator, mla_weights, randn

__all__ = ["BAR_FRACTION", "BAR_CONTEXT", "SKELETON_CONFIGS", "heuristic", "kernel_vs_reference",
           "correctness", "absorbed_vs_unabsorbed", "fixed_splits", "kv_bytes", "split_sweep",
           "split_choice", "skeletons", "split_choice_plot", "graph_replay"]

BAR_FRACTION = 0.75  # the bar: this fraction of the copy bandwidth on the KV bytes ...
BAR_CONTEXT = 32768  # ... from this context on
# the fastest skeleton configurations for these sizes in the floors' sweep of all of them
# (16 and 32 KB chunks, 8 warps)
SKELETON_CONFIGS = dict(chunks_kb=(16, 32), warps=(8,))
GRAPH_REPLAYS = 20


def heuristic(s: Setup, context: int) -> int:
    """The split count the kernel picks for M tokens of ``context`` on this device."""
    return default_num_splits(s.M, s.cfg.mla_heads, context, s.device)


def kernel_vs_reference(s: Setup, m: int, ctx: int, num_splits: int | None) -> dict:
    """The kernel's o_lat and log-sum-exp against the fp32 reference (raises on a mismatch of
    o_lat; tokens of different lengths up to ``ctx``)."""
    b = s.boundary
    inputs = b.make_inputs(s.cfg, s.device, s.seed, M=m, context=ctx)
    args = (inputs["q_lat"], inputs["q_rope"], inputs["kv_cache"], inputs["seq_lens"])
    o, lse = mla_decode(*args, sm_scale=inputs["sm_scale"], num_splits=num_splits,
                        return_lse=True)
    ro, rlse = mla_decode_reference(*args, sm_scale=inputs["sm_scale"], return_lse=True)
    err = b.check(o, ro, inputs)["o_lat"]
    return {"M": m, "lengths": inputs["seq_lens"].tolist(), "num_splits": num_splits or "auto",
            "o_lat max err": err, "lse max err": float((lse - rlse).abs().max())}


def correctness(s: Setup, context: int) -> pd.DataFrame:
    """:func:`kernel_vs_reference` at length 1, an odd length over 3 splits, the context with
    the heuristic's and with 4 splits, 3 tokens over 64 splits, and the comparison's M."""
    cases = [(1, 1, None), (1, 37, 3), (1, context, None), (1, context, 4),
             (3, min(context, 300), 64), (s.M, context, None)]
    return pd.DataFrame([kernel_vs_reference(s, *c) for c in cases])


def absorbed_vs_unabsorbed(s: Setup, ctx: int, m: int = 2) -> dict:
    """The reference and the kernel (bf16 q_lat), each taken back through W_uv, against the
    unabsorbed attention (per-head keys and values through SDPA)."""
    cfg = s.cfg
    gen = make_generator(s.seed + 1, s.device)
    w_uk, w_uv = split_kv_b(mla_weights(cfg, gen)["kv_b"].float(), cfg.mla_heads, cfg.qk_nope,
                            cfg.v_head)
    inputs = s.boundary.make_inputs(cfg, s.device, s.seed, M=m, context=ctx)
    q_nope = randn((m, cfg.mla_heads, cfg.qk_nope), gen, dtype=torch.float32)
    q_lat = torch.einsum("mhn,hnc->mhc", q_nope, w_uk)
    args = (inputs["q_rope"], inputs["kv_cache"], inputs["seq_lens"])
    scale = inputs["sm_scale"]
    expect = mla_decode_unabsorbed(q_nope, *args, w_uk, w_uv, sm_scale=scale)
    ref = torch.einsum("mhc,hvc->mhv", mla_decode_reference(q_lat, *args, sm_scale=scale), w_uv)
    fused = torch.einsum("mhc,hvc->mhv", mla_decode(q_lat.to(torch.bfloat16), *args,
                                                    sm_scale=scale).float(), w_uv)
    return {"context": ctx, "reference vs SDPA": float((ref - expect).abs().max()),
            "kernel (bf16 q_lat) vs SDPA": float((fused - expect).abs().max())}


def fixed_splits(num_splits: int):
    """A variant function: the kernel at a fixed split count."""
    def run(inputs):
        return mla_decode(inputs["q_lat"], inputs["q_rope"], inputs["kv_cache"],
                          inputs["seq_lens"], sm_scale=inputs["sm_scale"], num_splits=num_splits)
    return run


def kv_bytes(inputs: dict) -> int:
    """The KV-cache rows the tokens' lengths cover."""
    kv = inputs["kv_cache"]
    return int(inputs["seq_lens"].sum()) * kv.shape[-1] * kv.element_size()


def split_sweep(s: Setup, contexts: list[int], splits: list[int]) -> pd.DataFrame:
    """The kernel at every context x split count (plus the heuristic's pick and 4), M tokens
    of the full context, cold copies, every point checked before it is timed (raises on a
    mismatch). Wide rows: latency_us, p10_us, p90_us, kv_bytes, kv_TBps, copy_frac, heuristic
    (the heuristic's pick at that context)."""
    b = s.boundary

    def compile_point(ctx):
        inputs = b.make_inputs(s.cfg, s.device, s.seed, M=s.M, context=ctx)
        for ns in dict.fromkeys([*splits, heuristic(s, ctx), PEER_FIXED_SPLITS]):
            fixed_splits(ns)(inputs)

    s.compile_ahead([functools.partial(compile_point, ctx) for ctx in contexts])
    rows = []
    for ctx in contexts:
        copies = s.copies(M=s.M, context=ctx)
        ref = b.reference.fn(copies[0])
        pick = heuristic(s, ctx)
        for ns in dict.fromkeys([*splits, pick, PEER_FIXED_SPLITS]):
            b.check(fixed_splits(ns)(copies[0]), ref, copies[0])  # no timing on red
            t = profile.time_variant(fixed_splits(ns), copies, mode=s.mode, repeats=s.repeats)
            rows.append({**s.base, "variant": f"fused-s{ns}", "role": "fused", "mode": s.mode,
                         "context": ctx, "num_splits": ns, "heuristic": pick,
                         "latency_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us,
                         "copies": t.copies, "kv_bytes": kv_bytes(copies[0])})
        del copies
    d = pd.DataFrame(rows)
    d["kv_TBps"] = d.kv_bytes / (d.latency_us * 1e-6) / 1e12
    d["copy_frac"] = d.kv_bytes / (d.latency_us * 1e-6) / s.copy_bw
    return d


def split_choice(sweep: pd.DataFrame) -> pd.DataFrame:
    """Per context: the heuristic's split count and latency, the best split count of the sweep,
    the 4 fixed splits, and the ratios between them."""
    rows = []
    for ctx, d in sweep.groupby("context"):
        by = d.set_index("num_splits")
        lat = by.latency_us
        best, h, four = int(lat.idxmin()), int(d.heuristic.iloc[0]), PEER_FIXED_SPLITS
        rows.append({"context": ctx, "heuristic splits": h, "heuristic us": lat[h],
                     "best splits": best, "best us": lat[best], "4 splits us": lat[four],
                     "heuristic / best": lat[h] / lat[best],
                     "best speedup vs 4 splits": lat[four] / lat[best],
                     "heuristic speedup vs 4 splits": lat[four] / lat[h],
                     "heuristic KV TB/s": by.kv_TBps[h], "heuristic copy frac": by.copy_frac[h]})
    return pd.DataFrame(rows).set_index("context")


def skeletons(s: Setup, choice: pd.DataFrame, sweep: pd.DataFrame) -> pd.DataFrame:
    """From BAR_CONTEXT on, on a GPU: the bar's time (the KV bytes at BAR_FRACTION of the copy
    bandwidth) beside the skeletons that only read those bytes, alone and followed by a
    PDL-launched combine, and the room under the bar. Empty on the CPU or without such
    contexts."""
    rows = []
    for ctx in [c for c in choice.index if c >= BAR_CONTEXT and s.on_gpu]:
        kvb = int(sweep[sweep.context == ctx].kv_bytes.iloc[0])
        rows.append({
            "context": ctx, "KV MB": kvb / 1e6,
            "bar us (0.75 of copy bw)": kvb / s.copy_bw * 1e6 / BAR_FRACTION,
            "skeleton us: KV read": floors.stream_floor_us(kvb, s.device, "none",
                                                           **SKELETON_CONFIGS),
            "skeleton us: KV read + PDL combine": floors.stream_floor_us(kvb, s.device, "pdl",
                                                                         **SKELETON_CONFIGS),
            "heuristic us": choice.loc[ctx, "heuristic us"],
            "best us": choice.loc[ctx, "best us"]})
    if not rows:
        return pd.DataFrame()
    d = pd.DataFrame(rows).set_index("context")
    d["room under the bar us"] = (d["bar us (0.75 of copy bw)"]
                                  - d["skeleton us: KV read + PDL combine"])
    return d


def split_choice_plot(s: Setup, choice: pd.DataFrame, sweep: pd.DataFrame):
    """Latency of the heuristic, the best override and 4 fixed splits per context, and the
    bandwidth each reaches on the KV bytes against the copy bandwidth."""
    fig, (ax1, ax2) = plots.subplots(1, 2, figsize=(11, 3.8))
    for label, col, style in (("heuristic", "heuristic us", "o-"),
                              ("best override", "best us", "s--"),
                              ("4 fixed splits", "4 splits us", "^:")):
        ax1.plot(choice.index, choice[col], style, label=label)
    ax1.set(xscale="log", yscale="log", xlabel="context", ylabel=f"latency (us, {s.mode})",
            title="split choice")
    ax1.legend()
    for label, d in (("heuristic", sweep[sweep.num_splits == sweep.heuristic]),
                     ("4 fixed splits", sweep[sweep.num_splits == PEER_FIXED_SPLITS])):
        ax2.plot(d.context, d.kv_TBps, "o-", label=label)
    best = sweep.loc[sweep.groupby("context").latency_us.idxmin()]
    ax2.plot(best.context, best.kv_TBps, "s--", label="best override")
    ax2.axhline(s.copy_bw / 1e12, color="tab:red", ls="--",
                label=f"copy {s.copy_bw / 1e12:.3g} TB/s")
    ax2.set(xscale="log", xlabel="context", ylabel="KV-cache TB/s", title="bandwidth on KV bytes")
    ax2.legend()
    return plots.finish(fig, f"{s.cfg.describe()}, M={s.M}{s.note}")


def graph_replay(s: Setup, l_max: int, num_splits: int = 0, lengths=()) -> pd.DataFrame:
    """One CUDA graph captured at ``l_max`` with a fixed split count (0: the heuristic's at
    l_max), replayed after writing each length into ``seq_lens`` in place; every replay checked
    against the reference and timed warm (GRAPH_REPLAYS replays). CUDA only."""
    if not s.on_gpu:
        raise ValueError("device: CUDA graphs need a GPU")
    b = s.boundary
    ns = num_splits or heuristic(s, l_max)
    lengths = [n for n in (lengths or [1, 33, 1000, 4097, l_max // 3, l_max - 1, l_max])
               if 1 <= n <= l_max]
    inputs = b.make_inputs(s.cfg, s.device, s.seed, M=s.M, context=l_max)
    sl = inputs["seq_lens"]
    step = lambda: fixed_splits(ns)(inputs)  # noqa: E731
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    rows = []
    for n in lengths:
        sl.fill_(n)
        graph.replay()
        ref = b.reference.fn(inputs)
        try:
            err, ok, why = b.check(out, ref, inputs)["o_lat"], True, ""
        except AssertionError as exc:
            err, ok, why = float("nan"), False, str(exc)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()
        start.record()
        for _ in range(GRAPH_REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        rows.append({"length": n, "num_splits": ns, "correct": ok, "max abs err": err,
                     "replay us (warm)": start.elapsed_time(end) * 1e3 / GRAPH_REPLAYS,
                     "error": why})
    return pd.DataFrame(rows)
