"""Reports: metrics out of a notebook, the manifest, HTML rendering and the index page.

Metrics leave a notebook through its outputs: :func:`publish` displays the tidy records and the
headline figures under the MIME type :data:`MIME` (with text and HTML fallbacks so they stay
readable), and the runner collects them from the executed notebook with :func:`read_metrics`.
No side files are written from inside a notebook.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import html
import json
import math
import os
import platform
import re
import subprocess
import sys
import tempfile
import urllib.parse
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["MIME", "CPU_WARNING", "publish", "metrics_bundle", "read_metrics", "cpu_banner",
           "manifest", "manifest_summary", "to_html", "write_index", "atomic_write_text",
           "readable", "json_safe", "significant", "ASSETS_DIR", "prune_shared_assets",
           "shared_assets_in_use"]

MIME = "application/vnd.k3lab.metrics+json"
CPU_WARNING = ("Timings below were taken on the CPU under the Triton interpreter: "
               "they are not GPU figures.")
REPO_ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------- publishing from a notebook

def json_safe(obj: Any) -> Any:
    """``obj`` with numpy / torch / pandas scalars made plain and NaN or inf made None."""
    if isinstance(obj, dict):
        return {str(k): json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple | set):
        return [json_safe(v) for v in obj]
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if hasattr(obj, "isoformat"):  # datetime, pandas Timestamp
        return obj.isoformat()
    if hasattr(obj, "tolist"):  # numpy scalar / array, torch tensor
        return json_safe(obj.tolist())
    if hasattr(obj, "item"):
        return json_safe(obj.item())
    if type(obj).__name__ in ("NAType", "NaTType"):
        return None
    return str(obj)


def _records(records) -> list[dict]:
    if records is None:
        return []
    if hasattr(records, "to_dict"):  # DataFrame
        records = records.to_dict(orient="records")
    if isinstance(records, dict):
        records = [records]
    return [json_safe(dict(r)) for r in records]


def _headline(headline) -> dict:
    if headline is None:
        return {}
    if isinstance(headline, str):
        return {"summary": headline}
    return json_safe(dict(headline))


def significant(x, digits: int = 3) -> float:
    """``x`` as a float rounded to ``digits`` significant digits (a headline figure)."""
    return float(f"{float(x):.{digits}g}")


def _fmt(v: Any) -> str:
    from k3lab.readable import human

    return human(v)


def _headline_table(headline: dict) -> str:
    rows = "".join(f"<tr><th style='text-align:left'>{html.escape(str(k))}</th>"
                   f"<td>{html.escape(_fmt(v))}</td></tr>" for k, v in headline.items())
    return f"<table class='k3lab-headline'>{rows}</table>"


def metrics_bundle(records=None, headline=None) -> dict:
    """The MIME bundle :func:`publish` displays: JSON payload, text and HTML fallbacks."""
    payload = {"records": _records(records), "headline": _headline(headline)}
    head = payload["headline"]
    text = f"k3lab metrics: {len(payload['records'])} records"
    if head:
        text += "; " + ", ".join(f"{k}={_fmt(v)}" for k, v in head.items())
    html_text = (f"<div class='k3lab-metrics'><b>Headline</b>{_headline_table(head)}</div>"
                 if head else f"<div class='k3lab-metrics'>{html.escape(text)}</div>")
    return {MIME: payload, "text/plain": text, "text/html": html_text}


def publish(records=None, headline=None) -> None:
    """Display tidy ``records`` (DataFrame or list of dicts) and ``headline`` figures.

    headline: dict name -> value (or a plain string). Values are made JSON-safe (NaN -> None).
    The runner collects every published payload into the report's metrics JSON.
    """
    from IPython.display import display

    display(metrics_bundle(records, headline), raw=True)


def read_metrics(nb) -> dict:
    """Every payload :func:`publish` left in an executed notebook (node or path), merged.

    Returns {"records": all records in output order, "headline": merged headline (later wins),
    "payloads": how many were found}.
    """
    import nbformat

    if isinstance(nb, str | os.PathLike):
        nb = nbformat.read(nb, as_version=4)
    records, headline, count = [], {}, 0
    for cell in nb.get("cells", []):
        for out in cell.get("outputs", []) if cell.get("cell_type") == "code" else []:
            payload = out.get("data", {}).get(MIME)
            if payload is None:
                continue
            if isinstance(payload, str):  # a writer that kept it as text
                payload = json.loads(payload)
            count += 1
            records.extend(payload.get("records", []))
            headline.update(payload.get("headline", {}))
    return {"records": records, "headline": headline, "payloads": count}


def _is_cpu(device) -> bool:
    return str(getattr(device, "type", device)).split(":")[0] == "cpu"


def cpu_banner(device) -> None:
    """Display a warning banner when ``device`` is the CPU (timings are interpreter figures)."""
    if not _is_cpu(device):
        return
    from IPython.display import display

    display({"text/markdown": f"> **Warning.** {CPU_WARNING}",
             "text/html": ("<div style='border:2px solid #c60;background:#fff4e5;padding:8px;"
                           f"font-weight:bold'>&#9888; {html.escape(CPU_WARNING)}</div>"),
             "text/plain": f"WARNING: {CPU_WARNING}"}, raw=True)


# ---------------------------------------------------------------- manifest

def _cmd(args: list[str], cwd: Path | None = None) -> str | None:
    try:
        out = subprocess.run(args, cwd=cwd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpu(device: str) -> tuple[str | None, str | None]:
    """(GPU name, driver version): nvidia-smi first, torch as the fallback on a CUDA device."""
    smi = _cmd(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"])
    if smi:
        rows = [tuple(p.strip() for p in line.split(",", 1)) for line in smi.splitlines()]
        names = sorted({r[0] for r in rows})
        name = names[0] if len(names) == 1 else ", ".join(names)
        if len(rows) > 1:
            name = f"{len(rows)}x {name}"
        return name, rows[0][1] if len(rows[0]) > 1 else None
    if not _is_cpu(device):
        try:
            import torch

            if torch.cuda.is_available():
                return torch.cuda.get_device_name(0), f"CUDA {torch.version.cuda} (torch)"
        except ImportError:
            pass
    return None, None


CODE_PATHS = ("kernels", "k3lab", "notebooks", "benchmarks", "pyproject.toml")


def _sources(text: str) -> list | None:
    """A notebook's cells as (type, source): what a run executes, outputs left out."""
    try:
        cells = json.loads(text).get("cells", [])
    except (ValueError, AttributeError):
        return None
    return [(c.get("cell_type"), "".join(c.get("source", ""))) for c in cells]


