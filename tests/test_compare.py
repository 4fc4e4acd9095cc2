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


# ---------------------------------------------------------------- a side that is a revision

def _run_folder(path, notebook, value, parameters, manifest):
    _folder(path, notebook, [_record("fused", value)])
    record = json.loads((path / f"{notebook}.metrics.json").read_text())
    record["parameters"], record["manifest"] = parameters, {**record["manifest"], **manifest}
    (path / f"{notebook}.metrics.json").write_text(json.dumps(record))
    return path


class FakeRun:
    """Stands in for ``run_at_revision``: records each call, writes the records a run would."""

    def __init__(self, value=5.0):
        self.calls, self.value = [], value

    def __call__(self, tree, commit, names, options, params, out, notebook_dir):
        self.calls.append({"tree": tree, "commit": commit, "names": names, "options": options,
                           "params": params, "notebook_dir": notebook_dir,
                           "files": sorted(p.name for p in tree.iterdir()),
                           "kernels_link": (tree / "k3lab" / "kernels").is_symlink()})
        for name in names:
            _folder(out, name, [_record("fused", self.value)], commit=commit)
        return 0


@pytest.fixture
def rev_repo(repo):
    (repo / "k3lab").mkdir()
    (repo / "k3lab" / "__init__.py").write_text("")
    (repo / "notebooks" / "50_mla.ipynb").write_text("1\n")
    (repo / "pyproject.toml").write_text(
        '[tool.setuptools]\npackage-dir = { "k3lab.kernels" = "kernels" }\n')
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "k3lab")
    return repo


def test_a_side_is_a_folder_or_a_revision(rev_repo, tmp_path):
    assert compare.resolve_side(str(tmp_path), rev_repo).folder == tmp_path
    side = compare.resolve_side("HEAD~1", rev_repo)
    assert side.folder is None and side.commit == _git(rev_repo, "rev-parse", "HEAD~1")
    with pytest.raises(ValueError, match="neither a run folder nor a git revision"):
        compare.resolve_side("no-such-thing", rev_repo)


def test_run_plan_groups_notebooks_as_they_ran(tmp_path):
    run = _run_folder(tmp_path / "run", "10_route", 9.0,
                      {"device": "cpu", "preset": "tiny", "tp": 2, "M": 4,
                       "trace_dir": "/old/staging"}, {})
    _run_folder(run, "50_mla", 3.0, {"device": "cpu", "preset": "tiny", "tp": 2, "M": 4}, {})
    _run_folder(run, "60_attn_res", 1.0, {"seed": 1}, {"device": "cpu", "preset": "tiny",
                                                       "tp": 1})
    groups = compare.run_plan(run)
    assert [(g.options, g.params, g.names) for g in groups] == [
        ({"device": "cpu", "preset": "tiny", "tp": 2}, {"M": 4}, ["10_route", "50_mla"]),
        ({"device": "cpu", "preset": "tiny", "tp": 1}, {"seed": 1}, ["60_attn_res"])]
    assert [g.names for g in compare.run_plan(run, ["mla"])] == [["50_mla"]]


def test_compare_a_folder_with_a_revision_runs_its_notebooks_there(rev_repo, tmp_path):
    before = _git(rev_repo, "worktree", "list")
    a = _run_folder(tmp_path / "a", "10_route", 10.0,
                    {"device": "cpu", "preset": "tiny", "tp": 2, "M": 4}, {})
    _run_folder(a, "70_gone", 10.0, {"device": "cpu"}, {})  # not at the revision: left out
    fake, said = FakeRun(5.0), []
    table, la, lb = compare.compare_sides(str(a), "HEAD", repo=rev_repo, run=fake,
                                          keep=tmp_path / "runs", say=said.append)
    (call,) = fake.calls
    head = _git(rev_repo, "rev-parse", "HEAD")
    assert call["commit"] == head and call["names"] == ["10_route"]
    assert call["options"] == {"device": "cpu", "preset": "tiny", "tp": 2}
    assert call["params"] == {"M": 4} and call["notebook_dir"] == "notebooks"
    assert "notebooks" in call["files"] and call["kernels_link"]
    assert any("no notebook 70_gone" in s for s in said)
    assert lb == f"HEAD ({head[:10]})" and la == str(a)
    assert table[["a", "b", "ratio"]].values.tolist() == [[10.0, 5.0, 0.5]]
    assert (tmp_path / "runs" / f"b-{head[:12]}" / "10_route.metrics.json").is_file()
    assert _git(rev_repo, "worktree", "list") == before  # the temporary worktree is gone


