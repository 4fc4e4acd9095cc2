"""Run folders as tables: every record of a folder as one CSV (:func:`records`), two folders
side by side with ratios (:func:`compare`), either of them a git revision whose notebooks are
run first in a temporary worktree (:func:`compare_sides`), and which reports are older than the
checkout in the files they depend on (:func:`stale_files`)."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["records", "compare", "stale_files", "dependencies", "Side", "resolve_side",
           "run_plan", "compare_sides", "run_at_revision", "worktree"]

# the run's own columns, beside each record's
RUN_COLUMNS = ("notebook", "git_commit", "run_date", "gpu")


def _cell(v):
    return json.dumps(v) if isinstance(v, list | dict) else v


def records(run_dir: str | os.PathLike):
    """Every record of every readable ``*.metrics.json`` of ``run_dir`` as one DataFrame, with
    the notebook, commit, date and GPU of its run first; a profiled run's host seconds by
    category are records too (boundary "host", metric "host_s"). ValueError when there are
    none."""
    import pandas as pd

    from k3lab import folder  # it imports this module for stale_files

    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ValueError(f"run folder not found: {run_dir}")
    rows = []
    for path in sorted(run_dir.glob("*.metrics.json")):
        data, _ = folder.load_record(path)
        if not data:
            continue
        man = data.get("manifest") or {}
        run = {"notebook": data.get("notebook") or path.name.removesuffix(".metrics.json"),
               "git_commit": man.get("git_commit"), "run_date": man.get("date"),
               "gpu": man.get("gpu") or man.get("device")}
        rows += [{**run, **{k: _cell(v) for k, v in r.items() if k not in run}}
                 for r in data.get("records") or [] if isinstance(r, dict)]
        rows += [{**run, **r} for r in _host_rows(data.get("host_profile"))]
    if not rows:
        raise ValueError(f"{run_dir}: no readable records (*.metrics.json)")
    return pd.DataFrame(rows).convert_dtypes()  # ints stay ints beside missing values


def _host_rows(profile) -> list[dict]:
    """A profiled run's host seconds by category (``k3lab run --profile``) as records."""
    seconds = profile.get("seconds") if isinstance(profile, dict) else None
    if not isinstance(seconds, dict):
        return []
    return [{"boundary": "host", "variant": c, "role": "host profile", "metric": "host_s",
             "value": float(t), "unit": "s"} for c, t in seconds.items()
            if isinstance(t, int | float) and not isinstance(t, bool)]


def _measures(df) -> list[str]:
    import pandas as pd

    return [c for c in df.columns if c not in RUN_COLUMNS
            and (c == "value" or pd.api.types.is_float_dtype(df[c]))]


def compare(a: str | os.PathLike, b: str | os.PathLike):
    """The records of run folders ``a`` and ``b`` side by side: one row per record and measured
    column found in both, with ``a``, ``b`` and ``ratio`` (b / a). Records are matched on the
    notebook and every column that is not a measurement (float columns and ``value``)."""
    import pandas as pd

    da, db = records(a), records(b)
    measures = sorted(set(_measures(da)) | set(_measures(db)))
    keys = [c for c in dict.fromkeys([*da.columns, *db.columns])
            if c not in measures and c not in RUN_COLUMNS[1:]]

    def long(df):
        df = df.reindex(columns=[*keys, *measures])
        df[keys] = df[keys].astype(object).fillna("").astype(str)  # missing matches missing
        out = df.melt(id_vars=keys, value_vars=measures, var_name="measure", value_name="x")
        out["x"] = pd.to_numeric(out["x"], errors="coerce").astype(float)
        return out.dropna(subset=["x"]).groupby([*keys, "measure"], as_index=False).first()

    table = long(da).merge(long(db), on=[*keys, "measure"], suffixes=("_a", "_b"))
    table = table.rename(columns={"x_a": "a", "x_b": "b"})
    table["ratio"] = table["b"] / table["a"].where(table["a"] != 0)
    varying = [k for k in keys if table[k].nunique() > 1 or k == "notebook"]
    return table[[*varying, "measure", "a", "b", "ratio"]]


def dependencies(name: str) -> list[str]:
    """The paths a notebook's figures depend on: itself, the library's shared modules and the
    files named after its boundary (the overview and the decode step: all of the code)."""
    short = re.sub(r"^\d+_", "", name)
    base = ["k3lab/profile.py", "k3lab/floors.py", "k3lab/config.py", "k3lab/weights.py",
            "k3lab/report.py", "k3lab/studies/__init__.py", "k3lab/boundaries/__init__.py",
            "kernels/runtime.py", "kernels/plan.py"]
    if short in ("overview", "decode_step"):
        return [f"notebooks/{name}.ipynb", "k3lab", "kernels"]
    named = [f"{d}/{short}*" for d in ("kernels", "k3lab/boundaries", "k3lab/reference",
                                        "k3lab/studies")]
    return [f"notebooks/{name}.ipynb", *base, *named, *USES.get(short, ())]


