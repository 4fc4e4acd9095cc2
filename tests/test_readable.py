"""Reports for people: number formatting, the summary card (in a report and the index), long
tables folded and warnings split out of the page."""

import json

import nbformat
import pytest

from k3lab import readable, runner


@pytest.mark.parametrize("value, text", [
    (670.015991, "670"), (1.192093e-07, "1.2e-07"), (530.0, "530"), (0.3355296, "0.336"),
    (12877640.0, "12,877,640"), (1280.368, "1,280"), (9.0856, "9.09"), (7, "7"), (0, "0"),
    (-2.5, "-2.5"), (True, "True"), ("x", "x"), (float("nan"), "nan"), (None, "None"),
], ids=lambda v: repr(v))
def test_human_numbers(value, text):
    assert readable.human(value) == text


def _rec(variant, role, metric, value, mode="", **kw):
    return {"boundary": "route", "variant": variant, "role": role, "metric": metric,
            "mode": mode, "value": value, "M": 1, "tp": 8, "sweep": None, **kw}


RECORDS = [
    _rec("reference", "reference", "launches", 53.0),
    _rec("reference", "reference", "latency_us", 140.3, "graph"),
    _rec("fused", "fused", "launches", 1.0),
    _rec("fused", "fused", "latency_us", 9.0856, "graph"),
    _rec("fused", "fused", "latency_us", 120.19, "eager"),
    _rec("fused", "fused", "roofline_frac", 0.3355, "graph"),
    _rec("fused", "fused", "speedup_vs_reference", 15.44, "graph"),
    _rec("torch.compile", "peer", "latency_us", 55.29, "graph"),
    _rec("eager-peer", "peer", "latency_us", 80.0, "graph"),
    _rec("fused", "fused", "latency_us", 1.0, "graph", sweep="M"),  # a sweep: not the card's
]
HEADLINE = {"bar met": False, "all plan fields match the reference": True, "launches": 1}
GPU = {"device": "cuda", "gpu": "NVIDIA H200", "preset": "kimi-k3", "tp": 8}


def test_summary_of_the_variant_comparison():
    (row,) = readable.summary(RECORDS)
    assert row["launches"] == (53.0, 1.0) and row["graph_us"] == 9.0856
    assert row["eager_us"] == 120.19 and row["copy_frac"] == 0.3355
    assert row["vs_reference"] == 15.44 and row["best_peer"] == "torch.compile"
    assert row["vs_peer"] == pytest.approx(55.29 / 9.0856)


def test_card_shows_the_answer_verdicts_and_device():
    card = readable.summary_card(RECORDS, HEADLINE, GPU)
    for text in ("53 &rarr; 1", "9.09 us", "120 us", "34 %", "15.4x", "6.09x",
                 "(torch.compile)", "NVIDIA H200, preset kimi-k3, tp 8"):
        assert text in card, text
    assert "bar met: no" in card and "color:#900'>bar met" in card
    assert "color:#064'>all plan fields match the reference: yes" in card
    assert readable.CPU_CAVEAT not in card


def test_card_on_a_cpu_run_says_so():
    card = readable.summary_card(RECORDS, {}, {"device": "cpu", "preset": "tiny", "tp": 1})
    assert readable.CPU_CAVEAT in card and "CPU (Triton interpreter)" in card
    assert readable.CPU_CAVEAT in readable.summary_card([], {}, {"device": "cpu"})


def test_card_escapes_and_is_empty_without_figures():
    assert readable.summary_card([], {}, GPU) == ""
    card = readable.summary_card([{**r, "boundary": "<b>"} for r in RECORDS], {"<x>": True})
    assert "<th><b></th>" not in card and "<th>&lt;b&gt;</th>" in card
    assert "&lt;x&gt;: yes" in card


def test_index_shows_the_card_and_folds_the_headline(tmp_path):
    (tmp_path / "10_route.metrics.json").write_text(json.dumps({
        "notebook": "10_route", "status": "ok", "seconds": 1.0, "headline": HEADLINE,
        "records": RECORDS, "manifest": {**GPU, "date": "2026-01-01"}}))
    runner.update_index(tmp_path)
    page = (tmp_path / "index.html").read_text()
    assert "class='k3lab-card'" in page and "15.4x" in page
    assert "<details><summary>headline (3 figures)</summary>" in page


def test_long_tables_fold_and_warnings_split():
    rows = "".join(f"<tr><td>{i}</td></tr>" for i in range(readable.FOLD_ROWS + 1))
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("x", outputs=[
        nbformat.v4.new_output("display_data", data={"text/html": f"<table>{rows}</table>"}),
        nbformat.v4.new_output("display_data", data={"text/html": "<table><tr></tr></table>"}),
        nbformat.v4.new_output("stream", name="stderr", text="UserWarning: TF32\n"),
        nbformat.v4.new_output("stream", name="stdout", text="kept\n")])])
    assert readable.fold_long_tables(nb) == 1
    assert readable.split_warnings(nb) == ["UserWarning: TF32\n"]
    outs = nb.cells[0].outputs
    assert outs[0]["data"]["text/html"].startswith("<details>") and len(outs) == 3
    assert outs[2]["text"] == "kept\n"
