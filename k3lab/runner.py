"""Run the workbook's notebooks headless with papermill and write their reports.

For every notebook: the executed ``.ipynb``, an ``.html`` report (code hidden by default, plots
embedded, the stylesheets every report shares written once to ``_assets/`` and linked) and a
``.metrics.json`` (published records, headline, manifest, status), each written through a temp
file and an atomic rename. A notebook that fails leaves ``NAME.failed.ipynb``,
``NAME.failed.html`` and ``NAME.failed.json`` beside the last good report, which it never
touches; the batch goes on, and ``index.html`` lists every notebook of the output folder.

A notebook declaring ``trace_dir`` gets a private folder of the run there and writes its
timelines' Perfetto traces into it (:mod:`k3lab.traces`); they join the report as
``NAME.<label>.trace.json`` when it is published (a failed run's as
``NAME.failed.<label>.trace.json``), and the traces of an older run that the new report does not
write are removed, so a report never links another run's trace.

Parameters are checked against each notebook's ``parameters`` cell (names, types and the
contract its comments state, see :mod:`k3lab.parameters`), and the output folder for being
writable, before anything runs.
"""

from __future__ import annotations

import contextlib
import html
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

from k3lab import folder, hostprofile, kernelenv, precompile, readable, report, traces
from k3lab.kernelenv import KERNEL_NAME, repo_root
from k3lab.parameters import coerce, declared, notebook_parameters, validate

__all__ = ["Result", "Results", "auto_jobs", "notebook_dir", "list_notebooks", "resolve",
           "notebook_parameters", "declared", "validate", "coerce", "run", "update_index",
           "repo_root", "default_out_dir", "RUN_OPTIONS", "TRACE_PARAM", "KERNEL_NAME"]

RUN_OPTIONS = ("device", "preset", "tp")  # given by their own options, injected when declared
TRACE_PARAM = "trace_dir"  # set by the runner, when declared, to the run's folder for traces
NOTEBOOKS_ENV = "K3LAB_NOTEBOOKS"
# The per-cell limit where a run names none (unset: no limit). The test suite sets it: a kernel
# that finishes a cell but whose reply never reaches the client would otherwise wait forever.
TIMEOUT_ENV = "K3LAB_CELL_TIMEOUT"


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
        return _unreserved(available)
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
    return _unreserved(list(dict.fromkeys(found)))


def _unreserved(paths: list[Path]) -> list[Path]:
    bad = [p.name for p in paths if p.stem.lower() in folder.RESERVED]
    if bad:
        raise ValueError(f"notebook {', '.join(bad)}: the names {', '.join(folder.RESERVED)} are "
                         "reserved for the output folder's index.html and manifest.json; "
                         "rename the notebook")
    return paths


# ---------------------------------------------------------------- parameters

def _check_options(device: str, preset: str, tp: int) -> None:
    from k3lab.config import preset as make_preset

    if not re.fullmatch(r"cpu|cuda(:\d+)?", str(device)):
        raise ValueError(f"device: expected 'cpu' or 'cuda', got {device!r}")
    make_preset(preset, tp)  # unknown preset or a tp that does not divide: ValueError
    if str(device).startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ValueError("device: 'cuda' was asked for but torch sees no CUDA device")