def git_state(root: str | os.PathLike) -> tuple[str | None, bool | None, list[str]]:
    """(commit, dirty, the files that make it dirty) of the checkout at ``root``.

    Dirty means the run's code differs from the commit: a changed tracked file, or an untracked
    one under :data:`CODE_PATHS`. A notebook whose cells' sources equal the commit's (only
    outputs or execution counts differ, as JupyterLab's autosave leaves them) is not a change.
    """
    root = Path(root)
    commit = _cmd(["git", "rev-parse", "HEAD"], cwd=root)
    try:  # not _cmd: porcelain's leading status column must survive
        out = subprocess.run(["git", "status", "--porcelain", "-z", "--untracked-files=all"],
                             cwd=root, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.SubprocessError):
        out = None
    if not commit or out is None or out.returncode:
        return commit, None, []
    status = out.stdout
    files = []
    entries = iter(status.split("\0"))
    for entry in entries:
        if len(entry) < 4:
            continue
        code, path = entry[:2], entry[3:]
        if "R" in code or "C" in code:
            next(entries, None)  # the rename's source path
        if code == "??" and not path.startswith(tuple(f"{c}/" for c in CODE_PATHS[:-1])):
            continue
        if path.endswith(".ipynb") and code.strip() == "M":
            old = _cmd(["git", "show", f"HEAD:{path}"], cwd=root)
            with contextlib.suppress(OSError):
                if old is not None and _sources(old) == _sources((root / path).read_text()):
                    continue
        files.append(path)
    return commit, bool(files), sorted(files)


