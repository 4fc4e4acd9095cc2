"""The runner and the index under bad input and file-system faults: corrupt records, reserved
and hostile names, an unusable --out, a report that cannot be written, stale temp files, bad
timeouts and list items, Ctrl-C and a cell timeout. Each fault gives one clear line, never a
traceback, and never a lie in the index."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import nbformat
import pytest

from k3lab import cli, runner

FIXTURES = Path(__file__).parent / "notebooks"
GOOD = {"notebook": "10_good", "status": "ok", "error": None, "seconds": 1.5,
        "headline": {"speedup": 2.0}, "records": [], "manifest": {"date": "2026-01-01"}}


def _hrefs(page: str) -> list[str]:
    class P(HTMLParser):
        hrefs: list[str] = []

        def handle_starttag(self, tag, attrs):
            if tag == "a":
                self.hrefs.append(dict(attrs)["href"])
    p = P()
    p.hrefs = []
    p.feed(page)
    return p.hrefs


def _sleep_notebooks(folder: Path) -> Path:
    """A notebooks folder with one notebook whose second cell sleeps ``sleep`` seconds."""
    folder.mkdir()
    params = nbformat.v4.new_code_cell('sleep = 0.0  # seconds; range: 0..\nmarker = ""')
    params.metadata["tags"] = ["parameters"]
    nb = nbformat.v4.new_notebook(cells=[
        params, nbformat.v4.new_code_cell("if marker:\n    open(marker, 'w').close()"),
        nbformat.v4.new_code_cell("import time\ntime.sleep(sleep)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3",
                                 "language": "python"}
    nbformat.write(nb, folder / "30_sleep.ipynb")
    return folder


# ---------------------------------------------------------------- the index

@pytest.mark.parametrize("text", [
    '{"notebook": "00_bad", "status": "ok", "headl',  # truncated
    "[1, 2]", '"ok"', "null", '{"headline": [1]}', '{"seconds": "fast"}',
    '{"manifest": "x"}', "",
], ids=["truncated", "list", "string", "null", "headline-list", "seconds-text",
        "manifest-text", "empty"])
def test_index_shows_unreadable_metrics_as_corrupt(tmp_path, text):
    (tmp_path / "00_bad.metrics.json").write_text(text)
    (tmp_path / "00_bad.html").write_text("<html></html>")
    (tmp_path / "10_good.metrics.json").write_text(json.dumps(GOOD))
    runner.update_index(tmp_path)
    page = (tmp_path / "index.html").read_text()
    row = page[page.index("<b>00_bad</b>"):page.index("<b>10_good</b>")]
    assert "class='corrupt'>corrupt<" in row and "class='ok'" not in row
    assert "00_bad.metrics.json" in row and "run the notebook again" in row
    assert page.count("class='ok'") == 1  # the good report is still listed as ok
    reports = json.loads((tmp_path / "manifest.json").read_text())["reports"]
    assert reports["00_bad"]["status"] == "corrupt" and reports["10_good"]["status"] == "ok"


def test_corrupt_failure_record_is_not_ok_either(tmp_path):
    (tmp_path / "10_good.metrics.json").write_text(json.dumps(GOOD))
    (tmp_path / "10_good.failed.json").write_text("{")
    runner.update_index(tmp_path)
    reports = json.loads((tmp_path / "manifest.json").read_text())["reports"]
    assert reports["10_good"]["status"] == "corrupt"


@pytest.mark.parametrize("name", ["index", "manifest", "Index"])
def test_reserved_notebook_names_are_refused(tmp_path, name):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    shutil.copy(FIXTURES / "10_other.ipynb", nbs / f"{name}.ipynb")
    with pytest.raises(ValueError, match="reserved"):
        runner.resolve([name], nbs)
    with pytest.raises(ValueError, match="reserved"):
        runner.resolve(None, nbs)


def test_cli_refuses_a_reserved_name_before_running(tmp_path, capsys):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    shutil.copy(FIXTURES / "10_other.ipynb", nbs / "index.ipynb")
    out = tmp_path / "out"
    assert cli.main(["run", "--notebooks", str(nbs), "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert "reserved" in err and "\n" not in err and not out.exists()


@pytest.mark.parametrize("name", ["javascript:alert(1)", "a#b?c=1", "data:text,x", "sp ace"])
def test_index_links_are_encoded_relative_paths(tmp_path, name):
    (tmp_path / f"{name}.metrics.json").write_text(json.dumps({**GOOD, "notebook": name}))
    (tmp_path / f"{name}.html").write_text("<html></html>")
    runner.update_index(tmp_path)
    hrefs = _hrefs((tmp_path / "index.html").read_text())
    assert hrefs, "no links"
    for href in hrefs:
        url = urlparse(href)
        assert not url.scheme and not url.query and not url.fragment, href
        assert (tmp_path / unquote(url.path)).is_file(), href


# ---------------------------------------------------------------- checks before anything runs

def _refused(capsys, args, out):
    rc = cli.main(["run", "echo", *args])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert err.startswith("k3lab: error:") and "\n" not in err and "Traceback" not in err
    return err


def test_out_that_is_a_file_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    out = tmp_path / "out"
    out.write_text("not a folder")
    assert "--out" in _refused(capsys, ["--out", str(out)], out)
    assert out.read_text() == "not a folder"


def test_out_below_a_file_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    (tmp_path / "f").write_text("")
    assert "--out" in _refused(capsys, ["--out", str(tmp_path / "f" / "out")], None)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_out_exits_2(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    out = tmp_path / "ro"
    out.mkdir()
    out.chmod(0o500)
    try:
        assert "cannot write" in _refused(capsys, ["--out", str(out)], out)
    finally:
        out.chmod(0o700)


def _unwritable_dir() -> Path | None:
    """A folder even root cannot create files in (sysfs), where the platform has one."""
    import tempfile

    for d in (Path("/sys/kernel"), Path("/proc/sys")):
        if d.is_dir():
            try:
                fd, p = tempfile.mkstemp(dir=d)
            except OSError:
                return d
            os.close(fd)
            os.unlink(p)
    return None


@pytest.mark.skipif(_unwritable_dir() is None, reason="no unwritable folder on this platform")
def test_unwritable_out_exits_2(monkeypatch, capsys):
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    d = _unwritable_dir()
    assert "cannot write" in _refused(capsys, ["--out", str(d)], d)
    assert "cannot write" in _refused(capsys, ["--out", str(d / "k3lab-out")], None)


@pytest.mark.parametrize("value", ["nan", "0", "-1", "inf", "-inf"])
def test_bad_timeout_exits_2_before_anything_runs(monkeypatch, tmp_path, capsys, value):
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    out = tmp_path / "out"
    assert "--timeout" in _refused(capsys, [f"--timeout={value}", "--out", str(out)], out)
    assert not out.exists()


@pytest.mark.parametrize("given", ["[1, 'a']", "[1.5, 2]", "[True]", "[[1]]", "1,x"])
def test_list_items_of_the_wrong_type_are_refused(given):
    with pytest.raises(ValueError, match=r"00_echo: parameter 'sizes'"):
        runner.validate(FIXTURES / "00_echo.ipynb", {"sizes": given})


# ---------------------------------------------------------------- faults during a batch

def test_a_report_that_cannot_be_written_does_not_stop_the_batch(monkeypatch, tmp_path, capsys):
    """A write error of one report (here a folder in the way of its HTML, as a full disk would
    fail the write) fails that notebook only; the others and the index are written. Temp files a
    killed run left are removed; one of a live process is left alone."""
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    out = tmp_path / "out"
    (out / "00_echo.html").mkdir(parents=True)
    (out / "00_echo.html" / "keep").write_text("")
    dead = subprocess.Popen([sys.executable, "-c", ""])
    dead.wait()
    stale = [out / f".00_echo.{dead.pid}-abc123.running.ipynb", out / ".index.html.x1y2.tmp"]
    live = out / f".10_other.{os.getppid()}-zz9.running.ipynb"
    for p in (*stale, live):
        p.write_text("{}")
    rc = cli.main(["run", "echo", "other", "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1
    echo = json.loads((out / "00_echo.failed.json").read_text())
    assert echo["status"] == "failed" and "could not write the report" in echo["error"]
    assert (out / "10_other.metrics.json").is_file()
    page = (out / "index.html").read_text()
    assert "<b>00_echo</b>" in page and "<b>10_other</b>" in page
    assert not any(p.exists() for p in stale) and live.exists()
    assert "removed 2 temp file(s)" in text and live.name in text


def test_an_index_that_cannot_be_written_is_one_line(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv(runner.NOTEBOOKS_ENV, str(FIXTURES))
    out = tmp_path / "out"
    (out / "index.html").mkdir(parents=True)
    (out / "index.html" / "keep").write_text("")
    assert cli.main(["run", "other", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3lab: error: could not write the index") and "\n" not in err
    assert (out / "10_other.metrics.json").is_file()


def test_cell_timeout_is_one_line(tmp_path, capfd):
    nbs = _sleep_notebooks(tmp_path / "nbs")
    out = tmp_path / "out"
    rc = cli.main(["run", "--notebooks", str(nbs), "-p", "sleep=30", "--timeout", "1",
                   "--out", str(out)])
    time.sleep(0.5)  # the stopped kernel's last words, if any, reach the captured fd
    captured = capfd.readouterr()
    text = captured.out + captured.err
    assert rc == 1
    assert "Traceback" not in text and "ZMQ" not in text, text
    (line,) = [ln for ln in text.splitlines() if "30_sleep" in ln and "[1/1]" in ln]
    assert "timed out: a cell ran longer than --timeout 1 s: import time; time.sleep(sleep)" in line
    assert len(text.strip().splitlines()) == 3, text  # start, the notebook, the summary


def test_cell_timeout_from_the_environment(monkeypatch, tmp_path, capfd):
    """$K3LAB_CELL_TIMEOUT is the limit where --timeout is not given; a bad value is refused
    naming the variable."""
    nbs = _sleep_notebooks(tmp_path / "nbs")
    monkeypatch.setenv(runner.TIMEOUT_ENV, "1")
    rc = cli.main(["run", "--notebooks", str(nbs), "-p", "sleep=30", "--out",
                   str(tmp_path / "out")])
    assert rc == 1
    assert "timed out: a cell ran longer than --timeout 1 s" in capfd.readouterr().out
    monkeypatch.setenv(runner.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=r"\$K3LAB_CELL_TIMEOUT: expected seconds"):
        runner.run(["sleep"], notebook_dir=nbs, out_dir=tmp_path / "out2", progress=False)


@pytest.mark.parametrize("jobs", ["1", "2"])
def test_ctrl_c_is_one_line_and_keeps_the_reports(tmp_path, jobs):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it, mid-notebook: one
    notebook at a time, and two (the other, quick, may finish; an idle worker stays quiet).
    The batch starts with SIGINT at its default, as in a terminal's foreground: a suite run in
    the background by a non-interactive shell ignores SIGINT, and a child inherits that."""
    nbs = _sleep_notebooks(tmp_path / "nbs")
    shutil.copy(FIXTURES / "10_other.ipynb", nbs / "40_other.ipynb")
    out = tmp_path / "out"
    marker = tmp_path / "in-the-sleeping-cell"
    proc = subprocess.Popen(
        [sys.executable, "-m", "k3lab.cli", "run", "--notebooks", str(nbs), "-p", "sleep=600",
         "-p", f"marker={marker}", "--out", str(out), "-j", jobs], stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 180
    while not marker.exists() and time.monotonic() < deadline:  # the kernel wrote it: it is up
        time.sleep(0.2)
    if not marker.exists():
        proc.kill()
        pytest.fail(f"the notebook's kernel did not reach its marker cell in 180 s: "
                    f"{proc.communicate()[1][-2000:]}")
    time.sleep(1)  # past the marker cell, into the sleeping one
    os.killpg(proc.pid, signal.SIGINT)
    stdout, stderr = proc.communicate(timeout=90)
    assert proc.returncode == 130, stderr
    assert "Traceback" not in stderr and "Traceback" not in stdout, stderr
    (line,) = stderr.strip().splitlines()
    assert line.startswith("k3lab: interrupted while running 30_sleep") and "index" in line
    assert not list(out.glob(".*"))  # no temp file left
    if jobs == "1":
        assert not (out / "40_other.metrics.json").exists()  # the rest did not run
    assert (out / "index.html").is_file()
