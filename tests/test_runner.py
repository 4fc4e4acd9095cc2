"""The runner and the CLI, end to end on the fixture notebooks of tests/notebooks/.

00_echo publishes its parameters (and raises when fail=True), 10_other declares only seed and
label, 20_broken always raises. Each run starts a real "python3" Jupyter kernel through papermill.
"""

import json
import os
import shutil
from pathlib import Path

import pytest

from k3lab import cli, kernelenv, report, runner

FIXTURES = Path(__file__).parent / "notebooks"
ECHO_DEFAULTS = {"preset": "tiny", "tp": 1, "device": "cpu", "seed": 0, "sizes": [1, 2],
                 "scale": 0.5, "label": "x", "flag": False, "fail": False}


def _json(path: Path) -> dict:
    return json.loads(path.read_text())


@pytest.fixture
def nb_env(monkeypatch):
    """Point the runner (and the CLI) at the fixture notebooks through $K3LAB_NOTEBOOKS."""
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    return FIXTURES


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    """One CLI batch over every fixture: tp 2 and CLI-string parameters; 20_broken fails.

    Run from an environment without TRITON_INTERPRET and with MPLBACKEND=Agg, which the runner
    must set and clear for the kernel (interpreter on CPU, inline plots).
    """
    out = tmp_path_factory.mktemp("batch")
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("TRITON_INTERPRET", raising=False)
        mp.setenv("MPLBACKEND", "Agg")
        rc = cli.main(["run", "--notebooks", str(FIXTURES), "--tp", "2", "-p", "label=hello",
                       "-p", "sizes=[3,4]", "-p", "scale=2", "--out", str(out)])
    return rc, out


def test_the_kernel_environment_keeps_this_processes_variables(monkeypatch):
    """A kernel papermill starts inherits this environment with the runner's changes: a site
    folder on PYTHONPATH (where a machine keeps ipykernel) and any other variable stay."""
    monkeypatch.setenv("PYTHONPATH", "/opt/some/site")
    monkeypatch.setenv("K3LAB_TEST_MARK", "kept")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    before = dict(os.environ)
    with kernelenv.env("cuda"):
        assert os.environ.get("K3LAB_TEST_MARK") == "kept"
        assert os.environ["PYTHONPATH"].split(os.pathsep) == [str(runner.repo_root()),
                                                               "/opt/some/site"]
        assert "TRITON_INTERPRET" not in os.environ
    assert dict(os.environ) == before


@pytest.mark.skipif(os.name == "nt", reason="no Unix sockets")
def test_kernels_talk_over_unix_sockets_each_at_its_own_path():
    """No TCP ports to race for between kernels starting at once."""
    a, b = kernelenv.manager(), kernelenv.manager()
    assert a.transport == b.transport == "ipc" and a.ip != b.ip
    assert a.kernel_name == kernelenv.KERNEL_NAME


def test_a_gpu_kernel_lists_its_kernels_in_a_temp_file_of_the_folder(tmp_path):
    from k3lab import folder, precompile

    listed = runner._kernel_list_file(tmp_path, "10_route", "cuda:0")
    assert listed.parent == tmp_path and folder.TEMP_PATTERN.match(listed.name)
    assert kernelenv.environ("cuda", None, listed)[precompile.LIST_ENV] == str(listed)
    assert runner._kernel_list_file(tmp_path, "10_route", "cpu") is None
    assert precompile.LIST_ENV not in kernelenv.environ("cpu")


# ---------------------------------------------------------------- parameters, names

def test_notebook_parameters_reads_the_tagged_cell():
    assert runner.notebook_parameters(FIXTURES / "00_echo.ipynb") == ECHO_DEFAULTS
    assert runner.notebook_parameters(FIXTURES / "10_other.ipynb") == {"seed": 0,
                                                                       "label": "other"}


@pytest.mark.parametrize("name", ["00_echo", "echo", "00_echo.ipynb",
                                  str(FIXTURES / "00_echo.ipynb")])
