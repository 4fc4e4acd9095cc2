"""MLA decode kernel (kernels/mla.py) against the absorbed fp32 reference and the unabsorbed SDPA
form; every MLAConfig choice; split heuristic; bad input and bad configs; GPU: K3 tp 8 sizes, no
host sync, one CUDA graph at every length."""

import math
import os
import subprocess
import sys

import pytest
import torch

from k3lab.boundaries import assert_close, get
from k3lab.config import preset
from k3lab.kernels import MLAConfig, mla_decode
from k3lab.kernels.mla import (
    COMBINE_MAX_BLOCK_S,
    MAX_SPLITS,
    _pdl,
    _score_chunks,
    default_num_splits,
)
from k3lab.reference.mla import (
    mla_decode_reference,
    mla_decode_unabsorbed,
    mla_layer_reference,
    rope_rotate,
    split_kv_b,
)
from k3lab.weights import hidden_states, make_generator, mla_cache, mla_weights, randn

# Under the interpreter the kernel computes in fp32 from the bf16 inputs: o_lat differs from
# the fp32 reference by its bf16 output conversion only, which the interpreter truncates (not
# round-to-nearest as the GPU does): up to 1 ulp = 2^-7 relative.
O_LAT_ATOL_CPU = 1e-3
O_LAT_RTOL_CPU = 2 ** -7
# On the GPU the probabilities enter the P @ C tensor-core product in bf16 as well.
O_LAT_ATOL_GPU = 1e-2
O_LAT_RTOL_GPU = 1e-2
# lse: fp32 sums of exact bf16 products, in a different order than the reference.
LSE_ATOL = 1e-3
# Absorbed fp32 reference vs the unabsorbed SDPA form (same fp32 inputs): reassociation only.
UNABSORBED_ATOL = 1e-4
# Kernel (q_lat rounded to bf16, bf16 output) projected through W_uv vs the unabsorbed form.
KERNEL_VS_UNABSORBED_ATOL = 3e-2
# Layer step with the kernel inside vs the all-reference layer (fp32 output of o_proj).
LAYER_ATOL = 2e-2

TINY = preset("tiny", 1)
K3 = preset("kimi-k3", 8)
BLOCK_N = MLAConfig().block_n


def _on(device):
    return "gpu" if torch.device(device).type == "cuda" else "cpu"


def _tol(device):
    if _on(device) == "gpu":
        return dict(atol=O_LAT_ATOL_GPU, rtol=O_LAT_RTOL_GPU)
    return dict(atol=O_LAT_ATOL_CPU, rtol=O_LAT_RTOL_CPU)


def _inputs(cfg, lens, device, *, max_len=None, seed=0):
    """q_lat, q_rope (std 1), cache [M, max_len, C + R] and seq_lens for the given lengths."""
    gen = make_generator(seed, device)
    m = len(lens)
    q_lat = randn((m, cfg.mla_heads, cfg.kv_lora), gen)
    q_rope = randn((m, cfg.mla_heads, cfg.qk_rope), gen)
    cache = mla_cache(cfg, m, max_len or max(lens), lens, gen)
    return q_lat, q_rope, cache["kv_cache"], cache["seq_lens"]


def _check(device, q_lat, q_rope, kv, lens, num_splits, sm_scale, config=None):
    o, lse = mla_decode(q_lat, q_rope, kv, lens, sm_scale=sm_scale, num_splits=num_splits,
                        return_lse=True, config=config)
    ro, rlse = mla_decode_reference(q_lat, q_rope, kv, lens, sm_scale=sm_scale, return_lse=True)
    assert o.dtype == q_lat.dtype and o.shape == q_lat.shape
    assert lse.dtype == torch.float32 and lse.shape == q_lat.shape[:2]
    assert_close("o_lat", o, ro, **_tol(device))
    assert_close("lse", lse, rlse, atol=LSE_ATOL)
    return o


