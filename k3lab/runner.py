"""Run the workbook's notebooks headless with papermill and write their reports.

For every notebook: the executed ``.ipynb``, an ``.html`` report (code hidden by default, plots
embedded, the stylesheets every report shares written once to ``_assets/`` and linked) and a
``.metrics.json`` (published records, headline, manifest, status), each written through a temp
file and an atomic rename. A notebook that fails leaves ``NAME.failed.ipynb``,
``NAME.failed.html`` and ``NAME.failed.json`` beside the last good report, which it never
touches; the batch goes on, and ``index.html`` lists every notebook of the output folder.

Parameters are checked against each notebook's ``parameters`` cell before anything runs.
"""

from __future__ import annotations

import ast
import contextlib
import html
import json
import logging
import os
import re
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import k3lab
from k3lab import report

__all__ = ["Result", "notebook_dir", "list_notebooks", "resolve", "notebook_parameters",
           "validate", "coerce", "run", "update_index", "repo_root", "default_out_dir",
           "RUN_OPTIONS", "KERNEL_NAME"]

KERNEL_NAME = "python3"
RUN_OPTIONS = ("device", "preset", "tp")  # given by their own options, injected when declared
NOTEBOOKS_ENV = "K3LAB_NOTEBOOKS"
# the kernel's own start-up warnings (e.g. "running over TCP without encryption") would break the
# one-line-per-notebook progress; errors still show
KERNEL_ARGS = ["--IPKernelApp.log_level=ERROR"]


@dataclass
class Result:
    """Outcome of one notebook. Paths are None where nothing was written."""

    name: str
    status: str  # "ok" or "failed"
    seconds: float
    error: str | None = None
    notebook: Path | None = None
    html: Path | None = None
    metrics: Path | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"


# ---------------------------------------------------------------- finding notebooks

def repo_root() -> Path:
    return Path(k3lab.__file__).resolve().parents[1]


def default_out_dir() -> Path:
    return repo_root() / "executed" / "local"


def notebook_dir(override: str | os.PathLike | None = None) -> Path:
    """The notebooks folder: ``override``, else $K3LAB_NOTEBOOKS, else the repo's notebooks/."""
    path = Path(override or os.environ.get(NOTEBOOKS_ENV) or repo_root() / "notebooks")
    if not path.is_dir():
        raise FileNotFoundError(
            f"notebooks folder not found: {path} (k3lab runs from a checkout of the repository; "
            f"set ${NOTEBOOKS_ENV} to use another folder)")
    return path


def list_notebooks(nb_dir: str | os.PathLike | None = None) -> list[Path]:
    """The notebooks of the folder, sorted by name."""
    return sorted(p for p in notebook_dir(nb_dir).glob("*.ipynb") if not p.name.startswith("."))


def _short(stem: str) -> str:
    return re.sub(r"^\d+_", "", stem)


def resolve(names, nb_dir: str | os.PathLike | None = None) -> list[Path]:
    """Notebook paths for ``names``: "00_overview", "overview", "00_overview.ipynb" or a path.

    None or empty: every notebook of the folder. Unknown names: ValueError listing the names.
    """
    available = list_notebooks(nb_dir)
    if not names:
        if not available:
            raise ValueError(f"no notebooks in {notebook_dir(nb_dir)}")
        return available
    found, unknown = [], []
    for name in names:
        path = Path(name)
        if path.suffix == ".ipynb" and len(path.parts) > 1 and path.is_file():
            found.append(path.resolve())
            continue
        stem = path.name.removesuffix(".ipynb")
        hits = [p for p in available if stem in (p.stem, _short(p.stem))]
        if len(hits) > 1:
            raise ValueError(f"notebook {name!r} is ambiguous: "
                             f"{', '.join(p.stem for p in hits)}")
        if hits:
            found.append(hits[0])
        else:
            unknown.append(name)
    if unknown:
        names_list = ", ".join(p.stem for p in available) or "(none)"
        raise ValueError(f"unknown notebook {', '.join(map(repr, unknown))}; "
                         f"available: {names_list}")
    return list(dict.fromkeys(found))


# ---------------------------------------------------------------- parameters

def _parameters_cell(nb) -> str | None:
    for cell in nb.cells:
        if cell.cell_type == "code" and "parameters" in cell.get("metadata", {}).get("tags", []):
            return cell.source
    return None