def _plan(paths: list[Path], options: dict, params: dict,
          decl: dict[Path, dict] | None = None) -> list[dict]:
    """Per-notebook parameters, validated for every notebook before any runs. decl: each
    notebook's declared parameters (read here when not given)."""
    clash = [k for k in params if k in RUN_OPTIONS]
    if clash:
        raise ValueError(f"parameter {clash[0]!r} has its own option: use --{clash[0]}")
    if TRACE_PARAM in params:
        raise ValueError(f"parameter {TRACE_PARAM!r} is set by the runner: a notebook's traces "
                         "are written beside its report")
    decl = decl if decl is not None else {p: declared(p) for p in paths}
    unknown = [k for k in params if not any(k in d for d in decl.values())]
    if unknown:
        allowed = sorted({k for d in decl.values() for k in d if k not in RUN_OPTIONS})
        raise ValueError(f"unknown parameter {', '.join(map(repr, unknown))} for "
                         f"{', '.join(p.stem for p in paths)}; allowed: "
                         f"{', '.join(allowed) or '(none)'}")
    plans = []
    for p in paths:
        given = {k: v for k, v in {**options, **params}.items() if k in decl[p]}
        plan = validate(p, given, decl[p])
        if TRACE_PARAM in decl[p]:
            plan[TRACE_PARAM] = ""  # a placeholder: _run_one gives the run's folder
        plans.append(plan)
    return plans


def _check_memory(paths: list[Path], plans: list[dict], decl: dict[Path, dict],
                  options: dict, jobs: int) -> None:
    """ValueError (one line: needed vs available) when a notebook's estimated memory at the
    preset and tp does not fit the device (:mod:`k3lab.memory`)."""
    from k3lab import memory
    from k3lab.config import preset as make_preset

    cfg = make_preset(options["preset"], options["tp"])
    estimates = [memory.estimate(p.stem, cfg, options["device"],
                                 {**{k: v.default for k, v in decl[p].items()}, **plan})
                 for p, plan in zip(paths, plans, strict=True)]
    problem = memory.check(estimates, options["device"], jobs)
    if problem:
        raise ValueError(problem)


def _check_timeout(timeout) -> float | None:
    if timeout is None:
        env = os.environ.get(TIMEOUT_ENV, "").strip()
        if not env:
            return None
        try:
            timeout = float(env)
        except ValueError:
            raise ValueError(f"${TIMEOUT_ENV}: expected seconds as a number, got "
                             f"{env!r}") from None
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout: expected seconds as a number, got {timeout!r}")
    if not math.isfinite(timeout) or timeout <= 0:
        raise ValueError(f"--timeout: expected a positive number of seconds, got {timeout!r}")
    return float(timeout)


# ---------------------------------------------------------------- executing

@contextlib.contextmanager
def _quiet_papermill():
    """papermill logs what the runner checks or reports itself (parameter cell parsing, unknown
    parameters, a cell timeout); keep it quiet so progress stays one line per notebook."""
    log = logging.getLogger("papermill")
    level = log.level
    log.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        log.setLevel(level)


def _error_text(exc: BaseException, timeout: float | None = None) -> str:
    """One line: the cell's exception, or what timed out."""
    from nbclient.exceptions import CellTimeoutError

    if isinstance(exc, CellTimeoutError | TimeoutError):
        preview = re.search(r"-{5,}\n(.*?)\n-{5,}", str(exc), re.S)
        lines = [ln.strip() for ln in preview.group(1).splitlines()] if preview else []
        cell = "; ".join(ln for ln in lines if ln)[:80]
        cell = f": {cell}" if cell else ""
        return f"timed out: a cell ran longer than --timeout {timeout:g} s{cell}" if timeout \
            else f"timed out{cell}"
    ename, evalue = getattr(exc, "ename", None), getattr(exc, "evalue", None)
    if ename:
        where = getattr(exc, "exec_count", None)
        return f"{ename}: {evalue}" + (f" (cell In[{where}])" if where else "")
    return f"{type(exc).__name__}: {exc}".strip()


def _write_json(path: Path, data: dict) -> None:
    report.atomic_write_text(path, json.dumps(report.json_safe(data), indent=1) + "\n")


def _header(name: str, params: dict, man: dict) -> str:
    shown = ", ".join(f"{k}={v!r}" for k, v in params.items()) or "defaults"
    return (f"<div class='k3lab-header'><b>k3lab report {html.escape(name)}</b>: "
            f"{html.escape(shown)}. Run {html.escape(str(man['date']))} on "
            f"{html.escape(report.manifest_summary(man))}.</div>")