# (id, preset, lengths, L_max or None (= longest), num_splits)
CASES = [
    ("M1-L1-auto", TINY, [1], 40, None),
    ("M1-L1-s4", TINY, [1], 40, 4),
    ("M1-L37-auto", TINY, [37], None, None),
    ("M1-L100-s3", TINY, [100], 130, 3),
    ("M1-L33-s64-more-splits-than-blocks", TINY, [33], None, 64),
    ("M1-L600-auto-multisplit", TINY, [600], None, None),
    ("M1-L95-s1-single-kernel", TINY, [95], None, 1),
    ("M3-mixed-s4", TINY, [97, 1, 64], 100, 4),
    ("M2-mixed-s1", TINY, [31, 65], None, 1),
    ("M4-mixed-auto", TINY, [300, 2, 129, 33], 300, None),
    ("K3tp8-M2-L300-s5", K3, [300, 45], None, 5),
]


@pytest.mark.parametrize("cfg,lens,max_len,num_splits", [c[1:] for c in CASES],
                         ids=[c[0] for c in CASES])
def test_matches_reference(device, cfg, lens, max_len, num_splits):
    q_lat, q_rope, kv, sl = _inputs(cfg, lens, device, max_len=max_len)
    _check(device, q_lat, q_rope, kv, sl, num_splits, cfg.qk_head ** -0.5)


def test_cases_cover_the_paths():
    """M1-L600-auto runs the combine kernel (more than one split)."""
    assert default_num_splits(1, TINY.mla_heads, 600, "cpu") > 1


# ~25 s each under the interpreter: "late" (the running max rescales the first step's sums)
# stays in the default selection
@pytest.mark.parametrize("loud", ["late", pytest.param("early", marks=pytest.mark.slow)])
def test_combine_rescales_across_steps(device, loud):
    """More live splits than the combine merges in one step (one block per split), with the
    largest scores in the splits of the second step ("late": the running max must rescale what
    the first step accumulated) or of the first."""
    n_splits = COMBINE_MAX_BLOCK_S + 8
    length = n_splits * BLOCK_N - 5
    q_lat, q_rope, kv, sl = _inputs(TINY, [length], device)
    rows = slice(length - 8 * BLOCK_N, None) if loud == "late" else slice(0, 8 * BLOCK_N)
    kv[:, rows] = (kv[:, rows].float() * 2.5).to(kv.dtype)
    _check(device, q_lat, q_rope, kv, sl, n_splits, TINY.qk_head ** -0.5)


def test_rows_past_length_never_read(device):
    """NaN in every cache row at or past a token's length must not reach the output."""
    q_lat, q_rope, kv, sl = _inputs(TINY, [45, 3], device, max_len=80)
    ref = mla_decode_reference(q_lat, q_rope, kv, sl, sm_scale=0.2)
    kv[0, 45:] = float("nan")
    kv[1, 3:] = float("nan")
    for ns in (1, 3, 16):
        o = mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.2, num_splits=ns)
        assert_close(f"o_lat(splits={ns})", o, ref, **_tol(device))


def test_split_count_does_not_change_result(device):
    q_lat, q_rope, kv, sl = _inputs(TINY, [257, 100], device)
    outs = {ns: mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.15, num_splits=ns).float()
            for ns in (1, 2, 7, 9, 40)}
    for ns, o in outs.items():
        assert_close(f"o_lat(splits={ns}) vs 1 split", o, outs[1], **_tol(device))


# Split-kernel choices (MLAConfig score_chunks, defer_row_sum): (chunks, defer)
VARIANTS = [(2, False), (4, False), (1, True), (4, True)]


@pytest.mark.parametrize("chunks,defer", VARIANTS, ids=[f"c{c}-d{int(d)}" for c, d in VARIANTS])
def test_variants_match_reference(device, chunks, defer):
    """Column-chunked score products and the deferred row sum: same results, on one split (the
    final output written directly), several splits, empty splits, and K3's 512 + 64 sizes."""
    config = MLAConfig(score_chunks=chunks, defer_row_sum=defer)
    for cfg, lens, max_len, ns in ((TINY, [97, 1, 64], 100, 4), (TINY, [95], None, 1),
                                   (TINY, [33], None, 64), (K3, [300, 45], None, 5)):
        q_lat, q_rope, kv, sl = _inputs(cfg, lens, device, max_len=max_len)
        _check(device, q_lat, q_rope, kv, sl, ns, cfg.qk_head ** -0.5, config)


