"""A kernel's cache key does not depend on what the process compiled before it: under Triton's
older merge of callees' global constexprs (emulated in cache_key_check.py), keys differed with
the order they were first computed in, so the warming workers of k3lab.precompile and a
notebook disagreed and the notebook compiled again; k3lab.kernels primes every key bottom-up
as it imports (runtime.prime_cache_keys)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
STAGE1 = "k3lab.kernels.moe.stages:_moe_stage1_kernel"
MMA = "k3lab.kernels.moe.mma:_mma"
EMULATE = "k3lab.kernels.moe.mma:_mma_emulate"


def _keys(mode: str, *order: str) -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(Path(__file__).with_name("cache_key_check.py")),
                           mode, *order], capture_output=True, text=True, env=env,
                          timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU check covers it")
def test_kernel_keys_do_not_depend_on_the_order_they_are_computed_in():
    # the emulated merge reproduces the problem: a caller's key changes with its callee's turn
    early = _keys("unprimed", EMULATE, MMA)
    late = _keys("unprimed", MMA, EMULATE)
    assert early[MMA] != late[MMA]
    # primed as k3lab.kernels imports: one key whatever a process compiles first
    a = _keys("primed", STAGE1, MMA)
    b = _keys("primed", MMA, EMULATE, STAGE1)
    assert a[STAGE1] == b[STAGE1] and a[MMA] == b[MMA]
    assert a[MMA] == early[MMA]  # callees first: the complete key