def _staged_traces(staging: Path | None, name: str) -> list[str]:
    return traces.report_traces(staging, name) if staging is not None else []


def _remove_traces(out_dir: Path, name: str, keep: list[str], failed: bool) -> None:
    """Remove ``name``'s report traces (``failed``: a failed run's) that are not in ``keep``."""
    pattern = f"{traces.glob_escape(name)}.failed.*{traces.SUFFIX}"
    found = ([p.name for p in out_dir.glob(pattern)] if failed
             else traces.report_traces(out_dir, name))
    for n in found:
        if n not in keep:
            (out_dir / n).unlink(missing_ok=True)


def _publish_ok(name: str, out_dir: Path, tmp: Path, page: str, info: dict, metrics: dict,
                seconds: float, staging: Path | None = None,
                profile_page: Path | None = None) -> Result:
    report.atomic_write_text(out_dir / f"{name}.html", page)
    profile_to = out_dir / f"{name}{hostprofile.FILE_SUFFIX}"
    if profile_page is not None:
        os.replace(profile_page, profile_to)
    else:  # an older run's: this report does not link it
        profile_to.unlink(missing_ok=True)
    if metrics["warnings"]:
        report.atomic_write_text(out_dir / f"{name}.log", "".join(metrics["warnings"]))
    else:
        (out_dir / f"{name}.log").unlink(missing_ok=True)
    os.replace(tmp, out_dir / f"{name}.ipynb")
    _write_json(out_dir / f"{name}.metrics.json",
                {**info, "status": "ok", "error": None, "headline": metrics["headline"],
                 "records": metrics["records"],
                 **({"host_profile": metrics["host_profile"]}
                    if metrics.get("host_profile") else {})})
    # the traces last, each an atomic rename in the folder: a report that could not be written
    # leaves them staged for the failed run's record, not beside the last good report
    written = _staged_traces(staging, name)
    for n in written:
        os.replace(staging / n, out_dir / n)
    for suffix in (".failed.ipynb", ".failed.html", ".failed.json"):
        (out_dir / f"{name}{suffix}").unlink(missing_ok=True)
    _remove_traces(out_dir, name, written, failed=False)  # an older run's: never linked
    _remove_traces(out_dir, name, [], failed=True)
    return Result(name, "ok", seconds, None, out_dir / f"{name}.ipynb",
                  out_dir / f"{name}.html", out_dir / f"{name}.metrics.json")


def _publish_failed(name: str, out_dir: Path, tmp: Path, header: str, hide_code: bool,
                    info: dict, error: str, seconds: float, staging: Path | None = None,
                    cpu: bool = False) -> Result:
    failed_nb, failed_html = out_dir / f"{name}.failed.ipynb", None
    staged = _staged_traces(staging, name)
    moved = {n: traces.failed_name(n, name) for n in staged}
    _remove_traces(out_dir, name, list(moved.values()), failed=True)
    for n, failed_n in moved.items():  # the last good report keeps its own traces
        os.replace(staging / n, out_dir / failed_n)
    if tmp.exists() and tmp.stat().st_size:
        with contextlib.suppress(Exception):  # a half-written notebook may not render
            page = report.to_html(tmp, hide_code=hide_code, title=f"{name} (failed)",
                                  header=header + traces.links_html(staged, cpu),
                                  folder=out_dir)
            for n, failed_n in moved.items():  # its links point at this run's traces
                for q in "'\"":
                    page = page.replace(f"{q}./{quote(n, safe='')}{q}",
                                        f"{q}./{quote(failed_n, safe='')}{q}")
            failed_html = report.atomic_write_text(out_dir / f"{name}.failed.html", page)
        os.replace(tmp, failed_nb)
    else:
        failed_nb = None
    _write_json(out_dir / f"{name}.failed.json", {**info, "status": "failed", "error": error})
    return Result(name, "failed", seconds, error, failed_nb, failed_html,
                  out_dir / f"{name}.failed.json")


