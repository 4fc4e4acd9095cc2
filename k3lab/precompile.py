"""Compile a sweep's Triton kernels at once, in worker processes, before the sweep times them.

A cold notebook spends most of its time compiling: every point of a sweep (an expert count, a
token count, a shape) is a new specialization, and Triton compiles each one on its first launch,
one after another. :func:`ahead` runs the sweep's calls once with every Triton launch turned into
a compile-only warm-up under Triton's ``AsyncCompileMode``; each compile is sent to a pool of
worker processes (the machine's cores, not one), which leave the result in Triton's on-disk
cache, and the kernel is then loaded from there into this process, with its launcher stub
built. The timed calls that follow find every kernel compiled.

Nothing here changes what runs or what is timed: a call that fails in the compile-only pass
(its outputs are never written) or a compile that a worker cannot reproduce only leaves that
kernel to compile at its first launch, as without this module. It acts only where the kernels
compile (a GPU); under the interpreter it does nothing.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import contextlib
import functools
import importlib
import json
import os
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["ahead", "Stats", "WORKERS_ENV", "workers", "LIST_ENV", "LIST_SUFFIX", "record",
           "keep_list", "read_list", "warm", "Warm", "start_workers", "built_here",
           "CACHE_ENV", "pin_cache_dir"]

WORKERS_ENV = "K3LAB_COMPILE_WORKERS"  # worker processes (0: compile ahead in threads only)
# A worker's compile that takes longer is given up (the kernel compiles here instead) and the
# pool is not used again in this process: a hung worker must not hang the notebook.
WORKER_TIMEOUT_S = 300.0


CACHE_ENV = "TRITON_CACHE_DIR"


def pin_cache_dir() -> str | None:
    """Set $TRITON_CACHE_DIR, where unset, to the folder Triton uses now, and return it (None
    without Triton). torch.compile sets it to a folder of its own the first time it runs a
    kernel; a process (or a worker) that started before then would write the kernels to one
    folder and a notebook look them up in another, compiling all of them again. Called before
    workers start and for the environment the runner gives notebook kernels."""
    if os.environ.get(CACHE_ENV):
        return os.environ[CACHE_ENV]
    try:
        from triton import knobs

        folder = knobs.cache.dir
    except Exception:  # noqa: BLE001 - no Triton, or one without knobs: nothing to pin
        return None
    if folder:
        os.environ[CACHE_ENV] = str(folder)
    return folder or None


def workers() -> int:
    """Worker processes: $K3LAB_COMPILE_WORKERS, else one per core (at most 8)."""
    env = os.environ.get(WORKERS_ENV, "").strip()
    if env:
        if not env.isdigit():
            raise ValueError(f"${WORKERS_ENV}: expected a count of worker processes (0: none), "
                             f"got {env!r}")
        return int(env)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, min(8, cores or 1))


@dataclass
class Stats:
    """What one :func:`ahead` did: kernels compiled (in a worker, or in a thread here when the
    compile could not be sent), calls and compiles that failed, and its wall time."""

    kernels: int = 0
    in_workers: int = 0
    calls: int = 0
    failed_calls: int = 0
    failed_compiles: int = 0
    seconds: float = 0.0
    skipped: str = ""
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, name: str) -> None:
        with self._lock:
            setattr(self, name, getattr(self, name) + 1)


# ---------------------------------------------------------------- the worker side

def _kernel(module: str, name: str):
    """The @triton.jit function a module names: itself, or the one under the module
    attribute's Autotuner / Heuristics wrappers (each holds what it wraps as ``.fn``)."""
    from triton.runtime.jit import JITFunction

    obj = getattr(sys.modules.get(module) or importlib.import_module(module), name, None)
    for _ in range(8):
        if obj is None or isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def _compile_in_worker(spec: dict) -> bool:
    """Compile one kernel into Triton's cache (a worker process)."""
    import triton
    from triton.compiler import ASTSource

    jit = _kernel(spec["module"], spec["name"])
    src = ASTSource(jit, spec["signature"], spec["constexprs"], spec["attrs"])
    triton.compile(src, target=spec["target"], options=spec["options"],
                   _env_vars=spec["env_vars"])
    return True


def _worker_ready() -> int:
    """A worker's first task (:func:`start_workers`): import Triton's compiler and the
    kernels, which every compile it gets needs."""
    import triton.compiler  # noqa: F401

    with contextlib.suppress(Exception):
        importlib.import_module("k3lab.kernels")
    return os.getpid()


