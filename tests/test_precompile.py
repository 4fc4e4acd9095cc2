"""k3lab.precompile: a sweep's kernels compiled at once in worker processes, checked without a
GPU by compiling for sm_90 (tests/kernels/precompile_check.py) where Triton's NVIDIA backend is
installed; on the CPU interpreter it does nothing."""

import concurrent.futures as cf
import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from k3lab import precompile

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "kernels"))
from test_sm90_build import _ptxas  # noqa: E402


def _check(tmp_path, *args) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT),
           "TRITON_CACHE_DIR": str(tmp_path / "cache")}  # empty: every kernel is compiled
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" / "precompile_check.py"),
                           *args], capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles for itself")
@pytest.mark.skipif(not _ptxas(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_kernels_compile_in_workers_and_are_found_compiled(tmp_path):
    got = _check(tmp_path)
    assert got["calls"] == 4 and got["failed_calls"] == 1  # the broken call, alone
    assert got["kernels"] >= 2 and got["in_workers"] == got["kernels"]
    assert got["failed_compiles"] == 0 and got["restored"]
    assert got["built_here"] == []  # the workers compiled; this process loaded their cache
    assert got["compiles_after"] == []  # every kernel of the calls is in the JIT's cache


@pytest.mark.gpu
def test_on_the_gpu_kernels_compiled_in_workers_launch_and_are_right(tmp_path):
    got = _check(tmp_path, "--gpu")
    assert got["failed_calls"] == 1 and got["failed_compiles"] == 0
    assert got["kernels"] >= 2 and got["in_workers"] == got["kernels"]
    assert got["built_here"] == [] and got["compiles_after"] == []
    # bf16 outputs (rounding 2^-9 of the value) of fp32 sums: within 2^-7 of the largest
    assert got["rel_err"] <= 2 ** -7


def test_under_the_interpreter_nothing_runs():
    from k3lab.kernels import INTERPRETED

    if not INTERPRETED:
        pytest.skip("the kernels compile here")
    ran = []
    stats = precompile.ahead([lambda: ran.append(1)])
    assert ran == [] and stats.calls == 0 and "interpreter" in stats.skipped


def test_workers_from_the_environment(monkeypatch):
    monkeypatch.setenv(precompile.WORKERS_ENV, "3")
    assert precompile.workers() == 3
    monkeypatch.setenv(precompile.WORKERS_ENV, "0")
    assert precompile.workers() == 0
    monkeypatch.setenv(precompile.WORKERS_ENV, "-1")
    with pytest.raises(ValueError, match=r"\$K3LAB_COMPILE_WORKERS: expected a count"):
        precompile.workers()
    monkeypatch.delenv(precompile.WORKERS_ENV)
    assert 1 <= precompile.workers() <= 8


def test_the_cache_folder_is_pinned_for_kernels_and_workers(monkeypatch, tmp_path):
    """torch.compile moves an unset $TRITON_CACHE_DIR to a folder of its own the first time it
    runs a kernel: the batch pins it, so a notebook finds what the warming workers compiled."""
    from triton import knobs

    from k3lab import kernelenv

    monkeypatch.delenv(precompile.CACHE_ENV, raising=False)
    assert precompile.pin_cache_dir() == knobs.cache.dir == os.environ[precompile.CACHE_ENV]
    monkeypatch.setenv(precompile.CACHE_ENV, str(tmp_path))
    assert precompile.pin_cache_dir() == str(tmp_path)  # a folder already chosen stays
    assert kernelenv.environ("cuda")[precompile.CACHE_ENV] == str(tmp_path)
    monkeypatch.delenv(precompile.CACHE_ENV)
    assert kernelenv.environ("cpu")[precompile.CACHE_ENV] == knobs.cache.dir


@pytest.mark.gpu
def test_torch_compile_leaves_a_pinned_cache_folder(tmp_path):
    """In a fresh process: with the folder pinned, a torch.compile'd function run on the GPU
    leaves $TRITON_CACHE_DIR where it was."""
    code = ("import os, torch; from k3lab import precompile; "
            "before = precompile.pin_cache_dir(); "
            "f = torch.compile(lambda x: torch.sin(x) * 2); f(torch.ones(8, device='cuda')); "
            "print(before == os.environ['TRITON_CACHE_DIR'])")
    env = {k: v for k, v in os.environ.items() if k != precompile.CACHE_ENV}
    env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == "True"


@pytest.fixture
def handed(monkeypatch):
    """The calls each precompile.ahead is handed, run here (under the interpreter) to show
    that they launch what they should."""
    got: list[list] = []

    def record(calls, n_workers=None):
        got.append(list(calls))
        return precompile.Stats()

    monkeypatch.setattr(precompile, "ahead", record)
    return got


def test_measure_hands_over_each_fused_variant(handed, monkeypatch):
    from k3lab import boundaries, profile
    from k3lab.config import preset

    b = boundaries.get("route")
    profile.measure(b, preset("tiny"), "cpu", modes=("eager",), launches=False)
    (calls,) = handed
    fused = [v for v in b.available_variants("cpu") if v.role == "fused"]
    assert len(calls) == len(fused) >= 1
    for call in calls:
        assert call() is not None  # the fused variant's output


def test_a_sweep_hands_over_every_point_first(handed):
    from k3lab import studies

    s = studies.setup("route", "tiny", 1, "cpu")
    from k3lab.studies import route as study

    study.sweep(s, tokens=[1, 3])
    sweep_calls = [c for c in handed if len(c) == 2]  # measure hands one call per variant
    assert len(sweep_calls) == 1
    for call in sweep_calls[0]:
        call()


def test_the_dense_and_mla_sweeps_hand_over_their_points(handed):
    from k3lab import studies

    s = studies.setup("dense", "tiny", 1, "cpu")
    from k3lab.studies import dense as dstudy

    shapes = dstudy.default_shapes(s)
    dstudy.sweep(s, [1, 2], shapes=shapes, skeleton=False)
    assert len(handed[0]) == 2 * len(shapes)  # every (tp, shape) before the first is timed
    for call in handed[0]:
        call()

    handed.clear()
    s = studies.setup("mla", "tiny", 1, "cpu")
    from k3lab.studies import mla as mstudy

    mstudy.split_sweep(s, [64, 128], [1, 2])
    assert len(handed[0]) == 2  # one call per context, each launching every split count
    for call in handed[0]:
        call()


def test_the_attn_res_and_moe_sweeps_hand_over_their_points(handed):
    from k3lab import studies

    s = studies.setup("attn_res", "tiny", 1, "cpu")
    from k3lab.studies import attn_res as astudy

    astudy.depth_sweep(s, [0, 2])
    assert len(handed[0]) == 2
    for call in handed[0]:
        call()

    handed.clear()
    s = studies.setup("moe", "tiny", 1, "cpu")
    from k3lab.studies import moe as mstudy

    mstudy.token_sweep(s, [1, 2], "mxfp4", 1)
    assert len(handed[0]) == 2  # one call per token count: the fused block and its stages
    for call in handed[0]:
        call()


def test_a_worker_that_hangs_is_given_up_and_the_kernel_compiled_here(monkeypatch):
    import concurrent.futures as cf

    class Hung:
        def submit(self, *args, **kwargs):
            return cf.Future()  # never done

    monkeypatch.setattr(precompile, "_GAVE_UP", False)
    monkeypatch.setattr(precompile, "_spec", lambda fn: {"spec": 1})
    stats = precompile.Stats()
    with cf.ThreadPoolExecutor(2) as threads:
        ex = precompile._SendToWorkers(Hung(), threads, stats, timeout_s=0.05)
        assert ex.submit(lambda: "kernel").result(timeout=5) == "kernel"
    assert stats.kernels == 1 and stats.in_workers == 0 and precompile._GAVE_UP


def _list_check(cache, *args) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT),
           "TRITON_CACHE_DIR": str(cache)}
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "kernels" /
                                                "kernel_list_check.py"), *args],
                          capture_output=True, text=True, env=env, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU compiles for itself")