# Launch choices (MLAConfig combine_pdl, on by default, split_pdl): (id, config). On the CPU PDL
# is off whatever the config says (CUDA only; test_interpreter_ignores_pdl), so the CPU test runs
# the combine as it is.
COMBINE_VARIANTS = [
    ("no-pdl", MLAConfig(combine_pdl=False)),
    ("pdl", MLAConfig(combine_pdl=True)),
    ("pdl2", MLAConfig(combine_pdl=True, split_pdl=True)),
    ("splitpdl", MLAConfig(combine_pdl=False, split_pdl=True)),
]
CPU_COMBINE_VARIANTS = [("default", None)]


@pytest.mark.parametrize("config", [v[1] for v in CPU_COMBINE_VARIANTS],
                         ids=[v[0] for v in CPU_COMBINE_VARIANTS])
def test_combine_variants_match_reference(device, config):
    """Combine variants: several tokens and splits, splits past the end, K3 sizes, and a zero
    length (o = 0, lse = -inf)."""
    for cfg, lens, max_len, ns in ((TINY, [97, 1, 64], 100, 4), (TINY, [33], None, 64),
                                   (TINY, [95], None, 2), (K3, [300, 45], None, 5)):
        q_lat, q_rope, kv, sl = _inputs(cfg, lens, device, max_len=max_len)
        _check(device, q_lat, q_rope, kv, sl, ns, cfg.qk_head ** -0.5, config)
    q_lat, q_rope, kv, sl = _inputs(TINY, [20, 20], device)
    sl[1] = 0
    o, lse = mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.2, num_splits=3, return_lse=True,
                        config=config)
    assert torch.all(o[1] == 0) and torch.all(lse[1] == float("-inf"))
    assert torch.isfinite(o[0].float()).all() and torch.isfinite(lse[0]).all()


def test_interpreter_ignores_pdl():
    """With both PDL choices on, the CPU (interpreter) launches are the plain ones: no
    launch_pdl and no griddepcontrol in either kernel (the interpreter fails on those), so the
    result matches the reference."""
    config = MLAConfig(combine_pdl=True, split_pdl=True)
    assert _pdl(config, on_gpu=False, final=False) == (False, False)
    assert _pdl(config, on_gpu=True, final=False) == (True, True)
    assert _pdl(config, on_gpu=True, final=True) == (False, True)
    q_lat, q_rope, kv, sl = _inputs(TINY, [40], "cpu")
    _check("cpu", q_lat, q_rope, kv, sl, 2, 0.2, config)


def test_score_chunks_clamped_and_checked():
    config = MLAConfig(score_chunks=4)
    assert _score_chunks(512, config) == 4 and _score_chunks(32, config) == 2
    assert _score_chunks(16, config) == 1
    with pytest.raises(ValueError, match="score_chunks"):
        MLAConfig(score_chunks=3)


def test_zero_length_gives_zero_output(device):
    """Outside the contract (lengths >= 1) but what a padded graph batch relies on: a zero
    length yields o = 0 and lse = -inf instead of NaN."""
    q_lat, q_rope, kv, sl = _inputs(TINY, [20, 20], device)
    sl[1] = 0
    for ns in (1, 4):
        o, lse = mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.2, num_splits=ns, return_lse=True)
        assert torch.equal(o[1].float(), torch.zeros_like(o[1].float()))
        assert torch.isneginf(lse[1]).all()
        ref = mla_decode_reference(q_lat[:1], q_rope[:1], kv[:1], sl[:1], sm_scale=0.2)
        assert_close("o_lat[0]", o[:1], ref, **_tol(device))


# ---------------------------------------------------------------------------------------------
# the absorbed form is MLA: compare with keys and values expanded through W_uk / W_uv (SDPA)


def _unabsorbed_setup(cfg, lens, device, seed=1):
    gen = make_generator(seed, device)
    m = len(lens)
    w = mla_weights(cfg, gen)
    w_uk, w_uv = split_kv_b(w["kv_b"].float(), cfg.mla_heads, cfg.qk_nope, cfg.v_head)
    q_nope = randn((m, cfg.mla_heads, cfg.qk_nope), gen, dtype=torch.float32)
    q_rope = randn((m, cfg.mla_heads, cfg.qk_rope), gen)
    cache = mla_cache(cfg, m, max(lens) + 5, lens, gen)
    return q_nope, q_rope, cache["kv_cache"], cache["seq_lens"], w_uk, w_uv


