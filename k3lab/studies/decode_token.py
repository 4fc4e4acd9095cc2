"""The whole decode token under a stack: timed as one CUDA graph, split by layer and category,
extrapolated to the model's layers; its bytes floor and the modeled all-reduces.

How a figure is taken (GPU): the token of ``make_token`` (embedding, layer 0, a window of the
layers after it with distinct weights, the final read and the LM head) is captured as one CUDA
graph and replayed (``profile.time_variant``): the graph time. One replay is profiled: the
kernel durations and starts. A second graph of the same token with a marker kernel before each
group of launches (``run_token``'s tags) gives, in launch order, the part of the token (segment:
embed, layer i, head) and the category each launch belongs to; the markers only label, the
unmarked replay's launches carry the figures (the two launch sequences are the same otherwise).
A segment's time is from its first launch's start to the next segment's, so the gaps between
kernels are inside it, scaled so that the segments add up to the graph time. Where kernels
overlap (programmatic dependent launch), the overlapped time counts once, for the kernel that
started first (:func:`busy_us`).

Extrapolation: the once-a-token parts (embedding, layer 0, head) as measured, plus each
remaining layer of the model at the mean of the window's layers of its kind (KDA or MLA):
``token = embed + layer 0 + head + n_kda * mean(KDA layers) + n_mla * mean(MLA layers)``, per
category likewise. On the CPU one marked run under the interpreter stands in (wall clock,
logical launches): CPU figures only show that the pipeline runs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import pandas as pd
import torch

from k3lab import profile, stack, traces
from k3lab.config import Preset

__all__ = ["MARKER", "TokenFigures", "measure_token", "labelled_timeline", "extrapolate",
           "model_layers", "allreduces", "GAPS"]

MARKER = "lgamma"  # no op of the model calls lgamma: its launches are the markers
GAPS = "launch gaps"


@dataclass
class TokenFigures:
    """One stack's token: the labelled timeline, the graph time of the window token, the
    extrapolated per-token figures and notes on how they were taken."""

    label: str
    timeline: pd.DataFrame
    window_us: float
    token_us: float
    launches: float
    categories: dict = field(default_factory=dict)
    segments: pd.DataFrame | None = None
    notes: list = field(default_factory=list)

    @property
    def tok_per_s(self) -> float:
        return 1e6 / self.token_us if self.token_us > 0 else math.nan


def model_layers(cfg: Preset) -> dict[str, int]:
    """Layers after layer 0 per kind (layer 0, with its dense MLP, is measured as it is)."""
    mla = set(cfg.mla_layers)
    rest = range(cfg.first_dense or 1, cfg.n_layers)
    return {"kda": sum(layer not in mla for layer in rest), "mla": sum(layer in mla
                                                                       for layer in rest)}


def allreduces(cfg: Preset) -> int:
    """All-reduces a tp rank makes a token: attention output and FFN output, every layer."""
    return 2 * cfg.n_layers if cfg.tp > 1 else 0


def _marked(run, device):
    """(fn calling run with a marker launch before each tag, the tags in order)."""
    marker = torch.zeros(1, device=device)
    tags: list[str] = []

    def tag(name: str) -> None:
        tags.append(name)
        marker.lgamma_()

    return (lambda tk: run(tk, tag)), tags


def _labels(tl: pd.DataFrame, tags: list[str]) -> pd.DataFrame:
    """The non-marker launches of a marked timeline with their segment and category."""
    is_mark = tl["kernel"].str.contains(MARKER)
    if int(is_mark.sum()) < len(tags):
        raise RuntimeError(f"markers: {int(is_mark.sum())} seen, {len(tags)} expected")
    # one call's tags: the last len(tags) markers belong to the profiled call
    marks = list(tl.index[is_mark])[-len(tags):]
    out, seg, cat, i = [], "embed", stack.CATEGORIES[0], 0
    for idx, row in tl.loc[marks[0]:].iterrows():
        if i < len(marks) and idx == marks[i]:
            name = tags[i]
            i += 1
            if name.startswith("segment "):
                seg = name.removeprefix("segment ")
            else:
                cat = name
            continue
        out.append({**row.to_dict(), "segment": seg, "category": cat})
    return pd.DataFrame(out)


def labelled_timeline(st: stack.Stack, token: dict, device, *, num_splits: int = 4,
                      configs=None, repeats: int | None = None, trace_path: str | None = None
                      ) -> tuple[pd.DataFrame, float, list[str]]:
    """(timeline with segment and category per launch, the window token's time in us, notes).

    CUDA: graph time from ``profile.time_variant``; launches from a profiled replay of the
    unmarked graph (its Perfetto trace written to ``trace_path``), labelled by the marked graph.
    CPU: one marked interpreted run (the labelled launches written to ``trace_path`` as a trace
    of the interpreter's wall clock)."""
    dev = torch.device(device)

    def run(tk, tag=None):
        return stack.run_token(st, tk, num_splits=num_splits, configs=configs, tag=tag)

    marked, tags = _marked(run, dev)
    notes: list[str] = []
    if dev.type != "cuda":
        # the interpreter compiles nothing: one logged call, no warm-up
        tl = profile.timeline(marked, token, warmup=False)
        lab = _labels(tl, tags)
        if trace_path:
            traces.write_cpu(lab, trace_path)
        span = float(lab["end_us"].max() - lab["start_us"].min())
        return lab, span, ["CPU: wall clock under the Triton interpreter, logical launches"]
    t = profile.time_variant(run, [token], mode="graph", repeats=repeats, cold=False,
                             min_calls=1)
    graph = _graph(run, token)
    tl = profile.timeline(lambda _tk, g=graph: g.replay(), token, trace_path=trace_path)
    del graph
    tags.clear()
    mgraph = _graph(marked, token)
    tags[:] = tags[len(tags) // 2:]  # the capture's own tags (after the warm-up call's)
    mtl = profile.timeline(lambda _tk, g=mgraph: g.replay(), token)
    del mgraph
    try:
        lab = _labels(mtl, tags)
    except RuntimeError as exc:  # a profiler that names the marker otherwise: one segment
        notes.append(f"no labels ({exc}): the window extrapolated as a whole")
        return tl.assign(segment="window", category="unlabelled"), t.median_us, notes
    if len(lab) == len(tl):
        lab = tl.assign(segment=lab["segment"].to_numpy(), category=lab["category"].to_numpy())
    else:
        notes.append(f"the marked graph launched {len(lab)} kernels, the timed one {len(tl)}: "
                     f"figures split by the marked graph's launches")
    torch.cuda.empty_cache()
    return lab, t.median_us, notes


def _graph(fn, token):
    """A CUDA graph of one fn(token), after a warm-up call on a side stream."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn(token)
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn(token)
    return g


def busy_us(lab: pd.DataFrame) -> pd.Series:
    """Each launch's share of the time some kernel runs, in start order: its duration less the
    part already covered by kernels that started before it. Kernels overlap where a launch with
    programmatic dependent launch starts during its predecessor and waits inside it; that wait
    then counts once, for the kernel already running, so the shares add up to the union of the
    kernels' intervals and the launch gaps (span minus kernel time) are never negative."""
    covered = -math.inf
    out = []
    for a, b in zip(lab["start_us"], lab["end_us"], strict=True):
        out.append(max(0.0, float(b) - max(float(a), covered)))
        covered = max(covered, float(b))
    return pd.Series(out, index=lab.index)


def segments(lab: pd.DataFrame, window_us: float) -> pd.DataFrame:
    """Per segment (in launch order): span_us (its first start to the next segment's, scaled so
    the spans add up to ``window_us``), launches, kernel_us (the launches' :func:`busy_us`),
    and per category the same kernel us."""
    lab = lab.sort_values("start_us").reset_index(drop=True)
    lab = lab.assign(dur_us=busy_us(lab))
    order = list(dict.fromkeys(lab["segment"]))
    first = lab.groupby("segment")["start_us"].min()
    starts = [float(first[s]) for s in order]
    ends = starts[1:] + [float(lab["end_us"].max())]
    total = ends[-1] - starts[0]
    scale = window_us / total if total > 0 else 1.0
    per_cat = lab.pivot_table(index="segment", columns="category", values="dur_us",
                              aggfunc="sum", fill_value=0.0)
    rows = []
    for s, a, b in zip(order, starts, ends, strict=True):
        d = lab[lab["segment"] == s]
        row = {"segment": s, "span_us": (b - a) * scale, "launches": len(d),
               "kernel_us": float(d["dur_us"].sum())}
        row.update({c: float(per_cat.loc[s, c]) if c in per_cat.columns else 0.0
                    for c in stack.CATEGORIES})
        row[GAPS] = row["span_us"] - row["kernel_us"]
        rows.append(row)
    return pd.DataFrame(rows).set_index("segment")


def extrapolate(seg: pd.DataFrame, token: dict) -> tuple[pd.Series, list[str]]:
    """Per-token figures (span_us, launches, kernel_us, each category, gaps) over the model's
    layers from the window's segments; and how."""
    cfg = token["cfg"]
    if list(seg.index) == ["window"]:  # unlabelled: every layer at the window's mean
        scale = cfg.n_layers / len(token["layer_ids"])
        return seg.loc["window"] * scale, [f"the window's {len(token['layer_ids'])} layers "
                                           f"scaled to {cfg.n_layers}, head and embedding "
                                           f"included"]
    mla = set(cfg.mla_layers)
    window = [f"layer {layer}" for layer in token["layer_ids"][1:]]
    kinds = {"kda": [s for s, layer in zip(window, token["layer_ids"][1:], strict=True)
                     if layer not in mla],
             "mla": [s for s, layer in zip(window, token["layer_ids"][1:], strict=True)
                     if layer in mla]}
    counts = model_layers(cfg)
    missing = [k for k, n in counts.items() if n and not kinds[k]]
    if missing:
        raise ValueError(f"window: layers 1..{len(window)} hold no {missing[0].upper()} layer "
                         f"of {cfg.name}; widen the window")
    once = seg.loc[[s for s in ("embed", "layer 0", "head") if s in seg.index]].sum()
    total = once.copy()
    how = ["embedding, layer 0 and the head as measured"]
    for kind, names in kinds.items():
        if counts[kind]:
            total = total + counts[kind] * seg.loc[names].mean()
            how.append(f"{counts[kind]} {kind.upper()} layers at the mean of the window's "
                       f"{len(names)}")
    return total, how


def measure_token(st: stack.Stack, token: dict, device, *, label: str = "", num_splits: int = 4,
                  configs=None, repeats: int | None = None, trace_path: str | None = None
                  ) -> TokenFigures:
    """The stack's token: labelled timeline, window time, extrapolated per-token figures."""
    lab, window_us, notes = labelled_timeline(st, token, device, num_splits=num_splits,
                                              configs=configs, repeats=repeats,
                                              trace_path=trace_path)
    seg = segments(lab, window_us)
    total, how = extrapolate(seg, token)
    cats = {c: float(total.get(c, math.nan)) for c in (*stack.CATEGORIES, GAPS)}
    return TokenFigures(label or "+".join(st.names) or "engine baseline", lab, window_us,
                        float(total["span_us"]), float(total["launches"]), cats, seg,
                        notes + ["; ".join(how)])
