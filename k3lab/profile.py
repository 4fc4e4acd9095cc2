"""Measuring a boundary: launches, latency (eager and CUDA graph, cold weights), timeline, roofline.

Every figure says how it was taken. On CUDA, launches are the kernel, memset and memcpy events
torch.profiler records; latencies come from CUDA events recorded around each call or graph replay
with no host synchronization inside the timed region (one sync after the last repeat). On CPU the
Triton kernels run under the interpreter, launches are *logical* (Triton launches plus the ATen ops
dispatched, views and allocations excluded) and latencies are wall-clock: neither is a GPU figure.

Cold weights: the 60 MB L2 of an H200 holds a whole router weight, so replaying a boundary on one
set of inputs times it warm. ``cold_copies`` builds enough input copies (different seeds) that the
bytes touched by one pass over them exceed twice the L2; eager timing rotates through the copies,
and the CUDA graph captures passes over the copies (at least MIN_GRAPH_CALLS calls) and divides a
replay by the calls it holds.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import pandas as pd
import torch

from k3lab import precompile
from k3lab.boundaries import Boundary, clone_inputs
from k3lab.config import Preset
from k3lab.launches import (  # noqa: F401  (re-exported: profile's public names)
    Launches,
    _device_of,
    _sync,
    count_launches,
    short_kernel_name,
    tensor_bytes,
    timeline,
)

__all__ = [
    "Launches", "Timing", "count_launches", "time_variant", "graph_passes", "cold_copies",
    "tensor_bytes", "copy_bandwidth", "l2_bytes", "timeline", "measure", "roofline_us",
    "short_kernel_name", "value", "launch_lists", "variant_timelines", "graph_launch_us",
    "QUIET_WARNINGS", "quiet_warnings", "time_interleaved", "interleaved_ratios",
]

# Warnings that tell a report's reader nothing, silenced for the whole process when this module is
# imported (every notebook imports it): (message regex, category, why it says nothing here).
QUIET_WARNINGS = (
    (r"Warning: Profiler clears events at the end of each cycle", UserWarning,
     "each profile here is one cycle: nothing is lost"),
    (r"TensorFloat32 tensor cores for float32 matrix multiplication", UserWarning,
     "the references compute in fp32 on purpose; torch.compile peers compile them as written"),
    (r"\s*Online softmax is disabled on the fly", UserWarning,
     "an inductor choice inside the torch.compile peer, not a finding about it"),
)


def quiet_warnings() -> None:
    """Ignore the :data:`QUIET_WARNINGS` (other warnings still show)."""
    for message, category, _ in QUIET_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category)


quiet_warnings()


# On the CPU a timing only shows that a path runs (the interpreter's wall clock says nothing of a
# kernel's speed), so one untimed warm-up-free call per figure; nothing there compiles.
DEFAULT_REPEATS = {"cpu": 1, "cuda": 50}
DEFAULT_WARMUP = {"cpu": 0, "cuda": 5}
# Warm-up also lasts at least this long on the GPU (untimed, synchronized): the first timing of a
# process after its setup ran ~12 % slow at 5 warm-up replays, the way a GPU's clocks and
# translation caches need some milliseconds of work before they settle (docs/decisions.md).
WARMUP_SECONDS = {"cpu": 0.0, "cuda": 0.1}
# Back to back the device is warm already: a timing whose warm-up starts within HOT_GAP_S of the
# end of this process's previous timed or warm-up work on the device warms for
# HOT_WARMUP_SECONDS instead (still its warm-up calls at least). A sweep's points and a
# variant's eager then graph timings follow each other that closely; the first timing after
# setup work or a pause gets the whole WARMUP_SECONDS.
HOT_GAP_S = 0.25
HOT_WARMUP_SECONDS = {"cpu": 0.0, "cuda": 0.01}
_LAST_BUSY: dict[str, float] = {}  # device -> perf_counter() at the end of its last timed work
MAX_COLD_COPIES = 512  # small boundaries (AttnRes at B1: ~0.2 MB a call) need hundreds
# A graph replay has a fixed cost (~10-20 us on an H200) that a decode step's graph of hundreds of
# kernels pays once. Graph timing therefore captures at least this many calls (cycling through the
# cold copies) so a boundary's per-call figure is its marginal cost inside a long graph, not a
# share of one replay's launch.
MIN_GRAPH_CALLS = 32
AMORTIZED_CALL_US = 200.0
# Timed work a figure may take on the GPU: a slow call (an unfused reference at milliseconds a
# call) gets fewer samples, never fewer than MIN_SAMPLES; at microseconds a call the budget never
# binds. The samples taken are in the Timing (``repeats``).
TIME_BUDGET_S = 0.25
MIN_SAMPLES = 5


def budget_samples(per_sample_s: float, repeats: int, budget_s: float | None = None) -> int:
    """Samples of ``per_sample_s`` each within ``budget_s`` (default TIME_BUDGET_S): at most
    ``repeats``, at least MIN_SAMPLES (or ``repeats`` when that is fewer)."""
    budget_s = TIME_BUDGET_S if budget_s is None else budget_s
    if per_sample_s <= 0:
        return repeats
    return max(min(MIN_SAMPLES, repeats), min(repeats, int(budget_s / per_sample_s)))


@dataclass
class Timing:
    """Latency of one call in microseconds: median and 10th/90th percentiles over ``repeats``."""

    median_us: float
    p10_us: float
    p90_us: float
    repeats: int
    mode: str  # "eager" or "graph"
    cold: bool
    device: str
    copies: int = 1
    note: str = ""


# ---------------------------------------------------------------------------------------------
# latency


def l2_bytes(device: torch.device | str) -> int:
    dev = torch.device(device)
    if dev.type != "cuda":
        return 0
    return int(getattr(torch.cuda.get_device_properties(dev), "L2_cache_size", 50 << 20))


def cold_copies(make: Callable[[int], Any], *, bytes_per_copy: int | None = None,
                device: torch.device | str | None = None, min_bytes: int | None = None) -> list:
    """Input copies ``make(0), make(1), ...`` until one pass over them touches at least
    ``min_bytes`` (default: twice the L2 on CUDA; one copy on CPU, where L2 is moot).

    ``bytes_per_copy`` is what one call touches (a boundary's ``bytes_moved``), by default every
    tensor of a copy.
    """
    first = make(0)
    dev = torch.device(device) if device is not None else _device_of(first)
    if min_bytes is None:
        min_bytes = 2 * l2_bytes(dev)
    per = bytes_per_copy or tensor_bytes(first)
    n = 1 if per <= 0 else max(1, min(MAX_COLD_COPIES, math.ceil(min_bytes / per)))
    return [first] + [make(i) for i in range(1, n)]


def _summary(samples_us: list[float], **kw) -> Timing:
    q = statistics.quantiles(samples_us, n=10) if len(samples_us) > 1 else samples_us * 9
    return Timing(statistics.median(samples_us), q[0], q[-1], len(samples_us), **kw)


def _warm(run: Callable[[], Any], device: torch.device) -> float:
    """Call ``run`` (a batch of warm-up calls) until WARMUP_SECONDS (HOT_WARMUP_SECONDS back to
    back: HOT_GAP_S) of wall time have passed, at least once, synchronizing after each batch
    (before any timed region). Returns the wall seconds of the last batch."""
    t0 = time.perf_counter()
    last = _LAST_BUSY.get(str(device))
    hot = last is not None and t0 - last <= HOT_GAP_S
    seconds = (HOT_WARMUP_SECONDS if hot else WARMUP_SECONDS).get(device.type, 0.0)
    while True:
        t1 = time.perf_counter()
        run()
        _sync(device)
        t2 = time.perf_counter()
        _LAST_BUSY[str(device)] = t2
        if t2 - t0 >= seconds:
            return t2 - t1


def _done(device: torch.device) -> None:
    """The device's timed work ended now (after its synchronization): see HOT_GAP_S."""
    _LAST_BUSY[str(device)] = time.perf_counter()


def graph_passes(replay_call_us: float, n: int, min_calls: int = MIN_GRAPH_CALLS) -> int:
    """Passes over ``n`` input copies that a timing graph captures: enough for ``min_calls``
    calls, unless a call (``replay_call_us``: one pass's graph replay over its calls) is slower
    than AMORTIZED_CALL_US, which already dwarfs a replay's fixed cost: then one."""
    if replay_call_us >= AMORTIZED_CALL_US:
        return 1
    return max(1, -(-min_calls // n))


def _side_warmup(device: torch.device, run: Callable[[], Any]) -> None:
    """``run()`` on a side stream, then wait for it: the warm-up a CUDA-graph capture needs (a
    first call may compile or allocate)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        run()
    torch.cuda.current_stream(device).wait_stream(stream)
    torch.cuda.synchronize(device)


def _capture(fn: Callable[[Any], Any], inputs_list: list, passes: int):
    """A CUDA graph of ``passes`` passes of fn over the input copies."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(passes):
            for inputs in inputs_list:
                fn(inputs)
    return graph


def _replay_us(graph) -> float:
    """Microseconds of one replay of ``graph``, after an untimed one (events, then a sync)."""
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3


def time_variant(fn: Callable[[Any], Any], inputs_list: list, *, mode: str = "eager",
                 repeats: int | None = None, warmup: int | None = None,
                 cold: bool | None = None, min_calls: int = MIN_GRAPH_CALLS) -> Timing:
    """Latency of one call ``fn(inputs)``, rotating through ``inputs_list``.

    eager: CUDA events recorded around each call, back to back, one synchronization after the
    last (on CPU: wall clock per call). graph: one CUDA graph capturing passes over the input
    copies, at least ``min_calls`` calls in all, events around each replay, divided by the
    number of calls captured.
    """
    if mode not in ("eager", "graph"):
        raise ValueError(f"mode: expected 'eager' or 'graph', got {mode!r}")
    if not inputs_list:
        raise ValueError("inputs_list: expected at least one input set")
    device = _device_of(inputs_list[0])
    repeats = repeats or DEFAULT_REPEATS[device.type]
    warmup = DEFAULT_WARMUP[device.type] if warmup is None else warmup
    n = len(inputs_list)
    cold = n > 1 if cold is None else cold
    meta = dict(mode=mode, cold=cold, device=str(device), copies=n)
    if isinstance(min_calls, bool) or not isinstance(min_calls, int) or min_calls < 1:
        raise ValueError(f"min_calls: expected an int >= 1, got {min_calls!r}")
    if mode == "graph" and device.type != "cuda":
        raise ValueError("mode: 'graph' needs a CUDA device")

    if mode == "eager":
        if warmup or device.type == "cuda":
            calls = max(warmup, 1)
            batch_s = _warm(lambda: [fn(inputs_list[i % n]) for i in range(calls)], device)
            if device.type == "cuda":
                repeats = budget_samples(batch_s / calls, repeats)
        if device.type != "cuda":
            samples = []
            for i in range(repeats):
                t0 = time.perf_counter()
                fn(inputs_list[i % n])
                samples.append((time.perf_counter() - t0) * 1e6)
            return _summary(samples, **meta)
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        for i in range(repeats):
            starts[i].record()
            fn(inputs_list[i % n])
            ends[i].record()
        torch.cuda.synchronize(device)
        _done(device)
        samples = [s.elapsed_time(e) * 1e3 for s, e in zip(starts, ends, strict=True)]
        return _summary(samples, **meta)

    # graph: warm up on a side stream (required before capture), capture passes over the copies
    _side_warmup(device, lambda: [fn(inputs) for inputs in [inputs_list[0], *inputs_list]])
    graph = _capture(fn, inputs_list, 1)
    # how many passes: from one pass's graph replay, the GPU's time a call (an eager pass's time
    # is the host's when launches are slower than the kernels, which sized graphs too small;
    # docs/decisions.md)
    passes = graph_passes(_replay_us(graph) / n, n, min_calls)
    if passes > 1:
        del graph
        graph = _capture(fn, inputs_list, passes)

    def replay_batch(g=graph):
        for _ in range(max(warmup, 1)):
            g.replay()

    batch_s = _warm(replay_batch, device)
    replays = budget_samples(batch_s / max(warmup, 1), max(5, repeats // 2))
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(replays)]
    for i in range(replays):
        starts[i].record()
        graph.replay()
        ends[i].record()
    torch.cuda.synchronize(device)
    _done(device)
    samples = [s.elapsed_time(e) * 1e3 / (n * passes) for s, e in zip(starts, ends, strict=True)]
    del graph
    return _summary(samples, note=f"{n * passes} calls per graph replay", **meta)


def time_interleaved(fns: dict[str, Callable[[Any], Any]], inputs: Any, *, rounds: int = 5,
                     replays: int = 3) -> pd.DataFrame:
    """One call's graph time of every ``fns[label](inputs)``, interleaved: a CUDA graph of one
    call per label (after warm-up calls on a side stream), then ``rounds`` rounds that each
    replay every label's graph ``replays`` times in turn, events around each label's replays
    and one synchronization after the last round, so a slow drift of the clocks falls on
    every label alike. Rows: round, label, us (per call, the mean of the round's replays).
    CUDA only."""
    if not fns:
        raise ValueError("fns: expected at least one labelled function")
    for name, v in (("rounds", rounds), ("replays", replays)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name}: expected an int >= 1, got {v!r}")
    device = _device_of(inputs)
    if device.type != "cuda":
        raise ValueError("inputs: time_interleaved needs CUDA tensors (CUDA graphs)")
    _side_warmup(device, lambda: [fn(inputs) for fn in fns.values()])
    graphs = {label: _capture(fn, [inputs], 1) for label, fn in fns.items()}
    for g in graphs.values():  # one untimed replay each
        g.replay()
    events = []
    for r in range(rounds):
        for label, g in graphs.items():
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(replays):
                g.replay()
            end.record()
            events.append((r, label, start, end))
    torch.cuda.synchronize(device)
    _done(device)
    del graphs
    return pd.DataFrame([{"round": r, "label": label, "us": s.elapsed_time(e) * 1e3 / replays}
                         for r, label, s, e in events])


def interleaved_ratios(t: pd.DataFrame, base: str) -> pd.DataFrame:
    """From :func:`time_interleaved`'s rows: per label, base's time over the label's in each
    round (above 1: the label is faster), its median, min and max over the rounds."""
    piv = t.pivot(index="round", columns="label", values="us")
    if base not in piv.columns:
        raise ValueError(f"base: expected one of {list(piv.columns)}, got {base!r}")
    ratio = piv.rdiv(piv[base], axis=0)
    return pd.DataFrame({"median": ratio.median(), "min": ratio.min(), "max": ratio.max()})


_BANDWIDTH: dict[str, float] = {}


def copy_bandwidth(device: torch.device | str, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written; measured
    once per process and device (median of 10 copies of ``nbytes``)."""
    dev = torch.device(device)
    key = str(dev)
    if key in _BANDWIDTH:
        return _BANDWIDTH[key]
    if dev.type != "cuda":
        nbytes = min(nbytes, 64 << 20)
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=dev).fill_(1.0)
    dst = torch.empty_like(src)
    t = time_variant(lambda io: io[1].copy_(io[0]), [(src, dst)], repeats=10, warmup=2)
    _BANDWIDTH[key] = 2 * src.nbytes / (t.median_us * 1e-6)
    del src, dst
    return _BANDWIDTH[key]


def roofline_us(nbytes: int, bandwidth: float) -> float:
    """The time to move ``nbytes`` at ``bandwidth`` bytes/s, in microseconds."""
    return nbytes / bandwidth * 1e6


# ---------------------------------------------------------------------------------------------
# one boundary, every variant


def measure(boundary: Boundary, cfg: Preset, device: torch.device | str, *,
            variants: Iterable[str] | None = None, seed: int = 0, params: dict | None = None,
            modes: Iterable[str] = ("eager", "graph"), cold: bool = True,
            repeats: int | None = None, launches: bool = True) -> pd.DataFrame:
    """Check, count and time the variants of ``boundary`` at ``cfg`` on ``device``.

    Returns tidy rows (boundary, variant, role, preset, tp, device, M and the other scalar
    ``params``, mode, metric, value, unit, note). Correctness comes first: a variant whose
    check fails gets a ``check`` row of 0 and its error, and no timing. Graph mode is skipped
    on CPU; a variant that cannot be captured gets a note instead of a figure. Ratios
    (``speedup_vs_reference``) compare figures of this one call.
    """
    dev = torch.device(device)
    params = dict(params or {})
    chosen = [boundary.variant(v) for v in variants] if variants else list(boundary.variants)
    # every row names its inputs (M, and e.g. the MLA context), so a figure cannot be read as
    # another shape's
    base = dict(boundary=boundary.name, preset=cfg.name, tp=cfg.tp, device=dev.type,
                M=params.get("M", 1),
                **{k: v for k, v in params.items()
                   if k != "M" and isinstance(v, (bool, int, float, str))})
    rows: list[dict] = []

    def row(v, metric, value, unit="", mode="", note=""):
        rows.append({**base, "variant": v.name, "role": v.role, "mode": mode, "metric": metric,
                     "value": value, "unit": unit, "note": note})

    inputs = boundary.make_inputs(cfg, dev, seed, **params)
    nbytes = boundary.bytes_moved(inputs)
    ref = boundary.reference.fn(clone_inputs(inputs))
    # the fused variants' kernels compiled at once (k3lab.precompile; not under the interpreter)
    precompile.ahead([lambda v=v: v.fn(clone_inputs(inputs)) for v in chosen
                      if v.role == "fused" and v.unavailable(dev) is None])
    bw = copy_bandwidth(dev)
    modes = [m for m in modes if m == "eager" or dev.type == "cuda"]
    # on the CPU one call is the whole timing (DEFAULT_REPEATS): the launch count's call gives
    # it, instead of a third interpreted call
    one_call = (launches and dev.type != "cuda" and modes == ["eager"]
                and (repeats or DEFAULT_REPEATS[dev.type]) == 1)
    copies = None
    latency: dict[tuple[str, str], float] = {}
    for v in chosen:
        reason = v.unavailable(dev)
        if reason:
            row(v, "available", 0, note=reason)
            continue
        try:
            out = v.fn(clone_inputs(inputs))
            errs = boundary.check(out, ref, inputs) if v.role != "reference" else {}
        except AssertionError as exc:
            row(v, "check", 0, note=str(exc))
            continue
        row(v, "check", 1)
        for name, err in errs.items():
            row(v, "max_abs_err", err, note=name)
        if launches:
            # the check's call above was the warm-up (it compiled what the call launches)
            arg = clone_inputs(inputs)
            t0 = time.perf_counter()
            lc = count_launches(v.fn, arg, warmup=False)
            if one_call:
                once = _summary([(time.perf_counter() - t0) * 1e6], mode="eager", cold=cold,
                                device=str(dev), note="the launch count's call, wall clock")
            row(v, "launches", lc.count, "launches", note=lc.kind)
        row(v, "bytes", nbytes, "B")
        if copies is None and not one_call:
            copies = (cold_copies(lambda s: boundary.make_inputs(cfg, dev, seed + s, **params),
                                  bytes_per_copy=nbytes, device=dev) if cold else [inputs])
        for mode in modes:
            try:
                t = once if one_call else time_variant(v.fn, copies, mode=mode,
                                                       repeats=repeats, cold=cold)
            except Exception as exc:  # noqa: BLE001 - a capture failure is a finding, not a crash
                row(v, "latency_us", float("nan"), "us", mode,
                    note=f"{mode} failed: {type(exc).__name__}: {exc}"[:300])
                continue
            how = f"{'cold' if t.cold else 'warm'} x{t.copies}, {t.repeats} repeats"
            row(v, "latency_us", t.median_us, "us", mode, note=how)
            row(v, "latency_p10_us", t.p10_us, "us", mode)
            row(v, "latency_p90_us", t.p90_us, "us", mode)
            row(v, "roofline_us", roofline_us(nbytes, bw), "us", mode,
                note=f"copy bandwidth {bw / 1e12:.3f} TB/s measured in this run")
            row(v, "roofline_frac", roofline_us(nbytes, bw) / t.median_us, "", mode)
            latency[(v.name, mode)] = t.median_us
    ref_name = boundary.reference.name
    for v in chosen:
        for mode in modes:
            if (v.name, mode) in latency and (ref_name, mode) in latency:
                row(v, "speedup_vs_reference",
                    latency[(ref_name, mode)] / latency[(v.name, mode)], "x", mode)
    return pd.DataFrame(rows)


# ---------------------------------------------------------------------------------------------
# reading and extending measure()'s records


def value(records: pd.DataFrame, variant: str, metric: str, mode: str = "") -> float:
    """The first ``value`` of ``records`` (tidy rows, e.g. from :func:`measure`) for this
    variant, metric and mode ("" for the rows without one: launches, bytes); NaN when absent."""
    d = records[(records["variant"] == variant) & (records["metric"] == metric)
                & (records["mode"].fillna("") == mode)]
    return float(d["value"].iloc[0]) if len(d) else float("nan")


def launch_lists(boundary: Boundary, inputs: dict, device: torch.device | str,
                 variants: Iterable[str] | None = None) -> pd.DataFrame:
    """What one call of each available variant launches, one column per variant (in launch
    order; shorter columns padded with "")."""
    chosen = ([boundary.variant(v) for v in variants] if variants is not None
              else boundary.available_variants(device))
    lists = {v.name: count_launches(v.fn, clone_inputs(inputs)).kernels for v in chosen}
    width = max((len(k) for k in lists.values()), default=0)
    return pd.DataFrame({k: v + [""] * (width - len(v)) for k, v in lists.items()})


def variant_timelines(boundary: Boundary, inputs: dict, device: torch.device | str,
                      variants: Iterable[str] | None = None, traces=None
                      ) -> dict[str, pd.DataFrame]:
    """One call's :func:`timeline` per variant (default: every available one), each on fresh
    copies of ``inputs``, with the variant's name as its ``stream``. traces: a
    :class:`k3lab.traces.Traces`; each variant's trace is written as its label."""
    chosen = ([boundary.variant(v) for v in variants] if variants is not None
              else boundary.available_variants(device))
    out = {}
    for v in chosen:
        path = traces.path(v.name) if traces is not None else None
        t = timeline(v.fn, clone_inputs(inputs), trace_path=path)
        t["stream"] = v.name
        out[v.name] = t
    return out


GRAPH_LAUNCH_CALLS = 64


def graph_launch_us(device: torch.device | str, repeats: int | None = None) -> float:
    """One tiny kernel's share of a graph holding GRAPH_LAUNCH_CALLS of them, in us: the cost a
    launch adds inside a long graph (a whole replay's fixed cost would flatter a kernel). NaN on
    the CPU (no graphs)."""
    dev = torch.device(device)
    if dev.type != "cuda":
        return float("nan")
    tiny = [torch.zeros(1, device=dev) for _ in range(GRAPH_LAUNCH_CALLS)]
    return time_variant(lambda x: x.add_(1), tiny, mode="graph", repeats=repeats).median_us