def test_two_revisions_run_the_named_notebooks(rev_repo, tmp_path):
    fake = FakeRun()
    table, _, _ = compare.compare_sides("HEAD~1", "HEAD", repo=rev_repo, run=fake,
                                        notebooks=["10_route"], options={"tp": 2},
                                        params={"M": "2"}, say=lambda s: None)
    assert [c["commit"][:7] for c in fake.calls] == [
        _git(rev_repo, "rev-parse", "--short=7", r) for r in ("HEAD~1", "HEAD")]
    assert fake.calls[0]["options"] == {"device": "cpu", "preset": "tiny", "tp": 2}
    assert fake.calls[0]["params"] == {"M": "2"}
    assert table["ratio"].tolist() == [1.0]
    with pytest.raises(ValueError, match="--notebooks"):
        compare.compare_sides("HEAD~1", "HEAD", repo=rev_repo, run=fake)


def test_cli_compare_with_a_revision(monkeypatch, rev_repo, tmp_path, capsys):
    a = _run_folder(tmp_path / "a", "10_route", 10.0, {"device": "cpu"}, {})
    fake = FakeRun(20.0)
    monkeypatch.setattr(compare, "run_at_revision", fake)
    monkeypatch.setattr(compare, "_repo", lambda: rev_repo)
    assert cli.main(["compare", str(a), "HEAD", "-o", str(tmp_path / "c.csv")]) == 0
    out = capsys.readouterr()
    assert "b: HEAD (" in out.out and "2" in out.out and "running 10_route at HEAD" in out.err
    rows = list(csv.DictReader((tmp_path / "c.csv").open()))
    assert [float(r["ratio"]) for r in rows] == [2.0]


@pytest.mark.slow
def test_compare_with_head_runs_a_fixture_notebook_in_a_worktree(tmp_path, capsys):
    """End to end: a run folder of the views fixture here, against the same notebook run at
    HEAD in a temporary worktree by HEAD's own k3lab (two real kernels)."""
    a = tmp_path / "a"
    fixtures = runner.repo_root() / "tests" / "notebooks" / "views"
    (res,) = runner.run(["30_views"], out_dir=a, notebook_dir=fixtures, progress=False,
                        params={"label": "cmp"})
    assert res.ok, res.error
    rc = cli.main(["compare", str(a), "HEAD", "--notebook-dir", "tests/notebooks/views",
                   "--keep", str(tmp_path / "runs"), "-o", str(tmp_path / "c.csv")])
    assert rc == 0, capsys.readouterr()
    head = _git(runner.repo_root(), "rev-parse", "HEAD")
    b_dir = tmp_path / "runs" / f"b-{head[:12]}"
    b = json.loads((b_dir / "30_views.metrics.json").read_text())
    assert b["manifest"]["git_commit"] == head and b["manifest"]["git_dirty"] is False
    assert b["parameters"]["label"] == "cmp" and (b_dir / "30_views.cmp.trace.json").is_file()
    rows = list(csv.DictReader((tmp_path / "c.csv").open()))
    assert {(r["metric"], float(r["ratio"])) for r in rows} == {
        ("launches", 1.0), ("latency_us", 1.0), ("speedup_vs_reference", 1.0)}
    assert "k3lab-compare-" not in _git(runner.repo_root(), "worktree", "list")


def test_a_boundary_depends_on_the_kernels_its_launches_call():
    """The MoE report goes stale with the route and dense kernels its block launches, every
    report with the shared registry; the MLA report not with the MoE's files."""
    moe, mla = compare.dependencies("20_moe"), compare.dependencies("50_mla")
    assert {"kernels/route", "kernels/dense", "k3lab/boundaries/__init__.py"} <= set(moe)
    assert "k3lab/boundaries/__init__.py" in mla and "kernels/dense" not in mla
    assert "kernels/moe*" in moe and "kernels/moe*" not in mla


def test_a_profiled_runs_host_seconds_are_records_to_compare(tmp_path):
    a = _folder(tmp_path / "a", "10_route", [_record("fused", 10.0)])
    b = _folder(tmp_path / "b", "10_route", [_record("fused", 10.0)])
    for run, compile_s in ((a, 40.0), (b, 10.0)):
        path = run / "10_route.metrics.json"
        data = json.loads(path.read_text())
        data["host_profile"] = {"seconds": {"Triton compile": compile_s, "other host": 3.0},
                                "profiled_s": compile_s + 3.0, "samples": 9}
        path.write_text(json.dumps(data))
    rows = compare.records(a)
    host = rows[rows["boundary"] == "host"]
    assert host[["variant", "metric", "value"]].values.tolist() == [
        ["Triton compile", "host_s", 40.0], ["other host", "host_s", 3.0]]
    table = compare.compare(a, b)
    got = {r.variant: r.ratio for r in table.itertuples()}
    assert got == {"fused": 1.0, "Triton compile": 0.25, "other host": 1.0}
