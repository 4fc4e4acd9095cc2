"""A run's output folder: checked before anything runs, cleared of the temp files a killed run
left, and summed up in ``index.html`` and ``manifest.json`` from the report files found there."""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from k3lab import compare, readable, report, traces

__all__ = ["RESERVED", "prepare", "stale_temp_files", "remove_stale", "load_record",
           "update_index", "TEMP_PATTERN", "TRACES_SUFFIX"]

RESERVED = ("index", "manifest")  # index.html and manifest.json belong to the folder
TRACES_SUFFIX = ".traces"  # a run's folder for the traces a notebook writes (a temp folder)
# a temp file of the runner or of report.atomic_write_text: ".<name>.<pid>-<random><suffix>",
# or the runner's temp folder of a notebook's traces
TEMP_PATTERN = re.compile(r"^\..+\.(?:(\d+)-)?[\w]+(\.running\.ipynb|\.tmp|\.traces)$")


def prepare(out: Path) -> Path:
    """Create ``out`` if needed and make sure files can be written there (ValueError naming
    --out otherwise), before any notebook runs."""
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: exists and is not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=out, prefix=".k3lab-probe.")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"--out {out}: cannot write there ({exc.strerror or exc})") from None
    return out


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stale_temp_files(out: Path) -> tuple[list[Path], list[Path]]:
    """(stale, busy): temp files of ``out`` whose process is gone (or unnamed), and those of a
    process still running (another run writing into the same folder)."""
    stale, busy = [], []
    for p in sorted(out.glob(".*")):
        m = TEMP_PATTERN.match(p.name)
        if not m or not (p.is_file() or (p.is_dir() and not p.is_symlink()
                                         and m.group(2) == TRACES_SUFFIX)):
            continue
        pid = int(m.group(1)) if m.group(1) else None
        (busy if pid is not None and pid != os.getpid() and _alive(pid) else stale).append(p)
    return stale, busy


def remove_stale(out: Path) -> tuple[list[str], list[str]]:
    """Remove the stale temp files of ``out``; returns (removed names, busy names)."""
    stale, busy = stale_temp_files(out)
    removed = []
    for p in stale:
        try:
            if p.is_dir():
                shutil.rmtree(p)
            else:
                p.unlink()
            removed.append(p.name)
        except OSError:
            busy.append(p)
    return removed, [p.name for p in busy]


_FIELDS = {"manifest": dict, "headline": dict, "records": list, "parameters": dict}


def load_record(path: Path) -> tuple[dict | None, str | None]:
    """(record, problem) of a ``.metrics.json`` / ``.failed.json``: (None, None) when absent,
    (None, why) when it cannot be read, is not a JSON object or has fields of the wrong kind."""
    if not path.exists():
        return None, None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        return None, f"{path.name} is unreadable ({type(exc).__name__}: {exc})"
    if not isinstance(data, dict):
        return None, f"{path.name} is not a JSON object"
    bad = [k for k, kind in _FIELDS.items() if data.get(k) is not None
           and not isinstance(data[k], kind)]
    seconds = data.get("seconds")
    if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, int | float)):
        bad.append("seconds")
    if bad:
        return None, f"{path.name} has malformed fields: {', '.join(bad)}"
    return data, None


def _entry(out_dir: Path, name: str, repo: Path | None) -> dict:
    good, good_problem = load_record(out_dir / f"{name}.metrics.json")
    failed, failed_problem = load_record(out_dir / f"{name}.failed.json")
    problem = failed_problem or good_problem
    latest = failed or good or {}
    erratum = out_dir / f"{name}.erratum.txt"
    status = "corrupt" if problem else "failed" if failed else "ok"
    error = (f"{problem}; run the notebook again" if problem
             else failed.get("error") if failed else None)
    return {
        "erratum": erratum.read_text(errors="replace").strip() if erratum.exists() else None,
        "name": name,
        "status": status,
        "error": None if error is None else str(error),
        "date": (latest.get("manifest") or {}).get("date"),
        "seconds": latest.get("seconds"),
        "html": f"{name}.html" if good and (out_dir / f"{name}.html").exists() else None,
        "failed_html": (f"{name}.failed.html"
                        if failed and (out_dir / f"{name}.failed.html").exists() else None),
        "metrics": f"{name}.metrics.json" if good else None,
        # the last good report's traces (a run that failed leaves them as they were)
        "traces": (traces.report_traces(out_dir, name)
                   if good and (out_dir / f"{name}.html").exists() else []),
        "last_good_date": (good.get("manifest") or {}).get("date") if good else None,
        "headline": (good or {}).get("headline"),
        "manifest": latest.get("manifest"),
        "card": (readable.summary_card(good.get("records") or [], good.get("headline"),
                                       good.get("manifest")) if good else None),
        "stale": (None if repo is None or not good else
                  compare.stale_files((good.get("manifest") or {}).get("git_commit"), name, repo)),
    }


def update_index(out_dir: str | os.PathLike, repo: str | os.PathLike | None = None) -> Path:
    """Rewrite ``out_dir/index.html`` and ``out_dir/manifest.json`` (each report's status and
    manifest: git commit, GPU, driver, torch, triton, date) from every report found there, and
    drop the shared stylesheets of ``out_dir/_assets`` that no report links any more.

    A record that cannot be read shows as "corrupt" (never "ok", never a crash). A committed
    ``<name>.erratum.txt`` beside a report (a person's note of a mistake found in it after it
    ran) is shown with it; the measured report itself is never edited. A report whose commit
    is behind HEAD of ``repo`` (default: this checkout) in the files it depends on is flagged
    with those files."""
    out_dir = Path(out_dir)
    names = sorted({p.name.removesuffix(suffix) for suffix in (".metrics.json", ".failed.json")
                    for p in out_dir.glob(f"*{suffix}") if not p.name.startswith(".")})
    repo = Path(repo) if repo is not None else report.REPO_ROOT
    entries = [_entry(out_dir, name, repo) for name in names]
    report.prune_shared_assets(out_dir)
    report.atomic_write_text(out_dir / "manifest.json", json.dumps(report.json_safe({
        "reports": {e["name"]: {"status": e["status"], "manifest": e["manifest"],
                                **({"erratum": e["erratum"]} if e["erratum"] else {}),
                                **({"error": e["error"]} if e["status"] == "corrupt" else {}),
                                **({"stale_files": e["stale"]} if e["stale"] else {})}
                    for e in entries}}), indent=1) + "\n")
    return report.write_index(out_dir, entries)