def manifest(params: dict | None = None) -> dict:
    """What makes a report reproducible: code, machine, library versions, parameters, date.

    $K3LAB_GIT_COMMIT (and $K3LAB_GIT_DIRTY) name the commit of a copied tree and win over the
    tree's own git metadata, which a copy may carry from an older checkout. ``git_dirty`` says
    whether the code run differs from the commit (see :func:`git_state`), ``git_dirty_files``
    which files make it so.
    """
    params = dict(params or {})
    commit, files = os.environ.get("K3LAB_GIT_COMMIT"), []
    if commit:
        flag = os.environ.get("K3LAB_GIT_DIRTY")
        dirty = None if flag is None else flag.lower() in ("1", "true", "yes")
    else:
        commit, dirty, files = git_state(REPO_ROOT)
    device = str(params.get("device", "cpu"))
    gpu, driver = _gpu(device)
    return json_safe({
        "git_commit": commit,
        "git_dirty": dirty,
        "git_dirty_files": files[:50],
        "device": device,
        "gpu": gpu,
        "driver": driver,
        "cpu": platform.processor() or platform.machine(),
        "torch": _version("torch"),
        "triton": _version("triton"),
        "python": platform.python_version(),
        "preset": params.get("preset"),
        "tp": params.get("tp"),
        "parameters": params,
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1" or _is_cpu(device),
    })


# ---------------------------------------------------------------- HTML

def _template_dirs() -> list[str]:
    """nbconvert's template folders beside its own install, for when Jupyter's data path misses
    them (a venv over system packages, a ``pip --target`` install without $JUPYTER_PATH)."""
    import nbconvert

    pkg = Path(nbconvert.__file__).resolve()
    prefixes = [pkg.parents[1], pkg.parents[4] if len(pkg.parents) > 4 else pkg.parents[1],
                Path(sys.base_prefix), Path(sys.prefix)]
    dirs = [p / "share" / "jupyter" / "nbconvert" / "templates" for p in prefixes]
    return list(dict.fromkeys(str(d) for d in dirs if d.is_dir()))


ASSETS_DIR = "_assets"  # beside the reports of a folder: what every report of it shares
_SHARED_START, _SHARED_END = "<!-- k3lab:shared-css -->", "<!-- /k3lab:shared-css -->"
_STYLE = re.compile(r"\s*<style[^>]*>(.*?)</style>\s*", re.S)
SHARED_CSS_PATTERN = "k3lab-report-*.css"


def _share_css(page: str, folder: Path | None) -> str:
    """The page with the stylesheets between the template's markers written once to
    ``folder/_assets/k3lab-report-<hash>.css`` and linked relatively (``folder`` None: kept
    inline, the page then stands alone). The name follows the content, so a folder's older
    reports keep the stylesheet they were rendered with."""
    i, j = page.find(_SHARED_START), page.find(_SHARED_END)
    if i < 0 or j < i:
        return page
    chunk = page[i + len(_SHARED_START):j]
    styles = _STYLE.findall(chunk)
    if folder is None or not styles or _STYLE.sub("", chunk).strip():
        return page[:i] + chunk + page[j + len(_SHARED_END):]
    css = "\n".join(styles)
    name = f"k3lab-report-{hashlib.sha256(css.encode()).hexdigest()[:12]}.css"
    path = Path(folder) / ASSETS_DIR / name
    if not path.exists():
        atomic_write_text(path, css)
    link = f'<link rel="stylesheet" href="{ASSETS_DIR}/{name}">'
    return page[:i] + link + page[j + len(_SHARED_END):]


def shared_assets_in_use(folder: str | os.PathLike) -> set[str]:
    """Names of the shared stylesheets in ``folder/_assets`` that some page of the folder
    links."""
    folder = Path(folder)
    pages = [p.read_text(encoding="utf-8", errors="replace") for p in folder.glob("*.html")
             if p.is_file()]
    return {a.name for a in (folder / ASSETS_DIR).glob(SHARED_CSS_PATTERN)
            if any(f"{ASSETS_DIR}/{a.name}" in page for page in pages)}


def prune_shared_assets(folder: str | os.PathLike) -> list[Path]:
    """Remove the shared stylesheets of ``folder/_assets`` that no page of the folder links
    (left by reports since re-rendered with another nbconvert); returns what was removed."""
    folder = Path(folder)
    keep = shared_assets_in_use(folder)
    gone = [a for a in (folder / ASSETS_DIR).glob(SHARED_CSS_PATTERN) if a.name not in keep]
    for a in gone:
        a.unlink(missing_ok=True)
    return gone