@pytest.mark.parametrize("cfg,lens", [(TINY, [1]), (TINY, [70, 33, 2]), (K3, [129])],
                         ids=["tiny-M1-L1", "tiny-M3-mixed", "K3tp8-M1-L129"])
def test_reference_matches_unabsorbed(cfg, lens):
    q_nope, q_rope, kv, sl, w_uk, w_uv = _unabsorbed_setup(cfg, lens, "cpu")
    sm_scale = cfg.qk_head ** -0.5
    q_lat = torch.einsum("mhn,hnc->mhc", q_nope, w_uk)
    o_lat = mla_decode_reference(q_lat, q_rope, kv, sl, sm_scale=sm_scale)
    o = torch.einsum("mhc,hvc->mhv", o_lat, w_uv)
    expect = mla_decode_unabsorbed(q_nope, q_rope, kv, sl, w_uk, w_uv, sm_scale=sm_scale)
    assert_close("o (absorbed ref vs SDPA)", o, expect, atol=UNABSORBED_ATOL)


@pytest.mark.parametrize("lens,num_splits", [([50, 1], 4), ([200], None)],
                         ids=["tiny-M2-mixed-s4", "tiny-M1-L200-auto"])
def test_kernel_matches_unabsorbed(device, lens, num_splits):
    cfg = TINY
    q_nope, q_rope, kv, sl, w_uk, w_uv = _unabsorbed_setup(cfg, lens, device)
    sm_scale = cfg.qk_head ** -0.5
    q_lat = torch.einsum("mhn,hnc->mhc", q_nope, w_uk).to(torch.bfloat16)
    o_lat = mla_decode(q_lat, q_rope, kv, sl, sm_scale=sm_scale, num_splits=num_splits)
    o = torch.einsum("mhc,hvc->mhv", o_lat.float(), w_uv)
    expect = mla_decode_unabsorbed(q_nope, q_rope, kv, sl, w_uk, w_uv, sm_scale=sm_scale)
    assert_close("o (kernel vs SDPA)", o, expect, atol=KERNEL_VS_UNABSORBED_ATOL)


# ---------------------------------------------------------------------------------------------
# the whole layer step


def test_layer_reference_appends_and_runs_kernel(device):
    cfg = TINY
    gen = make_generator(3, device)
    w = mla_weights(cfg, gen)
    x = hidden_states(cfg, 2, gen)
    cache = mla_cache(cfg, 2, 50, [10, 30], gen)
    cache_k = {k: v.clone() for k, v in cache.items()}
    pos = torch.tensor([10, 30], device=device)
    expect = mla_layer_reference(x, w, cache, cfg, pos)
    got = mla_layer_reference(x, w, cache_k, cfg, pos,
                              attention=lambda *a, **k: mla_decode(*a, num_splits=3, **k))
    assert cache["seq_lens"].tolist() == [11, 31]
    assert torch.equal(cache["kv_cache"], cache_k["kv_cache"])
    assert expect.shape == (2, cfg.hidden) and torch.isfinite(expect).all()
    assert_close("layer output", got, expect, atol=LAYER_ATOL)
    # the appended row is the new token's normalized latent: unit RMS
    rms = cache["kv_cache"][0, 10, :cfg.kv_lora].float().pow(2).mean().sqrt()
    assert 0.5 < float(rms) < 2.0


def test_rope_rotation_is_a_rotation():
    x = torch.randn(3, 4, 16)
    pos = torch.tensor([0, 5, 1000])
    y = rope_rotate(x, pos)
    assert torch.allclose(y[0], x[0])
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-5)
    # relative: <R(a) q, R(b) k> depends on a - b only
    q, k = torch.randn(1, 16), torch.randn(1, 16)
    d1 = (rope_rotate(q, torch.tensor([7])) * rope_rotate(k, torch.tensor([3]))).sum()
    d2 = (rope_rotate(q, torch.tensor([104])) * rope_rotate(k, torch.tensor([100]))).sum()
    assert math.isclose(float(d1), float(d2), rel_tol=1e-4, abs_tol=1e-4)


