"""Reports for people: numbers at the precision a reader uses, a summary card of each
boundary's answer at the top of a report and in the index, long tables folded, and warnings
moved out of the rendered page into a log."""

from __future__ import annotations

import html
import math
import re
from typing import Any

__all__ = ["human", "human_tables", "summary", "summary_card", "fold_long_tables",
           "split_warnings", "FOLD_ROWS", "CPU_CAVEAT"]

FOLD_ROWS = 25  # an HTML table with more rows than this is folded under <details>
CPU_CAVEAT = ("CPU run under the Triton interpreter: launches are logical launches, and "
              "latencies, speedups and bandwidth fractions are not GPU figures.")


def human(v: Any) -> str:
    """``v`` for a reader: integral floats as integers (530.0 -> 530), large numbers with
    thousands separators, others to 3 significant digits (670.015991 -> 670, 1.192093e-07 ->
    1.2e-07); other values as str."""
    if isinstance(v, bool) or not isinstance(v, int | float):
        return str(v)
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if v == int(v) and abs(v) < 1e15:
        n = int(v)
        return f"{n:,}" if abs(n) >= 10_000 else str(n)
    a = abs(v)
    if a >= 1000:
        return f"{v:,.0f}"
    if a >= 1e-3:
        return f"{v:.3g}"
    return f"{v:.2g}"


def human_tables() -> None:
    """Make pandas show floats with :func:`human` (run in a report's kernel before the
    notebook)."""
    import pandas as pd

    pd.set_option("display.float_format", human)


# ---------------------------------------------------------------- the summary card

def _num(v) -> float | None:
    if isinstance(v, bool) or not isinstance(v, int | float):
        return None
    return float(v) if math.isfinite(v) else None


def _comparison(records: list[dict]) -> list[dict]:
    """The variant comparison's records (not a sweep's) of the three roles."""
    return [r for r in records if isinstance(r, dict) and r.get("sweep") in (None, "")
            and r.get("role") in ("reference", "fused", "peer")]


def summary(records: list[dict]) -> list[dict]:
    """Per boundary (in record order): launches of the reference and the fused variant, the
    fused variant's graph and eager latency, its fraction of the copy bandwidth, and its
    speedups over the reference and the best peer (None where a record is missing)."""
    rows = _comparison(records)
    out = []
    for b in dict.fromkeys(r.get("boundary") for r in rows):
        mine = [r for r in rows if r.get("boundary") == b]

        def get(metric, role=None, variant=None, mode=None, mine=mine):
            for r in mine:
                if (r.get("metric") == metric and (role is None or r.get("role") == role)
                        and (variant is None or r.get("variant") == variant)
                        and (mode is None or r.get("mode") == mode)):
                    return _num(r.get("value"))
            return None

        fused = [r.get("variant") for r in mine if r.get("role") == "fused"]
        if not fused:
            continue
        fv = "fused" if "fused" in fused else fused[0]
        graph = get("latency_us", "fused", fv, "graph")
        eager = get("latency_us", "fused", fv, "eager")
        peers = {r.get("variant"): _num(r.get("value")) for r in mine
                 if r.get("role") == "peer" and r.get("metric") == "latency_us"
                 and r.get("mode") == ("graph" if graph is not None else "eager")}
        peers = {k: v for k, v in peers.items() if v}
        best = min(peers, key=peers.get) if peers else None
        mine_lat = graph if graph is not None else eager
        out.append({
            "boundary": b, "fused": fv,
            "launches": (get("launches", "reference"), get("launches", "fused", fv)),
            "graph_us": graph, "eager_us": eager,
            "copy_frac": (get("roofline_frac", "fused", fv, "graph")
                          if graph is not None else get("roofline_frac", "fused", fv, "eager")),
            "vs_reference": get("speedup_vs_reference", "fused", fv,
                                "graph" if graph is not None else "eager"),
            "best_peer": best,
            "vs_peer": peers[best] / mine_lat if best and mine_lat else None,
        })
    return out


def _bars(headline: dict) -> list[tuple[str, bool]]:
    """The headline's verdicts: its bars and checks, the true/false figures."""
    return [(k, v) for k, v in (headline or {}).items() if isinstance(v, bool)]


