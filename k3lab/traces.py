"""Perfetto (Chrome trace-event) files of a report's timelines.

A notebook that shows a timeline declares ``trace_dir = ""`` in its parameters cell; ``k3lab
run`` sets it to a private folder of the run and, when the notebook succeeds, moves the files
written there beside the report as ``<notebook>.<label>.trace.json`` (see :mod:`k3lab.runner`).
Left empty (in JupyterLab), no file is written. In the notebook::

    traces = Traces(trace_dir, "50_mla")
    tl = profile.timeline(fn, inputs, trace_path=traces.path("fused"))
    traces.show()

On CUDA the file is torch.profiler's own trace of the call; on the CPU :func:`write_cpu` writes
the timeline's rows as trace events, marked as interpreter wall-clock (not GPU times).
"""

from __future__ import annotations

import html
import json
import os
import re
from pathlib import Path
from urllib.parse import quote

__all__ = ["SUFFIX", "CPU_NOTE", "file_name", "label_of", "write_cpu", "Traces", "links_html",
           "report_traces", "failed_name"]

SUFFIX = ".trace.json"
CPU_NOTE = ("CPU run under the Triton interpreter: times are the interpreter's wall clock, "
            "not GPU figures")
PERFETTO = "https://ui.perfetto.dev"


def _slug(label: str) -> str:
    """``label`` as a file-name part: no dots (they separate the name's parts), no spaces."""
    slug = re.sub(r"[^\w-]+", "_", str(label)).strip("_")
    if not slug:
        raise ValueError(f"trace label: expected some letters or digits, got {label!r}")
    return slug


def file_name(notebook: str, label: str) -> str:
    """``<notebook>.<label>.trace.json`` (the label made file-safe)."""
    return f"{notebook}.{_slug(label)}{SUFFIX}"


def failed_name(name: str, notebook: str) -> str:
    """The name a failed run's trace takes: ``<notebook>.failed.<label>.trace.json``."""
    return f"{notebook}.failed.{name.removeprefix(f'{notebook}.')}"


def label_of(name: str, notebook: str) -> str | None:
    """The label of a report's trace file name, None when ``name`` is not one of
    ``notebook``'s (a failed run's trace included: its label part holds a dot)."""
    prefix = f"{notebook}."
    if not (name.startswith(prefix) and name.endswith(SUFFIX)):
        return None
    label = name[len(prefix):-len(SUFFIX)]
    return label if label and "." not in label else None


def report_traces(folder: str | os.PathLike, notebook: str) -> list[str]:
    """The trace files of ``notebook``'s report in ``folder`` (names, sorted)."""
    folder = Path(folder)
    return sorted(p.name for p in folder.glob(f"{glob_escape(notebook)}.*{SUFFIX}")
                  if p.is_file() and label_of(p.name, notebook))


def glob_escape(text: str) -> str:
    return re.sub(r"([*?\[])", r"[\1]", text)


def _atomic_write(path: Path, text: str) -> None:
    from k3lab import report

    report.atomic_write_text(path, text)


def write_cpu(timeline, path: str | os.PathLike, note: str = CPU_NOTE) -> Path:
    """Write the rows of a timeline frame (kernel, start_us, end_us or dur_us, stream; other
    columns go into each event's args) as a Chrome trace-event JSON that Perfetto opens:
    one complete ("X") event per row, one thread per stream, ``note`` in the process name
    and in ``otherData``."""
    rows = timeline.to_dict(orient="records") if hasattr(timeline, "to_dict") else timeline
    streams: dict[str, int] = {}
    events = [{"name": "process_name", "ph": "M", "pid": 1, "tid": 0,
               "args": {"name": f"k3lab timeline ({note})"}}]
    for r in rows:
        stream = str(r.get("stream", "cpu"))
        tid = streams.setdefault(stream, len(streams) + 1)
        start = float(r["start_us"])
        dur = float(r["dur_us"]) if r.get("dur_us") is not None else float(r["end_us"]) - start
        args = {k: _plain(v) for k, v in r.items()
                if k not in ("kernel", "start_us", "end_us", "dur_us", "stream")}
        events.append({"name": str(r.get("kernel", "?")), "cat": "launch", "ph": "X",
                       "ts": round(start, 3), "dur": round(max(dur, 0.0), 3), "pid": 1,
                       "tid": tid, "args": args})
    events += [{"name": "thread_name", "ph": "M", "pid": 1, "tid": tid, "args": {"name": s}}
               for s, tid in streams.items()]
    doc = {"traceEvents": events,
           "otherData": {"k3lab": note, "clock": "wall clock (us)"}}
    path = Path(path)
    _atomic_write(path, json.dumps(doc) + "\n")
    return path


def _plain(v):
    from k3lab.report import json_safe

    return json_safe(v)


def links_html(names: list[str], cpu: bool | None = None, title: str = "Perfetto trace") -> str:
    """One line linking trace files of the report's folder (relative, percent-encoded), with
    how to open them and, on a CPU run, that the times are the interpreter's wall clock."""
    if not names:
        return ""
    links = " ".join(
        f"<a class='k3lab-trace' href='{html.escape('./' + quote(n, safe=''), quote=True)}'>"
        f"{html.escape(n)}</a>" for n in names)
    note = f"; {html.escape(CPU_NOTE)}" if cpu else ""
    return (f"<div class='k3lab-traces'>{html.escape(title)}{'s' if len(names) > 1 else ''}: "
            f"{links} <span class='k3lab-small'>(open in {PERFETTO}{note})</span></div>")


class Traces:
    """The trace files one notebook writes into ``trace_dir`` (empty: none)."""

    def __init__(self, trace_dir: str | os.PathLike | None, notebook: str):
        self.dir = Path(trace_dir) if trace_dir else None
        self.notebook = notebook
        self.written: list[str] = []

    def __bool__(self) -> bool:
        return self.dir is not None

    def path(self, label: str) -> str | None:
        """Where the trace ``label`` goes (None without a trace_dir); remembered for
        :meth:`show`."""
        if self.dir is None:
            return None
        name = file_name(self.notebook, label)
        if name not in self.written:
            self.written.append(name)
        self.dir.mkdir(parents=True, exist_ok=True)
        return str(self.dir / name)

    def html(self, names: list[str] | None = None, cpu: bool | None = None) -> str:
        names = [n for n in (self.written if names is None else names)
                 if self.dir is not None and (self.dir / n).exists()]
        return links_html(names, cpu)

    def show(self, labels=None, cpu: bool | None = None) -> None:
        """Display links to the traces written (``labels``: only these), or say why there are
        none."""
        from IPython.display import HTML, display

        if self.dir is None:
            print("no trace file: trace_dir is empty (k3lab run writes the traces beside the "
                  "report)")
            return
        names = (None if labels is None
                 else [file_name(self.notebook, label) for label in labels])
        if cpu is None:
            cpu = os.environ.get("TRITON_INTERPRET") == "1"
        page = self.html(names, cpu)
        display(HTML(page) if page else HTML("<div class='k3lab-traces'>no trace written</div>"))