def test_layer_reference_k2_rope_runs():
    cfg = preset("kimi-k2", 8)
    # shrink only what the math does not care about, keep K2's head dims and rope flag
    import dataclasses
    cfg = dataclasses.replace(cfg, hidden=128, q_lora=64)
    gen = make_generator(0, "cpu")
    w = mla_weights(cfg, gen)
    cache = mla_cache(cfg, 1, 8, [3], gen)
    out = mla_layer_reference(hidden_states(cfg, 1, gen), w, cache, cfg, 3)
    assert out.shape == (1, 128) and torch.isfinite(out).all()


# ---------------------------------------------------------------------------------------------
# heuristic


def test_heuristic_from_shapes():
    d = "cpu"
    assert default_num_splits(1, 12, 1, d) == 1
    assert default_num_splits(1, 12, 255, d) == 1
    seq = [default_num_splits(1, 12, n, d) for n in (256, 1024, 4096, 32768, 131072)]
    assert seq == sorted(seq) and seq[0] >= 1 and seq[-1] > seq[0]
    assert all(1 <= s <= MAX_SPLITS for s in seq)
    # more tokens / head groups fill the GPU without splitting as much
    assert default_num_splits(64, 12, 131072, d) <= default_num_splits(1, 12, 131072, d)


def test_boundary_variants_agree(device):
    b = get("mla")
    inputs = b.make_inputs(TINY, device, 0, M=2, context=100)
    ref = b.reference.fn(inputs)
    for v in b.available_variants(device):
        if v.name != "torch.compile":  # compiled in the notebook; minutes of compile here
            b.check(v.fn(inputs), ref, inputs)
    # the fused variant passes inputs' config
    b.check(b.variant("fused").fn({**inputs, "config": MLAConfig(score_chunks=1)}), ref, inputs)
    with pytest.raises(ValueError, match="config"):
        b.variant("fused").fn({**inputs, "config": {"block_n": 32}})
    kv_bytes = (100 + 75) * (TINY.kv_lora + TINY.qk_rope) * 2
    assert inputs["seq_lens"].tolist() == [100, 75]
    q_bytes = inputs["q_lat"].nbytes + inputs["q_rope"].nbytes
    assert b.bytes_moved(inputs) == kv_bytes + q_bytes + inputs["q_lat"].nbytes


# ---------------------------------------------------------------------------------------------
# bad input


def _good(device):
    return dict(zip(("q_lat", "q_rope", "kv_cache", "seq_lens"),
                    _inputs(TINY, [20, 10], device), strict=True))


def _bad_cases():
    def noncontig(a):
        return a["kv_cache"].transpose(1, 2).contiguous().transpose(1, 2)

    return [
        ("q_lat-2d", lambda a: {**a, "q_lat": a["q_lat"][0]}, "q_lat"),
        ("q_lat-fp32", lambda a: {**a, "q_lat": a["q_lat"].float()}, "q_lat"),
        ("q_lat-C48", lambda a: {**a, "q_lat": a["q_lat"][..., :48],
                                 "kv_cache": a["kv_cache"][..., 16:]}, "q_lat"),
        ("q_rope-heads", lambda a: {**a, "q_rope": a["q_rope"][:, :3]}, "q_rope"),
        ("q_rope-R12", lambda a: {**a, "q_rope": a["q_rope"][..., :12],
                                  "kv_cache": a["kv_cache"][..., :76]}, "q_rope"),
        ("q_rope-fp16", lambda a: {**a, "q_rope": a["q_rope"].half()}, "q_rope"),
        ("kv-width", lambda a: {**a, "kv_cache": a["kv_cache"][..., :70]}, "kv_cache"),
        ("kv-batch", lambda a: {**a, "kv_cache": a["kv_cache"][:1]}, "kv_cache"),
        ("kv-fp16", lambda a: {**a, "kv_cache": a["kv_cache"].half()}, "kv_cache"),
        ("kv-noncontig", lambda a: {**a, "kv_cache": noncontig(a)}, "kv_cache"),
        ("lens-int64", lambda a: {**a, "seq_lens": a["seq_lens"].long()}, "seq_lens"),
        ("lens-shape", lambda a: {**a, "seq_lens": a["seq_lens"][:1]}, "seq_lens"),
        ("lens-list", lambda a: {**a, "seq_lens": [20, 10]}, "seq_lens"),
    ]


