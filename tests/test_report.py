"""k3lab.report (publish / read back, banner, manifest, HTML, index) and k3lab.plots."""

import json
import re

import matplotlib.pyplot as plt
import nbformat
import numpy as np
import pandas as pd
import pytest
from matplotlib.figure import Figure
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from k3lab import plots, report


def _notebook(*cells):
    nb = new_notebook(cells=list(cells))
    nb.metadata["language_info"] = {"name": "python"}
    return nb


def _display(bundle):
    return new_output("display_data", data=bundle)


# ---------------------------------------------------------------- publish / read_metrics

def test_bundle_is_json_safe_with_fallbacks():
    df = pd.DataFrame({"variant": ["ref", "fused"], "value": [np.float32(2.5), np.nan],
                       "M": np.array([1, 2], dtype=np.int64)})
    bundle = report.metrics_bundle(df, {"speedup": np.float64(3.25), "bad": float("inf")})
    payload = bundle[report.MIME]
    json.dumps(payload, allow_nan=False)  # strict JSON: NaN / inf became None
    assert payload["records"] == [{"variant": "ref", "value": 2.5, "M": 1},
                                  {"variant": "fused", "value": None, "M": 2}]
    assert payload["headline"] == {"speedup": 3.25, "bad": None}
    assert "2 records" in bundle["text/plain"] and "speedup=3.25" in bundle["text/plain"]
    assert "<th style='text-align:left'>speedup</th><td>3.25</td>" in bundle["text/html"]


def test_headline_string_and_escaping():
    bundle = report.metrics_bundle([{"a": 1}], "<b>3x</b> fewer launches")
    assert bundle[report.MIME]["headline"] == {"summary": "<b>3x</b> fewer launches"}
    assert "&lt;b&gt;3x&lt;/b&gt;" in bundle["text/html"] and "<b>3x" not in bundle["text/html"]


def test_publish_displays_the_raw_bundle(monkeypatch):
    import IPython.display

    shown = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: shown.append((obj,
                                                                                          raw)))
    report.publish([{"x": 1}], headline={"h": 2})
    ((obj, raw),) = shown
    assert raw and obj[report.MIME] == {"records": [{"x": 1}], "headline": {"h": 2}}


def test_read_metrics_collects_every_payload_through_nbformat():
    nb = _notebook(
        new_markdown_cell("# t"),
        new_code_cell("a", outputs=[_display(report.metrics_bundle([{"i": 1}], {"a": 1, "b": 2})),
                                    new_output("stream", text="noise")]),
        new_code_cell("b", outputs=[_display({"text/plain": "unrelated"})]),
        new_code_cell("c", outputs=[_display(report.metrics_bundle([{"i": 2}, {"i": 3}],
                                                                   {"b": 5}))]),
    )
    nb = nbformat.reads(nbformat.writes(nb), as_version=4)  # round trip through the file format
    nbformat.validate(nb)
    got = report.read_metrics(nb)
    assert got == {"records": [{"i": 1}, {"i": 2}, {"i": 3}], "headline": {"a": 1, "b": 5},
                   "payloads": 2}


def test_read_metrics_of_a_notebook_without_payloads():
    assert report.read_metrics(_notebook(new_code_cell("x = 1"))) == {
        "records": [], "headline": {}, "payloads": 0}


@pytest.mark.parametrize("device, shown", [("cpu", True), ("cuda", False), ("cuda:1", False)])
def test_cpu_banner(monkeypatch, device, shown):
    import IPython.display

    got = []
    monkeypatch.setattr(IPython.display, "display", lambda obj, raw=False: got.append(obj))
    report.cpu_banner(device)
    assert bool(got) == shown
    if shown:
        assert report.CPU_WARNING in got[0]["text/markdown"]
        assert report.CPU_WARNING in got[0]["text/plain"]


# ---------------------------------------------------------------- manifest

def test_manifest_fields():
    m = report.manifest({"device": "cpu", "preset": "tiny", "tp": 2, "seed": 3})
    for key in ("git_commit", "git_dirty", "gpu", "driver", "torch", "triton", "python", "date"):
        assert key in m
    assert (m["preset"], m["tp"], m["device"]) == ("tiny", 2, "cpu")
    assert m["parameters"]["seed"] == 3
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00", m["date"])
    json.dumps(m, allow_nan=False)
    if (report.REPO_ROOT / ".git").exists():
        assert re.fullmatch(r"[0-9a-f]{40}", m["git_commit"]) and isinstance(m["git_dirty"], bool)


def test_manifest_commit_from_env_without_git(monkeypatch):
    monkeypatch.setattr(report, "REPO_ROOT", report.REPO_ROOT / "no-such-dir")
    monkeypatch.setenv("K3LAB_GIT_COMMIT", "abc123")
    monkeypatch.setenv("K3LAB_GIT_DIRTY", "0")
    m = report.manifest({"device": "cpu"})
    assert (m["git_commit"], m["git_dirty"]) == ("abc123", False)