def test_resolve_accepts_short_and_full_names(nb_env, name):
    assert runner.resolve([name]) == [(FIXTURES / "00_echo.ipynb").resolve()]


def test_resolve_unknown_name_lists_the_notebooks(nb_env):
    with pytest.raises(ValueError, match=r"unknown notebook 'nope'.*00_echo, 10_other, 20_broken"):
        runner.resolve(["nope"])
    assert [p.stem for p in runner.resolve(None)] == ["00_echo", "10_other", "20_broken"]


def test_missing_notebook_dir_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="notebooks folder not found"):
        runner.notebook_dir(tmp_path / "absent")


@pytest.mark.parametrize("key, given, expected", [
    ("tp", "8", 8), ("tp", 3, 3), ("scale", "2", 2.0), ("scale", 1, 1.0),
    ("flag", "true", True), ("flag", "0", False), ("sizes", "[1,2,4]", [1, 2, 4]),
    ("sizes", "1,2,4", [1, 2, 4]), ("sizes", (5,), [5]), ("label", "8", "8"),
], ids=lambda v: str(v))
def test_validate_coerces_cli_strings(key, given, expected):
    got = runner.validate(FIXTURES / "00_echo.ipynb", {key: given})
    assert got == {key: expected} and type(got[key]) is type(expected)


@pytest.mark.parametrize("key, given", [
    ("tp", "abc"), ("tp", 1.5), ("tp", True), ("flag", "maybe"), ("flag", 1), ("scale", "x"),
    ("sizes", "[1,"), ("sizes", 3), ("label", 3),
], ids=lambda v: str(v))
def test_validate_rejects_bad_types(key, given):
    with pytest.raises(ValueError, match=rf"00_echo: parameter '{key}': expected"):
        runner.validate(FIXTURES / "00_echo.ipynb", {key: given})


def test_validate_rejects_unknown_key_naming_allowed():
    with pytest.raises(ValueError, match=r"unknown parameter 'nope'; allowed: seed, label"):
        runner.validate(FIXTURES / "10_other.ipynb", {"nope": 1})


@pytest.mark.parametrize("kwargs, match", [
    ({"params": {"nope": 1}}, r"unknown parameter 'nope' for 00_echo, 10_other.*allowed"),
    ({"params": {"scale": "x"}}, r"00_echo: parameter 'scale'"),
    ({"params": {"preset": "tiny"}}, r"use --preset"),
    ({"preset": "kimi-k9"}, r"preset"),
    ({"tp": 4}, r"tp"),
    ({"device": "tpu"}, r"device"),
], ids=["unknown-key", "bad-type", "option-as-param", "bad-preset", "tp-not-dividing",
        "bad-device"])
def test_run_rejects_before_anything_runs(nb_env, tmp_path, kwargs, match):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        runner.run(["00_echo", "10_other"], out_dir=out, progress=False, **kwargs)
    assert not out.exists()


# ---------------------------------------------------------------- a batch through the CLI

def test_batch_exit_code_and_files(batch):
    rc, out = batch
    assert rc == 1  # 20_broken failed
    for name in ("00_echo", "10_other"):
        for suffix in (".ipynb", ".html", ".metrics.json"):
            assert (out / f"{name}{suffix}").is_file()
    assert not list(out.glob("*.kernels.jsonl"))  # a CPU run compiles nothing to list
    assert not (out / "20_broken.metrics.json").exists()
    assert (out / "20_broken.failed.ipynb").is_file() and (out / "20_broken.failed.html").is_file()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]  # no temp files left
    assert not [p.name for p in (out / report.ASSETS_DIR).iterdir() if p.name.startswith(".")]


