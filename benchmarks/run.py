"""Run a named sweep of one boundary and append tidy rows to one CSV.

    python -m benchmarks.run moe --sweep variants
    python -m benchmarks.run mla --sweep splits --preset kimi-k3 --tp 8 --base HEAD~3
    python -m benchmarks.run token --sweep tail      # launcher configs in the whole token
    python -m benchmarks.run --list

Every point is checked against the boundary's reference before it is timed (a variant whose
check fails gets a ``check`` row of 0 and no timing), then timed by ``k3lab.profile.measure``:
launches counted, eager and CUDA-graph latency with cold input copies, the fraction of the copy
bandwidth measured in the same process. ``--base REV`` runs the same sweep on another commit (a
temporary ``git worktree``, its own k3lab imported in a subprocess), appends its rows too and
prints both side by side. On CPU the kernels run under the Triton interpreter at the tiny
preset: those timings are not GPU figures. ``--device sm90`` times nothing: it compiles each
point's kernels for sm_90 on this machine and records their registers, stack and shared memory
(``benchmarks/builds.py``).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime as _dt
import importlib.abc
import importlib.machinery
import importlib.util
import json
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pandas as pd

__all__ = ["COLUMNS", "METRICS", "main", "run_sweep", "append_csv", "side_by_side",
           "run_base", "CPU_NOTE"]

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "benchmarks" / "results.csv"
COLUMNS = ["commit", "dirty", "gpu", "driver", "torch", "triton", "date", "device", "boundary",
           "variant", "sweep", "point", "config", "preset", "tp", "M", "metric", "value", "note"]
# metrics a row can carry (latencies in us, bandwidth in GB/s, fractions of the copy bandwidth)
# (token sweeps: tok/s and us of the extrapolated token, launches a token, the first point's
# window graph time over this point's, interleaved: median, min and max over the rounds)
METRICS = ("check", "available", "max_abs_err", "launches", "bytes",
           "eager_us", "eager_p10_us", "eager_p90_us", "eager_copy_frac",
           "graph_us", "graph_p10_us", "graph_p90_us", "graph_copy_frac", "copy_bw_GBps",
           "tok_per_s", "token_us", "window_ratio_median", "window_ratio_min",
           "window_ratio_max", "registers", "stack_bytes", "shared_bytes")
# shown in the printed tables (all of them go to the CSV)
SHOWN = ("check", "launches", "eager_us", "eager_copy_frac", "graph_us", "graph_p10_us",
         "graph_p90_us", "graph_copy_frac", "tok_per_s", "window_ratio_median",
         "window_ratio_min", "window_ratio_max", "registers", "stack_bytes", "shared_bytes")
CPU_NOTE = ("CPU timings (Triton interpreter, wall clock) are not GPU figures: they say that "
            "the sweep runs, nothing about a kernel's speed.")
TREE_ENV = "K3LAB_BENCH_TREE"  # set for a --base run: {"root": ..., "package_dirs": {...}}


# ---------------------------------------------------------------------------------------------
# importing k3lab from another tree


class _TreeFinder(importlib.abc.MetaPathFinder):
    """Imports ``k3lab`` (and every package of the tree's pyproject ``package-dir`` map, e.g.
    ``k3lab.kernels`` -> ``<tree>/kernels``) from one tree only, ahead of every other finder: an
    installed editable checkout must not fill in a module the tree lacks."""

    def __init__(self, root: str, dirs: dict[str, str]):
        self.root, self.dirs = root, dirs
        self.tops = {"k3lab", *(name.split(".")[0] for name in dirs)}

    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] not in self.tops:
            return None
        folder = self.dirs.get(name)
        if folder is not None:
            return importlib.util.spec_from_file_location(
                name, os.path.join(folder, "__init__.py"), submodule_search_locations=[folder])
        search = [self.root] if "." not in name else path
        spec = importlib.machinery.PathFinder.find_spec(name, search)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {name!r} in {self.root}", name=name)
        return spec


def _install_tree_finder() -> None:
    raw = os.environ.get(TREE_ENV)
    if raw and not any(isinstance(f, _TreeFinder) for f in sys.meta_path):
        tree = json.loads(raw)
        sys.meta_path.insert(0, _TreeFinder(tree["root"], tree["package_dirs"]))


def package_dirs(tree: Path) -> dict[str, str]:
    """The ``[tool.setuptools] package-dir`` map of ``tree``'s pyproject, as absolute folders."""
    path = tree / "pyproject.toml"
    if not path.exists():
        return {}
    text = path.read_text()
    try:
        import tomllib

        mapping = tomllib.loads(text).get("tool", {}).get("setuptools", {}).get("package-dir", {})
    except ImportError:  # Python 3.10: the one inline table this project writes
        m = re.search(r"^package-dir\s*=\s*\{([^}]*)\}", text, re.M)
        mapping = dict(re.findall(r'"([^"]+)"\s*=\s*"([^"]*)"', m.group(1))) if m else {}
    return {pkg: str((tree / folder).resolve()) for pkg, folder in mapping.items() if pkg}