# ---------------------------------------------------------------- HTML

def test_to_html_hides_code_by_default():
    png = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGA"
           "WjR9awAAAABJRU5ErkJggg==")  # a 1x1 PNG
    nb = _notebook(new_markdown_cell("# Title here"),
                   new_code_cell("SECRET_SOURCE = 42", outputs=[
                       new_output("stream", text="visible output\n"),
                       _display({"image/png": png, "text/plain": "<Figure>"})]))
    hidden = report.to_html(nb)
    assert "SECRET_SOURCE" not in hidden and "visible output" in hidden
    assert "Title here" in hidden and f"data:image/png;base64,{png}" in hidden
    assert "SECRET_SOURCE" in report.to_html(nb, hide_code=False)


def test_to_html_shares_its_stylesheets_once_per_folder(tmp_path):
    nb = _notebook(new_markdown_cell("# Styled"))
    alone = report.to_html(nb)
    assert "<link rel=" not in alone and "k3lab:shared-css" not in alone
    assert alone.count("<style") >= 3 and "mermaid" not in alone  # inline; no mermaid script
    linked = report.to_html(nb, folder=tmp_path)
    (css,) = (tmp_path / report.ASSETS_DIR).glob("k3lab-report-*.css")
    assert f'<link rel="stylesheet" href="{report.ASSETS_DIR}/{css.name}">' in linked
    assert len(linked) < len(alone) - 200_000  # the lab theme is most of a page without plots
    styles = re.findall(r"<style[^>]*>(.*?)</style>", alone, re.S)
    assert all(part in css.read_text() for part in styles[:4])  # the same CSS, moved
    assert "Styled" in linked
    again = report.to_html(_notebook(new_markdown_cell("# Other")), folder=tmp_path)
    assert css.name in again and len(list(css.parent.iterdir())) == 1  # written once


def test_prune_keeps_only_linked_stylesheets(tmp_path):
    assets = tmp_path / report.ASSETS_DIR
    assets.mkdir()
    (assets / "k3lab-report-111111111111.css").write_text("new")
    (tmp_path / "a.html").write_text(
        f'<link rel="stylesheet" href="{report.ASSETS_DIR}/k3lab-report-111111111111.css">')
    stale = tmp_path / report.ASSETS_DIR / "k3lab-report-000000000000.css"
    stale.write_text("old")
    other = tmp_path / report.ASSETS_DIR / "notes.txt"
    other.write_text("kept")
    assert report.prune_shared_assets(tmp_path) == [stale]
    assert not stale.exists() and other.exists()
    assert report.shared_assets_in_use(tmp_path) == {"k3lab-report-111111111111.css"}


def test_significant_digits():
    assert report.significant(0.0123456) == 0.0123 and report.significant(98765, 2) == 99000.0


def test_write_index_escapes_and_links(tmp_path):
    entries = [
        {"name": "00_<overview>", "status": "ok", "html": "00_<overview>.html",
         "headline": {"speedup": 3.14159, "<k>": "<v>"},
         "manifest": {"gpu": "NVIDIA H200", "driver": "570.1", "preset": "kimi-k3", "tp": 8,
                      "torch": "2.11", "triton": "3.6", "git_commit": "0123456789abcdef",
                      "git_dirty": True}},
        {"name": "10_route", "status": "failed", "error": "<script>alert(1)</script>",
         "html": "10_route.html", "failed_html": "10_route.failed.html",
         "last_good_date": "2026-01-01T00:00:00+00:00", "headline": {"launches": 2}},
    ]
    path = report.write_index(tmp_path, entries)
    page = path.read_text()
    assert "<script>alert" not in page and "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "<b>00_&lt;overview&gt;</b>" in page and "href='./00_%3Coverview%3E.html'" in page
    assert "<th>&lt;k&gt;</th><td>&lt;v&gt;</td>" in page and "<td>3.14</td>" in page
    assert "NVIDIA H200, driver 570.1, preset kimi-k3, tp 8" in page and "(dirty)" in page
    assert "last good report" in page and "href='./10_route.failed.html'" in page
    assert [p.name for p in tmp_path.iterdir()] == ["index.html"]  # no temp file left


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "a.json"
    report.atomic_write_text(target, "first")
    report.atomic_write_text(target, "second")
    assert target.read_text() == "second" and len(list(tmp_path.iterdir())) == 1
    assert target.stat().st_mode & 0o044  # readable by others like any new file


# ---------------------------------------------------------------- plots