def notebook_parameters(path: str | os.PathLike) -> dict[str, Any]:
    """name -> default of the notebook's ``parameters``-tagged cell ({} without one).

    Defaults must be Python literals; a non-literal default is kept as its source text wrapped in
    :class:`_Expr` (any value is then accepted for it).
    """
    import nbformat

    nb = nbformat.read(path, as_version=4)
    source = _parameters_cell(nb)
    if source is None:
        return {}
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        raise ValueError(f"{Path(path).name}: cannot parse the parameters cell: {exc}") from exc
    params: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            target, value = node.target, node.value
        else:
            continue
        if not isinstance(target, ast.Name):
            continue
        try:
            params[target.id] = ast.literal_eval(value)
        except ValueError:
            params[target.id] = _Expr(ast.get_source_segment(source, value) or "")
    return params


class _Expr(str):
    """A parameter default that is an expression, not a literal (no type check for it)."""

    def __repr__(self) -> str:
        return str(self)


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def _type_name(v: Any) -> str:
    return {bool: "bool", int: "int", float: "float", str: "str", list: "list", tuple: "list",
            dict: "dict"}.get(type(v), type(v).__name__)


def coerce(name: str, value: Any, default: Any) -> Any:
    """``value`` checked against (and converted to) the type of ``default``.

    Strings (as they come from ``-p KEY=VALUE``) are parsed for non-string defaults: bool from
    true/false/1/0/yes/no, int, float, list ("[1, 2, 4]" or "1,2,4"), dict. A value of another
    type raises ValueError naming the parameter and the expected type.
    """
    if default is None or isinstance(default, _Expr):
        if isinstance(value, str):
            try:
                return ast.literal_eval(value)
            except (ValueError, SyntaxError):
                return value
        return value
    kind = _type_name(default)

    def bad(why: str = "") -> ValueError:
        return ValueError(f"parameter {name!r}: expected {kind} (default {default!r}), "
                          f"got {value!r}{why}")

    if isinstance(value, str) and kind != "str":
        text = value.strip()
        if kind == "bool":
            if text.lower() in _TRUE | _FALSE:
                return text.lower() in _TRUE
            raise bad()
        try:
            if kind == "int":
                return int(text)
            if kind == "float":
                return float(text)
            if kind == "list" and not text.startswith(("[", "(")):
                text = f"[{text}]"
            value = ast.literal_eval(text)
        except (ValueError, SyntaxError) as exc:
            raise bad() from exc
    if kind == "bool":
        ok = isinstance(value, bool)
    elif kind == "int":
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif kind == "float":
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif kind == "list":
        ok = isinstance(value, list | tuple)
        value = list(value) if ok else value
    else:
        ok = isinstance(value, type(default))
    if not ok:
        raise bad()
    return value


def validate(path: str | os.PathLike, params: dict) -> dict:
    """``params`` checked against the notebook's parameters; returns them coerced.

    Unknown key: ValueError naming it and the allowed keys. Wrong type: ValueError (see coerce).
    """
    declared = notebook_parameters(path)
    name = Path(path).stem
    unknown = [k for k in params if k not in declared]
    if unknown:
        raise ValueError(f"{name}: unknown parameter {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(declared) or '(none)'}")
    try:
        return {k: coerce(k, v, declared[k]) for k, v in params.items()}
    except ValueError as exc:
        raise ValueError(f"{name}: {exc}") from None


def _check_options(device: str, preset: str, tp: int) -> None:
    from k3lab.config import preset as make_preset

    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    make_preset(preset, tp)  # unknown preset or a tp that does not divide: ValueError
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")


def _plan(paths: list[Path], options: dict, params: dict) -> list[dict]:
    """Per-notebook parameters, validated for every notebook before any runs."""
    clash = [k for k in params if k in RUN_OPTIONS]
    if clash:
        raise ValueError(f"parameter {clash[0]!r} has its own option: use --{clash[0]}")
    declared = {p: notebook_parameters(p) for p in paths}
    unknown = [k for k in params if not any(k in d for d in declared.values())]
    if unknown:
        allowed = sorted({k for d in declared.values() for k in d if k not in RUN_OPTIONS})
        raise ValueError(f"unknown parameter {', '.join(map(repr, unknown))} for "
                         f"{', '.join(p.stem for p in paths)}; allowed: "
                         f"{', '.join(allowed) or '(none)'}")
    plans = []
    for p in paths:
        given = {k: v for k, v in {**options, **params}.items() if k in declared[p]}
        plans.append(validate(p, given))
    return plans


# ---------------------------------------------------------------- executing

@contextlib.contextmanager
def _quiet_papermill():
    """papermill warns about what the runner has already checked (parameter cell parsing,
    unknown parameters); keep its errors only, so progress stays one line per notebook."""
    log = logging.getLogger("papermill")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@contextlib.contextmanager