# ---------------------------------------------------------------------------------------------
# one sweep


def _manifest(device: str, preset: str, tp: int) -> dict:
    from k3lab import report

    m = report.manifest({"device": device, "preset": preset, "tp": tp})
    return {"commit": m.get("git_commit"), "dirty": m.get("git_dirty"), "gpu": m.get("gpu"),
            "driver": m.get("driver"), "torch": m.get("torch"), "triton": m.get("triton"),
            "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")}


def _metric(row) -> str | None:
    """A k3lab.profile.measure row's metric under this CSV's name (None: not kept)."""
    metric, mode = row["metric"], row["mode"]
    if metric in ("check", "available", "launches", "bytes", "max_abs_err"):
        return metric
    if metric == "latency_us":
        return f"{mode}_us"
    if metric in ("latency_p10_us", "latency_p90_us"):
        return f"{mode}_{metric.removeprefix('latency_')}"
    if metric == "roofline_frac":
        return f"{mode}_copy_frac"
    return None


def _with_config(boundary, config):
    """``boundary`` whose inputs carry ``config`` (what its fused variant passes on)."""
    make = boundary.make_inputs

    def make_inputs(cfg, device, seed, **params):
        return {**make(cfg, device, seed, **params), "config": config}

    return dataclasses.replace(boundary, make_inputs=make_inputs)


class _ConfigReadError(Exception):
    """Raised by :class:`_Inputs` as soon as a variant reads its config (the probe stops)."""


class _Inputs(dict):
    """An inputs dict that stops the variant reading it as soon as it asks for "config"."""

    def _seen(self, key):
        if key == "config":
            raise _ConfigReadError

    def __getitem__(self, key):
        self._seen(key)
        return super().__getitem__(key)

    def get(self, key, default=None):
        self._seen(key)
        return super().get(key, default)

    def __contains__(self, key):
        self._seen(key)
        return super().__contains__(key)

    def items(self):
        self._seen("config")
        return super().items()

    def values(self):
        self._seen("config")
        return super().values()


def config_ignored(boundary, device: str, config, variants: list[str]) -> list[str]:
    """The fused-role variants among ``variants`` that never read ``inputs["config"]``: a sweep
    of config fields would time their defaults. Probed on the tiny preset (where the boundary
    applies): a variant is stopped as soon as it asks for its config, so normally no kernel runs.
    """
    from k3lab import boundaries
    from k3lab.config import preset as make_preset

    cfg = make_preset("tiny", 1)
    if not boundary.applies(cfg):
        return []
    inputs = boundary.make_inputs(cfg, device, 0)
    ignored = []
    for name in variants:
        v = boundary.variant(name)
        if v.role != "fused" or v.unavailable(device):
            continue
        try:
            v.fn(_Inputs({**boundaries.clone_inputs(inputs), "config": config}))
        except _ConfigReadError:
            continue
        ignored.append(name)
    return ignored