def _spec(compile_fn: Callable) -> dict | None:
    """What a worker needs to repeat the compile Triton's JIT queued as ``compile_fn`` (a
    closure over src, target, options and env_vars), or None when it does not fit."""
    code, cells = getattr(compile_fn, "__code__", None), getattr(compile_fn, "__closure__", None)
    if code is None or cells is None:
        return None
    free = dict(zip(code.co_freevars, (c.cell_contents for c in cells), strict=True))
    src = free.get("src")
    jit = getattr(src, "fn", None)
    py = getattr(jit, "fn", None)
    if src is None or py is None or "target" not in free or "options" not in free:
        return None
    module, name = py.__module__, py.__name__
    if _kernel(module, name) is not jit:  # only kernels a worker can import by name
        return None
    return {"module": module, "name": name, "signature": src.signature,
            "constexprs": src.constants, "attrs": src.attrs, "target": free["target"],
            "options": dict(free["options"].__dict__), "env_vars": free.get("env_vars")}


_POOL: cf.ProcessPoolExecutor | None = None
_POOL_LOCK = threading.Lock()
_GAVE_UP = False  # a worker timed out: compile here from now on


def _pool(n: int) -> cf.ProcessPoolExecutor | None:
    """The process's worker pool, started once (spawned: no CUDA state crosses)."""
    global _POOL
    if n <= 0:
        return None
    pin_cache_dir()
    with _POOL_LOCK:
        if _POOL is None:
            import multiprocessing as mp

            _POOL = cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"))
            atexit.register(_POOL.shutdown, wait=False, cancel_futures=True)
        return _POOL


def start_workers(n_workers: int | None = None) -> int:
    """Start this process's compile workers (:func:`ahead`'s pool) and have each import what a
    compile needs, returning at once: a notebook kernel started ahead of its notebook calls it
    (``k3lab.kernelenv.PRELOAD_CALLS``), so that the notebook's first :func:`ahead` does not wait
    for processes to start. Returns the number of workers asked for."""
    n = workers() if n_workers is None else n_workers
    pool = _pool(n)
    if pool is None:
        return 0
    for _ in range(n):  # a submit with no idle worker starts one more
        pool.submit(_worker_ready)
    return n


class _SendToWorkers(cf.Executor):
    """The executor Triton's AsyncCompileMode submits compiles to: each compile goes to a
    worker process, then the kernel is loaded here from the cache (and its launcher stub
    built) in a thread."""

    def __init__(self, pool: cf.ProcessPoolExecutor | None, threads: cf.ThreadPoolExecutor,
                 stats: Stats, timeout_s: float = WORKER_TIMEOUT_S):
        self.pool, self.threads, self.stats, self.timeout_s = pool, threads, stats, timeout_s

    def submit(self, fn, /, *args, **kwargs):
        spec = None
        if self.pool is not None and not _GAVE_UP:
            with contextlib.suppress(Exception):
                spec = _spec(fn)

        def run():
            global _GAVE_UP
            self.stats.add("kernels")
            if spec is not None and not _GAVE_UP:
                try:
                    self.pool.submit(_compile_in_worker, spec).result(timeout=self.timeout_s)
                    self.stats.add("in_workers")
                except cf.TimeoutError:
                    _GAVE_UP = True
                except Exception:  # noqa: BLE001 - compiled here instead, below
                    pass
            try:
                kernel = fn(*args, **kwargs)  # a cache load when a worker compiled it
            except Exception:
                self.stats.add("failed_compiles")
                raise
            with contextlib.suppress(Exception):  # the C launcher stub, built once per signature
                from triton.runtime import driver

                driver.active.launcher_cls(kernel.src, kernel.metadata)
            return kernel

        return self.threads.submit(run)


@contextlib.contextmanager
def _compile_only():
    """Every Triton launch a warm-up: compiled (here, queued), never run."""
    import triton.runtime.jit as jit

    run = jit.JITFunction.run

    def compile_only(self, *args, grid, warmup, **kw):
        return run(self, *args, grid=grid, warmup=True, **kw)

    jit.JITFunction.run = compile_only
    try:
        yield
    finally:
        jit.JITFunction.run = run


