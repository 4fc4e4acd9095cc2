"""k3lab run --profile: each cell's host work sampled in the kernel, summed by category into the
report's header and metrics, the call tree beside the report."""

import json
from pathlib import Path

import nbformat
import pytest

from k3lab import hostprofile, runner

pytest.importorskip("pyinstrument")


def _id(fn: str, path: str, line: int = 1) -> str:
    return f"{fn}\x00{path}\x00{line}"


@pytest.mark.parametrize("stack, expected", [
    ([_id("run", "/s/triton/compiler/compiler.py")], "Triton compile"),
    ([_id("make_ir", "/s/triton/backends/nvidia/compiler.py")], "Triton compile"),
    ([_id("_build", "/s/triton/runtime/build.py")], "Triton compile"),
    ([_id("_do_compile", "/s/triton/runtime/jit.py")], "other host"),  # the JIT's own lookup
    ([_id("ahead", "/k/k3lab/precompile.py"),  # waiting for the compile workers
      _id("__exit__", "/s/triton/runtime/_async_compile.py"), _id("wait", "/u/threading.py")],
     "Triton compile"),
    ([_id("_implicit_cvt", "/s/triton/runtime/interpreter.py")], "Triton interpreter"),
    ([_id("__call__", "/s/torch/_dynamo/convert_frame.py")], "torch.compile"),
    ([_id("fx_codegen_and_compile", "/s/torch/_inductor/compile_fx.py")], "torch.compile"),
    ([_id("run", "/s/torch/_inductor/runtime/triton_heuristics.py")], "other host"),
    ([_id("time_variant", "/k/k3lab/profile.py"), _id("synchronize", "<built-in>", 0)],
     "waiting on the device"),
    ([_id("f", "/k/k3lab/profile.py"), _id("Tensor.item", "<built-in>", 0)],
     "waiting on the device"),
    ([_id("item", "/k/k3lab/profile.py")], "other host"),  # a Python function named item
    ([_id("moe_weights", "/k/k3lab/weights.py")], "weights and inputs"),
    ([_id("make_inputs", "/k/k3lab/boundaries/moe.py")], "weights and inputs"),
    ([_id("moe_reference", "/k/k3lab/reference/moe.py")], "references"),
    ([_id("savefig", "/s/matplotlib/figure.py")], "plots and tables"),
    ([_id("f", "/k/k3lab/studies/moe.py")], "other host"),
    # priority: the first category of the list that any frame matches
    ([_id("make_inputs", "/k/k3lab/boundaries/moe.py"), _id("compile", "/s/triton/compiler/c.py")],
     "Triton compile"),
    ([_id("_find_and_load", "<frozen importlib._bootstrap>"),
      _id("<module>", "/s/torch/_dynamo/convert_frame.py")], "imports"),
])
def test_category_of_a_stack(stack, expected):
    assert hostprofile.category(stack) == expected


def test_a_long_profile_page_is_resampled(tmp_path, monkeypatch):
    """The page's call tree holds at most PAGE_SAMPLES samples; rare paths drop out, the
    frequent ones stay."""
    from pyinstrument.session import Session

    monkeypatch.setattr(hostprofile, "PAGE_SAMPLES", 50)
    n = 2000
    records = [([_id("main", "/k/x.py"), _id("hot" if i % 4 else f"rare{i}", "/k/y.py")], 0.001)
               for i in range(n)]
    session = Session(frame_records=records, start_time=0.0, duration=n * 0.001,
                      min_interval=0.001, max_interval=0.001, sample_count=n,
                      start_call_stack=[_id("main", "/k/x.py")], target_description="t",
                      cpu_time=2.0, sys_path=[],
                      sys_prefixes=[])
    page = hostprofile.write_html(session, tmp_path / "p.html").read_text()
    assert "hot" in page and page.count("rare") < 60  # of 500 rare frames