@pytest.mark.skipif(not _ptxas(), reason="Triton's NVIDIA backend (ptxas) is not installed")
def test_a_kernel_list_recorded_in_one_process_compiles_another_ones_kernels(tmp_path):
    listed = tmp_path / "nb.kernels.jsonl"
    got = _list_check(tmp_path / "cache_a", "record", str(listed))
    assert got["recording"] and got["lines"] >= 3  # specializations of plain and gate/up
    assert "wrapped_fill" in got["names"]  # behind a heuristics wrapper: listed too
    assert sum(got["noted"].values()) == got["lines"]  # an empty cache: each built here
    lines = got["lines"]
    got = _list_check(tmp_path / "cache_b", "replay", str(listed))  # an empty cache
    assert got["listed"] == lines and got["compiled"] == lines and got["failed"] == 0
    assert list(got["ready"]) == ["nb"]  # the missing list adds no label
    assert got["noted"] == {}  # every kernel came from the cache
    assert got["built_here"] == []  # the launches found the workers' kernels in the cache


@pytest.mark.gpu
def test_on_the_gpu_a_kernel_list_compiles_kernels_that_launch_and_are_right(tmp_path):
    listed = tmp_path / "nb.kernels.jsonl"
    got = _list_check(tmp_path / "cache_a", "record", str(listed), "--gpu")
    assert got["recording"] and got["lines"] >= 2
    got = _list_check(tmp_path / "cache_b", "replay", str(listed), "--gpu")
    assert got["compiled"] == got["listed"] >= 2 and got["built_here"] == []
    assert got["noted"] == {}
    assert list(got["ready"]) == ["nb"] and got["ready"]["nb"] >= 0
    assert got["rel_err"] < 2e-2  # bf16 inputs, fp32 accumulation, bf16 output