def ahead(calls: Iterable[Callable[[], Any]], n_workers: int | None = None) -> Stats:
    """Run ``calls`` (each a sweep point's launches) compile-only and compile every kernel they
    launch, ``n_workers`` processes at once (default :func:`workers`; 0: threads here). Where
    the kernels run interpreted, or Triton has no async compile, nothing runs."""
    stats, t0 = Stats(), time.perf_counter()
    from k3lab.kernels import INTERPRETED

    if INTERPRETED:
        stats.skipped = "the kernels run under the interpreter"
        return stats
    try:
        from triton.runtime._async_compile import AsyncCompileMode
    except ImportError:
        stats.skipped = "this Triton has no AsyncCompileMode"
        return stats
    n = workers() if n_workers is None else n_workers
    with cf.ThreadPoolExecutor(max(2, n)) as threads:
        executor = _SendToWorkers(_pool(n), threads, stats)
        with _compile_only(), AsyncCompileMode(executor, ignore_errors=True):
            for call in calls:
                stats.add("calls")
                try:
                    call()
                except Exception:  # noqa: BLE001 - its kernels compile at their first launch
                    stats.add("failed_calls")
    stats.seconds = time.perf_counter() - t0
    return stats


# ---------------------------------------------------------------- kernel lists

LIST_ENV = "K3LAB_KERNEL_LIST"  # a notebook's kernel appends the kernels it compiles here
LIST_SUFFIX = ".kernels.jsonl"  # beside a report: what its notebook compiled, one per line
NICE = 10  # the warming workers yield the cores to the notebook that runs


def _listed(fn, compile: dict) -> str | None:
    """One list line for a compile Triton's post-compile hook reports, or None for a kernel a
    worker cannot import by name (Inductor's generated kernels, a closure)."""
    jit = getattr(fn, "jit_function", None)
    module, name = getattr(fn, "module", None), getattr(fn, "name", None)
    if jit is None or sys.modules.get(module or "") is None or _kernel(module, name or "") \
            is not jit:
        return None
    if not _importable(module):  # a module made at run time (Inductor's code cache)
        return None
    from triton.runtime import driver

    target = driver.active.get_current_target()
    return json.dumps({"module": module, "name": name,
                       "target": [target.backend, target.arch, target.warp_size],
                       "data": compile["specialization_data"]})


@functools.cache
def _importable(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def record(path: str | os.PathLike | None = None) -> bool:
    """From now on append every Triton kernel this process compiles or loads from the cache
    (Triton's ``jit_post_compile_hook``) to ``path`` (default ``$K3LAB_KERNEL_LIST``; unset:
    nothing). False where nothing is recorded. A kernel's notebook calls it as it starts."""
    path = path if path is not None else os.environ.get(LIST_ENV)
    if not path:
        return False
    try:
        from triton import knobs
    except ImportError:
        return False
    chained = knobs.runtime.jit_post_compile_hook
    lock = threading.Lock()

    def hook(**kw):
        with contextlib.suppress(Exception):  # a list is a speed-up, never a failure
            line = _listed(kw.get("fn"), kw.get("compile") or {})
            if line is not None:
                with lock, open(path, "a") as f:
                    f.write(line + "\n")
        return chained(**kw) if chained is not None else None

    knobs.runtime.jit_post_compile_hook = hook
    _note_front_ends(built_path(path), lock)
    return True


def built_path(recorded: str | os.PathLike) -> Path:
    """Beside a recorded list ``x.tmp``: ``x_built.tmp``, the names of the kernels whose front
    end ran in the recording process (a temp file of the same kind)."""
    p = Path(recorded)
    return p.with_name(f"{p.stem}_built{p.suffix}")


_NOTED: dict = {}  # the file front ends are noted in, and ASTSource.make_ir as Triton has it


def _note_front_ends(path: Path, lock: threading.Lock) -> None:
    """Append to ``path`` the name of every kernel whose front end (``ASTSource.make_ir``) runs
    in this process: a compile that neither the cache nor a worker spared it. A later call
    moves the notes to its own file."""
    with contextlib.suppress(Exception):
        from triton.compiler import ASTSource

        _NOTED["path"], _NOTED["lock"] = path, lock
        if "make_ir" in _NOTED:
            return
        make_ir = _NOTED["make_ir"] = ASTSource.make_ir

        def noted(self, *args, **kwargs):
            with contextlib.suppress(Exception), _NOTED["lock"], open(_NOTED["path"], "a") as f:
                f.write(f"{getattr(self.fn, '__name__', '?')}\n")
            return make_ir(self, *args, **kwargs)

        ASTSource.make_ir = noted


def built_here(recorded: str | os.PathLike) -> dict[str, int]:
    """Per kernel name, how often its front end ran in the process that recorded ``recorded``
    (:func:`record`), most first; empty when none ran or nothing was recorded."""
    counts: dict[str, int] = {}
    with contextlib.suppress(OSError):
        for name in built_path(recorded).read_text().split():
            counts[name] = counts.get(name, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: -kv[1]))