def _execute(src: Path, tmp: Path, out_dir: Path, params: dict, man: dict,
             timeout: float | None, hide_code: bool, header: str, progress: dict | None,
             staging: Path | None = None, standby: kernelenv.Standby | None = None,
             profile: Path | None = None, kernels: Path | None = None):
    """Run the notebook into ``tmp``; (error or None, report page, metrics, profile page).
    ``params`` are the kernel's (``trace_dir`` included); the traces found in ``staging``
    afterwards are linked at the top of the page. ``standby``: a kernel already started for it.
    ``profile``: where the kernel writes its host profile, then summarized in the metrics and
    the header, its page written to a temp file of ``out_dir`` (the profile page)."""
    import nbformat
    import papermill

    km = standby.take() if standby is not None else None
    own = km is None  # started by papermill below, stopped here
    km = kernelenv.manager() if own else km
    profile_page = None
    try:
        with kernelenv.env(man["device"], profile, kernels), _quiet_papermill():
            try:
                papermill.execute_notebook(
                    str(src), str(tmp), parameters=params, kernel_name=kernelenv.KERNEL_NAME,
                    cwd=str(repo_root()), execution_timeout=timeout,
                    progress_bar=progress if progress is not None else False,
                    log_output=False, extra_arguments=kernelenv.KERNEL_ARGS, km=km)
            finally:
                if own:
                    kernelenv.shutdown(km)
        nb = nbformat.read(tmp, as_version=4)  # the page's copy: the .ipynb keeps everything
        metrics = report.read_metrics(nb)
        metrics["warnings"] = readable.split_warnings(nb)
        readable.fold_long_tables(nb)
        card = readable.summary_card(metrics["records"], metrics["headline"], man)
        logged = (f"<div class='k3lab-small'>{len(metrics['warnings'])} warning(s) of the run "
                  f"are in <a href='./{quote(src.stem)}.log'>{html.escape(src.stem)}.log</a>"
                  "</div>") if metrics["warnings"] else ""
        links = traces.links_html(_staged_traces(staging, src.stem),
                                  str(man["device"]).startswith("cpu"))
        profiled = ""
        if profile is not None and profile.exists() and profile.stat().st_size:
            session = hostprofile.load(profile)
            metrics["host_profile"] = hostprofile.summarize(session)
            profile_page = Path(_temp_file(out_dir, src.stem))
            hostprofile.write_html(session, profile_page)
            profiled = hostprofile.header_html(metrics["host_profile"],
                                               f"{src.stem}{hostprofile.FILE_SUFFIX}")
        page = report.to_html(nb, hide_code=hide_code, title=src.stem,
                              header=header + card + links + profiled + logged, folder=out_dir)
    except Exception as exc:  # a failing notebook is reported, and the batch goes on
        if profile_page is not None:
            profile_page.unlink(missing_ok=True)
        return _error_text(exc, timeout), None, None, None
    return None, page, metrics, profile_page


def _kernel_list_file(out_dir: Path, name: str, device: str) -> Path | None:
    """Where the kernel of notebook ``name`` lists what it compiles (a GPU run only; the same
    path for its standby kernel, started by this process): a temp file of ``out_dir``."""
    if not str(device).startswith("cuda"):
        return None
    return Path(out_dir) / f".{name}.{os.getpid()}-kernels.tmp"


def _temp_file(out_dir: Path, name: str, suffix: str = ".tmp") -> str:
    """A temp file of ``out_dir`` that a later run removes if this one is killed
    (:data:`k3lab.folder.TEMP_PATTERN`)."""
    fd, path = tempfile.mkstemp(dir=out_dir, prefix=f".{name}.{os.getpid()}-", suffix=suffix)
    os.close(fd)
    return path