def test_parameters_injected_and_metrics_published(batch):
    _, out = batch
    m = _json(out / "00_echo.metrics.json")
    assert m["status"] == "ok" and m["error"] is None
    (rec,) = m["records"]
    assert rec == {**rec, "preset": "tiny", "tp": 2, "device": "cpu", "seed": 0, "sizes": [3, 4],
                   "scale": 2.0, "label": "hello", "flag": False}
    assert rec["interpret"] == "1"  # TRITON_INTERPRET=1 for a CPU run
    assert Path(rec["cwd"]) == runner.repo_root()
    assert rec["nan"] is None  # JSON-safe
    assert m["headline"] == {"label": "hello", "tp": 2, "sum_sizes": 7}
    man = m["manifest"]
    assert {"git_commit", "git_dirty", "gpu", "driver", "torch", "triton", "python", "date",
            "parameters"} <= set(man)
    assert (man["preset"], man["tp"], man["device"]) == ("tiny", 2, "cpu")
    assert man["date"].endswith("+00:00") and man["torch"] and man["triton"]


def test_only_declared_parameters_are_injected(batch):
    _, out = batch
    m = _json(out / "10_other.metrics.json")
    assert m["parameters"] == {"label": "hello"}
    assert m["records"] == [{"present": ["seed", "label"], "label": "hello"}]
    assert m["headline"] == {"summary": "other ran"}


def test_html_hides_code_and_embeds_plots(batch):
    _, out = batch
    page = (out / "00_echo.html").read_text()
    assert "CODE_ONLY_MARKER" not in page
    # two plot cells (the figure as the cell's value; with a trailing ';'): each shown once
    assert page.count('src="data:image/png;base64') == 2
    assert report.CPU_WARNING in page
    # the hidden code no longer shows the parameters: the header does
    assert "<b>k3lab report 00_echo</b>: device='cpu', preset='tiny', tp=2, label='hello'" in page


def test_reports_share_one_stylesheet(batch):
    _, out = batch
    (css,) = (out / report.ASSETS_DIR).iterdir()
    for name in ("00_echo.html", "10_other.html", "20_broken.failed.html"):
        page = (out / name).read_text()
        assert f'href="{report.ASSETS_DIR}/{css.name}"' in page, name
        assert ".jp-Notebook" not in page  # the lab theme is in the shared file only
    assert ".jp-Notebook" in css.read_text()


def test_failed_notebook_reported_with_its_error(batch):
    _, out = batch
    failed = _json(out / "20_broken.failed.json")
    assert failed["status"] == "failed" and failed["error"].startswith("ZeroDivisionError")
    assert "ZeroDivisionError" in (out / "20_broken.failed.html").read_text()


def test_index_lists_every_notebook_with_status(batch):
    _, out = batch
    page = (out / "index.html").read_text()
    for name in ("00_echo", "10_other", "20_broken"):
        assert f"<b>{name}</b>" in page
    assert page.count("class='ok'") == 2 and page.count("class='failed'") == 1
    assert "ZeroDivisionError: division by zero" in page
    assert "<th>sum_sizes</th><td>7</td>" in page
    assert "href='./00_echo.html'" in page and "href='./20_broken.failed.html'" in page
    manifest = _json(out / "manifest.json")["reports"]
    assert {k: v["status"] for k, v in manifest.items()} == {
        "00_echo": "ok", "10_other": "ok", "20_broken": "failed"}
    assert {"git_commit", "torch", "triton", "date"} <= set(manifest["00_echo"]["manifest"])


