"""Notebooks of one batch run concurrently: ``jobs`` slots, each with a worker process of its
own (the kernel environment a notebook needs never crosses another's): on the CPU, slots share
it; on CUDA, one slot per GPU (``CUDA_VISIBLE_DEVICES``), never more slots than GPUs. Or, with
the ray extra, one Ray task per notebook over a cluster's GPUs, the report files sent back to
the driver's output folder."""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import signal
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["gpu_slots", "run_slots", "cpu_threads", "THREAD_VARS"]


def gpu_slots(device: str, jobs: int) -> list[str | None]:
    """The GPU each slot sees (None: what the process sees). A CUDA run gets at most one slot
    per GPU: two notebooks timing on one GPU would disturb each other's figures."""
    if not str(device).startswith("cuda"):
        return [None] * jobs
    import torch

    n = torch.cuda.device_count()
    return [str(i) for i in range(min(jobs, n))] if n > 1 else [None]


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")


def cpu_threads(slots: int) -> int:
    """Threads a notebook's kernel gets when ``slots`` notebooks share this machine's cores:
    torch's intra-op pools of concurrent kernels would otherwise each take every core."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // max(1, slots))


def _init_worker(gpu: str | None, threads: int | None = None) -> None:
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    if threads is not None:  # inherited by the notebook's kernel; a user's own setting wins
        for var in THREAD_VARS:
            os.environ.setdefault(var, str(threads))
    # an idle worker ignores Ctrl-C (else it dies printing a traceback); a task takes it
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _task(fn: Callable[..., Any], *args) -> Any:
    """fn(*args) in a worker with Ctrl-C on: the notebook stops and cleans up, and the
    KeyboardInterrupt reaches the batch through the future."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        return fn(*args)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def run_slots(tasks: list[tuple], slots: list[str | None], fn: Callable[..., Any],
              on_done: Callable[[int, Any, str | None], None],
              on_error: Callable[[int, BaseException], Any],
              threads: int | None = None) -> bool:
    """Run ``fn(*args)`` for every ``(i, args)`` of ``tasks`` over the slots, in task order as
    slots free up; ``on_done(i, result, gpu)`` as each ends (under a lock), ``on_error(i, exc)``
    giving the result of a task whose worker failed. ``threads``: the CPU threads each worker's
    notebooks may use (``OMP_NUM_THREADS``, unless already set; None: no limit). Returns False
    when a Ctrl-C stopped the batch: it reaches the workers too (one process group), whose
    notebooks stop and clean up; tasks not started are dropped."""
    import multiprocessing as mp

    pending: queue.SimpleQueue = queue.SimpleQueue()
    for task in tasks:
        pending.put(task)
    stop, lock = threading.Event(), threading.Lock()
    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads or CUDA state
    pools = [cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker,
                                    initargs=(gpu, threads)) for gpu in slots]

    def slot(pool, gpu):
        while not stop.is_set():
            try:
                i, args = pending.get_nowait()
            except queue.Empty:
                return
            try:
                result = pool.submit(_task, fn, *args).result()
            except KeyboardInterrupt:  # Ctrl-C reached the worker too: it cleaned up and
                stop.set()             # left its notebook's last good report as it was
                return
            except Exception as exc:  # the worker died or could not start
                result = on_error(i, exc)
            with lock:
                on_done(i, result, gpu)

    threads = [threading.Thread(target=slot, args=(p, g), daemon=True)
               for p, g in zip(pools, slots, strict=True)]
    for t in threads:
        t.start()
    completed = True
    try:
        while any(t.is_alive() for t in threads):
            for t in threads:
                t.join(timeout=0.2)  # short joins: the main thread keeps getting Ctrl-C
    except KeyboardInterrupt:
        completed = False
        stop.set()
        for t in threads:
            t.join()
    finally:
        for p in pools:
            p.shutdown(wait=True, cancel_futures=True)
    return completed and not stop.is_set()


# ---------------------------------------------------------------- Ray

def _remote_run(source: str, name: str, args: tuple, origin: str) -> tuple:
    """On a Ray worker: run the notebook (its source text) into a temp folder; returns the
    Result and every file written there (relative path -> bytes) for the driver to place."""
    import tempfile
    from pathlib import Path

    from k3lab import runner

    params, options, timeout, hide_code = args
    with tempfile.TemporaryDirectory(prefix="k3lab-ray-") as d:
        src, out = Path(d) / "src" / f"{name}.ipynb", Path(d) / "out"
        src.parent.mkdir()
        out.mkdir()
        src.write_text(source, encoding="utf-8")
        res = runner._run_one(src, out, params, options, timeout, hide_code, source=origin)
        files = {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    res.notebook = res.html = res.metrics = None
    return res, files


def _place(out, name: str, res, files: dict) -> None:
    """Write a Ray task's files into ``out`` as a local run would leave them: a good run
    replaces the report and clears its failure files, a failed one leaves the report alone."""
    from k3lab import report

    for rel, data in sorted(files.items(), key=lambda kv: kv[0].endswith(".metrics.json")):
        path = out / rel
        if rel.startswith("_assets/") and path.exists():
            continue  # content-named: the same name is the same stylesheet
        report.atomic_write_text(path, data.decode("utf-8"))
    from k3lab import runner

    if res.ok:
        for suffix in (".failed.ipynb", ".failed.html", ".failed.json"):
            (out / f"{name}{suffix}").unlink(missing_ok=True)
        runner._remove_traces(out, name, list(files), failed=False)  # an older run's traces
        runner._remove_traces(out, name, [], failed=True)
        res.notebook, res.html = out / f"{name}.ipynb", out / f"{name}.html"
        res.metrics = out / f"{name}.metrics.json"
    else:
        runner._remove_traces(out, name, list(files), failed=True)
        res.metrics = out / f"{name}.failed.json" if f"{name}.failed.json" in files else None


def run_ray(tasks: list[tuple], address: str, gpu: bool, out,
            on_done: Callable[[int, Any, str | None], None],
            on_error: Callable[[int, BaseException], Any]) -> bool:
    """Run every ``(i, (path, params, options, timeout, hide_code))`` of ``tasks`` as a Ray task
    asking for one GPU (``gpu``) or one CPU, on the cluster at ``address`` ("local": start one
    on this machine); the files come back to ``out``. Every node must have this checkout
    installed at the same commit. Returns False when a Ctrl-C stopped the batch."""
    try:
        import ray
    except ImportError as exc:
        raise RuntimeError("--ray needs the ray extra: pip install -e '.[ray]'") from exc

    if address == "local":
        ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False)
    else:
        ray.init(address=address, log_to_driver=False, configure_logging=False)
    remote = ray.remote(num_gpus=1 if gpu else 0, num_cpus=0 if gpu else 1)(_remote_run)
    try:
        refs = {remote.remote(p.read_text(encoding="utf-8"), p.stem, tuple(rest), str(p)):
                (i, p.stem) for i, (p, *rest) in tasks}
        pending = list(refs)
        try:
            while pending:
                ready, pending = ray.wait(pending, num_returns=1)
                i, name = refs[ready[0]]
                try:
                    res, files = ray.get(ready[0])
                    _place(out, name, res, files)
                except Exception as exc:  # the task or its node failed
                    res = on_error(i, exc)
                on_done(i, res, None)
        except KeyboardInterrupt:
            for ref in pending:
                ray.cancel(ref, force=True)
            return False
        return True
    finally:
        ray.shutdown()