def _run_one(src: Path, out_dir: Path, params: dict, options: dict, timeout: float | None,
             hide_code: bool, progress: dict | None = None, source: str | None = None,
             standby: kernelenv.Standby | None = None, profile: bool | Path = False) -> Result:
    """Execute one notebook into ``out_dir``. A failing notebook and a report that cannot be
    written (disk full, a folder in the way) both give a failed Result; the batch goes on.
    source: the notebook's path as recorded (default ``src``; a Ray task runs a copy).
    standby: a kernel started for it ahead of time (it is shut down here, used or not).
    profile: sample the host (True, or the file the standby's kernel writes to), the profile
    page beside the report."""
    name = src.stem
    t0 = time.perf_counter()
    tmp = None
    try:
        tmp = _temp_file(out_dir, name, ".running.ipynb")
        if profile is True:
            profile = Path(_temp_file(out_dir, name))
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        if standby is not None:
            standby.close()
        return Result(name, "failed", 0.0, f"could not create a temp file in {out_dir}: {exc}")
    profile = profile or None
    kernels = _kernel_list_file(out_dir, name, options["device"])
    tmp, staging = Path(tmp), None
    params = dict(params)
    kernel_params = params
    try:  # tmp and the traces' folder go whatever happens, a Ctrl-C included
        report.readable(tmp)
        if params.pop(TRACE_PARAM, None) is not None:
            staging = Path(tempfile.mkdtemp(dir=out_dir, prefix=f".{name}.{os.getpid()}-",
                                            suffix=folder.TRACES_SUFFIX))
            kernel_params = {**params, TRACE_PARAM: str(staging)}
        man = report.manifest({**options, **params})
        header = _header(name, params, man)
        error, page, metrics, profile_page = _execute(
            src, tmp, out_dir, kernel_params, man, timeout, hide_code, header, progress, staging,
            standby, profile, kernels)
        seconds = time.perf_counter() - t0
        info = {"notebook": name, "source": source or str(src), "seconds": round(seconds, 3),
                "parameters": params, "manifest": man}
        if kernels is not None:  # kernels it compiled itself (cache misses), for its record
            built = precompile.built_here(kernels)
            if built:
                info["compiled_here"] = built
        if error is None:
            try:
                if kernels is not None:  # what it compiled, for the next batch to compile early
                    precompile.keep_list(kernels, out_dir / f"{name}{precompile.LIST_SUFFIX}")
                return _publish_ok(name, out_dir, tmp, page, info, metrics, seconds, staging,
                                   profile_page)
            except OSError as exc:
                error = f"could not write the report: {exc}"
                if profile_page is not None:
                    profile_page.unlink(missing_ok=True)
        try:
            return _publish_failed(name, out_dir, tmp, header, hide_code, info, error, seconds,
                                   staging, str(man["device"]).startswith("cpu"))
        except OSError as exc:
            return Result(name, "failed", seconds,
                          f"{error}; could not write the failure record either: {exc}")
    except KeyboardInterrupt:
        # the kernel died with the interrupt: its pending nbclient task would print a "Task
        # exception was never retrieved" trace when collected, here or in a batch's worker
        logging.getLogger("asyncio").setLevel(logging.CRITICAL)
        raise
    finally:
        if standby is not None:
            standby.close()
        tmp.unlink(missing_ok=True)
        if profile is not None:
            profile.unlink(missing_ok=True)
        if kernels is not None:
            kernels.unlink(missing_ok=True)
            precompile.built_path(kernels).unlink(missing_ok=True)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def update_index(out_dir: str | os.PathLike, repo: str | os.PathLike | None = None) -> Path:
    """Rewrite ``out_dir/index.html`` and ``out_dir/manifest.json`` (see
    :func:`k3lab.folder.update_index`)."""
    return folder.update_index(out_dir, repo)