# kernels a boundary's launches call beyond its own files (the MoE block routes and runs dense
# GEMVs; the dense boundary's merged projections are in kernels/dense)
USES = {"moe": ("kernels/route", "kernels/dense", "kernels/mxfp4.py"),
        "route": ("kernels/mxfp4.py",)}


def stale_files(commit: str | None, name: str, repo: str | os.PathLike) -> list[str] | None:
    """The files ``name`` depends on that changed between ``commit`` and HEAD of ``repo``
    ([] when none; None when git or the commit is not there to tell)."""
    if not commit or not re.fullmatch(r"[0-9a-f]{7,40}", str(commit)):
        return None
    try:
        out = subprocess.run(["git", "diff", "--name-only", str(commit), "HEAD", "--",
                              *dependencies(name)], cwd=repo, capture_output=True, text=True,
                             timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode:
        return None
    return out.stdout.split()


# ---------------------------------------------------------------- a side that is a revision

RUN_KEYS = ("device", "preset", "tp")
NOT_RUN_PARAMS = ("trace_dir",)  # set by the runner (older records may hold it)


def _repo() -> Path:
    return Path(__file__).resolve().parents[1]


def _git(args: list[str], cwd: Path) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=120)
    if out.returncode:
        raise RuntimeError(f"git {' '.join(args)}: {out.stderr.strip() or out.stdout.strip()}")
    return out.stdout.strip()


@dataclass
class Side:
    """One side of a comparison: a run folder, or a git revision to run (``commit``)."""

    spec: str
    folder: Path | None = None
    commit: str | None = None

    @property
    def label(self) -> str:
        return self.spec if self.commit is None else f"{self.spec} ({self.commit[:10]})"


def resolve_side(spec: str, repo: str | os.PathLike | None = None) -> Side:
    """``spec`` as a run folder (a folder that exists), else as a git revision of ``repo``
    (default: this checkout); ValueError when it is neither."""
    path = Path(spec)
    if path.is_dir():
        return Side(spec, folder=path)
    repo = Path(repo) if repo is not None else _repo()
    try:
        commit = _git(["rev-parse", "--verify", "--quiet", f"{spec}^{{commit}}"], repo)
    except (RuntimeError, OSError, subprocess.SubprocessError):
        commit = ""
    if not commit:
        raise ValueError(f"{spec}: neither a run folder nor a git revision of {repo}")
    return Side(spec, commit=commit)


@dataclass
class _Group:
    """Notebooks run together at a revision: one ``k3lab run`` call."""

    options: dict
    params: dict
    names: list[str] = field(default_factory=list)


def run_plan(folder: str | os.PathLike, notebooks: list[str] | None = None) -> list[_Group]:
    """How the notebooks of run folder ``folder`` ran (``notebooks``: only these): grouped by
    device, preset, tp and parameters, one ``k3lab run`` each."""
    from k3lab import folder as run_folder

    groups: dict[str, _Group] = {}
    for path in sorted(Path(folder).glob("*.metrics.json")):
        data, _ = run_folder.load_record(path)
        if not data:
            continue
        name = data.get("notebook") or path.name.removesuffix(".metrics.json")
        if notebooks and name not in notebooks and re.sub(r"^\d+_", "", name) not in notebooks:
            continue
        man, params = data.get("manifest") or {}, dict(data.get("parameters") or {})
        options = {k: params.pop(k, man.get(k)) for k in RUN_KEYS}
        options = {k: v for k, v in options.items() if v is not None}
        for k in NOT_RUN_PARAMS:
            params.pop(k, None)
        key = json.dumps([options, params], sort_keys=True, default=str)
        groups.setdefault(key, _Group(options, params)).names.append(name)
    return list(groups.values())


def _cli_value(v) -> str:
    return json.dumps(v) if isinstance(v, list | dict | bool) else str(v)


def _link_packages(tree: Path) -> None:
    """Make every ``k3lab.X`` of the tree's pyproject ``package-dir`` map importable from the
    tree itself (a link ``k3lab/X`` -> its folder), so that ``PYTHONPATH=tree`` imports that
    commit's modules only, in this process's children and in their notebook kernels."""
    text = (tree / "pyproject.toml").read_text() if (tree / "pyproject.toml").exists() else ""
    m = re.search(r"^package-dir\s*=\s*\{([^}]*)\}", text, re.M)
    for pkg, folder in re.findall(r'"([^"]+)"\s*=\s*"([^"]*)"', m.group(1)) if m else []:
        parts = pkg.split(".")
        if len(parts) < 2 or not folder:
            continue
        link = tree.joinpath(*parts)
        if not link.exists():
            link.symlink_to((tree / folder).resolve(), target_is_directory=True)


@contextlib.contextmanager
def worktree(commit: str, repo: str | os.PathLike | None = None):
    """A temporary detached ``git worktree`` of ``commit`` (removed afterwards): yields it."""
    repo = Path(repo) if repo is not None else _repo()
    tmp = Path(tempfile.mkdtemp(prefix="k3lab-compare-"))
    tree = tmp / "tree"
    _git(["worktree", "add", "--detach", "--quiet", str(tree), commit], repo)
    try:
        _link_packages(tree)
        yield tree
    finally:
        with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
            _git(["worktree", "remove", "--force", str(tree)], repo)
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(RuntimeError, OSError, subprocess.SubprocessError):
            _git(["worktree", "prune"], repo)