def test_summarize_adds_every_sample_once():
    from pyinstrument.session import Session

    records = [([_id("a", "/s/triton/compiler/c.py")], 2.0),
               ([_id("b", "/k/k3lab/weights.py")], 0.5),
               ([_id("c", "/k/x.py")], 0.25), ([_id("a", "/s/triton/compiler/c.py")], 1.0)]
    session = Session(frame_records=records, start_time=0.0, duration=3.75, min_interval=0.005,
                      max_interval=0.005, sample_count=4, start_call_stack=[],
                      target_description="t", cpu_time=3.75, sys_path=[], sys_prefixes=[])
    got = hostprofile.summarize(session)
    assert got == {"seconds": {"Triton compile": 3.0, "weights and inputs": 0.5,
                               "other host": 0.25}, "profiled_s": 3.75, "samples": 4}
    line = hostprofile.header_html(got, "a b.profile.html")
    assert "Triton compile 3.0 s (80 %)" in line and "a%20b.profile.html" in line
    assert "eager latencies" in line


def _notebooks(folder: Path) -> Path:
    folder.mkdir()
    params = nbformat.v4.new_code_cell("seed = 0\nfail = False")
    params.metadata["tags"] = ["parameters"]
    cells = [params,
             nbformat.v4.new_code_cell("import time\nfrom k3lab import report\n"
                                       "time.sleep(0.3)"),
             nbformat.v4.new_code_cell("if fail:\n    raise RuntimeError('boom')\n"
                                       "report.publish([{'x': 1}], headline='h')")]
    for name in ("00_a", "10_b"):
        nb = nbformat.v4.new_notebook(cells=cells)
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, folder / f"{name}.ipynb")
    return folder


@pytest.mark.parametrize("jobs", [1, 2])
def test_a_profiled_run_writes_the_breakdown_and_the_call_tree(tmp_path, jobs):
    nbs, out = _notebooks(tmp_path / "nbs"), tmp_path / "out"
    res = runner.run(None, notebook_dir=nbs, out_dir=out, progress=False, jobs=jobs,
                     profile=True)
    assert res.ok, [r.error for r in res]
    for name in ("00_a", "10_b"):
        prof = json.loads((out / f"{name}.metrics.json").read_text())["host_profile"]
        assert prof["profiled_s"] >= 0.3 and prof["samples"] > 0  # the sleeping cell at least
        assert abs(sum(prof["seconds"].values()) - prof["profiled_s"]) < 0.01
        page = (out / f"{name}.html").read_text()
        assert f"./{name}.profile.html" in page and "Host profile of the cells" in page
        tree = (out / f"{name}.profile.html").read_text()
        assert "fonts.googleapis" not in tree and "sleep" in tree
    assert not list(out.glob(".*"))  # no temp file left

    # an unprofiled run of the same folder does not leave the older run's call tree behind
    res = runner.run(["00_a"], notebook_dir=nbs, out_dir=out, progress=False, jobs=jobs)
    assert res.ok
    assert not (out / "00_a.profile.html").exists()
    assert "host_profile" not in json.loads((out / "00_a.metrics.json").read_text())
    assert (out / "10_b.profile.html").exists()


def test_a_failed_profiled_run_keeps_the_last_good_call_tree(tmp_path):
    nbs, out = _notebooks(tmp_path / "nbs"), tmp_path / "out"
    assert runner.run(["00_a"], notebook_dir=nbs, out_dir=out, progress=False,
                      profile=True).ok
    before = (out / "00_a.profile.html").read_bytes()
    res = runner.run(["00_a"], notebook_dir=nbs, out_dir=out, progress=False, profile=True,
                     params={"fail": True})
    assert not res.ok and "boom" in res[0].error
    assert (out / "00_a.profile.html").read_bytes() == before
    assert not list(out.glob(".*"))


def test_profile_refusals_come_before_anything_runs(tmp_path, monkeypatch):
    nbs = _notebooks(tmp_path / "nbs")
    with pytest.raises(ValueError, match="--profile: not with --ray"):
        runner.run(None, notebook_dir=nbs, out_dir=tmp_path / "o", profile=True, ray="local")
    monkeypatch.setattr(hostprofile, "available", lambda: False)
    with pytest.raises(ValueError, match=r"--profile: needs pyinstrument"):
        runner.run(None, notebook_dir=nbs, out_dir=tmp_path / "o", profile=True)
    assert not (tmp_path / "o").exists()