def _tidy():
    rows = []
    for variant, role, launches, lat in (("reference", "reference", 22, {"eager": 500.0,
                                                                         "graph": 80.0}),
                                         ("fused", "fused", 2, {"eager": 40.0, "graph": 9.0})):
        base = dict(boundary="route", variant=variant, role=role, preset="tiny", tp=1,
                    device="cpu", M=1, unit="")
        rows.append({**base, "metric": "launches", "value": launches, "mode": None})
        rows.append({**base, "metric": "bytes", "value": 2.0e7, "mode": None})
        rows.append({**base, "metric": "roofline_us", "value": 4.7, "mode": None})
        for mode, us in lat.items():
            rows.append({**base, "metric": "latency_us", "value": us, "mode": mode})
            rows.append({**base, "metric": "latency_p10_us", "value": us * 0.9, "mode": mode})
            rows.append({**base, "metric": "latency_p90_us", "value": us * 1.2, "mode": mode})
    moe = pd.DataFrame(rows).assign(boundary="moe")
    return pd.concat([pd.DataFrame(rows), moe], ignore_index=True)


def _timeline(n, streams=(7,)):
    start = np.arange(n, dtype=float) * 10
    return pd.DataFrame({"kernel": [f"k{i % 12}" for i in range(n)], "start_us": start,
                         "end_us": start + 4 + np.arange(n) % 5, "dur_us": 4.0,
                         "stream": [streams[i % len(streams)] for i in range(n)]})


def test_timeline_rows():
    small = plots.timeline_gantt(_timeline(5))  # auto: one row per launch, named
    assert [t.get_text() for t in small.axes[0].get_yticklabels()] == [f"k{i}" for i in range(5)]
    big = plots.timeline_gantt(_timeline(plots.MAX_KERNEL_ROWS + 1, streams=(7, 9)))
    ax = big.axes[0]
    assert [t.get_text() for t in ax.get_yticklabels()] == ["7", "9"]  # auto: per stream
    assert len(ax.patches) == plots.MAX_KERNEL_ROWS + 1
    assert "61 launches" in ax.get_xlabel()
    labels = [t.get_text() for t in big.legends[0].get_texts()]
    assert len(labels) == plots.TOP_KERNELS + 1 and labels[-1] == "other"


def test_plots_return_figures():
    df = _tidy()
    tl = pd.DataFrame({"kernel": ["gemv", "topk", "a_very_long_kernel_name_" * 3],
                       "start_us": [0.0, 5.0, 9.0], "end_us": [4.0, 8.0, 15.0],
                       "dur_us": [4.0, 3.0, 6.0], "stream": [7, 7, 9]})
    pivot = pd.DataFrame([[1.0, 2.0], [3.0, np.nan]], index=pd.Index([1, 2], name="M"),
                         columns=pd.Index(["a", "b"], name="variant"))
    figs = [plots.launch_bars(df), plots.latency_bars(df), plots.bandwidth_bars(df, 4.27e12),
            plots.timeline_gantt(tl, title="t"), plots.timeline_gantt(tl, rows="stream"),
            plots.heatmap(pivot, "sweep", label="us")]
    assert all(isinstance(f, Figure) for f in figs)
    # closed in pyplot: the inline backend does not show them a second time at the cell's end
    assert plt.get_fignums() == []
    assert all(f._ipython_display_() is None for f in figs)  # outside a kernel: shows nothing


def test_latency_bars_marks_roofline_and_spread():
    fig = plots.latency_bars(_tidy())
    ax = fig.axes[0]
    roof = [ln for ln in ax.get_lines() if ln.get_label().startswith("roofline")]
    assert len(roof) == 1 and roof[0].get_ydata()[0] == pytest.approx(4.7)
    assert ax.get_yscale() == "log"  # 4.7 us .. 500 us
    assert len(ax.containers) == 4  # eager bars, graph bars and their error bars
    assert [t.get_text() for t in ax.get_xticklabels()] == ["reference", "fused"]
    assert "not GPU figures" in fig._suptitle.get_text()


def test_launch_bars_one_panel_per_boundary():
    fig = plots.launch_bars(_tidy())
    assert [ax.get_title() for ax in fig.axes] == ["route", "moe"]
    heights = [p.get_height() for p in fig.axes[0].patches]
    assert heights == [22, 2]


def test_bandwidth_bars_values():
    fig = plots.bandwidth_bars(_tidy(), copy_bw=4.0e12)
    heights = sorted(p.get_height() for p in fig.axes[0].patches)
    # 2e7 bytes in 9 us -> 2.22 TB/s; in 500 us -> 0.04 TB/s
    assert heights[0] == pytest.approx(0.04) and heights[-1] == pytest.approx(2.0e7 / 9e-6 / 1e12)


def test_plots_reject_frames_without_the_metric():
    df = _tidy()
    with pytest.raises(ValueError, match="latency_us"):
        plots.latency_bars(df[df["metric"] == "launches"])
    with pytest.raises(ValueError, match="launches"):
        plots.launch_bars(df[df["metric"] == "bytes"])
    with pytest.raises(ValueError, match="'auto', 'kernel' or 'stream'"):
        plots.timeline_gantt(pd.DataFrame({"kernel": ["k"], "start_us": [0.0], "end_us": [1.0],
                                           "dur_us": [1.0], "stream": [0]}), rows="bogus")
