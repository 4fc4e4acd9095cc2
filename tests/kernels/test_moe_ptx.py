"""The MoE stage-2 + tail kernel compiled for sm_90 without a GPU (a subprocess with the kernels
imported compiled): the memory ordering the launches rely on, the PDL wait's place and the
evict_first hints on the expert weights must survive the Triton version in use. Skipped where
no sm_90 toolchain (ptxas) is installed."""

import os
import re
import subprocess
import sys

import pytest

# The scripts: the imports, stage 2's (and the tail's) launch arguments kw at the tiny preset,
# then the compile, which prints the PTX.
_IMPORTS = r"""
import os
os.environ["TRITON_INTERPRET"] = "0"  # the compiled path (tensor-core tiles, inline PTX)
import torch, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from k3lab.config import preset
from k3lab.kernels.moe import MoEConfig, launch
from k3lab.reference.route import route_sort_reference
from k3lab.weights import make_generator, moe_weights, hidden_states, randn

"""
_COMPILE = r"""
fn = launch._moe_stage2_tail_kernel
names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.int32: "i32", torch.uint8: "u8"}
sig, const = {}, {}
for p in fn.params:
    v = kw[p.name]
    if p.is_constexpr:
        sig[p.name], const[p.name] = "constexpr", v
    elif isinstance(v, torch.Tensor):
        sig[p.name] = "*" + names[v.dtype]
    else:
        sig[p.name] = "fp32" if isinstance(v, float) else "i32"
k = triton.compile(ASTSource(fn, sig, const), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": launch.NUM_WARPS})
print(k.asm["ptx"])
"""


def _stage2_setup(m: int, config: str = "MoEConfig()") -> str:
    """Script lines: the tiny preset's MXFP4 experts, a plan of ``m`` tokens in tiles of ``m``,
    and stage 2's arguments for them (``stage2``) under ``config``."""
    return f"""
config = {config}
cfg = preset("tiny")
gen = make_generator(0, "cpu")
w = moe_weights(cfg, gen, expert_format="mxfp4")
x = hidden_states(cfg, {m}, gen)
plan = route_sort_reference(x, w["gate_weight"], w["correction_bias"], top_k=cfg.top_k,
                            n_group=cfg.n_group, topk_group=cfg.topk_group, block_m={m},
                            out_dim=cfg.moe_in)
a = randn(({m} * cfg.top_k, cfg.moe_intermediate), gen)
stage2 = launch._stage2_args(config, a, plan, w["w2"], False, {m} * cfg.top_k)
"""


# stage 2 and the tail in one launch, 2 tokens
_FUSED_SCRIPT = _IMPORTS + _stage2_setup(2) + r"""
sa = randn((2, cfg.shared_intermediate), gen)
tail = launch._tail_args(config, stage2[2], w["latent_norm"], w["latent_up"], None, sa,
                         w["shared_w2"], cfg.rms_eps)
kw, _ = launch._stage2_tail_kwargs(config, stage2, tail, torch.zeros(2, dtype=torch.int32))
""" + _COMPILE


def _stage2_b1(config: str = "MoEConfig()") -> str:
    """Stage 2 alone at B1 (compiled tensor-core tiles): the kernel's arguments kw."""
    return _stage2_setup(1, config) + r"""
kw, _ = launch._stage2_tail_kwargs(config, stage2, None)
assert kw["USE_MMA"] and kw["ASM"], kw  # compiled tensor-core tiles
"""


_PDL_SCRIPT = _IMPORTS + _stage2_b1() + r"""
kw["PDL"] = True  # as launched with pdl=True
""" + _COMPILE


