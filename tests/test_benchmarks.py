"""The benchmark runner (benchmarks/run.py) and its sweeps, on CPU: rows, the failure before
anything runs, and --base."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from benchmarks import run, sweeps

ROOT = Path(__file__).resolve().parents[1]
KDA_ONE = ["kda", "--sweep", "variants", "--points", "0", "--variants", "fused",
           "--device", "cpu", "--repeats", "2"]


@dataclasses.dataclass(frozen=True)
class _Inner:
    block_k: int = 512


@dataclasses.dataclass(frozen=True)
class _FakeConfig:
    tiles: int = 2
    pdl: bool = False
    inner: _Inner = _Inner()

    def __post_init__(self):
        if self.tiles < 1:
            raise ValueError(f"tiles: expected >= 1, got {self.tiles}")


def _rows(path) -> pd.DataFrame:
    df = pd.read_csv(path)
    assert list(df.columns) == run.COLUMNS
    return df


@pytest.mark.interpreter
def test_runner_writes_tidy_rows(tmp_path, capsys):
    out = tmp_path / "results.csv"
    assert run.main([*KDA_ONE, "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "not GPU figures" in printed
    df = _rows(out)
    assert set(df["metric"]) <= set(run.METRICS)
    assert {"check", "launches", "eager_us", "eager_copy_frac", "copy_bw_GBps"} <= set(
        df["metric"])
    assert (df[["boundary", "variant", "sweep", "preset", "device"]].drop_duplicates()
            .values.tolist() == [["kda", "fused", "variants", "tiny", "cpu"]])
    assert df["tp"].unique().tolist() == [1] and df["M"].unique().tolist() == [1]
    assert json.loads(df["point"].iloc[0]) == {"M": 1}
    assert df["commit"].notna().all() and df["date"].nunique() == 1
    value = df.set_index("metric")["value"]
    assert value["check"] == 1 and value["eager_us"] > 0 and value["launches"] >= 1
    # a second run appends under the same header
    assert run.main([*KDA_ONE, "--out", str(out), "--quiet"]) == 0
    assert len(_rows(out)) == 2 * len(df)


def test_unknown_config_field_fails_before_anything_runs(tmp_path, monkeypatch, capsys):
    bad = sweeps.Sweep("bad", "kda", ({"M": 1}, {"no_such_field": 3}))
    monkeypatch.setitem(sweeps.SWEEPS, ("kda", "bad"), bad)

    def measure(*a, **k):
        raise AssertionError("measured a sweep with an unknown field")

    monkeypatch.setattr("k3lab.profile.measure", measure)
    out = tmp_path / "results.csv"
    assert run.main(["kda", "--sweep", "bad", "--device", "cpu", "--out", str(out)]) == 2
    assert "no_such_field" in capsys.readouterr().err
    assert not out.exists()
    with pytest.raises(KeyError, match="no_such_field"):
        run.run_sweep(bad, device="cpu")
    # with a config class: the unknown field is named beside the class's fields
    monkeypatch.setattr(sweeps, "config_class", lambda boundary: _FakeConfig)
    with pytest.raises(KeyError, match=r"_FakeConfig has no field 'no_such_field'"):
        sweeps.resolve(bad)
    with pytest.raises(KeyError, match="inner.nope"):
        sweeps.resolve(dataclasses.replace(bad, points=({"inner.nope": 1},)))
    with pytest.raises(KeyError, match="tiles is not a config"):
        sweeps.resolve(dataclasses.replace(bad, points=({"tiles.x": 1},)))
    with pytest.raises(ValueError, match="tiles: expected >= 1"):
        sweeps.resolve(dataclasses.replace(bad, points=({"tiles": 0},)))
    with pytest.raises(KeyError, match="no variant 'nope'"):
        sweeps.resolve(dataclasses.replace(bad, points=({"M": 1},), variants=("nope",)))


def test_points_split_into_inputs_and_config(monkeypatch):
    monkeypatch.setattr(sweeps, "config_class", lambda boundary: _FakeConfig)
    s = sweeps.Sweep("s", "kda", ({"M": 4, "tiles": 3, "inner.block_k": 256}, {"M": 1}),
                     params={"M": 2})
    a, b = sweeps.resolve(s)
    assert a.params == {"M": 4} and a.overrides == {"tiles": 3, "inner.block_k": 256}
    assert a.config == _FakeConfig(tiles=3, inner=_Inner(256))
    assert b.params == {"M": 1} and b.config is None  # no config field: the defaults, untouched
    assert json.loads(sweeps.point_json(a.config)) == {"inner": {"block_k": 256}, "pdl": False,
                                                       "tiles": 3}
    # the fused variant finds the point's config in its inputs
    from k3lab import boundaries
    from k3lab.config import preset

    bb = run._with_config(boundaries.get("kda"), a.config)
    assert bb.make_inputs(preset("tiny"), "cpu", 0, M=1)["config"] is a.config


def test_config_probe_names_fused_variants_that_ignore_their_config():
    import torch

    from k3lab.boundaries import Boundary, Variant

    ran = []

    def reads(inputs):
        config = inputs.get("config")
        ran.append("reads")  # not reached: the probe stops at the read
        return config

    def ignores(inputs):
        ran.append("ignores")
        return inputs["x"]

    b = Boundary("fake", "fake", (), lambda cfg, device, seed: {"x": torch.zeros(2)},
                 (Variant("reference", "reference", ignores), Variant("reads", "fused", reads),
                  Variant("ignores", "fused", ignores)),
                 check=lambda out, ref, inputs: {}, bytes_moved=lambda inputs: 8)
    assert run.config_ignored(b, "cpu", _FakeConfig(), ["reference", "reads", "ignores"]) == [
        "ignores"]
    assert ran == ["ignores"]


def test_tune_sweep_names_every_k3_dense_shape():
    """The tune sweep spells the shape names out (so it runs against a base tree too); they are
    the dense boundary's shapes at K3, no more and no fewer."""
    from k3lab.boundaries.dense import shapes
    from k3lab.config import preset
    for tp in (8, 16):
        assert sorted(sweeps._DENSE_SHAPES) == sorted(shapes(preset("kimi-k3", tp=tp)))


