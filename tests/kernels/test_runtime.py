"""kernels/runtime.py: every launcher given CPU tensors while the kernels were imported compiled
(TRITON_INTERPRET=0 on a machine without a GPU, or the flag set only after the import) says so,
naming its first tensor, instead of failing inside Triton."""

import os
import subprocess
import sys

import pytest
import torch

SCRIPT = """
import os
import torch
import k3lab.kernels as K
from k3lab.kernels.dense.launch import dense_gemv
from k3lab.reference.route import sort_metadata_reference
assert not K.INTERPRETED
os.environ["TRITON_INTERPRET"] = "1"  # too late: the kernels are already compiled ones
bf = torch.bfloat16
x = torch.zeros(1, 32, dtype=bf)
q = torch.zeros(1, 2, 16)
plan = sort_metadata_reference(torch.tensor([[0, 1]]), torch.ones(1, 2), 4, out_dim=16)
calls = {
    "route_sort": lambda: K.route_sort(x, torch.zeros(8, 32, dtype=bf), torch.zeros(8), top_k=2),
    "gate_logits": lambda: K.gate_logits(x, torch.zeros(8, 32, dtype=bf)),
    "latent_down": lambda: K.latent_down(x, torch.zeros(16, 32, dtype=bf)),
    "moe_stage1": lambda: K.moe_stage1(torch.zeros(1, 16, dtype=bf), plan,
                                       torch.zeros(4, 16, 16, dtype=bf)),
    "moe_stage2": lambda: K.moe_stage2(torch.zeros(2, 8, dtype=bf), plan,
                                       torch.zeros(4, 16, 8, dtype=bf)),
    "latent_moe_tail": lambda: K.latent_moe_tail(torch.zeros(1, 16), torch.ones(16),
                                                 torch.zeros(32, 16, dtype=bf), eps=1e-5),
    "dense_gemv": lambda: dense_gemv(x, torch.zeros(16, 32, dtype=bf)),
    "kda_decode": lambda: K.kda_decode(q, q, q, torch.zeros(1, 4), torch.zeros(32, 4),
                                       torch.zeros(2), torch.zeros(32), torch.zeros(1, 2),
                                       torch.zeros(1, 2, 16, 16)),
    "mla_decode": lambda: K.mla_decode(torch.zeros(1, 2, 16, dtype=bf),
                                       torch.zeros(1, 2, 16, dtype=bf),
                                       torch.zeros(1, 4, 32, dtype=bf),
                                       torch.ones(1, dtype=torch.int32), sm_scale=0.1),
    "attn_res_norm": lambda: K.attn_res_norm(torch.zeros(1, 1, 32, dtype=bf),
                                             torch.zeros(1, 32, dtype=bf), torch.ones(32),
                                             torch.ones(32), torch.ones(32)),
}
for name, call in calls.items():
    try:
        call()
        print(name, "|", "no error")
    except Exception as e:  # noqa: BLE001 - the test reads the type and message
        print(name, "|", type(e).__name__, str(e).splitlines()[0])
"""
FIRST = {"route_sort": "hidden", "gate_logits": "hidden", "latent_down": "x", "moe_stage1": "z",
         "moe_stage2": "a", "latent_moe_tail": "y", "dense_gemv": "x", "kda_decode": "q",
         "mla_decode": "q_lat", "attn_res_norm": "live"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine imports compiled anyway")
def test_cpu_tensors_with_compiled_kernels():
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", SCRIPT], env=env, capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    lines = dict(line.split(" | ", 1) for line in out.stdout.splitlines() if " | " in line)
    assert set(lines) == set(FIRST), out.stdout
    for name, first in FIRST.items():
        assert lines[name].startswith(
            f"ValueError {first}: CPU tensors need the Triton interpreter"), (name, lines[name])


def test_zeroed_words_are_made_outside_a_capture_only():
    """The shared per-device int32 words (route counter, MoE stage-2 counters, persistent sync
    words, KDA tickets): made zeroed, at least ``minimum``; reused while large enough, also
    during a capture; made or grown during one: the launcher's error."""
    from k3lab.kernels.runtime import zeroed_words

    store, dev = {}, torch.device("cpu")
    with pytest.raises(ValueError, match="call it once first"):
        zeroed_words(store, dev, 4, error="x: call it once first", capturing=True)
    assert not store
    buf = zeroed_words(store, dev, 4, minimum=16, error="unused")
    assert buf.dtype == torch.int32 and buf.numel() == 16 and not buf.any()
    assert zeroed_words(store, dev, 16, error="unused", capturing=True) is buf
    with pytest.raises(ValueError, match="grown"):
        zeroed_words(store, dev, 17, error="x: not grown in a capture", capturing=True)
    assert store[dev] is buf
    assert zeroed_words(store, dev, 40, error="unused").numel() == 40


def test_an_interpreted_scalar_is_an_index_however_numpy_shapes_it():
    """A kernel argument looped over (``range(0, n, BLOCK)``) is a one-element array in the
    interpreter; NumPy 2.4 refuses ``int()`` of one that is not 0-d, as Triton up to 3.6 did."""
    import numpy as np

    from k3lab.kernels.runtime import _index

    class Handle:
        def __init__(self, data):
            self.data = data

    class Scalar:
        def __init__(self, data):
            self.handle = Handle(data)

    for data in (np.array([7], dtype=np.int32), np.array(7, dtype=np.int64),
                 np.array([[7]], dtype=np.int64)):
        assert _index(Scalar(data)) == 7
    assert list(range(0, _index(Scalar(np.array([10]))), 4)) == [0, 4, 8]