def _ptx_of(script):
    """PTX printed by ``script`` (compiled for sm_90 without a GPU); skips without a toolchain."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=600)
    tail = run.stderr[-2000:]
    # skip only for a missing toolchain (ptxas not found); a kernel that fails to compile fails
    if (run.returncode and re.search(r"FileNotFoundError|No such file|not found", tail)
            and "CompilationError" not in tail):
        pytest.skip(f"no CUDA compiler backend here: {run.stderr.strip().splitlines()[-1]}")
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def _derived_registers(lines, kernel, params):
    """PTX registers whose values derive from the kernel's parameters ``params`` (by index):
    loaded from them, or computed from such registers (a fixed point over the listing)."""
    regs: set[str] = set()
    sources = tuple(f"{kernel}_param_{i}]" for i in params)
    for _ in range(4):
        for ln in lines:
            m = re.match(r"\s*(?:@!?%\w+\s+)?[a-z][\w.]*\s+\{?\s*(%\w+)[^,]*,(.*)", ln)
            if m and (any(src in ln for src in sources)
                      or regs & set(re.findall(r"%\w+", m.group(2)))):
                regs.add(m.group(1))
    return regs


def test_pdl_ptx_orders_the_wait():
    """Stage 2 launched with PDL (compiled, sm_90): the plan's loads come before
    griddepcontrol.wait, every other load (the K loop's weights and activations) and every
    atomic after it, and the next launch is let go after it."""
    lines = _ptx_of(_PDL_SCRIPT).splitlines()
    # (the compiler may copy the wait into both sides of the tile's branch)
    wait = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    go = [i for i, ln in enumerate(lines) if "griddepcontrol.launch_dependents" in ln]
    assert wait and len(go) == len(wait), (wait, go)
    assert all(g > w for g, w in zip(go, wait, strict=True)), (wait, go)
    before, after = lines[:wait[0]], lines[wait[0]:]
    # the memory the previous launch writes: a (parameter 0) and y (parameter 9)
    written = _derived_registers(lines, "_moe_stage2_tail_kernel", (0, 9))

    def touches(ln):
        addr = re.search(r"\[\s*(%\w+)", ln)
        return (("ld.global" in ln or "atom." in ln or "red." in ln) and addr is not None
                and addr.group(1) in written)
    assert any("ld.global" in ln for ln in before)  # the plan
    assert not [ln for ln in before if touches(ln) or "atom." in ln or "red." in ln]
    assert any(touches(ln) and "ld.global" in ln for ln in after)  # a, after the wait
    assert any(touches(ln) and ("atom." in ln or "red." in ln) for ln in after)


@pytest.mark.parametrize("evict", [True, False], ids=["evict_first", "default"])
def test_stage2_weight_loads_evict_first(evict):
    """``stage2_evict_first`` (compiled tensor-core tiles, sm_90): every load of the expert
    weights (parameter p_w) carries the L1 evict_first policy and an L2 evict_first cache hint,
    and the activations' loads (p_a) do not; switched off, none does. (At the tiny preset the
    loads are 4-byte ones; at K3 sizes 16-byte ones.)"""
    script = _IMPORTS + _stage2_b1(f"MoEConfig(stage2_evict_first={evict})") + _COMPILE
    lines = _ptx_of(script).splitlines()
    kernel = "_moe_stage2_tail_kernel"
    from_w = _derived_registers(lines, kernel, (1,)) - _derived_registers(lines, kernel, (0,))
    from_a = _derived_registers(lines, kernel, (0,))

    def loads(regs):
        return [ln for ln in lines if "ld.global" in ln
                and (m := re.search(r"\[\s*(%\w+)", ln)) and m.group(1) in regs]
    w_loads, a_loads = loads(from_w), loads(from_a)
    assert w_loads and a_loads
    hinted = ["L1::evict_first.L2::cache_hint" in ln for ln in w_loads]
    assert all(hinted) if evict else not any(hinted), w_loads
    assert not any("evict_first" in ln for ln in a_loads), a_loads
    assert ("createpolicy.fractional.L2::evict_first" in "\n".join(lines)) == evict


def test_fused_tail_ptx_orders_memory():
    """The compiled stage-2 + tail launch keeps its ordering: stage-2 tiles signal with a release
    RMW, tail tiles poll and then acquire before reading y. (Triton 3.6, the H200's, drops an
    acquire atomic_add of 0 whose value is unused: the poll then had no acquire at all.)"""
    ptx = _ptx_of(_FUSED_SCRIPT)
    assert re.search(r"(atom|red)\.global\.gpu\.release\.add", ptx), "no release RMW"
    assert re.search(r"(atom\.global\.gpu\.acquire|ld\.global\.gpu\.acquire)", ptx), (
        "no acquire after the poll")
    assert "ld.volatile.global" in ptx  # the poll


_ZERO_PDL_SCRIPT = _IMPORTS + _stage2_b1().replace(
    f"{1} * cfg.top_k)", "1 * cfg.top_k, zero=True)") + r"""
assert kw["ZERO_Y"], kw
kw["PDL"] = True  # as launched with pdl=True
""" + _COMPILE


def test_self_zeroing_stage2_ptx_orders_memory():
    """The self-zeroing atomic stage 2 (moe_stage2's launch), with PDL: no atomic (ticket, zero
    flag, adds) and no store to y before griddepcontrol.wait (the previous launch may still
    read y or reset the counters); the zeroing signals with a release, the adds wait for it with
    an acquire, and the done count is an acq_rel RMW."""
    assert "zero=True" in _ZERO_PDL_SCRIPT
    ptx = _ptx_of(_ZERO_PDL_SCRIPT)
    lines = ptx.splitlines()
    wait = [i for i, ln in enumerate(lines) if "griddepcontrol.wait" in ln]
    assert wait, "no griddepcontrol.wait"
    before = lines[:wait[0]]
    assert not [ln for ln in before if "atom." in ln or "red." in ln or "st.global" in ln]
    assert re.search(r"atom\.global\.gpu\.release\.exch", ptx), "no release exchange (flag)"
    assert re.search(r"atom\.global\.gpu\.acquire\.max", ptx), "no acquire after the poll"
    assert re.search(r"atom\.global\.gpu\.acq_rel\.add", ptx), "no acq_rel done count"
    assert "ld.volatile.global" in ptx  # the poll
