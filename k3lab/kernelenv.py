"""The Jupyter kernel a notebook runs in: its environment, its start-up lines, the standby
kernel a sequential batch starts ahead of the next notebook, and the client that waits for its
messages."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

import k3lab
from k3lab import hostprofile, precompile

__all__ = ["KERNEL_NAME", "KERNEL_ARGS", "POLL_SLICE_S", "PRELOAD", "PRELOAD_CALLS",
           "PRELOAD_DEVICES", "PRELOAD_ENV", "Standby", "check_kernel", "client_class", "environ",
           "env", "manager", "repo_root", "shutdown"]

KERNEL_NAME = "python3"

# What every notebook's first cell imports, and torch.compile's compiler, which the peers and
# the launch counting (through torch's dispatch modes) import (never ``k3lab.kernels``:
# ``studies.setup`` chooses its device first). A kernel imports them as it starts, so the
# standby kernel a sequential batch starts for the next notebook has them loaded by the time
# that notebook runs. A kernel started when its notebook starts has nothing to overlap and
# skips it (the notebook imports what it needs), and so does a CPU run's standby: there the
# notebook before it needs the cores.
PRELOAD_ENV = "K3LAB_PRELOAD"
PRELOAD_DEVICES = ("cuda",)
PRELOAD = ("torch", "triton", "numpy", "pandas", "matplotlib.pyplot", "IPython.display",
           "ipywidgets", "torch._inductor.compile_fx", "k3lab.plots", "k3lab.report",
           "k3lab.profile", "k3lab.studies", "k3lab.traces")
# then started: Inductor's compile workers (its first torch.compile would start them) and the
# Triton compile workers of k3lab.precompile.ahead (a notebook's first sweep would)
PRELOAD_CALLS = ("torch._inductor.async_compile:maybe_warm_pool",
                 "k3lab.precompile:start_workers")
# the kernel's own log (start-up warnings, the ZMQ trace of a kernel stopped by a timeout) would
# break the one-line-per-notebook progress; a cell's errors still reach the report
KERNEL_ARGS = ["--IPKernelApp.log_level=CRITICAL",
               # tables for people: floats to the digits a reader uses (k3lab.readable.human);
               # a preload that fails leaves the import, and its error, to the notebook's cell
               "--IPKernelApp.exec_lines=import k3lab.readable as _k3r; _k3r.human_tables(); "
               f"del _k3r; __import__('k3lab').preload({list(PRELOAD)!r}, '{PRELOAD_ENV}', "
               f"{list(PRELOAD_CALLS)!r}); "
               # k3lab run --profile: sample every cell (k3lab.hostprofile)
               "__import__('k3lab.hostprofile').hostprofile.start_from_env(); "
               # on a GPU: list the kernels it compiles (k3lab.precompile.record)
               "__import__('k3lab.precompile').precompile.record()"]


def repo_root() -> Path:
    return Path(k3lab.__file__).resolve().parents[1]


def environ(device: str, profile: Path | None = None,
            kernels: Path | None = None) -> dict[str, str]:
    """The environment a notebook kernel gets: this process's, with the interpreter on for the
    CPU and off for CUDA, inline plots, and this checkout importable; ``profile``: the file its
    cells' host profile goes to (:mod:`k3lab.hostprofile`); ``kernels``: the file it lists its
    compiled kernels in (:func:`k3lab.precompile.record`)."""
    env = dict(os.environ)
    env.pop(hostprofile.ENV, None)
    env.pop(PRELOAD_ENV, None)
    env.pop(precompile.LIST_ENV, None)
    if profile is not None:
        env[hostprofile.ENV] = str(profile)
    if kernels is not None:
        env[precompile.LIST_ENV] = str(kernels)
    if str(device).startswith("cpu"):
        env["TRITON_INTERPRET"] = "1"
    else:
        env.pop("TRITON_INTERPRET", None)
    env.pop("MPLBACKEND", None)  # an inherited Agg would silence the inline plots
    cache = precompile.pin_cache_dir()  # the folder the background compile fills
    if cache:
        env[precompile.CACHE_ENV] = cache
    root = str(repo_root())
    path = env.get("PYTHONPATH", "")
    if root not in path.split(os.pathsep):
        env["PYTHONPATH"] = root + (os.pathsep + path if path else "")
    return env


@contextlib.contextmanager
def env(device: str, profile: Path | None = None, kernels: Path | None = None):
    """:func:`environ` as this process's environment, which the kernel inherits."""
    saved = dict(os.environ)
    env = environ(device, profile, kernels)  # from this one, before it is cleared
    try:
        os.environ.clear()
        os.environ.update(env)
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