class Results(list):
    """The batch's :class:`Result` list, with ``index`` (the index page, None when it could not
    be written) and ``interrupted`` (the notebook a Ctrl-C stopped, else None)."""

    index: Path | None = None
    interrupted: str | None = None

    @property
    def ok(self) -> bool:
        return self.index is not None and not self.interrupted and all(r.ok for r in self)


def _last_seconds(out: Path, name: str) -> float | None:
    record, _ = folder.load_record(out / f"{name}.metrics.json")
    seconds = (record or {}).get("seconds")
    return float(seconds) if seconds is not None else None


def _run_parallel(paths, plans, lasts, out, options, timeout, hide_code, jobs, results,
                  line, ray_address: str | None = None, profile: bool = False) -> None:
    from k3lab import batch

    done: dict[int, Result] = {}

    def on_done(i, res, gpu):
        done[i] = res
        line(i + 1, res, lasts[i], f"  [gpu {gpu}]" if gpu is not None else "")

    def on_error(i, exc):
        return Result(paths[i].stem, "failed", 0.0, f"worker failed: {_error_text(exc)}")

    pairs = list(enumerate(zip(paths, plans, strict=True)))
    if ray_address:
        tasks = [(i, (p, nb_params, options, timeout, hide_code)) for i, (p, nb_params) in pairs]
        completed = batch.run_ray(tasks, ray_address, str(options["device"]).startswith("cuda"),
                                  out, on_done, on_error)
    else:
        slots = batch.gpu_slots(options["device"], min(jobs, len(paths)))
        if len(slots) < min(jobs, len(paths)):
            print(f"k3lab: --jobs {jobs} on {len(slots)} GPU(s): {len(slots)} at a time, one "
                  "notebook per GPU, so that timings do not disturb each other", flush=True)
        # the longest first (by the last run here, else by the committed H200 reports' run),
        # so the batch does not end on one long notebook
        ref = repo_root() / "executed" / "h200"
        hints = [last if last is not None else _last_seconds(ref, p.stem)
                 for last, p in zip(lasts, paths, strict=True)]
        order = sorted(pairs, key=lambda ip: -(hints[ip[0]] or 0.0))
        tasks = [(i, (p, out, nb_params, options, timeout, hide_code, None, None, None, profile))
                 for i, (p, nb_params) in order]
        cpu = not str(options["device"]).startswith("cuda")
        threads = batch.cpu_threads(len(slots)) if cpu and len(slots) > 1 else None
        completed = batch.run_slots(tasks, slots, _run_one, on_done, on_error, threads)
    results.extend(done[i] for i in sorted(done))
    if not completed:
        results.interrupted = ", ".join(p.stem for i, p in enumerate(paths) if i not in done) \
            or "the last notebooks"


def _standby(device: str, out: Path, path: Path,
             profile: bool) -> tuple[kernelenv.Standby | None, Path | bool]:
    """A kernel started for the notebook ``path`` and the file its host profile goes to (False:
    not profiled)."""
    to: Path | bool = False
    try:
        if profile:
            to = Path(_temp_file(out, path.stem))
        return kernelenv.Standby(device, to or None, _kernel_list_file(out, path.stem, device)), to
    except Exception:  # noqa: BLE001 - without it the notebook starts its own kernel
        return None, to


def _run_sequential(paths, plans, lasts, out, options, timeout, hide_code, cells: bool,
                    results, line, profile: bool = False) -> None:
    """One notebook after another, each after the first in a kernel started while the one
    before it ran (the first starts its own: a standby would have nothing to overlap)."""
    nxt, nxt_profile = None, profile
    try:
        for i, (path, nb_params) in enumerate(zip(paths, plans, strict=True), 1):
            last = lasts[i - 1]
            bar = None
            if cells:  # papermill's tqdm bar: cells done, elapsed, cells per second
                was = f" (last run {last:.0f} s)" if last is not None else ""
                bar = {"desc": f"[{i}/{len(paths)}] {path.stem}{was}", "unit": "cell",
                       "leave": False}
            mine, mine_profile = nxt, nxt_profile
            nxt, nxt_profile = (_standby(options["device"], out, paths[i], profile)
                                if i < len(paths) else (None, False))
            try:
                res = _run_one(path, out, nb_params, options, timeout, hide_code, bar,
                               standby=mine, profile=mine_profile)
            except KeyboardInterrupt:
                results.interrupted = path.stem
                break
            results.append(res)
            line(i, res, last)
    finally:
        if nxt is not None:
            nxt.close()
        if isinstance(nxt_profile, Path):
            nxt_profile.unlink(missing_ok=True)