def run_sweep(sweep, *, device: str = "cpu", preset: str = "tiny", tp: int = 1,
              repeats: int | None = None, points: list[int] | None = None,
              variants: list[str] | None = None, seed: int = 0,
              log=print) -> pd.DataFrame:
    """Measure ``sweep`` (a :class:`benchmarks.sweeps.Sweep`); tidy rows with :data:`COLUMNS`.

    Every point is resolved first (an unknown field raises before anything runs). A point whose
    measurement raises gets a ``check`` row of 0 with the error for each variant, and the sweep
    goes on.
    """
    from benchmarks import sweeps as sweeps_mod
    from k3lab import profile

    sweep, resolved, b, cfg = sweeps_mod.prepare(sweep, preset, tp, points, variants)
    dev = device
    meta = _manifest(device, preset, tp)
    chosen = list(sweep.variants) if sweep.variants is not None else [v.name for v in b.variants]
    tuned = next((pt for pt in resolved if pt.overrides), None)
    if tuned is not None:
        ignored = config_ignored(b, device, tuned.config, chosen)
        if ignored:
            raise sweeps_mod.SweepError(
                f"sweep {sweep.boundary}/{sweep.name}: the fused variant(s) {ignored} of "
                f"{sweep.boundary} do not read inputs['config'] in this checkout, so its points "
                f"would all time the defaults; nothing was measured")
    rows: list[dict] = []
    for i, pt in enumerate(resolved):
        point = sweeps_mod.point_json(pt.spec)
        config = "" if pt.config is None else sweeps_mod.point_json(pt.config)
        m = pt.params.get("M", b.params.get("M", 1))
        base = {**meta, "device": device, "boundary": sweep.boundary, "sweep": sweep.name,
                "point": point, "config": config, "preset": preset, "tp": tp, "M": m}
        log(f"[{i + 1}/{len(resolved)}] {sweep.boundary}/{sweep.name} {point}")
        bb = b if pt.config is None else _with_config(b, pt.config)
        try:
            df = profile.measure(bb, cfg, dev, variants=chosen, seed=seed, params=pt.params,
                                 repeats=repeats)
        except Exception as exc:  # noqa: BLE001 - a failing point is a row, not a crash
            note = f"{type(exc).__name__}: {exc}"[:300]
            log(f"    failed: {note}")
            rows += [{**base, "variant": v, "metric": "check", "value": 0.0, "note": note}
                     for v in chosen]
            continue
        _release(device)  # the point's inputs and copies are gone: hand their memory back
        bw = profile.copy_bandwidth(dev)
        errs: dict[str, float] = {}
        for r in df.to_dict("records"):
            name = _metric(r)
            if name is None:
                continue
            if name == "max_abs_err":
                errs[r["variant"]] = max(errs.get(r["variant"], 0.0), float(r["value"]))
                continue
            rows.append({**base, "variant": r["variant"], "metric": name,
                         "value": float(r["value"]), "note": r.get("note", "") or ""})
            if name == "check" and r["value"] == 0:
                log(f"    {r['variant']}: check failed: {r['note']}"[:300])
        for v, err in errs.items():
            rows.append({**base, "variant": v, "metric": "max_abs_err", "value": err, "note": ""})
        for v in sorted({r["variant"] for r in rows if r["point"] == point
                         and r["metric"] == "eager_us"}):
            rows.append({**base, "variant": v, "metric": "copy_bw_GBps", "value": bw / 1e9,
                         "note": "device-to-device copy, read + write, measured in this run"})
    return pd.DataFrame(rows, columns=COLUMNS)


def _release(device: str) -> None:
    if device.startswith("cuda"):
        import gc

        import torch

        gc.collect()
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------
# the CSV and the tables


def append_csv(df: pd.DataFrame, path: str | os.PathLike) -> Path:
    """Append ``df``'s rows to the CSV at ``path`` (written with its header when new)."""
    path = Path(path)
    if path.exists() and path.stat().st_size:
        have = list(pd.read_csv(path, nrows=0).columns)
        if have != COLUMNS:
            raise ValueError(f"out: {path} has columns {have}, expected {COLUMNS}; "
                             f"write to another file")
        df[COLUMNS].to_csv(path, mode="a", header=False, index=False)
    else:
        path.parent.mkdir(parents=True, exist_ok=True)
        df[COLUMNS].to_csv(path, index=False)
    return path


def _shown(df: pd.DataFrame) -> pd.DataFrame:
    return df[df["metric"].isin(SHOWN)]


def table(df: pd.DataFrame) -> pd.DataFrame:
    """One run's rows as variant x point (rows) by metric (columns)."""
    t = _shown(df).pivot_table(index=["variant", "point"], columns="metric", values="value",
                               aggfunc="first")
    return t[[m for m in SHOWN if m in t.columns]]


def side_by_side(head: pd.DataFrame, base: pd.DataFrame) -> pd.DataFrame:
    """(variant, point, metric) rows with columns head, base and ratio = head / base."""
    key = ["variant", "point", "metric"]
    h = _shown(head).groupby(key)["value"].first().rename("head")
    b = _shown(base).groupby(key)["value"].first().rename("base")
    t = pd.concat([h, b], axis=1)
    t["ratio"] = [x / y if y and not (math.isnan(x) or math.isnan(y)) else float("nan")
                  for x, y in zip(t["head"], t["base"], strict=True)]
    order = {m: i for i, m in enumerate(SHOWN)}
    return t.sort_index(key=lambda s: s.map(order) if s.name == "metric" else s)


def _describe(df: pd.DataFrame, label: str) -> str:
    if df.empty:
        return f"{label}: no rows"
    r = df.iloc[0]
    commit = str(r["commit"])[:10] if isinstance(r["commit"], str) else "?"
    dirty = " (dirty)" if r["dirty"] is True or str(r["dirty"]) == "True" else ""
    where = {"cpu": "CPU, Triton interpreter", "sm90": "sm_90 builds on this machine, no GPU"
             }.get(r["device"], r["gpu"])
    return (f"{label}: {commit}{dirty}, {where}, torch {r['torch']}, triton {r['triton']}, "
            f"{r['preset']} tp {r['tp']}, {r['date']}")