def _cell(v, unit: str = "", fmt=human) -> str:
    return "&ndash;" if v is None else html.escape(fmt(v) + unit)


def summary_card(records: list[dict], headline: dict | None = None,
                 manifest: dict | None = None) -> str:
    """The card: one line per boundary (launches reference -> fused, graph and eager latency,
    fraction of the copy bandwidth, speedup over the reference and the best peer), each bar's
    and check's verdict in colour (green yes, red no), the device, and the CPU caveat on a CPU
    run (shown on its own when a CPU run has no figures). "" with nothing to show."""
    rows, bars, man = summary(records or []), _bars(headline or {}), manifest or {}
    cpu = str(man.get("device", "cpu")).startswith("cpu") if man else False
    if not rows and not bars and not cpu:
        return ""
    body = []
    for r in rows:
        ref, fus = r["launches"]
        peer = ("&ndash;" if r["vs_peer"] is None else
                f"{html.escape(human(r['vs_peer']))}x <span class='k3lab-small'>"
                f"({html.escape(str(r['best_peer']))})</span>")
        body.append(
            f"<tr><th>{html.escape(str(r['boundary']))}</th>"
            f"<td>{_cell(ref)} &rarr; {_cell(fus)}</td><td>{_cell(r['graph_us'], ' us')}</td>"
            f"<td>{_cell(r['eager_us'], ' us')}</td>"
            f"<td>{_cell(r['copy_frac'], ' %', lambda f: f'{100 * f:.0f}')}</td>"
            f"<td>{_cell(r['vs_reference'], 'x')}</td><td>{peer}</td></tr>")
    table = ("<table class='k3lab-card-table'><tr><th></th><th>launches ref &rarr; fused</th>"
             "<th>graph</th><th>eager</th><th>of copy bw</th><th>vs reference</th>"
             "<th>vs best peer</th></tr>" + "".join(body) + "</table>") if body else ""
    chips = "".join(
        f"<span class='k3lab-bar' style='background:{'#d7f5d7' if ok else '#fbd5d5'};"
        f"color:{'#064' if ok else '#900'}'>{html.escape(str(k))}: "
        f"{'yes' if ok else 'no'}</span> " for k, ok in bars)
    device = man.get("gpu") or ("CPU (Triton interpreter)" if cpu else man.get("device"))
    where = (f"<div class='k3lab-small'>{html.escape(str(device))}"
             + (f", preset {html.escape(str(man['preset']))}" if man.get("preset") else "")
             + (f", tp {html.escape(str(man['tp']))}" if man.get("tp") is not None else "")
             + "</div>") if device else ""
    caveat = f"<div class='k3lab-caveat'>{html.escape(CPU_CAVEAT)}</div>" if cpu else ""
    return (f"<div class='k3lab-card' style='border:1px solid #999;padding:6px 10px;"
            f"margin:6px 0'>{table}{chips and f'<div>{chips}</div>'}{where}{caveat}</div>")


# ---------------------------------------------------------------- the rendered page

_ROW = re.compile(r"<tr\b", re.I)


def fold_long_tables(nb, rows: int = FOLD_ROWS) -> int:
    """Wrap every HTML output of ``nb`` (in place) holding a table of more than ``rows`` rows
    in ``<details>``; returns how many were folded."""
    folded = 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            data = out.get("data", {})
            page = data.get("text/html")
            if page is None:
                continue
            text = "".join(page) if isinstance(page, list) else page
            n = len(_ROW.findall(text))
            if "<table" in text and n > rows and "<details" not in text:
                data["text/html"] = (f"<details><summary>table of {n - 1} rows (click to "
                                     f"open)</summary>{text}</details>")
                folded += 1
    return folded


def split_warnings(nb) -> list[str]:
    """Remove the stderr stream outputs (warnings: profiler, TF32, inductor) of ``nb`` in place
    and return their texts, for a log beside the report."""
    texts = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") != "code":
            continue
        keep = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                text = out.get("text", "")
                texts.append("".join(text) if isinstance(text, list) else text)
            else:
                keep.append(out)
        cell["outputs"] = keep
    return texts