def _kernel_env(device: str):
    """The environment the notebook kernel inherits: the interpreter on CPU, off on CUDA, inline
    plots, and this checkout importable."""
    saved = dict(os.environ)
    try:
        if str(device).startswith("cpu"):
            os.environ["TRITON_INTERPRET"] = "1"
        else:
            os.environ.pop("TRITON_INTERPRET", None)
        os.environ.pop("MPLBACKEND", None)  # an inherited Agg would silence the inline plots
        root = str(repo_root())
        path = os.environ.get("PYTHONPATH", "")
        if root not in path.split(os.pathsep):
            os.environ["PYTHONPATH"] = root + (os.pathsep + path if path else "")
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def _check_kernel() -> None:
    """Make sure kernel "python3" exists and warn when it runs another Python than this one.

    jupyter_client falls back to this interpreter's own ipykernel when no "python3" kernelspec
    is installed, so nothing needs registering; only a missing ipykernel is fatal.
    """
    from jupyter_client.kernelspec import KernelSpecManager, NoSuchKernel

    try:
        spec = KernelSpecManager().get_kernel_spec(KERNEL_NAME)
    except NoSuchKernel as exc:
        raise RuntimeError(f"no Jupyter kernel {KERNEL_NAME!r}: install ipykernel in this "
                           f"Python ({sys.executable} -m pip install ipykernel)") from exc
    exe = spec.argv[0] if spec.argv else ""
    if exe not in ("python", "python3", f"python{sys.version_info[0]}.{sys.version_info[1]}"):
        with contextlib.suppress(OSError):
            if Path(exe).resolve() != Path(sys.executable).resolve():
                print(f"k3lab: warning: kernel {KERNEL_NAME!r} runs {exe}, not {sys.executable}; "
                      "k3lab must be importable there", file=sys.stderr)


def _error_text(exc: BaseException) -> str:
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        where = getattr(exc, "exec_count", None)
        return f"{ename}: {evalue}" + (f" (cell In[{where}])" if where else "")
    return f"{type(exc).__name__}: {exc}".strip()


def _write_json(path: Path, data: dict) -> None:
    report.atomic_write_text(path, json.dumps(report.json_safe(data), indent=1) + "\n")


def _run_one(src: Path, out_dir: Path, params: dict, options: dict, timeout: float | None,
             hide_code: bool) -> Result:
    import nbformat
    import papermill

    name = src.stem
    fd, tmp = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.", suffix=".running.ipynb")
    os.close(fd)
    tmp = Path(tmp)
    report.readable(tmp)
    man = report.manifest({**options, **params})
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "defaults"
    header = (f"<div class='k3lab-header'><b>k3lab report {html.escape(name)}</b>: "
              f"{html.escape(shown)}. Run {html.escape(str(man['date']))} on "
              f"{html.escape(report.manifest_summary(man))}.</div>")
    t0 = time.perf_counter()
    error = None
    try:
        with _kernel_env(options["device"]), _quiet_papermill():
            papermill.execute_notebook(
                str(src), str(tmp), parameters=params, kernel_name=KERNEL_NAME,
                cwd=str(repo_root()), execution_timeout=timeout, progress_bar=False,
                log_output=False, extra_arguments=KERNEL_ARGS)
        nb = nbformat.read(tmp, as_version=4)
        metrics = report.read_metrics(nb)
        page = report.to_html(nb, hide_code=hide_code, title=name, header=header,
                              folder=out_dir)
    except Exception as exc:  # a failing notebook is reported, and the batch goes on
        error = _error_text(exc)
    seconds = time.perf_counter() - t0
    info = {"notebook": name, "source": str(src), "seconds": round(seconds, 3),
            "parameters": params, "manifest": man}
    try:
        if error is None:
            report.atomic_write_text(out_dir / f"{name}.html", page)
            os.replace(tmp, out_dir / f"{name}.ipynb")
            _write_json(out_dir / f"{name}.metrics.json",
                        {**info, "status": "ok", "error": None, "headline": metrics["headline"],
                         "records": metrics["records"]})
            for suffix in (".failed.ipynb", ".failed.html", ".failed.json"):
                (out_dir / f"{name}{suffix}").unlink(missing_ok=True)
            return Result(name, "ok", seconds, None, out_dir / f"{name}.ipynb",
                          out_dir / f"{name}.html", out_dir / f"{name}.metrics.json")
        failed_nb = out_dir / f"{name}.failed.ipynb"
        failed_html = None
        if tmp.exists() and tmp.stat().st_size:
            with contextlib.suppress(Exception):  # a half-written notebook may not render
                page = report.to_html(tmp, hide_code=hide_code, title=f"{name} (failed)",
                                      header=header, folder=out_dir)
                failed_html = report.atomic_write_text(out_dir / f"{name}.failed.html", page)
            os.replace(tmp, failed_nb)
        else:
            failed_nb = None
        _write_json(out_dir / f"{name}.failed.json", {**info, "status": "failed", "error": error})
        return Result(name, "failed", seconds, error, failed_nb, failed_html,
                      out_dir / f"{name}.failed.json")
    finally:
        tmp.unlink(missing_ok=True)


