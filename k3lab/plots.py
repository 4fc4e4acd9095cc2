"""Plots of the tidy measurement frames from ``k3lab.profile``.

Every function takes a tidy DataFrame (columns boundary, variant, role, preset, tp, device, M,
metric, value, unit, mode; or a timeline frame kernel, start_us, end_us, dur_us, stream) and
returns a matplotlib Figure. In a notebook the figure shows exactly once, where it is made,
whichever way the cell is written (``plots.latency_bars(df)``, with a trailing ``;``, or
``fig = ...``): it is closed in pyplot so the inline backend does not show it again at the end of
the cell, and it is not shown a second time as the same cell's value. Displaying it in a later
cell shows it again. Outside a notebook nothing is displayed and any backend works (Agg).
"""

from __future__ import annotations

import base64
import sys

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.figure import Figure

__all__ = ["launch_bars", "latency_bars", "bandwidth_bars", "timeline_gantt", "heatmap",
           "subplots", "finish"]

ROLE_COLORS = {"reference": "tab:gray", "fused": "tab:blue", "peer": "tab:orange"}
MODE_COLORS = {"eager": "tab:orange", "graph": "tab:blue"}
MODE_ORDER = ("eager", "graph")
# metric names (or columns) that may carry the spread of a latency
P10_NAMES = ("latency_p10_us", "p10_us", "p10")
P90_NAMES = ("latency_p90_us", "p90_us", "p90")
LOG_SCALE_RATIO = 20  # switch a value axis to log scale when max/min exceeds this
MAX_KERNEL_ROWS = 60  # a Gantt chart with one row per launch stays readable up to about this
TOP_KERNELS = 8  # kernels colored (by total time) in the per-stream chart
PALETTE = ("C0", "C1", "C2", "C3", "C4", "C5", "C6", "C8", "C9")  # tab10 without its gray
LABEL_MIN_FRACTION = 0.02  # name a bar in the per-stream chart when it spans this much time