def _print_table(t: pd.DataFrame, cpu: bool, built: bool = False) -> None:
    if built:
        from benchmarks.builds import NOTE

        print(f"NOTE: {NOTE}")
    if cpu:
        print(f"NOTE: {CPU_NOTE}")
    with pd.option_context("display.max_rows", 500, "display.max_columns", 50,
                           "display.width", 200, "display.max_colwidth", 60):
        print(t.to_string(float_format=lambda v: f"{v:.4g}"))
    if cpu:
        print(f"NOTE: {CPU_NOTE}")


# ---------------------------------------------------------------------------------------------
# --base


def _git(*args: str, cwd: Path = REPO_ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


@contextlib.contextmanager
def _worktree(rev: str):
    """A temporary detached ``git worktree`` of ``rev``: yields (folder, full commit hash)."""
    commit = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    tmp = Path(tempfile.mkdtemp(prefix="k3lab-base-"))
    tree = tmp / "tree"
    _git("worktree", "add", "--detach", "--quiet", str(tree), commit)
    try:
        yield tree, commit
    finally:
        with contextlib.suppress(RuntimeError):
            _git("worktree", "remove", "--force", str(tree))
        shutil.rmtree(tmp, ignore_errors=True)


def run_base(rev: str, args: list[str], *, tree: str | None = None) -> pd.DataFrame:
    """Run this runner, with ``args``, on commit ``rev``'s k3lab and kernels in a subprocess;
    return its rows.

    The tree is a temporary ``git worktree`` of ``rev`` (removed afterwards), or ``tree`` when
    given (a checkout of ``rev`` made beforehand, e.g. on a machine without the git history).
    The subprocess imports this checkout's benchmarks package (the same sweeps) and the tree's
    k3lab; the tree's pyproject ``package-dir`` (``k3lab.kernels`` -> ``kernels/``) is honoured
    by a finder, so nothing is installed.
    """
    with contextlib.ExitStack() as stack:
        if tree is None:
            root, commit = stack.enter_context(_worktree(rev))
        else:
            root, commit = Path(tree).resolve(), rev
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="k3lab-bench-")))
        runner = tmp / "runner" / "benchmarks"
        runner.mkdir(parents=True)
        for f in Path(__file__).parent.glob("*.py"):
            shutil.copy2(f, runner / f.name)
        out = tmp / "base.csv"
        env = {**os.environ,
               "PYTHONPATH": os.pathsep.join(
                   [str(runner.parent), str(root), *filter(None, [os.environ.get("PYTHONPATH")])]),
               TREE_ENV: json.dumps({"root": str(root), "package_dirs": package_dirs(root)}),
               "K3LAB_GIT_COMMIT": commit, "K3LAB_GIT_DIRTY": "0" if tree is None else ""}
        if tree is not None:
            env.pop("K3LAB_GIT_DIRTY")
        cmd = [sys.executable, "-m", "benchmarks.run", *args, "--out", str(out), "--quiet"]
        proc = subprocess.run(cmd, cwd=tmp, env=env)
        if proc.returncode:
            raise RuntimeError(f"--base {rev}: the run on {commit[:10]} failed "
                               f"(exit {proc.returncode}); see its output above")
        return pd.read_csv(out) if out.exists() else pd.DataFrame(columns=COLUMNS)


# ---------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.run",
                                description=__doc__.splitlines()[0])
    p.add_argument("boundary", nargs="?", help="a boundary of the k3lab registry")
    p.add_argument("--sweep", help="a sweep of benchmarks/sweeps.py (see --list)")
    p.add_argument("--list", action="store_true", help="list the sweeps and exit")
    p.add_argument("--device", choices=("cpu", "cuda", "sm90"), default=None,
                   help="default: cuda when a GPU is visible, else cpu; sm90: compile the "
                        "kernels for sm_90 here and record their registers (no timing)")
    p.add_argument("--preset", default=None,
                   help="default: kimi-k3 on cuda and sm90, tiny on cpu")
    p.add_argument("--tp", type=int, default=None,
                   help="default: the sweep's own tp (else 8) on cuda and sm90, 1 on cpu")
    p.add_argument("--repeats", type=int, default=None,
                   help="timed repeats (default: k3lab.profile's, 50 on cuda, 3 on cpu)")
    p.add_argument("--points", default=None, metavar="I,J",
                   help="measure only these points of the sweep (0-based indices)")
    p.add_argument("--variants", default=None, metavar="A,B",
                   help="measure these variants instead of the sweep's")
    p.add_argument("--out", default=str(DEFAULT_OUT), help="CSV the rows are appended to")
    p.add_argument("--base", default=None, metavar="REV",
                   help="also run the sweep on commit REV and print both side by side")
    p.add_argument("--base-tree", default=None, metavar="DIR",
                   help="with --base: a checkout of REV made beforehand (no git needed)")
    p.add_argument("--quiet", action="store_true", help="print no table")
    return p