def test_every_named_sweep_resolves():
    for key, s in sweeps.SWEEPS.items():
        assert key == (s.boundary, s.name)
        assert sweeps.resolve(s), key


def test_side_by_side_and_csv_header(tmp_path):
    def frame(value):
        return pd.DataFrame([{"variant": "fused", "point": '{"M":1}', "metric": "graph_us",
                              "value": value}])

    t = run.side_by_side(frame(2.0), frame(4.0))
    assert t.loc[("fused", '{"M":1}', "graph_us")].tolist() == [2.0, 4.0, 0.5]
    other = tmp_path / "other.csv"
    other.write_text("a,b\n1,2\n")
    with pytest.raises(ValueError, match="has columns"):
        run.append_csv(pd.DataFrame(columns=run.COLUMNS), other)


def test_package_dirs_of_this_checkout():
    assert run.package_dirs(ROOT) == {"k3lab.kernels": str((ROOT / "kernels").resolve())}


def _worktrees() -> str:
    return subprocess.run(["git", "worktree", "list", "--porcelain"], cwd=ROOT,
                          capture_output=True, text=True).stdout


@pytest.mark.interpreter
def test_base_head_side_by_side(tmp_path, capsys):
    if subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True).returncode:
        pytest.skip("not a git checkout")
    out = tmp_path / "results.csv"
    assert run.main([*KDA_ONE, "--out", str(out), "--base", "HEAD"]) == 0
    printed = capsys.readouterr().out
    assert "head" in printed and "base" in printed and "ratio" in printed
    assert "not GPU figures" in printed
    df = _rows(out)
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
    assert df["date"].nunique() == 2  # two runs, the base one in its own process
    base = df[df["date"] == df["date"].max()]
    assert base["commit"].unique().tolist() == [head]
    assert base["dirty"].unique().tolist() == [False]
    assert set(base["metric"]) == set(df[df["date"] == df["date"].min()]["metric"])
    assert "k3lab-base-" not in _worktrees()  # the temporary worktree is gone


