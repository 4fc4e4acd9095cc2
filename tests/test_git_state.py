"""The manifest's dirty flag says whether the code run differs from its commit, and the
nbstripout filter keeps notebook sources without outputs (executed reports keep theirs)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from k3lab import report

REPO = Path(__file__).resolve().parents[1]


def _git(repo, *args):
    return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo,
                          check=True, capture_output=True, text=True).stdout


def _nb(source: str, outputs=()) -> str:
    cell = {"cell_type": "code", "source": source, "metadata": {}, "outputs": list(outputs),
            "execution_count": 1 if outputs else None}
    return json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4, "nbformat_minor": 5})


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "notebooks").mkdir(parents=True)
    (repo / "kernels").mkdir()
    (repo / "notebooks" / "10_x.ipynb").write_text(_nb("x = 1"))
    (repo / "kernels" / "a.py").write_text("A = 1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "one")
    return repo


def test_clean_checkout_is_clean(repo):
    commit, dirty, files = report.git_state(repo)
    assert len(commit) == 40 and dirty is False and files == []


def test_outputs_alone_do_not_make_a_notebook_dirty(repo):
    out = {"output_type": "stream", "name": "stdout", "text": "1\n"}
    (repo / "notebooks" / "10_x.ipynb").write_text(_nb("x = 1", [out]))
    assert report.git_state(repo)[1:] == (False, [])


@pytest.mark.parametrize("change, path", [
    (lambda r: (r / "notebooks" / "10_x.ipynb").write_text(_nb("x = 2")), "notebooks/10_x.ipynb"),
    (lambda r: (r / "kernels" / "a.py").write_text("A = 2\n"), "kernels/a.py"),
    (lambda r: (r / "kernels" / "new.py").write_text(""), "kernels/new.py"),
], ids=["notebook-source", "tracked-code", "untracked-code"])
def test_code_changes_make_it_dirty_and_are_named(repo, change, path):
    change(repo)
    assert report.git_state(repo)[1:] == (True, [path])


def test_untracked_files_outside_the_code_do_not_count(repo):
    (repo / "notes.txt").write_text("")
    assert report.git_state(repo)[1] is False


def test_attributes_filter_the_sources_only():
    out = subprocess.run(["git", "check-attr", "filter", "--", "notebooks/10_route.ipynb",
                          "tests/notebooks/00_echo.ipynb", "executed/h200/10_route.ipynb"],
                         cwd=REPO, capture_output=True, text=True)
    if out.returncode:
        pytest.skip(f"git check-attr unavailable: {out.stderr.strip()}")
    assert out.stdout.splitlines() == [
        "notebooks/10_route.ipynb: filter: nbstripout",
        "tests/notebooks/00_echo.ipynb: filter: nbstripout",
        "executed/h200/10_route.ipynb: filter: unspecified"]


def test_nbstripout_filter_leaves_the_committed_sources_unchanged(tmp_path):
    """What the filter commits for a notebook is what is committed today: stripping a source
    notebook changes nothing, and an executed copy strips back to it (modulo its metadata)."""
    pytest.importorskip("nbstripout")
    src = REPO / "notebooks" / "30_dense.ipynb"
    stripped = subprocess.run([sys.executable, "-m", "nbstripout", "-t"], input=src.read_text(),
                              capture_output=True, text=True, check=True).stdout
    assert report._sources(stripped) == report._sources(src.read_text())
    executed = tmp_path / "x.ipynb"
    shutil.copy(REPO / "tests" / "notebooks" / "00_echo.ipynb", executed)
    nb = json.loads(executed.read_text())
    for cell in nb["cells"]:
        if cell["cell_type"] == "code":
            cell["outputs"] = [{"output_type": "stream", "name": "stdout", "text": "x\n"}]
            cell["execution_count"] = 3
    executed.write_text(json.dumps(nb))
    subprocess.run([sys.executable, "-m", "nbstripout", str(executed)], check=True)
    cleaned = json.loads(executed.read_text())
    assert all(not c.get("outputs") and not c.get("execution_count")
               for c in cleaned["cells"] if c["cell_type"] == "code")