def to_html(nb, hide_code: bool = True, title: str | None = None,
            header: str | None = None, folder: str | os.PathLike | None = None) -> str:
    """The notebook as an HTML page that opens offline (plots inline as base64 PNGs).

    hide_code: leave out code inputs and prompts (markdown, outputs and errors stay).
    header: HTML (already escaped) shown above the first cell; the runner puts the run's
    parameters and manifest there, since the hidden code no longer shows them.
    folder: where the page will be written. Given, the stylesheets every report shares (about
    260 KB) go once into ``folder/_assets/`` and the page links them; None, the page keeps them
    inline and stands alone.
    Widgets show as static stand-ins drawn from the state the run saved
    (:func:`k3lab.widgets.stand_ins`); the page loads no widget manager.
    """
    import copy

    import nbformat
    from nbconvert import HTMLExporter

    from k3lab import widgets

    if isinstance(nb, str | os.PathLike):
        title = title or Path(nb).stem
        nb = nbformat.read(nb, as_version=4)
    if header or widgets.present(nb):
        nb = copy.deepcopy(nb)
        widgets.stand_ins(nb)
        nb.get("metadata", {}).pop("widgets", None)  # nothing on the page reads it
    if header:
        cell = nbformat.v4.new_markdown_cell(header)
        if nb.nbformat_minor >= 5:
            cell["id"] = "k3lab-report-header"
        else:
            cell.pop("id", None)  # no cell ids before nbformat 4.5
        nb.cells.insert(0, cell)
    extra = [str(Path(__file__).parent / "templates"), *_template_dirs()]
    exporter = HTMLExporter(template_name="k3lab_report", exclude_input=hide_code,
                            exclude_input_prompt=hide_code, exclude_output_prompt=hide_code,
                            extra_template_basedirs=extra, extra_template_paths=extra)
    body, _ = exporter.from_notebook_node(nb, resources={"metadata": {"name": title or "k3lab"}})
    return _share_css(body, Path(folder) if folder is not None else None)


def readable(path: str | os.PathLike) -> None:
    """Give a private temp file the permissions a plain new file gets (mkstemp makes it 0600)."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    """Write ``text`` to a temp file beside ``path`` and rename it over ``path`` (atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # the pid in the name lets the next run tell a killed run's leftovers from a live one's
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.{os.getpid()}-",
                               suffix=".tmp")
    try:
        readable(tmp)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def manifest_summary(m: dict | None) -> str:
    """One line: GPU (or device), driver, preset, tp, torch, triton, git commit."""
    if not m:
        return ""
    parts = [m.get("gpu") or m.get("device"), f"preset {m.get('preset')}" if m.get("preset")
             else None, f"tp {m.get('tp')}" if m.get("tp") is not None else None,
             f"torch {m.get('torch')}", f"triton {m.get('triton')}"]
    if m.get("driver"):
        parts.insert(1, f"driver {m['driver']}")
    commit = m.get("git_commit")
    if commit:
        parts.append(f"git {str(commit)[:10]}{' (dirty)' if m.get('git_dirty') else ''}")
    return ", ".join(str(p) for p in parts if p)