def test_failure_keeps_last_good_report_then_recovers(batch, nb_env, tmp_path, capsys):
    _, batch_out = batch
    out = tmp_path / "out"
    shutil.copytree(batch_out, out)
    good = {s: (out / f"00_echo{s}").read_bytes() for s in (".ipynb", ".html", ".metrics.json")}

    (res,) = runner.run(["echo"], params={"fail": "true"}, out_dir=out)
    assert not res.ok and res.error.startswith("RuntimeError: fixture failure requested")
    line = [ln for ln in capsys.readouterr().out.splitlines() if "00_echo" in ln][0]
    assert "failed" in line and " s " in line
    for suffix, data in good.items():
        assert (out / f"00_echo{suffix}").read_bytes() == data, suffix
    assert (out / "00_echo.failed.ipynb").is_file()
    page = (out / "index.html").read_text()
    assert "fixture failure requested" in page and "last good report" in page
    assert "<b>10_other</b>" in page and "<b>20_broken</b>" in page  # earlier reports kept

    assert cli.main(["run", "echo", "--out", str(out)]) == 0
    assert not list(out.glob("00_echo.failed.*"))
    assert _json(out / "00_echo.metrics.json")["records"][0]["label"] == "x"  # defaults again
    assert (out / "index.html").read_text().count("class='failed'") == 1  # only 20_broken


# ---------------------------------------------------------------- CLI errors and list

@pytest.mark.parametrize("args, match", [
    (["-p", "nope=1"], "unknown parameter 'nope'"),
    (["-p", "tp=8"], "use --tp"),
    (["-p", "scale=abc"], "parameter 'scale'"),
    (["-p", "novalue"], "expected KEY=VALUE"),
    (["--preset", "kimi-k9"], "preset"),
    (["--tp", "4"], "tp"),
    (["missing_nb"], "unknown notebook 'missing_nb'"),
], ids=["unknown-param", "option-as-param", "bad-value", "no-equals", "bad-preset",
        "tp-not-dividing", "unknown-notebook"])