def run_at_revision(tree: Path, commit: str, names: list[str], options: dict, params: dict,
                    out: Path, notebook_dir: str = "notebooks") -> int:
    """``k3lab run NAMES`` of the tree's own k3lab (a subprocess, its notebooks from
    ``tree/notebook_dir``) into ``out``; the reports name ``commit``. Returns its exit code."""
    env = {**os.environ, "K3LAB_GIT_COMMIT": commit, "K3LAB_GIT_DIRTY": "0",
           "PYTHONPATH": os.pathsep.join([str(tree), *filter(None, [
               os.environ.get("PYTHONPATH")])])}
    env.pop("K3LAB_NOTEBOOKS", None)
    cmd = [sys.executable, "-m", "k3lab.cli", "run", *names, "--out", str(out),
           "--notebooks", str(tree / notebook_dir), "-q"]
    for k in RUN_KEYS:
        if k in options:
            cmd += [f"--{k}", str(options[k])]
    for k, v in params.items():
        cmd += ["-p", f"{k}={_cli_value(v)}"]
    return subprocess.run(cmd, cwd=tree, env=env).returncode


def _available(tree: Path, notebook_dir: str, names: list[str]) -> tuple[list[str], list[str]]:
    """(names whose notebook the tree has, names it lacks)."""
    stems = {p.stem for p in (tree / notebook_dir).glob("*.ipynb")}
    shorts = {re.sub(r"^\d+_", "", s) for s in stems}
    have = [n for n in names if n in stems or n in shorts]
    return have, [n for n in names if n not in have]


def compare_sides(a: str, b: str, *, notebooks: list[str] | None = None,
                  options: dict | None = None, params: dict | None = None,
                  keep: str | os.PathLike | None = None, notebook_dir: str = "notebooks",
                  repo: str | os.PathLike | None = None,
                  run: Callable[..., int] | None = None, say=print):
    """:func:`compare` of ``a`` and ``b``, each a run folder or a git revision.

    A revision's side is run first, in a temporary worktree of it: the notebooks of the other
    side's folder as they ran there (device, preset, tp and parameters from their records),
    or ``notebooks`` (with ``options`` and ``params``: device, preset, tp and notebook
    parameters; defaults cpu, tiny, 1) when given or when both sides are revisions.
    ``keep``: write the revision runs under ``keep/a-<commit>`` (``b-``) (default: a temporary
    folder, removed afterwards). ``run``: what runs the notebooks at a revision (see
    :func:`run_at_revision`). Returns (table, label of a, label of b)."""
    run = run or run_at_revision
    sides = [resolve_side(a, repo), resolve_side(b, repo)]
    revs = [s for s in sides if s.commit is not None]
    if not revs:
        return compare(a, b), sides[0].label, sides[1].label
    if len(revs) == 2 and not notebooks:
        raise ValueError("A and B are both git revisions: name the notebooks to run at each "
                         "with --notebooks")
    base_options = {"device": "cpu", "preset": "tiny", "tp": 1, **(options or {})}
    with contextlib.ExitStack() as stack:
        root = (Path(keep) if keep is not None else
                Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="k3lab-runs-"))))
        for side in revs:
            other = sides[1] if side is sides[0] else sides[0]
            groups = (run_plan(other.folder, notebooks) if other.folder is not None else [])
            if notebooks and other.folder is not None:  # named ones the folder did not run
                ran = {n for g in groups for n in g.names}
                ran |= {re.sub(r"^\d+_", "", n) for n in ran}
                rest = [n for n in notebooks if n not in ran]
                if rest:
                    groups.append(_Group(base_options, dict(params or {}), rest))
            elif notebooks:
                groups = [_Group(base_options, dict(params or {}), list(notebooks))]
            if not groups:
                raise ValueError(f"{other.spec}: no notebook records to run at {side.spec}")
            out = root / f"{'a' if side is sides[0] else 'b'}-{side.commit[:12]}"
            out.mkdir(parents=True, exist_ok=True)
            tree = stack.enter_context(worktree(side.commit, repo))
            for g in groups:
                names, missing = _available(tree, notebook_dir, g.names)
                if missing:
                    say(f"k3lab: {side.spec} has no notebook {', '.join(missing)}: left out")
                if not names:
                    continue
                how = [f"{k} {v}" for k, v in g.options.items()]
                how += [f"-p {k}={_cli_value(v)}" for k, v in g.params.items()]
                say(f"k3lab: running {', '.join(names)} at {side.label} ({', '.join(how)}) "
                    f"-> {out}")
                rc = run(tree, side.commit, names, g.options, g.params, out, notebook_dir)
                if rc not in (0, 1):  # 1: a notebook failed; its records are left out
                    raise RuntimeError(f"the run at {side.label} failed (exit {rc})")
            side.folder = out
        table = compare(sides[0].folder, sides[1].folder)
    return table, sides[0].label, sides[1].label