def _load(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def update_index(out_dir: str | os.PathLike) -> Path:
    """Rewrite ``out_dir/index.html`` and ``out_dir/manifest.json`` (each report's status and
    manifest: git commit, GPU, driver, torch, triton, date) from every report found there, and
    drop the shared stylesheets of ``out_dir/_assets`` that no report links any more.

    A committed ``<name>.erratum.txt`` beside a report (a person's note of a mistake found in it
    after it ran, e.g. a bar check that left out a requirement) is shown with it; the measured
    report itself is never edited."""
    out_dir = Path(out_dir)
    names = sorted({p.name.removesuffix(suffix) for suffix in (".metrics.json", ".failed.json")
                    for p in out_dir.glob(f"*{suffix}") if not p.name.startswith(".")})
    entries = []
    for name in names:
        good = _load(out_dir / f"{name}.metrics.json")
        failed = _load(out_dir / f"{name}.failed.json")
        latest = failed or good or {}
        erratum = out_dir / f"{name}.erratum.txt"
        entries.append({
            "erratum": erratum.read_text().strip() if erratum.exists() else None,
            "name": name,
            "status": "failed" if failed else "ok",
            "error": failed.get("error") if failed else None,
            "date": (latest.get("manifest") or {}).get("date"),
            "seconds": latest.get("seconds"),
            "html": f"{name}.html" if good and (out_dir / f"{name}.html").exists() else None,
            "failed_html": (f"{name}.failed.html"
                            if failed and (out_dir / f"{name}.failed.html").exists() else None),
            "metrics": f"{name}.metrics.json" if good else None,
            "last_good_date": (good.get("manifest") or {}).get("date") if good else None,
            "headline": (good or {}).get("headline"),
            "manifest": latest.get("manifest"),
        })
    report.prune_shared_assets(out_dir)
    _write_json(out_dir / "manifest.json", {
        "reports": {e["name"]: {"status": e["status"], "manifest": e["manifest"],
                                **({"erratum": e["erratum"]} if e["erratum"] else {})}
                    for e in entries}})
    return report.write_index(out_dir, entries)


def run(notebooks=None, *, device: str = "cpu", preset: str = "tiny", tp: int = 1,
        params: dict | None = None, out_dir: str | os.PathLike | None = None,
        timeout: float | None = None, progress: bool = True, hide_code: bool = True,
        notebook_dir: str | os.PathLike | None = None) -> list[Result]:
    """Execute ``notebooks`` (names, see :func:`resolve`; None: all) and write their reports.

    device / preset / tp are injected into each notebook that declares them; every other key of
    ``params`` must be declared by at least one selected notebook and goes only to those. All
    parameters of all notebooks are validated before the first one runs (ValueError). timeout:
    per-cell limit in seconds. Returns one :class:`Result` per notebook; check ``r.ok``.
    """
    options = {"device": device, "preset": preset, "tp": tp}
    _check_options(device, preset, tp)
    paths = resolve(notebooks, notebook_dir)
    plans = _plan(paths, options, dict(params or {}))
    _check_kernel()
    out = Path(out_dir) if out_dir is not None else default_out_dir()
    out.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"k3lab: {len(paths)} notebook(s) on {device}, preset {preset}, tp {tp} -> {out}",
              flush=True)
    results = []
    width = max(len(p.stem) for p in paths)
    for i, (path, nb_params) in enumerate(zip(paths, plans, strict=True), 1):
        res = _run_one(path, out, nb_params, options, timeout, hide_code)
        results.append(res)
        if progress:
            line = f"[{i}/{len(paths)}] {res.name:<{width}}  {res.status:<6} {res.seconds:7.1f} s"
            print(line + (f"  {res.error}" if res.error else ""), flush=True)
    index = update_index(out)
    if progress:
        failed = sum(not r.ok for r in results)
        print(f"k3lab: {len(results) - failed} ok, {failed} failed; index: {index}", flush=True)
    return results
