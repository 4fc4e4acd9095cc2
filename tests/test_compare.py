"""Run folders as tables: k3lab export (every record as one CSV), k3lab compare (two folders
side by side with ratios) and the index's flag on reports older than HEAD in their files."""

import csv
import json
import subprocess

import pytest

from k3lab import cli, compare, runner


def _record(variant, value, M=1, **extra):
    return {"boundary": "route", "variant": variant, "metric": "latency_us", "mode": "graph",
            "M": M, "tp": 8, "value": value, "note": None, **extra}


def _folder(path, notebook, records, commit="0" * 40):
    path.mkdir(parents=True, exist_ok=True)
    (path / f"{notebook}.metrics.json").write_text(json.dumps({
        "notebook": notebook, "status": "ok", "seconds": 1.0, "headline": {},
        "manifest": {"git_commit": commit, "date": "2026-01-01", "gpu": "NVIDIA H200"},
        "records": records}))
    return path


def test_export_writes_every_record_of_a_folder(tmp_path, capsys):
    run = _folder(tmp_path / "run", "10_route", [_record("fused", 9.5), _record("ref", 140.0,
                                                                             sizes=[1, 2])])
    _folder(run, "50_mla", [_record("fused", 3.25, M=4)])
    (run / "60_bad.metrics.json").write_text("{")  # unreadable: left out, not a crash
    assert cli.main(["export", str(run)]) == 0
    assert "3 records of 2 notebook(s)" in capsys.readouterr().out
    rows = list(csv.DictReader((run / "records.csv").open()))
    assert [(r["notebook"], r["variant"], r["M"], r["value"]) for r in rows] == [
        ("10_route", "fused", "1", "9.5"), ("10_route", "ref", "1", "140.0"),
        ("50_mla", "fused", "4", "3.25")]
    assert rows[1]["sizes"] == "[1, 2]" and rows[0]["gpu"] == "NVIDIA H200"
    assert cli.main(["export", str(run), "-o", "-"]) == 0
    assert capsys.readouterr().out.startswith("notebook,git_commit,run_date,gpu,")


def test_export_of_an_empty_folder_is_a_usage_error(tmp_path, capsys):
    assert cli.main(["export", str(tmp_path)]) == 2
    assert "no readable records" in capsys.readouterr().err


def test_compare_matches_records_and_gives_ratios(tmp_path, capsys):
    a = _folder(tmp_path / "a", "10_route", [_record("fused", 10.0), _record("ref", 100.0),
                                             _record("only_a", 1.0)])
    b = _folder(tmp_path / "b", "10_route", [_record("fused", 5.0), _record("ref", 100.0),
                                             _record("fused", 7.0, M=8)], commit="1" * 40)
    table = compare.compare(a, b)
    got = {(r.variant, r.measure): (r.a, r.b, r.ratio) for r in table.itertuples()}
    assert got == {("fused", "value"): (10.0, 5.0, 0.5), ("ref", "value"): (100.0, 100.0, 1.0)}
    out = tmp_path / "cmp.csv"
    assert cli.main(["compare", str(a), str(b), "-o", str(out)]) == 0
    text = capsys.readouterr().out
    assert "ratio" in text and "0.5" in text
    rows = list(csv.DictReader(out.open()))
    assert {r["variant"]: float(r["ratio"]) for r in rows} == {"fused": 0.5, "ref": 1.0}


def _git(repo, *args):
    return subprocess.run(["git", *args], cwd=repo, check=True, capture_output=True,
                          text=True).stdout.strip()


@pytest.fixture
def repo(tmp_path):
    repo = tmp_path / "repo"
    (repo / "kernels" / "route").mkdir(parents=True)
    (repo / "notebooks").mkdir()
    for rel in ("kernels/route/sort.py", "kernels/mla.py", "notebooks/10_route.ipynb"):
        (repo / rel).write_text("1\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "one")
    return repo


def test_index_flags_reports_behind_head_in_their_files(repo, tmp_path):
    first = _git(repo, "rev-parse", "HEAD")
    out = _folder(tmp_path / "out", "10_route", [], commit=first)
    _folder(out, "50_mla", [], commit=first)
    (repo / "kernels" / "route" / "sort.py").write_text("2\n")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qam", "two")
    runner.update_index(out, repo=repo)
    page = (out / "index.html").read_text()
    route = page[page.index("<b>10_route</b>"):page.index("<b>50_mla</b>")]
    assert "behind HEAD: 1 file(s)" in route and "kernels/route/sort.py" in route
    assert "behind HEAD" not in page[page.index("<b>50_mla</b>"):]  # mla files unchanged
    reports = json.loads((out / "manifest.json").read_text())["reports"]
    assert reports["10_route"]["stale_files"] == ["kernels/route/sort.py"]
    assert "stale_files" not in reports["50_mla"]


def test_unknown_commit_is_not_flagged(repo, tmp_path):
    out = _folder(tmp_path / "out", "10_route", [], commit="f" * 40)
    assert compare.stale_files("f" * 40, "10_route", repo) is None
    runner.update_index(out, repo=repo)
    assert "behind HEAD" not in (out / "index.html").read_text()