# The longest a client's wait for a kernel message polls its socket in one go (seconds).
POLL_SLICE_S = 1.0


@functools.cache
def client_class():
    """The notebook client's kernel client: jupyter_client's AsyncKernelClient whose channels
    wait for a message in polls of at most :data:`POLL_SLICE_S`. A ZMQ socket wakes the event
    loop on an edge, and a wake-up can be missed: a cell's reply then sits on the socket unread
    until the wait's timeout (the whole cell timeout), the kernel idle meanwhile. Each poll
    first asks the socket itself, so a missed wake-up costs one slice."""
    from queue import Empty

    from jupyter_client.asynchronous import AsyncKernelClient
    from jupyter_client.channels import AsyncZMQSocketChannel
    from traitlets import Type

    class SlicedChannel(AsyncZMQSocketChannel):
        async def get_msg(self, timeout: float | None = None):
            assert self.socket is not None
            deadline = None if timeout is None else time.monotonic() + timeout
            while True:
                left = None if deadline is None else max(0.0, deadline - time.monotonic())
                step = POLL_SLICE_S if left is None else min(POLL_SLICE_S, left)
                if await self.socket.poll(int(step * 1000)):
                    return await self._recv()
                if left is not None and left <= step:
                    raise Empty

    class SlicedClient(AsyncKernelClient):
        shell_channel_class = Type(SlicedChannel)
        iopub_channel_class = Type(SlicedChannel)
        stdin_channel_class = Type(SlicedChannel)
        control_channel_class = Type(SlicedChannel)

    return SlicedClient


def manager():
    """A manager for one notebook kernel, not started; its clients are :func:`client_class`'s.
    Its channels are Unix sockets at a path of its own: TCP ports are picked before the kernel
    binds them, and two kernels starting at once (two notebooks at once, a standby beside a
    starting notebook) could take each other's, failing one with "Address already in use"
    before it ran anything."""
    from jupyter_client.manager import AsyncKernelManager

    if os.name == "nt":  # no Unix sockets
        km = AsyncKernelManager(kernel_name=KERNEL_NAME)
    else:
        path = os.path.join(tempfile.gettempdir(), f"k3lab-kernel-{uuid.uuid4().hex[:16]}")
        km = AsyncKernelManager(kernel_name=KERNEL_NAME, transport="ipc", ip=path)
    km.client_factory = client_class()
    return km


def shutdown(km) -> None:
    """Stop a kernel this process started (nothing when it is gone already)."""
    from jupyter_core.utils import run_sync

    with contextlib.suppress(Exception):
        run_sync(km.shutdown_kernel)(now=True)


class Standby:
    """A kernel started ahead of its notebook (a sequential batch starts the next notebook's
    while one runs): its start and :data:`PRELOAD` imports, seconds of host work, overlap the
    running notebook instead of adding to the batch. Nothing it runs touches a GPU. Hand
    :meth:`take` to the notebook's run, and :meth:`close` it whatever happened."""

    def __init__(self, device: str, profile: Path | None = None, kernels: Path | None = None):
        from jupyter_core.utils import run_sync

        self._run_sync = run_sync
        self.km = manager()
        env = environ(device, profile, kernels)
        if str(device).split(":")[0] in PRELOAD_DEVICES:
            env[PRELOAD_ENV] = "1"
        run_sync(self.km.start_kernel)(extra_arguments=list(KERNEL_ARGS), cwd=str(repo_root()),
                                       env=env)

    def take(self):
        """The kernel manager for the notebook's client, or None when the kernel has died (the
        notebook then starts a kernel of its own)."""
        try:
            alive = self._run_sync(self.km.is_alive)()
        except Exception:  # noqa: BLE001 - a broken standby only costs its head start
            alive = False
        return self.km if alive else None

    def close(self) -> None:
        shutdown(self.km)


def check_kernel() -> None:
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