def _run_batch(paths, plans, lasts, out, options, timeout, hide_code, jobs, ray, cells,
               progress, results, line, profile) -> None:
    if jobs > 1 or ray:
        _run_parallel(paths, plans, lasts, out, options, timeout, hide_code, jobs, results, line,
                      ray, profile)
    else:
        _run_sequential(paths, plans, lasts, out, options, timeout, hide_code, cells and progress,
                        results, line, profile)


def auto_jobs(device: str, n_notebooks: int) -> int:
    """Notebooks run at once by default: on the CPU one per core, on CUDA one per visible GPU
    (timings on one GPU would disturb each other), never more than there are notebooks."""
    if str(device).startswith("cuda"):
        import torch

        slots = torch.cuda.device_count()
    else:
        slots = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
            os.cpu_count()
    return max(1, min(slots or 1, n_notebooks))


def run(notebooks=None, *, device: str = "cpu", preset: str = "tiny", tp: int = 1,
        params: dict | None = None, out_dir: str | os.PathLike | None = None,
        timeout: float | None = None, progress: bool = True, hide_code: bool = True,
        notebook_dir: str | os.PathLike | None = None, cells: bool = False,
        jobs: int | None = 1, ray: str | None = None, force: bool = False,
        profile: bool = False) -> Results:
    """Execute ``notebooks`` (names, see :func:`resolve`; None: all) and write their reports.

    device / preset / tp are injected into each notebook that declares them; every other key of
    ``params`` must be declared by at least one selected notebook and goes only to those. All
    parameters of all notebooks, the timeout and the output folder are checked before the first
    one runs (ValueError / TypeError). timeout: per-cell limit in seconds (None:
    $K3LAB_CELL_TIMEOUT when set, else none). progress: one line per notebook; cells: a per-cell
    progress bar too (one notebook at a time only). jobs: notebooks run at once, each in a
    worker process, one GPU each on a multi-GPU host (see :mod:`k3lab.batch`), the longest by
    their last run first; None: :func:`auto_jobs`. ray: a Ray cluster's address ("local" starts
    one here): every notebook a Ray task asking for one GPU (one CPU on a CPU run), its files
    sent back here.
    force: run even when a notebook's estimated memory (:mod:`k3lab.memory`) exceeds what the
    device has free; without it that is a ValueError before anything runs (not checked for a
    remote Ray cluster, whose nodes' memory is not known here).
    profile: sample each notebook's host work (:mod:`k3lab.hostprofile`, the profile extra;
    not with ``ray``): a breakdown in each report's header and metrics, the call tree in
    ``NAME.profile.html``.
    Returns one :class:`Result` per notebook, in order; a Ctrl-C stops the
    batch, keeps every report written so far and sets ``interrupted``.
    """
    options = {"device": device, "preset": preset, "tp": tp}
    _check_options(device, preset, tp)
    timeout = _check_timeout(timeout)
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int)):
        raise TypeError(f"jobs: expected an int or None, got {jobs!r}")
    if jobs is not None and jobs < 1:
        raise ValueError(f"--jobs: expected at least 1, got {jobs}")
    if profile and ray:
        raise ValueError("--profile: not with --ray (profile the notebooks on this machine)")
    if profile and not hostprofile.available():
        raise ValueError("--profile: needs pyinstrument (pip install -e '.[profile]')")
    paths = resolve(notebooks, notebook_dir)
    if jobs is None:
        jobs = auto_jobs(device, len(paths))
    decl = {p: declared(p) for p in paths}
    plans = _plan(paths, options, dict(params or {}), decl)
    if not force and (not ray or ray == "local"):
        _check_memory(paths, plans, decl, options, 1 if ray else jobs)
    kernelenv.check_kernel()
    out = folder.prepare(Path(out_dir) if out_dir is not None else default_out_dir())
    removed, busy = folder.remove_stale(out)
    say = (lambda text: print(text, flush=True)) if progress else (lambda text: None)
    say(f"k3lab: {len(paths)} notebook(s) on {device}, preset {preset}, tp {tp} -> {out}")
    if removed:
        say(f"k3lab: removed {len(removed)} temp file(s) a killed run left: {', '.join(removed)}")
    if busy:
        say(f"k3lab: left {len(busy)} temp file(s) of a run still going: {', '.join(busy)}")
    results = Results()
    width = max(len(p.stem) for p in paths)

    def line(i: int, res: Result, last: float | None, where: str = "") -> None:
        was = f"  (last {last:.1f} s)" if last is not None else ""
        say(f"[{i}/{len(paths)}] {res.name:<{width}}  {res.status:<6} {res.seconds:7.1f} s"
            + where + (f"  {res.error}" if res.error else was))
        if res.ok and res.metrics is not None:
            record, _ = folder.load_record(res.metrics)
            pad = " " * (len(str(len(paths))) * 2 + 4)
            spent = (record or {}).get("host_profile", {}).get("seconds", {})
            if profile and spent:
                say(pad + "host: " + ", ".join(f"{c} {t:.1f} s" for c, t in spent.items()))
            built = (record or {}).get("compiled_here") or {}
            if built:
                say(pad + f"compiled in its own process: {sum(built.values())} kernel(s): "
                    + ", ".join(f"{k} x{n}" for k, n in list(built.items())[:6])
                    + (", ..." if len(built) > 6 else ""))

    lasts = [_last_seconds(out, p.stem) for p in paths]
    # what the notebooks compiled at their last run here starts compiling in the background
    warming = (precompile.warm([out / f"{p.stem}{precompile.LIST_SUFFIX}" for p in paths])
               if str(device).startswith("cuda") and not ray else None)
    if warming is not None and warming.futures:
        say(f"k3lab: compiling the {len(warming.futures)} kernels the notebooks compiled last "
            f"time here, in the background ({precompile.LIST_SUFFIX})")
    try:
        _run_batch(paths, plans, lasts, out, options, timeout, hide_code, jobs, ray, cells,
                   progress, results, line, profile)
    finally:
        if warming is not None and warming.futures:
            counts, ready = warming.counts(), warming.ready_after()
            warming.close()
            say(f"k3lab: background compile: {counts['compiled']} of {counts['listed']} done"
                + (f", {counts['failed']} failed (compiled at first launch instead)"
                   if counts["failed"] else "")
                + ("; all of a notebook's done after: " + ", ".join(
                    f"{name} {t:.0f} s" for name, t in ready.items()) if ready else ""))
    try:
        results.index = update_index(out)
    except OSError as exc:
        print(f"k3lab: error: could not write the index of {out}: {exc}", file=sys.stderr,
              flush=True)
    if results.interrupted:
        kept = ", ".join(r.name for r in results) or "none"
        print(f"k3lab: interrupted while running {results.interrupted}: last good reports are "
              f"untouched; finished before it: {kept}; nothing else ran"
              + (f"; index: {results.index}" if results.index else ""),
              file=sys.stderr, flush=True)
    elif results.index is not None:
        failed = sum(not r.ok for r in results)
        say(f"k3lab: {len(results) - failed} ok, {failed} failed; index: {results.index}")
    return results
