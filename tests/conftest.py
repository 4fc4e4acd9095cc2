"""Test setup: Triton runs under its interpreter unless a GPU is present, and fresh allocations
are filled with NaN (ints with their max value) so a kernel that reads memory it never wrote
fails its comparison."""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# a notebook cell of the tests takes seconds: a cell whose reply is lost fails in minutes rather
# than holding the suite forever (k3lab.runner.TIMEOUT_ENV; the workers' processes inherit it)
os.environ.setdefault("K3LAB_CELL_TIMEOUT", "300")

if os.environ.get("PYTEST_XDIST_WORKER"):  # one torch thread a worker: workers share the cores
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _nan_fill_fresh_allocations():
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(False)


@pytest.fixture
def device():
    """The device the kernel tests run on: CUDA when present, else the CPU interpreter."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pytest_collection_modifyitems(config, items):
    gpu = torch.cuda.is_available()
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device (GPU-only test)")
    skip_cpu = pytest.mark.skip(reason="runs Triton on CPU tensors: interpreter-only test")
    for item in items:
        if "gpu" in item.keywords and not gpu:
            item.add_marker(skip_gpu)
        if "interpreter" in item.keywords and os.environ.get("TRITON_INTERPRET") != "1":
            item.add_marker(skip_cpu)