def test_cli_usage_errors_exit_2_and_run_nothing(nb_env, tmp_path, capsys, args, match):
    out = tmp_path / "out"
    assert cli.main(["run", "echo", *args, "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3lab: error:") and match in err and "\n" not in err
    assert not out.exists()


@pytest.mark.parametrize("args, noted", [(["--preset", "kimi-k3", "--tp", "8"], True),
                                         (["--preset", "kimi-k3", "--device", "cpu"], False),
                                         ([], False)],
                         ids=["k3-no-device", "k3-cpu-asked", "tiny"])
def test_cli_notes_a_cpu_run_of_a_large_preset_where_a_gpu_is_visible(monkeypatch, capsys,
                                                                       args, noted):
    seen = {}

    class _Done:
        interrupted, ok = False, True

    def fake_run(names, **kw):
        seen.update(kw)
        return _Done()

    monkeypatch.setattr(cli, "_gpu_visible", lambda: True)
    monkeypatch.setattr(runner, "run", fake_run)
    assert cli.main(["run", "echo", *args]) == 0
    assert seen["device"] == "cpu"
    assert ("pass --device cuda" in capsys.readouterr().err) == noted


def test_cli_bad_tp_type_is_an_argparse_error(capsys):
    assert cli.main(["run", "--tp", "two"]) == 2
    assert "invalid int value" in capsys.readouterr().err


def test_cli_list_shows_notebooks_and_defaults(nb_env, capsys):
    assert cli.main(["list"]) == 0
    text = capsys.readouterr().out
    assert text.splitlines()[0] == "00_echo"
    for expected in ("    sizes  = [1, 2]", "    label  = 'x'", "10_other", "    label = 'other'",
                     "20_broken", "    device = 'cpu'"):
        assert expected in text


def test_erratum_shown_beside_report_untouched(batch, tmp_path):
    """A person's <name>.erratum.txt is shown in the index and manifest; the report's own
    files stay byte for byte as the run wrote them."""
    _, batch_out = batch
    out = tmp_path / "out"
    shutil.copytree(batch_out, out)
    before = (out / "00_echo.metrics.json").read_bytes()
    (out / "00_echo.erratum.txt").write_text("the <bar> check left out a row\n")
    runner.update_index(out)
    page = (out / "index.html").read_text()
    assert "erratum: the &lt;bar&gt; check left out a row" in page
    manifest = _json(out / "manifest.json")["reports"]
    assert manifest["00_echo"]["erratum"] == "the <bar> check left out a row"
    assert "erratum" not in manifest["10_other"]
    assert (out / "00_echo.metrics.json").read_bytes() == before


def test_cell_progress_with_last_run_and_quiet(batch, nb_env, tmp_path, capsys):
    """A per-cell bar (papermill's tqdm) names the notebook and the previous run's time;
    --quiet prints nothing but errors."""
    _, batch_out = batch
    out = tmp_path / "out"
    shutil.copytree(batch_out, out)
    last = _json(out / "10_other.metrics.json")["seconds"]
    runner.run(["other"], out_dir=out, cells=True)
    captured = capsys.readouterr()
    assert f"[1/1] 10_other (last run {last:.0f} s)" in captured.err and "cell" in captured.err
    assert f"(last {last:.1f} s)" in captured.out
    assert cli.main(["run", "other", "-q", "--out", str(out)]) == 0
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == ""


def test_report_is_for_people(batch):
    """Floats at a reader's precision, long tables folded, warnings in a log beside the page
    (the executed notebook keeps them)."""
    _, out = batch
    page = (out / "00_echo.html").read_text()
    assert "670.015991" not in page and "1.192093e-07" not in page and "530.0<" not in page
    assert ">670<" in page.replace("</td>", "<").replace("<td>", ">") and "1.2e-07" in page
    assert "<details><summary>table of 40 rows" in page
    assert "FIXTURE_WARNING" not in page and "warning(s) of the run" in page
    assert "FIXTURE_WARNING" in (out / "00_echo.log").read_text()
    assert "FIXTURE_WARNING" in (out / "00_echo.ipynb").read_text()
    assert not (out / "10_other.log").exists()


def test_jobs_run_notebooks_concurrently(batch, nb_env, tmp_path, capsys):
    """--jobs 2 on the CPU: every notebook in a worker of its own, the same files and index as
    one at a time, the results in notebook order."""
    _, serial = batch
    out = tmp_path / "out"
    assert cli.main(["run", "--jobs", "2", "--tp", "2", "-p", "label=hello", "-p", "sizes=[3,4]",
                     "-p", "scale=2", "--out", str(out)]) == 1
    text = capsys.readouterr().out
    assert sorted(ln.split()[1] for ln in text.splitlines() if ln.startswith("[")) == [
        "00_echo", "10_other", "20_broken"]
    assert sorted(p.name for p in out.iterdir() if p.is_file()) == sorted(
        p.name for p in serial.iterdir() if p.is_file())
    assert _json(out / "00_echo.metrics.json")["records"] == \
        _json(serial / "00_echo.metrics.json")["records"]
    assert _json(out / "manifest.json")["reports"].keys() == {"00_echo", "10_other",
                                                              "20_broken"}


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_bad_jobs_exit_2(nb_env, tmp_path, capsys, jobs):
    assert cli.main(["run", "echo", f"--jobs={jobs}", "--out", str(tmp_path / "o")]) == 2
    assert "--jobs" in capsys.readouterr().err and not (tmp_path / "o").exists()


def test_cuda_slots_never_share_a_gpu():
    import torch

    from k3lab import batch

    assert batch.gpu_slots("cpu", 3) == [None, None, None]
    n = torch.cuda.device_count()
    slots = batch.gpu_slots("cuda", 8)
    assert slots == ([None] if n <= 1 else [str(i) for i in range(min(8, n))])


def test_auto_jobs_is_one_per_core_and_never_more_than_the_notebooks():
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert runner.auto_jobs("cpu", 1) == 1
    assert runner.auto_jobs("cpu", 1000) == cores
    assert runner.auto_jobs("cpu", 0) == 1


def test_cpu_slots_share_the_cores(monkeypatch):
    """Workers of a CPU batch cap their notebooks' thread pools at their share of the cores,
    unless the user set the variable; a GPU batch leaves it alone."""
    from k3lab import batch

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    assert batch.cpu_threads(1) == cores and batch.cpu_threads(10 ** 6) == 1
    for var in batch.THREAD_VARS:
        monkeypatch.delenv(var, raising=False)
    got = {}
    batch.run_slots([(0, ("OMP_NUM_THREADS",)), (1, ("MKL_NUM_THREADS",))], [None, None],
                    os.getenv, lambda i, r, g: got.__setitem__(i, r), lambda i, e: None,
                    threads=3)
    assert got == {0: "3", 1: "3"}
    monkeypatch.setenv("OMP_NUM_THREADS", "7")
    batch.run_slots([(0, ("OMP_NUM_THREADS",))], [None], os.getenv,
                    lambda i, r, g: got.__setitem__(i, r), lambda i, e: None, threads=3)
    assert got[0] == "7"


# ---------------------------------------------------------------- kernels started ahead

def _pid_notebooks(folder: Path, names: list[str]) -> Path:
    """Notebooks that publish their kernel's pid and which of the preload was not yet imported
    when their first cell ran."""
    import nbformat

    folder.mkdir()
    code = ("import os, sys\nfrom k3lab import kernelenv, report\n"
            "missing = [m for m in kernelenv.PRELOAD if m not in sys.modules]\n"
            "report.publish([{'pid': os.getpid(), 'missing': missing}], headline='pid')")
    for name in names:
        params = nbformat.v4.new_code_cell("seed = 0")
        params.metadata["tags"] = ["parameters"]
        nb = nbformat.v4.new_notebook(cells=[params, nbformat.v4.new_code_cell(code)])
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                     "language": "python"}
        nbformat.write(nb, folder / f"{name}.ipynb")
    return folder