@pytest.mark.parametrize("mutate,param", [c[1:] for c in _bad_cases()],
                         ids=[c[0] for c in _bad_cases()])
def test_bad_tensors(device, mutate, param):
    a = mutate(_good(device))
    with pytest.raises(ValueError, match=param):
        mla_decode(a["q_lat"], a["q_rope"], a["kv_cache"], a["seq_lens"], sm_scale=0.1)


@pytest.mark.parametrize("kwargs,param", [
    ({"sm_scale": 0.0}, "sm_scale"), ({"sm_scale": float("nan")}, "sm_scale"),
    ({"sm_scale": -1.0}, "sm_scale"), ({"sm_scale": True}, "sm_scale"),
    ({"sm_scale": 0.1, "num_splits": 0}, "num_splits"),
    ({"sm_scale": 0.1, "num_splits": MAX_SPLITS + 1}, "num_splits"),
    ({"sm_scale": 0.1, "num_splits": 2.0}, "num_splits"),
    ({"sm_scale": 0.1, "num_splits": True}, "num_splits"),
], ids=["scale-0", "scale-nan", "scale-neg", "scale-bool", "splits-0", "splits-max", "splits-float",
        "splits-bool"])
def test_bad_scalars(device, kwargs, param):
    a = _good(device)
    with pytest.raises(ValueError, match=param):
        mla_decode(a["q_lat"], a["q_rope"], a["kv_cache"], a["seq_lens"], **kwargs)


@pytest.mark.parametrize("field,value", [
    ("block_n", 48), ("block_n", 8), ("num_warps", 0), ("num_stages", 2.0), ("score_chunks", 8),
    ("defer_row_sum", 1), ("programs_per_sm", 0), ("min_rows_per_split", True),
    ("combine_pdl", "yes"), ("split_pdl", None)])
def test_bad_config(device, field, value):
    with pytest.raises(ValueError, match=field):
        MLAConfig(**{field: value})
    a = _good(device)
    with pytest.raises(ValueError, match="config"):
        mla_decode(a["q_lat"], a["q_rope"], a["kv_cache"], a["seq_lens"], sm_scale=0.1,
                   config={field: value})