_INDEX_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em; }
table { border-collapse: collapse; }
th, td { border: 1px solid #ccc; padding: 4px 8px; vertical-align: top; text-align: left; }
.ok { color: #070; font-weight: bold; } .failed { color: #b00; font-weight: bold; }
.corrupt { color: #fff; background: #b00; font-weight: bold; padding: 0 4px; }
.stale { color: #850; font-size: 85%; max-width: 30em; }
.k3lab-card-table th, .k3lab-card-table td { border: none; border-bottom: 1px solid #eee; }
.k3lab-bar { padding: 1px 6px; border-radius: 3px; font-size: 85%; }
.k3lab-caveat { color: #a50; font-weight: bold; font-size: 85%; }
.k3lab-small { font-size: 85%; color: #555; }
.err { font-family: monospace; white-space: pre-wrap; color: #b00; max-width: 40em; }
.head td, .head th { border: none; padding: 0 6px 0 0; font-size: 90%; }
.small { font-size: 85%; color: #444; }
"""


def _link(href: str | None, text: str) -> str:
    """A link to a file of the folder: the name percent-encoded behind "./", so no file name
    (``javascript:x.html``, ``a#b.html``) is read as a scheme, a fragment or a query."""
    if not href:
        return ""
    url = "./" + urllib.parse.quote(href, safe="")
    return f"<a href='{html.escape(url, quote=True)}'>{html.escape(text)}</a>"


def write_index(out_dir: str | os.PathLike, entries: list[dict], title: str = "k3lab reports"):
    """Write ``out_dir/index.html``: one row per report with its status and headline figures.

    entries: dicts with name, status ("ok"/"failed"), error, date, seconds, html (relative link
    to the report), failed_html (link to the failed run's page), last_good_date, headline (dict),
    manifest (dict), erratum (text or None), stale (files changed since its commit), card
    (the summary card's HTML, :func:`k3lab.readable.summary_card`) and traces (the report's
    Perfetto trace files, linked under it). Everything is HTML-escaped.
    """
    rows = []
    for e in entries:
        status = str(e.get("status", "?"))
        links = " ".join(x for x in (
            _link(e.get("html"), "report" if status == "ok" else "last good report"),
            _link(e.get("failed_html"), "failed run"),
            _link(e.get("metrics"), "metrics")) if x)
        trace_files = [str(t) for t in e.get("traces") or []]
        if trace_files:
            name = str(e.get("name"))
            labels = [t.removeprefix(f"{name}.").removesuffix(".trace.json")
                      for t in trace_files]
            cpu = str((e.get("manifest") or {}).get("device", "")).startswith("cpu")
            links += ("<div class='k3lab-traces small'>Perfetto: " + " ".join(
                _link(t, label).replace("<a ", "<a class='k3lab-trace' ", 1)
                for t, label in zip(trace_files, labels, strict=True))
                + (" <span title='CPU run: interpreter wall clock, not GPU times'>"
                   "(CPU wall clock)</span>" if cpu else "") + "</div>")
        css = {"ok": "ok", "corrupt": "corrupt"}.get(status, "failed")
        state = f"<span class='{css}'>{html.escape(status)}</span>"
        if e.get("error"):
            state += f"<div class='err'>{html.escape(str(e['error']))}</div>"
        if e.get("erratum"):
            state += f"<div class='err'>erratum: {html.escape(str(e['erratum']))}</div>"
        if e.get("stale"):
            files = ", ".join(e["stale"][:4]) + (", ..." if len(e["stale"]) > 4 else "")
            state += (f"<div class='stale'>behind HEAD: {len(e['stale'])} file(s) it depends "
                      f"on changed since its commit ({html.escape(files)})</div>")
        if status != "ok" and e.get("last_good_date"):
            state += (f"<div class='small'>last good report: "
                      f"{html.escape(str(e['last_good_date']))}</div>")
        head = e.get("headline") or {}
        head_html = "<table class='head'>" + "".join(
            f"<tr><th>{html.escape(str(k))}</th><td>{html.escape(_fmt(v))}</td></tr>"
            for k, v in head.items()) + "</table>" if head else ""
        if head and e.get("card"):  # the card has the answer; the full headline on demand
            head_html = (f"<details><summary>headline ({len(head)} figures)</summary>"
                         f"{head_html}</details>")
        head_html = (e.get("card") or "") + head_html  # built escaped by readable.summary_card
        if head and status != "ok":
            head_html = "<div class='small'>from the last good report</div>" + head_html
        seconds = e.get("seconds")
        when = html.escape(str(e.get("date") or ""))
        if seconds is not None:
            when += f"<div class='small'>{float(seconds):.1f} s</div>"
        rows.append(
            f"<tr><td><b>{html.escape(str(e.get('name')))}</b><div>{links}</div></td>"
            f"<td>{state}</td><td>{head_html}</td><td>{when}</td>"
            f"<td class='small'>{html.escape(manifest_summary(e.get('manifest')))}</td></tr>")
    page = (
        "<!DOCTYPE html><html><head><meta charset='utf-8'>"
        f"<title>{html.escape(title)}</title><style>{_INDEX_CSS}</style></head><body>"
        f"<h1>{html.escape(title)}</h1>"
        "<table><tr><th>notebook</th><th>status</th><th>headline</th><th>run</th>"
        "<th>manifest</th></tr>" + "".join(rows) + "</table></body></html>\n")
    return atomic_write_text(Path(out_dir) / "index.html", page)