def test_kernel_lists_read_each_kernel_once_and_skip_bad_lines(tmp_path):
    line = {"module": "m", "name": "k", "target": ["cuda", 90, 32], "data": "{}"}
    src = tmp_path / "rec.tmp"
    src.write_text("\n".join([json.dumps(line), "not json", json.dumps(line),
                               json.dumps({**line, "data": '{"a": 1}'}), ""]))
    assert precompile.read_list(src) == [line, {**line, "data": '{"a": 1}'}]
    dest = tmp_path / "nb.kernels.jsonl"
    assert precompile.keep_list(src, dest) and len(precompile.read_list(dest)) == 2
    assert not precompile.keep_list(tmp_path / "none.tmp", dest)  # nothing recorded: kept
    assert len(precompile.read_list(dest)) == 2
    assert precompile.warm([tmp_path / "none.tmp"]).futures == []
    assert not precompile.record(None) or os.environ.get(precompile.LIST_ENV)


def test_a_warm_says_when_all_of_each_list_was_done():
    gate = threading.Event()
    with cf.ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(lambda: True), ex.submit(gate.wait, 10), ex.submit(lambda: True)]
        warming = precompile.Warm(None, futures, ["a", "b", "b"], time.monotonic())
        futures[0].result()
        futures[2].result()
        assert list(warming.ready_after()) == ["a"]  # b waits on its second line
        gate.set()
        futures[1].result()
    ready = warming.ready_after()
    assert list(ready) == ["a", "b"] and 0 <= ready["a"] <= ready["b"]


def test_start_workers_starts_the_pool_that_ahead_uses():
    """In a fresh process (the pool is the process's own): every worker asked for is started,
    each imports Triton's compiler and the kernels, and ahead's pool is that one."""
    code = ("import os, time; from k3lab import precompile as p; n = p.start_workers(2); "
            "pool = p._pool(2); pids = {pool.submit(p._worker_ready).result(timeout=120) "
            "for _ in range(4)}; print(n, len(pool._processes), pids <= set(pool._processes), "
            "p.start_workers(0))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, env={**os.environ, "TRITON_INTERPRET": "1"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["2", "2", "True", "0"]


def test_a_batch_keeps_and_prints_what_each_notebook_compiled_itself(tmp_path, monkeypatch,
                                                                    capsys):
    """The kernel-list path a GPU run gives a notebook's kernel, on the CPU here: a cell notes
    front ends as precompile.record's hook would; the run keeps the counts in the metrics and
    prints them under the notebook's line, and leaves no temp file."""
    import nbformat

    from k3lab import runner

    nbs, out = tmp_path / "nbs", tmp_path / "out"
    nbs.mkdir()
    params = nbformat.v4.new_code_cell("seed = 0")
    params.metadata["tags"] = ["parameters"]
    note = ("import os\nfrom k3lab import precompile, report\n"
            f"p = precompile.built_path(os.environ[{precompile.LIST_ENV!r}])\n"
            "p.write_text('stage1\\nstage2\\nstage1\\n')\n"
            "report.publish([{'x': 1}], headline='h')")
    nb = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell(note)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, nbs / "00_a.ipynb")
    monkeypatch.setattr(runner, "_kernel_list_file",
                        lambda out_dir, name, device: Path(out_dir) / f".{name}.{os.getpid()}"
                                                                      "-kernels.tmp")
    res = runner.run(None, notebook_dir=nbs, out_dir=out, progress=True)
    assert res.ok, [r.error for r in res]
    record = json.loads((out / "00_a.metrics.json").read_text())
    assert record["compiled_here"] == {"stage1": 2, "stage2": 1}
    printed = capsys.readouterr().out
    assert "compiled in its own process: 3 kernel(s): stage1 x2, stage2 x1" in printed
    assert not list(out.glob(".*"))