@pytest.mark.interpreter
def test_token_sweep_rows_and_checks(tmp_path, capsys, monkeypatch):
    """A token sweep: every point's token checked, then measured (interpreted); its config
    fields reach the launchers (a tail tiling the interpreter runs), rows under the CSV's
    columns and metrics; a point off the truth is a check row of 0 and is not timed."""
    out = tmp_path / "token.csv"
    argv = ["token", "--sweep", "tail", "--points", "0,1", "--device", "cpu", "--out", str(out)]
    assert run.main(argv) == 0
    assert "not GPU figures" in capsys.readouterr().out
    df = _rows(out)
    assert set(df["metric"]) <= set(run.METRICS)
    assert (df[["boundary", "variant", "sweep"]].drop_duplicates().values.tolist()
            == [["token", "full stack", "tail"]])
    points = [json.loads(p) for p in df["point"].unique()]
    assert points == [{}, sweeps.get("token", "tail").points[1]]
    v = df.pivot_table(index="point", columns="metric", values="value", aggfunc="first")
    assert (v["check"] == 1).all() and (v["tok_per_s"] > 0).all() and (v["launches"] > 0).all()
    assert "window_ratio_median" not in v  # CUDA graphs only

    from k3lab.studies import decode_step

    real = decode_step.check_token

    def off(token, stacks, configs, num_splits):  # the second point misses the truth
        t = real(token, stacks, configs, num_splits)
        return t.assign(ok=[True] + [False] * (len(t) - 1))

    monkeypatch.setattr(decode_step, "check_token", off)
    out2 = tmp_path / "off.csv"
    assert run.main([*argv[:-1], str(out2), "--quiet"]) == 0
    df = _rows(out2)
    second = df[df["point"] != "{}"]
    assert second.set_index("metric").loc["check", "value"] == 0
    assert "tok_per_s" not in set(second["metric"])
    assert "tok_per_s" in set(df[df["point"] == "{}"]["metric"])


def test_token_sweep_points_take_their_own_mla_split_count(monkeypatch):
    """A point's "num_splits" is its token's split count, checked and timed with it; the
    other points keep the sweep's (0 on a GPU: the decode step's split override)."""
    from benchmarks import token as token_sweeps
    from k3lab.studies import decode_step

    seen = {}

    def check(token, stacks, configs, num_splits):
        seen["check"] = num_splits
        return pd.DataFrame({"stack": list(stacks), "ok": True, "max abs error": 0.0,
                             "tolerance": 1.0})

    def compare(token, device, choices, stacks, *, num_splits, repeats):
        seen["compare"] = num_splits
        return pd.DataFrame({"choice": list(choices), "tok/s": 1.0, "token us": 1.0,
                             "launches per token": 1})

    monkeypatch.setattr(decode_step, "check_token", check)
    monkeypatch.setattr(decode_step, "compare", compare)
    sweep = sweeps.get("token", "mla")
    df = token_sweeps.run_token_sweep(sweep, device="cpu", log=lambda *_: None)
    own = token_sweeps.CPU_PARAMS["num_splits"]
    want = {sweeps.point_json(p): p.get("num_splits", own) for p in sweep.points}
    assert seen == {"check": want, "compare": want} and len(set(want.values())) == 3
    assert set(df["point"]) == set(want)
    assert token_sweeps.GPU_PARAMS["num_splits"] == 0  # the reports' split override


def test_token_sweep_refuses_bad_points_before_running():
    tail = sweeps.get("token", "tail")
    for points, match in ((({"tail.block_k": 256},), "first point must be"),
                          (({}, {"tail.nope": 1}), "GemvConfig has no field 'nope'"),
                          (({}, {"nope.block_k": 1}), "names no config field"),
                          (({}, {"tail": 1}), "names no config field")):
        with pytest.raises(sweeps.SweepError, match=match):
            sweeps.resolve(dataclasses.replace(tail, points=points))
    with pytest.raises(ValueError, match="tail.block_k=3"):
        sweeps.resolve(dataclasses.replace(tail, points=({}, {"tail.block_k": 3})))
    for bad in (0, 2.0, True):
        with pytest.raises(ValueError, match=f"num_splits={bad!r}: expected an MLA split"):
            sweeps.resolve(dataclasses.replace(tail, points=({}, {"num_splits": bad})))
    with pytest.raises(ValueError, match="in_proj_prefetch=1.0: expected an int"):
        sweeps.resolve(dataclasses.replace(tail, points=({}, {"in_proj_prefetch": 1.0})))
    with pytest.raises(ValueError, match="point 1 .*Configs.o_proj_prefetch: expected None"):
        sweeps.resolve(dataclasses.replace(tail, points=({}, {"o_proj_prefetch": 9})))
    with pytest.raises(sweeps.SweepError, match="no point 9"):
        sweeps.resolve(tail, [9])
    assert run.main(["token", "--sweep", "tail", "--variants", "fused", "--device", "cpu",
                     "--out", "/dev/null"]) == 2