def _list() -> int:
    from benchmarks import sweeps

    for key in sweeps.names():
        s = sweeps.SWEEPS[key]
        print(f"{s.boundary} --sweep {s.name}: {s.description} "
              f"({len(s.points)} points; variants: {', '.join(s.variants or ['all'])})")
    return 0


def main(argv: list[str] | None = None) -> int:
    _install_tree_finder()
    args = _parser().parse_args(argv)
    if args.list:
        return _list()
    if not args.boundary or not args.sweep:
        print("usage: python -m benchmarks.run BOUNDARY --sweep NAME (see --list)",
              file=sys.stderr)
        return 2
    if args.base_tree and not args.base:
        print("--base-tree: needs --base REV (the commit the tree holds)", file=sys.stderr)
        return 2
    import torch

    from benchmarks import builds, sweeps, token

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == builds.DEVICE:
        from k3lab import sm90

        try:
            sm90.compile_here()
            sm90.cuobjdump()
        except (ValueError, RuntimeError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    else:
        try:
            from k3lab.device import use_device

            use_device(device)
        except ImportError:  # an older k3lab: the interpreter switch by hand
            if device == "cpu":
                os.environ["TRITON_INTERPRET"] = "1"
    try:
        sweep = sweeps.get(args.boundary, args.sweep)
        preset = args.preset or ("tiny" if device == "cpu" else "kimi-k3")
        tp = args.tp or (1 if device == "cpu" else sweep.tp or 8)
        points = [int(i) for i in args.points.split(",")] if args.points else None
        variants = args.variants.split(",") if args.variants else None
        sweeps.resolve(dataclasses.replace(sweep, variants=tuple(variants))
                       if variants else sweep, points)  # fails here, before anything runs
    except (KeyError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    log = (lambda *a, **k: None) if args.quiet else print
    try:
        if sweep.boundary == token.TOKEN and variants:
            raise sweeps.SweepError("--variants: a token sweep runs the full stack only")
        if device == builds.DEVICE and sweep.boundary == token.TOKEN:
            head = builds.build_token_sweep(sweep, preset=preset, tp=tp, columns=COLUMNS,
                                            meta=_manifest("cpu", preset, tp), points=points,
                                            log=log)
        elif device == builds.DEVICE:
            head = builds.build_sweep(sweep, preset=preset, tp=tp, columns=COLUMNS,
                                      meta=_manifest("cpu", preset, tp), points=points,
                                      variants=variants, log=log)
        elif sweep.boundary == token.TOKEN:
            head = token.run_token_sweep(sweep, device=device, preset=preset, tp=tp,
                                         repeats=args.repeats, points=points, columns=COLUMNS,
                                         meta=_manifest(device, preset, tp), log=log)
        else:
            head = run_sweep(sweep, device=device, preset=preset, tp=tp, repeats=args.repeats,
                             points=points, variants=variants, log=log)
    except sweeps.SweepError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    path = append_csv(head, args.out)
    cpu, built = device == "cpu", device == builds.DEVICE
    if args.base is None:
        if not args.quiet:
            print(_describe(head, "rows"))
            _print_table(table(head), cpu, built)
            print(f"{len(head)} rows appended to {path}")
        return 0

    passed = [args.boundary, "--sweep", args.sweep, "--device", device, "--preset", preset,
              "--tp", str(tp)]
    for flag, value in (("--repeats", args.repeats), ("--points", args.points),
                        ("--variants", args.variants)):
        if value is not None:
            passed += [flag, str(value)]
    try:
        base = run_base(args.base, passed, tree=args.base_tree)
    except RuntimeError as exc:
        print(_describe(head, "head"))
        _print_table(table(head), cpu, built)
        print(f"{len(head)} rows appended to {path}")
        print(f"error: {exc}", file=sys.stderr)
        return 1
    append_csv(base, args.out)
    print(_describe(head, "head"))
    print(_describe(base, "base"))
    print("ratio = head / base (latency: < 1 means head is faster)")
    _print_table(side_by_side(head, base), cpu, built)
    print(f"{len(head) + len(base)} rows appended to {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