def test_one_at_a_time_each_notebook_runs_in_a_kernel_started_ahead(tmp_path, monkeypatch):
    """-j 1: the next notebook's kernel starts (and, on a GPU, imports the preload) while one
    runs; each notebook after the first runs in the kernel started for it, and none outlives
    the batch."""
    from jupyter_core.utils import run_sync

    started = []

    class Spy(kernelenv.Standby):
        def __init__(self, *args):
            super().__init__(*args)
            started.append(self)

    monkeypatch.setattr(kernelenv, "Standby", Spy)
    monkeypatch.setattr(kernelenv, "PRELOAD_DEVICES", ("cpu", "cuda"))  # a GPU run's, here
    nbs = _pid_notebooks(tmp_path / "nbs", ["00_a", "10_b", "20_c"])
    out = tmp_path / "out"
    res = runner.run(None, notebook_dir=nbs, out_dir=out, progress=False, jobs=1)
    assert res.ok
    assert len(started) == 2  # the first notebook starts its own kernel
    pids = [s.km.provisioner.pid if s.km.provisioner else None for s in started]
    recs = [_json(out / f"{n}.metrics.json")["records"][0] for n in ("00_a", "10_b", "20_c")]
    assert [r["pid"] for r in recs[1:]] == pids and recs[0]["pid"] not in pids
    assert all(r["missing"] == [] for r in recs[1:])
    assert not any(run_sync(s.km.is_alive)() for s in started)


def test_a_standby_kernel_that_died_costs_only_its_head_start(tmp_path, monkeypatch):
    """The kernel started ahead is gone when its notebook comes: the notebook starts its own."""
    from jupyter_core.utils import run_sync

    class Dead(kernelenv.Standby):
        def __init__(self, *args):
            super().__init__(*args)
            run_sync(self.km.shutdown_kernel)(now=True)

    monkeypatch.setattr(kernelenv, "Standby", Dead)
    nbs = _pid_notebooks(tmp_path / "nbs", ["00_a", "10_b"])
    res = runner.run(None, notebook_dir=nbs, out_dir=tmp_path / "out", progress=False, jobs=1)
    assert res.ok, [r.error for r in res]
