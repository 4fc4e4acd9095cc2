"""Notebooks of one batch run concurrently: ``jobs`` slots, each with a worker process of its
own (the kernel environment a notebook needs never crosses another's), one GPU per slot on a
host with several (``CUDA_VISIBLE_DEVICES``), and all slots sharing the CPU or the one GPU
otherwise."""

from __future__ import annotations

import concurrent.futures as cf
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["gpu_slots", "run_slots"]


def gpu_slots(device: str, jobs: int) -> list[str | None]:
    """The GPU each of ``jobs`` slots sees (None: what the process sees, all slots alike)."""
    if not str(device).startswith("cuda"):
        return [None] * jobs
    import torch

    n = torch.cuda.device_count()
    return [str(i % n) for i in range(jobs)] if n > 1 else [None] * jobs


def _init_worker(gpu: str | None) -> None:
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu


def run_slots(tasks: list[tuple], slots: list[str | None], fn: Callable[..., Any],
              on_done: Callable[[int, Any, str | None], None],
              on_error: Callable[[int, BaseException], Any]) -> bool:
    """Run ``fn(*args)`` for every ``(i, args)`` of ``tasks`` over the slots, in task order as
    slots free up; ``on_done(i, result, gpu)`` as each ends (under a lock), ``on_error(i, exc)``
    giving the result of a task whose worker failed. Returns False when a Ctrl-C stopped the
    batch: it reaches the workers too (one process group), whose notebooks stop and clean up;
    tasks not started are dropped."""
    import multiprocessing as mp

    pending: queue.SimpleQueue = queue.SimpleQueue()
    for task in tasks:
        pending.put(task)
    stop, lock = threading.Event(), threading.Lock()
    ctx = mp.get_context("spawn")  # a clean interpreter: no inherited threads or CUDA state
    pools = [cf.ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker,
                                    initargs=(gpu,)) for gpu in slots]

    def slot(pool, gpu):
        while not stop.is_set():
            try:
                i, args = pending.get_nowait()
            except queue.Empty:
                return
            try:
                result = pool.submit(fn, *args).result()
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
