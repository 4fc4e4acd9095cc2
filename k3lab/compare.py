"""Run folders as tables: every record of a folder as one CSV (:func:`records`), two folders
side by side with ratios (:func:`compare`), and which reports are older than the checkout in
the files they depend on (:func:`stale_files`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

__all__ = ["records", "compare", "stale_files", "dependencies"]

# the run's own columns, beside each record's
RUN_COLUMNS = ("notebook", "git_commit", "run_date", "gpu")


def _cell(v):
    return json.dumps(v) if isinstance(v, list | dict) else v


def records(run_dir: str | os.PathLike):
    """Every record of every readable ``*.metrics.json`` of ``run_dir`` as one DataFrame, with
    the notebook, commit, date and GPU of its run first. ValueError when there are none."""
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
    if not rows:
        raise ValueError(f"{run_dir}: no readable records (*.metrics.json)")
    return pd.DataFrame(rows).convert_dtypes()  # ints stay ints beside missing values


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
            "k3lab/report.py", "k3lab/studies/__init__.py", "kernels/runtime.py"]
    if short in ("overview", "decode_step"):
        return [f"notebooks/{name}.ipynb", "k3lab", "kernels"]
    named = [f"{d}/{short}*" for d in ("kernels", "k3lab/boundaries", "k3lab/reference",
                                        "k3lab/studies")]
    return [f"notebooks/{name}.ipynb", *base, *named]


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