def _kernel():
    """The running IPython kernel's shell, or None (a script, a test, a terminal IPython)."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell if getattr(shell, "kernel", None) is not None else None


class _NotebookFigure(Figure):
    """A Figure a notebook shows once per cell (see the module docstring)."""

    _shown_in = None  # execution count of the cell that showed it

    def _ipython_display_(self):
        from IPython.core.pylabtools import print_figure
        from IPython.display import display

        shell = _kernel()
        if shell is None or self._shown_in == shell.execution_count:
            return
        self._shown_in = shell.execution_count
        png = print_figure(self, "png", bbox_inches="tight")
        display({"image/png": base64.b64encode(png).decode("ascii"), "text/plain": repr(self)},
                raw=True)


def subplots(*args, **kwargs):
    """``plt.subplots`` making a figure that a notebook shows once (see the module docstring);
    end it with :func:`finish`."""
    return plt.subplots(*args, FigureClass=_NotebookFigure, **kwargs)


def _ordered(values) -> list:
    """Unique values in order of first appearance (pandas pivots would sort them)."""
    return list(dict.fromkeys(v for v in values if not pd.isna(v)))


def _facets(n: int, width: float = 4.2, height: float = 3.4, per_row: int = 4):
    """One panel per boundary, at most ``per_row`` to a row; unused panels hidden."""
    cols, rows = min(n, per_row), -(-n // per_row)
    fig, axes = subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    axes = list(axes.ravel())
    for ax in axes[n:]:
        ax.set_visible(False)
    return fig, axes[:n]


def _headroom(ax) -> None:
    """Room above the tallest bar for its label."""
    lo, hi = ax.get_ylim()
    ax.set_ylim(lo, hi * 2.5 if ax.get_yscale() == "log" else hi * 1.12)


def finish(fig: Figure, title: str | None = None, legend: bool = False) -> Figure:
    """Title, one legend for all panels (below them), layout; closed in pyplot and, in a
    notebook, shown once (see the module docstring). Returns ``fig``."""
    if title:
        fig.suptitle(title)
    bottom = 0.0
    if legend:
        handles = {}
        for ax in fig.axes:
            for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
                handles.setdefault(label, h)
        if handles:
            ncol = min(len(handles), 4)
            fig.legend(handles.values(), handles.keys(), loc="lower center", ncol=ncol,
                       fontsize=8, frameon=False)
            lines = -(-len(handles) // ncol)
            bottom = (0.1 + 0.2 * lines) / fig.get_figheight()  # room for the legend
    fig.tight_layout(rect=(0, bottom, 1, 1))
    plt.close(fig)  # not shown again by the inline backend at the end of the cell
    if _kernel() is not None:
        fig._ipython_display_()
    return fig


def _device_note(df: pd.DataFrame) -> str:
    devices = _ordered(df["device"]) if "device" in df else []
    return " (CPU, Triton interpreter: not GPU figures)" if "cpu" in devices else ""


def _log_if_wide(ax, values) -> None:
    v = np.asarray([x for x in values if x is not None and np.isfinite(x) and x > 0])
    if v.size and v.max() / v.min() > LOG_SCALE_RATIO:
        ax.set_yscale("log")


def _grouped_bars(ax, table: pd.DataFrame, colors=None, err: dict | None = None) -> None:
    """Bars of ``table`` (rows: x categories, columns: series) side by side, labelled."""
    n = max(len(table.columns), 1)
    width = 0.8 / n
    x = np.arange(len(table.index))
    for j, col in enumerate(table.columns):
        vals = table[col].to_numpy(dtype=float)
        yerr = err.get(col) if err else None
        color = colors.get(col) if isinstance(colors, dict) else colors
        bars = ax.bar(x + (j - (n - 1) / 2) * width, vals, width, label=str(col), color=color,
                      yerr=yerr, capsize=3 if yerr is not None else 0)
        ax.bar_label(bars, fmt="%.3g", fontsize=7, padding=2)
    ax.set_xticks(x, [str(i) for i in table.index], rotation=30, ha="right")
    _xlim(ax, len(table.index))


def _xlim(ax, n: int) -> None:
    """At least two slots wide, centred: a lone variant stays bar-sized."""
    half, centre = max(n, 2) / 2, (n - 1) / 2
    ax.set_xlim(centre - half, centre + half)


def _hline(ax, y: float, label: str, value: str) -> None:
    """A dashed red reference line, its value written at its right end."""
    ax.axhline(y, color="tab:red", ls="--", lw=1.2, label=label)
    ax.annotate(value, xy=(1, y), xycoords=("axes fraction", "data"), xytext=(-2, 2),
                textcoords="offset points", ha="right", va="bottom", fontsize=7, color="tab:red",
                zorder=5, bbox=dict(boxstyle="round,pad=0.15", fc="white", ec="none", alpha=0.8))


def _metric(df: pd.DataFrame, names) -> pd.DataFrame:
    names = (names,) if isinstance(names, str) else tuple(names)
    return df[df["metric"].isin(names)]


def launch_bars(df: pd.DataFrame, title: str | None = None) -> Figure:
    """Launches per variant (colored by role), one panel per boundary."""
    d = _metric(df, "launches")
    if d.empty:
        raise ValueError("df: no rows with metric 'launches'")
    boundaries = _ordered(d["boundary"])
    fig, axes = _facets(len(boundaries), width=3.6)
    for ax, b in zip(axes, boundaries, strict=True):
        sub = d[d["boundary"] == b].drop_duplicates("variant")
        roles = sub["role"] if "role" in sub else [None] * len(sub)
        bars = ax.bar(sub["variant"].astype(str), sub["value"].astype(float),
                      color=[ROLE_COLORS.get(r, "tab:green") for r in roles])
        ax.bar_label(bars, fmt="%d", fontsize=8, padding=2)
        _xlim(ax, len(sub))
        _headroom(ax)
        ax.set_title(str(b))
        ax.set_ylabel("launches")
        ax.tick_params(axis="x", rotation=30)
    return finish(fig, title or "Kernel launches per call" + _device_note(d))


def _spread(d: pd.DataFrame, table: pd.DataFrame, modes: list) -> dict | None:
    """Asymmetric error bars (value - p10, p90 - value) per mode, when the rows carry them."""
    if "p10_us" not in d or "p90_us" not in d:
        return None
    err = {}
    for m in modes:
        rows = d[d["mode"] == m].drop_duplicates("variant").set_index("variant")
        if rows[["p10_us", "p90_us"]].isna().all().all():
            continue
        v = table[m].to_numpy(float)
        lo = rows["p10_us"].reindex(table.index).to_numpy(float)
        hi = rows["p90_us"].reindex(table.index).to_numpy(float)
        err[m] = np.nan_to_num(np.vstack([v - lo, hi - v]).clip(min=0))
    return err or None


def _latency_frame(df: pd.DataFrame) -> pd.DataFrame:
    """latency_us rows with p10/p90 attached as columns when given as separate metric rows."""
    keys = ["boundary", "variant", "mode"] + (["M"] if "M" in df else [])
    lat = _metric(df, "latency_us").copy()
    for names, col in ((P10_NAMES, "p10_us"), (P90_NAMES, "p90_us")):
        given = next((c for c in names if c in lat.columns), None)
        if given:
            lat[col] = lat[given]
            continue
        rows = _metric(df, names)
        if not rows.empty:
            extra = rows[keys + ["value"]].rename(columns={"value": col})
            lat = lat.merge(extra.drop_duplicates(keys), on=keys, how="left")
    return lat


def latency_bars(df: pd.DataFrame, title: str | None = None) -> Figure:
    """latency_us per variant, eager and graph side by side, p10-p90 error bars, roofline line.

    One panel per boundary; the boundary's ``roofline_us`` row (bytes it must move over the copy
    bandwidth) is drawn as a dashed red line. A wide range switches the axis to log scale.
    """
    lat = _latency_frame(df)
    if lat.empty:
        raise ValueError("df: no rows with metric 'latency_us'")
    if "mode" not in lat:
        lat["mode"] = "eager"
    boundaries = _ordered(lat["boundary"])
    fig, axes = _facets(len(boundaries))
    for ax, b in zip(axes, boundaries, strict=True):
        d = lat[lat["boundary"] == b]
        modes = [m for m in MODE_ORDER if m in set(d["mode"])] + [
            m for m in _ordered(d["mode"]) if m not in MODE_ORDER]
        table = d.pivot_table(index="variant", columns="mode", values="value", aggfunc="first")
        table = table.reindex(index=_ordered(d["variant"]), columns=modes)
        _grouped_bars(ax, table, MODE_COLORS, _spread(d, table, modes))
        values = list(table.to_numpy(float).ravel())
        roof = _metric(df[df["boundary"] == b], "roofline_us")
        if not roof.empty:
            r = float(roof["value"].iloc[0])
            _hline(ax, r, "roofline", f"{r:.3g} us")
            values.append(r)
        _log_if_wide(ax, values)
        _headroom(ax)
        ax.set_title(str(b))
        ax.set_ylabel("latency (us)")
    return finish(fig, title or "Latency, median with p10-p90" + _device_note(lat), legend=True)


def bandwidth_bars(df: pd.DataFrame, copy_bw: float, title: str | None = None) -> Figure:
    """Achieved bandwidth (bytes moved / latency, TB/s) per variant and mode vs the copy bandwidth.

    copy_bw: bytes/s measured in the same process (``k3lab.profile.copy_bandwidth``).
    """
    lat = _metric(df, "latency_us")
    nbytes = _metric(df, "bytes")
    if lat.empty or nbytes.empty:
        raise ValueError("df: needs rows with metric 'latency_us' and 'bytes'")
    per_boundary = nbytes.drop_duplicates("boundary").set_index("boundary")["value"]
    boundaries = _ordered(lat["boundary"])
    fig, axes = _facets(len(boundaries))
    for ax, b in zip(axes, boundaries, strict=True):
        d = lat[lat["boundary"] == b].copy()
        if "mode" not in d:
            d["mode"] = "eager"
        d["tbps"] = float(per_boundary.get(b, np.nan)) / (d["value"].astype(float) * 1e-6) / 1e12
        modes = [m for m in MODE_ORDER if m in set(d["mode"])]
        modes += [m for m in _ordered(d["mode"]) if m not in modes]
        table = d.pivot_table(index="variant", columns="mode", values="tbps", aggfunc="first")
        _grouped_bars(ax, table.reindex(index=_ordered(d["variant"]), columns=modes), MODE_COLORS)
        _hline(ax, copy_bw / 1e12, "copy bandwidth", f"{copy_bw / 1e12:.3g} TB/s")
        _headroom(ax)
        ax.set_title(str(b))
        ax.set_ylabel("achieved TB/s")
    return finish(fig, title or "Achieved bandwidth vs measured copy bandwidth" + _device_note(lat),
                  legend=True)


def timeline_gantt(tl: pd.DataFrame, title: str | None = None, rows: str = "auto") -> Figure:
    """Gantt chart of a timeline frame (kernel, start_us, end_us, dur_us, stream).

    rows="kernel": one row per launch in start order, named on the y axis; rows="stream": one row
    per stream, kernel names written in the bars wide enough to hold them; "auto": per kernel up
    to :data:`MAX_KERNEL_ROWS` launches, else per stream. Times are relative to the first start.
    """
    if tl.empty:
        raise ValueError("tl: empty timeline")
    if rows not in ("auto", "kernel", "stream"):
        raise ValueError(f"rows: expected 'auto', 'kernel' or 'stream', got {rows!r}")
    if rows == "auto":
        rows = "kernel" if len(tl) <= MAX_KERNEL_ROWS else "stream"
    t = tl.sort_values("start_us").reset_index(drop=True)
    t0 = float(t["start_us"].min())
    start = (t["start_us"].astype(float) - t0).to_numpy()
    dur = (t["end_us"] - t["start_us"]).astype(float).clip(lower=1e-3).to_numpy()
    span = float((t["end_us"].astype(float) - t0).max())
    stream = t["stream"].tolist() if "stream" in t else [0] * len(t)
    streams = _ordered(stream)
    names = [str(k) if len(str(k)) <= 40 else str(k)[:37] + "..." for k in t["kernel"]]
    if rows == "kernel":
        fig, ax = subplots(figsize=(9, 1.2 + 0.2 * len(t)))
        y = np.arange(len(t))
        ax.barh(y, dur, left=start, color=[f"C{streams.index(s) % 10}" for s in stream],
                height=0.7)
        ax.set_yticks(y, names, fontsize=7)
        ax.invert_yaxis()
    else:
        fig, ax = subplots(figsize=(11, 1.6 + 0.7 * len(streams)))
        y = np.array([streams.index(s) for s in stream])
        # color the kernels that take the most time, the rest gray, so a dense row still reads
        top = pd.Series(dur, index=names).groupby(level=0).sum().nlargest(TOP_KERNELS).index
        group = np.array([n if n in top else "other" for n in names])
        for i, k in enumerate([*top, "other"]):
            m = group == k
            if m.any():
                ax.barh(y[m], dur[m], left=start[m], height=0.6, edgecolor="white", lw=0.3,
                        color=PALETTE[i] if k != "other" else "lightgray", label=k)
        for yi, x0, w, name in zip(y, start, dur, names, strict=True):
            if w > LABEL_MIN_FRACTION * span:
                ax.text(x0 + w / 2, yi, name, ha="center", va="center", fontsize=6,
                        rotation=90, clip_on=True)
        ax.set_yticks(np.arange(len(streams)), [str(s) for s in streams])
        ax.invert_yaxis()
    ax.set_xlabel(f"time (us); {len(t)} launches over {span:.1f} us")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title or "Timeline")
    return finish(fig, legend=rows == "stream")


def heatmap(pivot: pd.DataFrame, title: str | None = None, *, fmt: str = "{:.3g}",
            cmap: str = "viridis", label: str | None = None, log: bool = False) -> Figure:
    """Annotated heatmap of a pivoted frame (rows x columns of values), e.g. a sweep."""
    from matplotlib.colors import LogNorm

    vals = pivot.to_numpy(dtype=float)
    fig, ax = subplots(figsize=(1.2 + 0.8 * vals.shape[1], 1.0 + 0.45 * vals.shape[0]))
    im = ax.imshow(vals, cmap=cmap, aspect="auto", norm=LogNorm() if log else None)
    ax.set_xticks(np.arange(vals.shape[1]), [str(c) for c in pivot.columns], rotation=30,
                  ha="right")
    ax.set_yticks(np.arange(vals.shape[0]), [str(i) for i in pivot.index])
    ax.set_xlabel(str(pivot.columns.name or ""))
    ax.set_ylabel(str(pivot.index.name or ""))
    finite = vals[np.isfinite(vals)]
    mid = (finite.min() + finite.max()) / 2 if finite.size else 0.0
    for (i, j), v in np.ndenumerate(vals):
        if np.isfinite(v):
            ax.text(j, i, fmt.format(v), ha="center", va="center", fontsize=7,
                    color="white" if v < mid else "black")
    fig.colorbar(im, ax=ax, label=label or "")
    ax.set_title(title or "")
    return finish(fig)