def read_list(path: str | os.PathLike) -> list[dict]:
    """The lines of a kernel list, each once, in order; unreadable lines are skipped."""
    seen, out = set(), []
    with contextlib.suppress(OSError):
        for text in Path(path).read_text().splitlines():
            with contextlib.suppress(ValueError):
                line = json.loads(text)
                key = (line["module"], line["name"], line["data"])
                if key not in seen and isinstance(line.get("target"), list):
                    seen.add(key)
                    out.append(line)
    return out


def keep_list(recorded: str | os.PathLike, dest: str | os.PathLike) -> bool:
    """Write what ``recorded`` holds (each kernel once) to ``dest``, replacing it atomically;
    nothing when nothing was recorded (a CPU run, under the interpreter). True if written."""
    lines = read_list(recorded)
    if not lines:
        return False
    from k3lab.report import atomic_write_text

    atomic_write_text(Path(dest), "".join(json.dumps(line) + "\n" for line in lines))
    return True


def _compile_listed(line: dict) -> bool:
    """Compile one list line into Triton's cache (a warming worker): Triton's own
    ``JITFunction.preload`` decoding, for the recorded target instead of the active device."""
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    jit = _kernel(line["module"], line["name"])
    data = json.loads(line["data"])

    def tuples(v):
        return tuple(tuples(x) for x in v) if isinstance(v, list) else v

    constexprs = {tuple(k): tl.dtype(v) if tl.dtype.is_dtype(v) else
                  tl.constexpr(v["constexpr"]) if isinstance(v, dict) and "constexpr" in v else v
                  for k, v in zip(data["constant_keys"], data["constant_vals"], strict=True)}
    attrs = dict(zip(map(tuple, data["attrs_keys"]), data["attrs_vals"], strict=True))
    signature = {k: tuples(v) for k, v in data["signature"].items()}
    options = {k: tuple(v) if isinstance(v, list) else v for k, v in data["options"].items()}
    triton.compile(ASTSource(jit, signature, constexprs, attrs),
                   target=GPUTarget(*line["target"]), options=options)
    return True


@dataclass
class Warm:
    """A background compile of kernel lists: ``futures`` per line, ``labels`` the list each
    came from; :meth:`close` cancels what has not started (the batch is over) and lets the
    running compiles finish on their own."""

    pool: cf.ProcessPoolExecutor | None
    futures: list = field(default_factory=list)
    labels: list = field(default_factory=list)
    started: float = field(default_factory=time.monotonic)
    _ended: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        for f in self.futures:
            f.add_done_callback(lambda f: self._ended.setdefault(id(f), time.monotonic()))

    def counts(self) -> dict:
        done = [f for f in self.futures if f.done() and not f.cancelled()]
        failed = sum(f.exception() is not None for f in done)
        return {"listed": len(self.futures), "compiled": len(done) - failed, "failed": failed}

    def ready_after(self) -> dict[str, float]:
        """Per list label whose every line is done: seconds from the start of the warm to the
        end of its last compile (when a notebook starting later finds all of its kernels)."""
        out: dict[str, list] = {}
        for f, label in zip(self.futures, self.labels, strict=True):
            out.setdefault(label, []).append(self._ended.get(id(f)) if f.done()
                                             and not f.cancelled() else None)
        return {k: max(v) - self.started for k, v in out.items() if None not in v}

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=False, cancel_futures=True)


def warm(lists: Iterable[str | os.PathLike], n_workers: int | None = None) -> Warm:
    """Start compiling, in niced worker processes, the kernels the kernel ``lists`` name (what
    each notebook compiled at its last run into the folder), in the lists' order, and return at
    once. The compiles land in Triton's on-disk cache, where a notebook that needs a kernel
    later finds it; a kernel whose source or signature has changed since simply compiles at
    its first launch again. Nothing starts without lines or workers. Each line is labelled
    with its list's name less :data:`LIST_SUFFIX` (the notebook's)."""
    t0 = time.monotonic()
    lines = [(Path(p).name.removesuffix(LIST_SUFFIX), line) for p in lists
             for line in read_list(p)]
    n = min(workers() if n_workers is None else n_workers, len(lines))
    if n <= 0:
        return Warm(None)
    pin_cache_dir()  # the workers and the notebooks (which inherit it) share one folder
    import multiprocessing as mp

    pool = cf.ProcessPoolExecutor(n, mp_context=mp.get_context("spawn"), initializer=os.nice,
                                  initargs=(NICE,))
    atexit.register(pool.shutdown, wait=False, cancel_futures=True)
    return Warm(pool, [pool.submit(_compile_listed, line) for _, line in lines],
                [label for label, _ in lines], t0)
