"""Where a notebook's time goes on the host: ``k3lab run --profile``.

The kernel of a profiled run samples its own call stacks with pyinstrument (the ``profile``
extra) while each cell runs (``pre_run_cell`` to ``post_run_cell``), adding every cell's samples
to one session file ($K3LAB_HOST_PROFILE) that survives a failed cell. The runner then writes
the session beside the report as ``NAME.profile.html`` (pyinstrument's page: the call tree with
wall times) and sums its samples by :data:`CATEGORIES` into the report's header and its
``.metrics.json`` (``host_profile``): compiling (Triton, torch.compile), waiting on the GPU,
building weights and inputs, the references, plots and the rest.

Sampling has a cost in every Python call, so a profiled run's eager latencies, which time the
host's launches, are not comparable with an unprofiled run's (graph replays are); its report
says so.
"""

from __future__ import annotations

import html
import os
import re
from pathlib import Path
from urllib.parse import quote

__all__ = ["ENV", "INTERVAL_S", "CATEGORIES", "available", "start_from_env", "category",
           "summarize", "write_html", "header_html", "FILE_SUFFIX"]

ENV = "K3LAB_HOST_PROFILE"  # the session file a profiled kernel writes
INTERVAL_S = 0.005
FILE_SUFFIX = ".profile.html"

# (category, frame tests), in priority order: a sample counts for the first category one of
# whose tests (a function regex and a file regex, both to match) fits a frame of its stack (a
# Triton compile under a weight build is a compile), else "other host". Imports come first (a
# lazy import inside a compile is an import); Triton's compile includes loading a kernel from
# its cache and waiting for the compiles sent to worker processes (k3lab.precompile.ahead, in
# Triton's AsyncCompileMode); "waiting on the device" is the host blocked in a synchronizing
# call (a CPU run's are its own ops).
_ANY = r"."
CATEGORIES: tuple[tuple[str, tuple[tuple[re.Pattern, re.Pattern], ...]], ...] = tuple(
    (name, tuple((re.compile(fn), re.compile(path)) for fn, path in tests)) for name, tests in (
        ("imports", ((r"^_find_and_load$", r"importlib"),)),
        ("Triton compile", ((_ANY, r"triton[/\\](compiler|backends)[/\\]|"
                                   r"triton[/\\]runtime[/\\](build|_async_compile)\.py"),)),
        ("Triton interpreter", ((_ANY, r"triton[/\\]runtime[/\\]interpreter\.py"),)),
        ("torch.compile", ((_ANY, r"torch[/\\]_dynamo[/\\]convert_frame\.py|torch[/\\]_inductor"
                                  r"[/\\](compile_fx|codecache|async_compile)\.py"),)),
        ("waiting on the device", ((r"(^|\.)(_cuda_synchronize|synchronize|elapsed_time|item|"
                                    r"tolist|cpu|_local_scalar_dense)$", r"^<built-in>$"),)),
        ("weights and inputs", ((_ANY, r"k3lab[/\\]weights\.py"),
                                (r"^(make_inputs|cold_copies|copies|stage_copies)$", _ANY))),
        ("references", ((_ANY, r"k3lab[/\\]reference[/\\]"),)),
        ("plots and tables", ((_ANY, r"matplotlib[/\\]|pandas[/\\]|"
                                     r"k3lab[/\\](plots|readable)\.py"),)),
    ))
OTHER = "other host"


def available() -> bool:
    try:
        import pyinstrument  # noqa: F401
    except ImportError:
        return False
    return True


def _frame(identifier: str) -> tuple[str, str]:
    """(function, file) of a pyinstrument frame identifier ``function\\0file\\0line...``."""
    parts = identifier.split("\x00")
    return parts[0], parts[1] if len(parts) > 1 else ""


def category(stack: list[str]) -> str:
    """The category of one sample's stack (pyinstrument frame identifiers, outermost first)."""
    frames = [_frame(s) for s in stack]
    for name, tests in CATEGORIES:
        if any(fn.search(f) and path.search(p) for f, p in frames for fn, path in tests):
            return name
    return OTHER


def summarize(session) -> dict:
    """``{"seconds": {category: s}, "profiled_s": s, "samples": n}`` of a pyinstrument session
    (categories in :data:`CATEGORIES` order, then "other host", zeros left out)."""
    sums: dict[str, float] = {}
    for stack, t in session.frame_records:
        c = category(stack)
        sums[c] = sums.get(c, 0.0) + float(t)
    order = [c for c, _ in CATEGORIES] + [OTHER]
    return {"seconds": {c: round(sums[c], 3) for c in order if sums.get(c)},
            "profiled_s": round(sum(sums.values()), 3), "samples": int(session.sample_count)}


def load(path: str | os.PathLike):
    from pyinstrument.session import Session

    return Session.load(str(path))


# the page's call tree is resampled to at most this many samples (a 4-minute notebook at 24 ms):
# the full tree of a long notebook made a page of 25 MB that a browser opens slowly; the report's
# categories are summed from the full session
PAGE_SAMPLES = 10_000


def write_html(session, path: Path) -> Path:
    """pyinstrument's page of ``session`` at ``path`` (through a temp file; at most
    PAGE_SAMPLES samples), its web-font stylesheet made an empty one: the page loads nothing
    from the network."""
    from pyinstrument.renderers import HTMLRenderer

    from k3lab import report

    if len(session.frame_records) > PAGE_SAMPLES and session.duration > 0:
        session = session.resample(interval=session.duration / PAGE_SAMPLES)
    page = HTMLRenderer(resample_interval=0).render(session)
    page = re.sub(r"https://fonts\.googleapis\.com/css[^\"'\s]*", "data:text/css,", page)
    return report.atomic_write_text(path, page)


def header_html(summary: dict, page: str | None) -> str:
    """One line for the report's header: the categories' seconds and shares, a link to the
    profile page, and the caveat on eager latencies."""
    total = summary.get("profiled_s") or 0.0
    parts = ", ".join(f"{html.escape(c)} {s:.1f} s ({100 * s / total:.0f} %)"
                      for c, s in summary.get("seconds", {}).items() if total)
    link = (f" <a class='k3lab-profile' href='./{html.escape(quote(page, safe=''), quote=True)}'>"
            f"{html.escape(page)}</a>") if page else ""
    return (f"<div class='k3lab-small'>Host profile of the cells ({total:.1f} s sampled): "
            f"{parts}.{link} Profiled run: eager latencies include the sampler's cost.</div>")


# ---------------------------------------------------------------- in the kernel

def start_from_env() -> bool:
    """In a notebook kernel with $K3LAB_HOST_PROFILE set: sample every cell and save the
    session there after each one. True when profiling."""
    path = os.environ.get(ENV)
    if not path:
        return False
    from IPython import get_ipython
    from pyinstrument import Profiler
    from pyinstrument.session import Session

    ip = get_ipython()
    if ip is None:
        return False
    state: dict = {"profiler": None, "session": None}

    def pre(*_):
        state["profiler"] = Profiler(interval=INTERVAL_S, async_mode="disabled")
        state["profiler"].start()

    def post(*_):
        profiler, state["profiler"] = state["profiler"], None
        if profiler is None:
            return
        session = profiler.stop()
        state["session"] = session if state["session"] is None else \
            Session.combine(state["session"], session)
        tmp = f"{path}.part"
        state["session"].save(tmp)
        os.replace(tmp, path)

    ip.events.register("pre_run_cell", pre)
    ip.events.register("post_run_cell", post)
    return True