def test_readme_names_every_sweep():
    """benchmarks/README.md's table names every sweep of the catalogue in its boundary's row."""
    import re

    rows = {}
    for line in (ROOT / "benchmarks" / "README.md").read_text().splitlines():
        m = re.match(r"\| (\w+) \| (.*) \|$", line)
        if m:
            rows[m.group(1)] = set(re.findall(r"`(\w+)`", m.group(2)))
    missing = [f"{b}:{n}" for b, n in sweeps.names() if n not in rows.get(b, set())]
    assert not missing, f"sweeps the README's table does not name: {missing}"


def _sweep_cli(*args: str, tmp_path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "benchmarks.run", *args, "--out",
                           str(tmp_path / "rows.csv")], cwd=ROOT, capture_output=True,
                          text=True, timeout=600,
                          env={**os.environ, "TRITON_DEFAULT_FP_FUSION": "1"})


def test_sm90_builds_record_registers_per_launch(tmp_path):
    """--device sm90 compiles each point's kernels for sm_90 here (a fresh process) and writes
    their registers, stack and shared memory, one row per launch and metric; nothing timed."""
    from k3lab import sm90

    try:
        sm90.cuobjdump()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    proc = _sweep_cli("attn_res", "--sweep", "sealed", "--device", "sm90", "--preset", "tiny",
                      "--tp", "1", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "resources, not timings" in proc.stdout
    df = pd.read_csv(tmp_path / "rows.csv")
    assert set(df["device"]) == {"sm90"} and set(df["metric"]) == {
        "registers", "stack_bytes", "shared_bytes"}
    assert not ({"check", "graph_us", "eager_us"} & set(df["metric"]))
    regs = df[df["metric"] == "registers"]
    assert set(regs["variant"]) == {"fused/_attn_res_norm_kernel"}
    assert len(regs) == 3 and regs["value"].between(1, 255).all()
    assert regs["note"].str.startswith("grid (").all()
    assert regs["note"].str.contains(r"tensors (?:\d+x)+\d+ ").all()


def test_sm90_builds_of_a_token_sweep(tmp_path):
    """A token sweep's sm90 builds: each point's full-stack token compiled over a short window
    of the middle block, one set of rows per distinct compiled kernel, named where it first
    launched; a point that changes a launcher's config changes that launcher's build."""
    from k3lab import sm90

    try:
        sm90.cuobjdump()
    except RuntimeError as exc:
        pytest.skip(str(exc))
    proc = _sweep_cli("token", "--sweep", "tail", "--points", "0,1", "--device", "sm90",
                      "--preset", "tiny", "--tp", "1", tmp_path=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    df = pd.read_csv(tmp_path / "rows.csv")
    assert set(df["device"]) == {"sm90"} and "check" not in set(df["metric"])
    regs = df[df["metric"] == "registers"]
    base, tail = (regs[regs["point"] == p].set_index("variant")["value"]
                  for p in sorted(set(regs["point"]), key=len))
    assert any(": dense_gemv_kernel" in v for v in base.index)
    assert any(v.startswith("head, dense projections: ") for v in base.index)
    assert base.between(1, 255).all() and tail.between(1, 255).all()
    assert len(base) == len(set(base.index)) > 5
    # the second point retiles the MoE tail's GEMV alone: its build changes, the KDA's does not
    assert set(base.index) == set(tail.index)
    changed = base.index[base != tail[base.index]]
    assert len(changed) >= 1 and all("dense_gemv_kernel" in v for v in changed)