CPU_WITHOUT_INTERPRETER = """
import torch
import k3lab.kernels
from k3lab.kernels import mla_decode
assert not k3lab.kernels.INTERPRETED
q, kv = torch.zeros(1, 2, 16, dtype=torch.bfloat16), torch.zeros(1, 4, 32, dtype=torch.bfloat16)
try:
    mla_decode(q, q, kv, torch.ones(1, dtype=torch.int32), sm_scale=0.1)
except ValueError as e:
    print(e)
"""


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU machine imports compiled anyway")
def test_cpu_needs_interpreter():
    """CPU tensors with the kernels imported compiled (TRITON_INTERPRET=0 on a machine without
    a GPU): a clear error naming q_lat, not a failure deep inside Triton."""
    env = {**os.environ, "TRITON_INTERPRET": "0"}
    out = subprocess.run([sys.executable, "-c", CPU_WITHOUT_INTERPRETER], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("q_lat: CPU tensors need the Triton interpreter"), out.stdout


@pytest.mark.gpu
def test_device_mismatch():
    a = _good("cuda")
    with pytest.raises(ValueError, match="seq_lens"):
        mla_decode(a["q_lat"], a["q_rope"], a["kv_cache"], a["seq_lens"].cpu(), sm_scale=0.1)


# ---------------------------------------------------------------------------------------------
# GPU: K3 at tp 8 (12 heads, 512 + 64), long contexts, no host sync, one graph for all lengths


@pytest.mark.gpu
@pytest.mark.parametrize("length", [1, 31, 32, 33, 1000, 4097, 32768, 131072])
@pytest.mark.parametrize("num_splits", [None, 1, 4, 64, 300])
def test_gpu_k3_sizes(length, num_splits):
    q_lat, q_rope, kv, sl = _inputs(K3, [length], "cuda", max_len=max(length, BLOCK_N * 3))
    _check("cuda", q_lat, q_rope, kv, sl, num_splits, K3.qk_head ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [None, 8, 132])
def test_gpu_k3_batch_mixed_lengths(num_splits):
    q_lat, q_rope, kv, sl = _inputs(K3, [8192, 1, 3000, 77], "cuda")
    _check("cuda", q_lat, q_rope, kv, sl, num_splits, K3.qk_head ** -0.5)


@pytest.mark.gpu
@pytest.mark.parametrize("chunks,defer", VARIANTS, ids=[f"c{c}-d{int(d)}" for c, d in VARIANTS])
@pytest.mark.parametrize("length", [33, 4097, 65536])
@pytest.mark.parametrize("num_splits", [None, 1])
def test_gpu_k3_variants(chunks, defer, length, num_splits):
    config = MLAConfig(score_chunks=chunks, defer_row_sum=defer)
    q_lat, q_rope, kv, sl = _inputs(K3, [length], "cuda", max_len=max(length, BLOCK_N * 3))
    _check("cuda", q_lat, q_rope, kv, sl, num_splits, K3.qk_head ** -0.5, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [v[1] for v in COMBINE_VARIANTS],
                         ids=[v[0] for v in COMBINE_VARIANTS])
@pytest.mark.parametrize("length", [33, 65536])
@pytest.mark.parametrize("num_splits", [None, 64])
def test_gpu_k3_combine_variants(config, length, num_splits):
    q_lat, q_rope, kv, sl = _inputs(K3, [length], "cuda", max_len=max(length, BLOCK_N * 3))
    _check("cuda", q_lat, q_rope, kv, sl, num_splits, K3.qk_head ** -0.5, config)


@pytest.mark.gpu
@pytest.mark.parametrize("config", [v[1] for v in COMBINE_VARIANTS],
                         ids=[v[0] for v in COMBINE_VARIANTS])
def test_gpu_combine_variants_in_graph(config):
    """One graph captured with the variant, replayed at several lengths (PDL launches must
    capture and keep their order on replay)."""
    _graph_every_length(None, [[8192, 8192], [1, 33], [4097, 100], [8192, 2048]] * 2, 8192,
                        config)


@pytest.mark.gpu
def test_gpu_no_host_sync():
    q_lat, q_rope, kv, sl = _inputs(K3, [5000], "cuda")
    mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.1)  # compile first
    mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.1, num_splits=16)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.1)
        mla_decode(q_lat, q_rope, kv, sl, sm_scale=0.1, num_splits=16, return_lse=True)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [1, 4, 64, None])
def test_gpu_one_graph_every_length(num_splits):
    """Capture once at L_max with a fixed split count, then change seq_lens in place and replay:
    every length (shorter, not a multiple of the block, 1, L_max) must match the reference."""
    l_max = 16384
    _graph_every_length(num_splits, ([l_max, l_max], [1, 33], [4097, 100], [31, l_max],
                                     [l_max - 1, 2048]), l_max)


def _graph_every_length(num_splits, lengths, l_max, config=None):
    q_lat, q_rope, kv, sl = _inputs(K3, [l_max, l_max], "cuda")
    sm_scale = K3.qk_head ** -0.5

    def step():
        return mla_decode(q_lat, q_rope, kv, sl, sm_scale=sm_scale, num_splits=num_splits,
                          return_lse=True, config=config)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o, lse = step()
    for lens in lengths:
        sl.copy_(torch.tensor(lens, dtype=torch.int32))
        graph.replay()
        torch.cuda.synchronize()
        ro, rlse = mla_decode_reference(q_lat, q_rope, kv, sl, sm_scale=sm_scale,
                                        return_lse=True)
        assert_close(f"o_lat at {lens}", o, ro, atol=O_LAT_ATOL_GPU, rtol=O_LAT_RTOL_GPU)
        assert_close(f"lse at {lens}", lse, rlse, atol=LSE_ATOL)
