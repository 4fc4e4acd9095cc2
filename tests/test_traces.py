"""Perfetto traces of the timelines: the CPU trace-event file, the notebooks' ``trace_dir``
set by the runner, the traces carried beside the report (a failed run's apart) and linked
from it and from the index, and never an older run's trace left linked.

The runner cases run the fixture tests/notebooks/views/30_views.ipynb (a timeline, a widget,
a summary card's records; ``fail`` raises after the trace is written) in a real kernel.
"""

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from k3lab import batch, cli, folder, profile, runner, traces

VIEWS = Path(__file__).parent / "notebooks" / "views" / "30_views.ipynb"


def _events(path: Path) -> list[dict]:
    doc = json.loads(path.read_text())
    return [e for e in doc["traceEvents"] if e["ph"] == "X"]


def test_cpu_timeline_writes_a_chrome_trace(tmp_path):
    path = tmp_path / "nb.one.trace.json"
    tl = profile.timeline(lambda t: (t @ t).relu(), torch.randn(16, 16), trace_path=str(path))
    doc = json.loads(path.read_text())
    events = _events(path)
    assert [e["name"] for e in events] == list(tl["kernel"])
    for e in events:
        assert {"name", "ph", "ts", "dur", "pid", "tid"} <= set(e) and e["dur"] >= 0
    assert events[0]["ts"] == 0.0
    assert "wall clock" in doc["otherData"]["k3lab"] and "not GPU" in doc["otherData"]["k3lab"]
    names = [e["args"]["name"] for e in doc["traceEvents"] if e["ph"] == "M"]
    assert any("not GPU figures" in n for n in names) and "cpu" in names


def test_write_cpu_keeps_extra_columns_and_one_thread_per_stream(tmp_path):
    rows = [{"kernel": "a", "start_us": 0.0, "end_us": 2.0, "dur_us": 2.0, "stream": "fused",
             "segment": "layer 1"},
            {"kernel": "b", "start_us": 1.0, "end_us": 4.0, "dur_us": 3.0, "stream": "ref",
             "segment": "layer 2"}]
    events = _events(traces.write_cpu(rows, tmp_path / "x.trace.json"))
    assert [e["tid"] for e in events] == [1, 2]
    assert [e["args"]["segment"] for e in events] == ["layer 1", "layer 2"]


def test_traces_names_and_labels(tmp_path):
    t = traces.Traces(tmp_path / "staged", "10_route")
    assert t.path("torch.compile").endswith("10_route.torch_compile.trace.json")
    assert traces.label_of("10_route.fused.trace.json", "10_route") == "fused"
    assert traces.label_of("10_route.failed.fused.trace.json", "10_route") is None
    assert traces.label_of("10_route.fused.trace.json", "20_moe") is None
    assert traces.failed_name("10_route.fused.trace.json", "10_route") == \
        "10_route.failed.fused.trace.json"
    assert not traces.Traces("", "x") and traces.Traces("", "x").path("a") is None


def test_variant_timelines_write_one_trace_per_variant(tmp_path):
    fake = SimpleNamespace(available_variants=lambda device: [
        SimpleNamespace(name="reference", fn=lambda i: i["x"] + 1),
        SimpleNamespace(name="fused", fn=lambda i: i["x"] * 2)])
    t = traces.Traces(tmp_path, "60_attn_res")
    frames = profile.variant_timelines(fake, {"x": torch.ones(4)}, "cpu", traces=t)
    assert set(frames) == {"reference", "fused"}
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "60_attn_res.fused.trace.json", "60_attn_res.reference.trace.json"]
    assert "60_attn_res.fused.trace.json" in t.html(cpu=True)


def test_trace_dir_is_the_runners(tmp_path, capsys):
    rc = cli.main(["run", str(VIEWS), "-p", "trace_dir=/tmp/x", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "set by the runner" in err


def test_stale_trace_folder_of_a_dead_run_is_removed(tmp_path):
    dead = tmp_path / ".30_views.999999999-abc123.traces"
    dead.mkdir()
    (dead / "30_views.x.trace.json").write_text("{}")
    removed, busy = folder.remove_stale(tmp_path)
    assert removed == [dead.name] and busy == [] and not dead.exists()


def _links(page: str) -> list[str]:
    import re

    return re.findall(r"class=['\"]k3lab-trace['\"] href=['\"]\./([^'\"]+)['\"]", page)


def test_runner_carries_traces_and_never_links_an_older_run(tmp_path):
    out = tmp_path / "out"
    (good,) = runner.run([str(VIEWS)], out_dir=out, progress=False)
    assert good.ok, good.error
    assert (out / "30_views.call.trace.json").is_file()
    assert _events(out / "30_views.call.trace.json")
    page = (out / "30_views.html").read_text()
    assert set(_links(page)) == {"30_views.call.trace.json"}  # the header and the cell
    assert "interpreter" in page
    assert _links((out / "index.html").read_text()) == ["30_views.call.trace.json"]
    record = json.loads((out / "30_views.metrics.json").read_text())
    assert "trace_dir" not in record["parameters"]
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]

    # a failed run: its trace apart, linked from its page only; the last good one untouched
    (bad,) = runner.run([str(VIEWS)], out_dir=out, progress=False,
                        params={"fail": True, "label": "second"})
    assert not bad.ok
    assert (out / "30_views.failed.second.trace.json").is_file()
    assert not (out / "30_views.second.trace.json").exists()
    assert set(_links((out / "30_views.failed.html").read_text())) == {
        "30_views.failed.second.trace.json"}
    assert _links((out / "30_views.html").read_text()) == _links(page)
    assert _links((out / "index.html").read_text()) == ["30_views.call.trace.json"]

    # a good run with another trace: the older run's trace and the failed one are gone
    (again,) = runner.run([str(VIEWS)], out_dir=out, progress=False, params={"label": "third"})
    assert again.ok
    assert sorted(p.name for p in out.glob("*.trace.json")) == ["30_views.third.trace.json"]
    assert set(_links((out / "30_views.html").read_text())) == {"30_views.third.trace.json"}
    assert _links((out / "index.html").read_text()) == ["30_views.third.trace.json"]


def test_ray_placement_drops_an_older_runs_traces(tmp_path):
    out = tmp_path
    (out / "30_views.old.trace.json").write_text("{}")
    (out / "30_views.failed.x.trace.json").write_text("{}")
    (out / "40_other.old.trace.json").write_text("{}")
    files = {"30_views.new.trace.json": b"{}", "30_views.html": b"<html></html>",
             "30_views.metrics.json": b"{}"}
    res = runner.Result("30_views", "ok", 1.0)
    batch._place(out, "30_views", res, files)
    assert sorted(p.name for p in out.glob("*.trace.json")) == [
        "30_views.new.trace.json", "40_other.old.trace.json"]


def test_index_links_only_the_good_reports_traces(tmp_path):
    record = {"notebook": "10_route", "status": "ok", "seconds": 1.0, "records": [],
              "headline": {}, "manifest": {"device": "cpu", "date": "2026-01-01"}}
    (tmp_path / "10_route.metrics.json").write_text(json.dumps(record))
    (tmp_path / "10_route.html").write_text("<html></html>")
    for name in ("10_route.fused.trace.json", "10_route.failed.fused.trace.json",
                 "10_routeX.fused.trace.json"):
        (tmp_path / name).write_text("{}")
    page = runner.update_index(tmp_path).read_text()
    assert _links(page) == ["10_route.fused.trace.json"] and "CPU wall clock" in page
    os.remove(tmp_path / "10_route.html")  # no report to go with it: nothing linked
    assert _links(runner.update_index(tmp_path).read_text()) == []


@pytest.mark.parametrize("name", ["00_overview", "10_route", "20_moe", "40_kda", "50_mla",
                                  "60_attn_res", "90_decode_step"])
def test_every_timeline_notebook_declares_trace_dir(name):
    nb = runner.repo_root() / "notebooks" / f"{name}.ipynb"
    assert runner.TRACE_PARAM in runner.declared(nb)
    assert f'Traces(trace_dir, "{name}")' in nb.read_text().replace('\\"', '"')
