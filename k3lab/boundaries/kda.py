"""KDA decode boundary (docs/model.md): the f_b projection, gate, beta, L2 norms and
the recurrent step with its state in place, for one decode token per sequence.

Variants: the op-by-op reference; ours in one launch (``fused``), and with the short-conv step
fused in front (``fused+conv``, which also owns ``kda.short_conv``) or the output RMSNorm times
sigmoid gate behind (``fused+out_gate``, also ``kda.out_norm_gate``), or both
(``fused+conv+out_gate``, the whole decode); peers: fla-core 0.6.0's
``fused_recurrent_kda`` kernel (its in-kernel gate, L2 norm and beta sigmoid) after the separate
f_b projection, and ``torch.compile`` of the reference.

Every variant returns a dict: ``o`` [M, Hl, d] (``o_gated`` instead with the out gate),
``state`` (the updated recurrent state) and, with the conv, the three updated conv caches.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lab.boundaries import Boundary, Variant, assert_close, clone_inputs, compiled
from k3lab.config import Preset
from k3lab.kernels import KDAConv, KDAOutGate, kda_decode
from k3lab.reference.kda import kda_decode_reference, out_norm_gate, short_conv_step
from k3lab.weights import hidden_states, kda_cache, kda_weights, make_generator

__all__ = ["BOUNDARY", "make_inputs", "decode_stream", "check", "bytes_moved", "state_bytes",
           "reference_conv", "reference_out_gate", "reference_conv_out_gate", "O_ATOL", "O_RTOL",
           "STATE_ATOL", "STATE_RTOL", "O_GATED_ATOL", "O_GATED_RTOL"]

# o (|o| < about 0.2) is bf16: two ulps relative (2^-7; the Triton interpreter truncates to bf16
# where the GPU rounds to nearest), over fp32 math that agrees to about 1e-6.
O_ATOL = 1e-4
O_RTOL = 8e-3
# state (fp32, |S| < about 1): fp32 reduction order and exp / sigmoid implementations in one step.
STATE_ATOL = 1e-5
STATE_RTOL = 1e-4
# gated output (RMS-normalized: |o_gated| up to about 4), bf16: two ulps relative.
O_GATED_ATOL = 1e-3
O_GATED_RTOL = 8e-3


def _token(x: torch.Tensor, w: dict, conv_states: dict, hl: int, d: int) -> dict:
    """The per-token tensors of one decode step from x [M, hidden] bf16, projected in bf16 like
    the model; ``conv_states`` (q, k, v caches) advance by one step in place."""
    m = x.shape[0]
    tok = {}
    with torch.no_grad():
        for n in "qkv":
            pre = x @ w[f"{n}_proj"].T                                   # [M, Hl*d] bf16
            post = short_conv_step(pre, conv_states[n], w[f"{n}_conv"])
            tok[n] = post.to(x.dtype).view(m, hl, d)
            tok[f"{n}_pre"] = pre.view(m, hl, d)
        tok["f_low"] = x @ w["f_a"].T
        tok["b_logits"] = x @ w["b_proj"].T
        tok["g_logits"] = (x @ w["g_proj"].T).view(m, hl, d)
    return tok


def decode_stream(cfg: Preset, device, seed: int, M: int = 1, steps: int = 64
                  ) -> tuple[dict, list[dict]]:
    """``steps`` consecutive decode tokens with one set of weights.

    Returns (fixed, tokens): ``fixed`` holds the weights' small tensors (f_b, A_log, dt_bias,
    o_norm, the conv taps), the initial recurrent state and conv caches, lower_bound, scale and
    eps; ``tokens[t]`` the tensors of token t (q, k, v, q_pre, k_pre, v_pre, f_low, b_logits,
    g_logits), computed through conv caches carried from token to token (a copy: ``fixed``
    keeps the caches as they were before token 0). ``{**fixed, **tokens[0]}`` equals
    ``make_inputs(cfg, device, seed, M)``.
    """
    if not 1 <= M <= 64:
        raise ValueError(f"M: expected 1 <= M <= 64, got {M}")
    gen = make_generator(seed, device)
    w = kda_weights(cfg, gen)
    cache = kda_cache(cfg, M, gen)
    hl, d = cfg.kda_heads, cfg.kda_head_dim
    carried = {n: cache[f"{n}_conv_state"].clone() for n in "qkv"}
    tokens = [_token(hidden_states(cfg, M, gen), w, carried, hl, d) for _ in range(steps)]
    fixed = {"lower_bound": cfg.kda_lower_bound, "scale": None, "eps": cfg.rms_eps,
             "state": cache["state"]}
    for n in "qkv":
        fixed[f"{n}_conv_state"] = cache[f"{n}_conv_state"]
        fixed[f"{n}_conv"] = w[f"{n}_conv"]
    for name in ("f_b", "A_log", "dt_bias", "o_norm"):
        fixed[name] = w[name]
    return fixed, tokens


def make_inputs(cfg: Preset, device, seed: int, M: int = 1) -> dict:
    """One decode token for M sequences at ``cfg``'s shard, from ``kda_weights`` / ``kda_cache``
    (the big projection weights are dropped once used).

    x [M, hidden] bf16 is projected in bf16 like the model: q_pre, k_pre, v_pre [M, Hl, d] bf16
    (before the short conv) and q, k, v [M, Hl, d] bf16 after one conv step + SiLU over the
    caches; f_low [M, R] = x @ f_a^T and b_logits [M, Hl] = x @ W_b^T bf16; g_logits
    [M, Hl, d] = x @ W_g^T bf16; f_b [Hl*d, R] bf16; A_log [Hl], dt_bias [Hl*d], o_norm [d]
    fp32; state [M, Hl, d, d] fp32; the conv caches {q,k,v}_conv_state [M, Hl*d, C-1] bf16 as
    they were *before* this token and the taps {q,k,v}_conv [Hl*d, C]; lower_bound, scale
    (None = d^-0.5) and eps (cfg.rms_eps).
    """
    fixed, tokens = decode_stream(cfg, device, seed, M, steps=1)
    return {**fixed, **tokens[0]}


def _core(inputs: dict, q=None, k=None, v=None) -> tuple:
    return (inputs["q"] if q is None else q, inputs["k"] if k is None else k,
            inputs["v"] if v is None else v, inputs["f_low"], inputs["f_b"], inputs["A_log"],
            inputs["dt_bias"], inputs["b_logits"], inputs["state"])


def _reference(inputs: dict) -> dict:
    o = kda_decode_reference(*_core(inputs), lower_bound=inputs["lower_bound"],
                             scale=inputs["scale"])
    return {"o": o, "state": inputs["state"]}


def reference_conv(inputs: dict) -> dict:
    """The reference with the short-conv step in front (what ``fused+conv`` replaces): conv +
    SiLU of the pre-conv projections (caches updated in place), then the recurrent step."""
    m, hl, d = inputs["q_pre"].shape
    qkv = [short_conv_step(inputs[f"{n}_pre"].view(m, hl * d), inputs[f"{n}_conv_state"],
                           inputs[f"{n}_conv"]).view(m, hl, d) for n in "qkv"]
    o = kda_decode_reference(*_core(inputs, *qkv), lower_bound=inputs["lower_bound"],
                             scale=inputs["scale"])
    return {"o": o, "state": inputs["state"],
            **{f"{n}_conv_state": inputs[f"{n}_conv_state"] for n in "qkv"}}


def reference_out_gate(inputs: dict) -> dict:
    """The reference with the output RMSNorm * sigmoid gate behind (what ``fused+out_gate``
    replaces)."""
    out = _reference(inputs)
    o = out_norm_gate(out["o"], inputs["g_logits"], inputs["o_norm"], inputs["eps"])
    return {"o_gated": o, "state": out["state"]}


def reference_conv_out_gate(inputs: dict) -> dict:
    """The reference with both the short-conv step in front and the output gate behind (what
    ``fused+conv+out_gate`` replaces)."""
    out = reference_conv(inputs)
    o = out_norm_gate(out.pop("o"), inputs["g_logits"], inputs["o_norm"], inputs["eps"])
    return {"o_gated": o, **out}


def _fused(inputs: dict) -> dict:
    o = kda_decode(*_core(inputs), lower_bound=inputs["lower_bound"], scale=inputs["scale"],
                   config=inputs.get("config"))
    return {"o": o, "state": inputs["state"]}


def _fused_conv(inputs: dict) -> dict:
    conv = KDAConv(*(inputs[f"{n}_conv_state"] for n in "qkv"),
                   *(inputs[f"{n}_conv"] for n in "qkv"))
    o = kda_decode(*_core(inputs, inputs["q_pre"], inputs["k_pre"], inputs["v_pre"]),
                   lower_bound=inputs["lower_bound"], scale=inputs["scale"], conv=conv,
                   config=inputs.get("config"))
    return {"o": o, "state": inputs["state"],
            **{f"{n}_conv_state": inputs[f"{n}_conv_state"] for n in "qkv"}}


def _fused_conv_out_gate(inputs: dict) -> dict:
    conv = KDAConv(*(inputs[f"{n}_conv_state"] for n in "qkv"),
                   *(inputs[f"{n}_conv"] for n in "qkv"))
    gate = KDAOutGate(inputs["g_logits"], inputs["o_norm"], inputs["eps"])
    o = kda_decode(*_core(inputs, inputs["q_pre"], inputs["k_pre"], inputs["v_pre"]),
                   lower_bound=inputs["lower_bound"], scale=inputs["scale"], conv=conv,
                   out_gate=gate, config=inputs.get("config"))
    return {"o_gated": o, "state": inputs["state"],
            **{f"{n}_conv_state": inputs[f"{n}_conv_state"] for n in "qkv"}}


def _fused_out_gate(inputs: dict) -> dict:
    gate = KDAOutGate(inputs["g_logits"], inputs["o_norm"], inputs["eps"])
    o = kda_decode(*_core(inputs), lower_bound=inputs["lower_bound"], scale=inputs["scale"],
                   out_gate=gate, config=inputs.get("config"))
    return {"o_gated": o, "state": inputs["state"]}


_MM_FP32_OUT: dict[str, bool] = {}


def _f_proj_fp32(f_low: torch.Tensor, f_b: torch.Tensor) -> torch.Tensor:
    """f = f_low @ f_b^T [M, Hl*d] with an fp32 output, in one cuBLAS GEMM where torch offers
    ``torch.mm(..., out_dtype=)`` (CUDA, torch >= 2.8), else by upcasting both operands.

    fp32 like our kernel's f: a bf16 f (the model code's ``f_b_proj`` output) moves the gate by
    up to about 0.04 and a channel's decay exp(g) by up to 4% per step, far outside the state
    tolerance, which would hide the peer's figures behind a red check."""
    key = str(f_low.device)
    if f_low.is_cuda and _MM_FP32_OUT.get(key, True):
        try:
            f = torch.mm(f_low, f_b.t(), out_dtype=torch.float32)
            _MM_FP32_OUT[key] = True
            return f
        except (TypeError, RuntimeError, NotImplementedError):
            _MM_FP32_OUT[key] = False
    return F.linear(f_low.float(), f_b.float())


def _fla(inputs: dict) -> dict:
    """fla-core 0.6.0: the separate f_b projection (fp32 output) then its recurrent KDA kernel
    with the gate, q/k L2 norm and beta sigmoid in kernel and the state updated in place (the
    decode path under ``fused_recurrent_kda``, whose public wrapper writes a new final state)."""
    from fla.ops.kda.fused_recurrent import fused_recurrent_kda_fwd
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    m, hl, d = q.shape
    f = _f_proj_fp32(inputs["f_low"], inputs["f_b"])                       # [M, Hl*d] fp32
    o = torch.empty((m, 1, hl, d), dtype=v.dtype, device=v.device)
    fused_recurrent_kda_fwd(
        q=q.unsqueeze(1), k=k.unsqueeze(1), v=v.unsqueeze(1), g=f.view(m, 1, hl, d),
        beta=inputs["b_logits"].unsqueeze(1), A_log=inputs["A_log"], dt_bias=inputs["dt_bias"],
        scale=inputs["scale"], initial_state=inputs["state"], inplace_final_state=True,
        use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, use_beta_sigmoid_in_kernel=True,
        lower_bound=inputs["lower_bound"], out=o)
    return {"o": o.view(m, hl, d), "state": inputs["state"]}


def check(out: dict, ref: dict, inputs: dict) -> dict:
    """Max abs errors of o (or o_gated), state and, for fused+conv, the conv caches (exact).

    A fused+conv output is compared with :func:`reference_conv` on the same pre-conv inputs
    (fp32 conv outputs, not the bf16-rounded q, k, v the plain reference starts from)."""
    errs = {}
    if "q_conv_state" in out:
        ref = reference_conv(clone_inputs(inputs))
        for n in "qkv":
            key = f"{n}_conv_state"
            errs[key] = assert_close(key, out[key], ref[key], atol=0.0)
    errs["state"] = assert_close("state", out["state"], ref["state"], atol=STATE_ATOL,
                                 rtol=STATE_RTOL)
    if "o_gated" in out:
        expected = out_norm_gate(ref["o"], inputs["g_logits"], inputs["o_norm"], inputs["eps"])
        errs["o_gated"] = assert_close("o_gated", out["o_gated"], expected, atol=O_GATED_ATOL,
                                       rtol=O_GATED_RTOL)
    else:
        errs["o"] = assert_close("o", out["o"], ref["o"], atol=O_ATOL, rtol=O_RTOL)
    return errs


def state_bytes(inputs: dict) -> int:
    """The recurrent state read and written: the bytes the bar's roofline fraction counts."""
    return 2 * inputs["state"].nbytes


def bytes_moved(inputs: dict) -> int:
    """State read + written, q, k, v, f_b, f_low, A_log, dt_bias, b_logits read, o written."""
    read = sum(inputs[n].nbytes for n in ("q", "k", "v", "f_b", "f_low", "A_log", "dt_bias",
                                           "b_logits"))
    return state_bytes(inputs) + read + inputs["v"].nbytes


BOUNDARY = Boundary(
    name="kda",
    title="KDA decode: f_b projection, gate, beta, L2 norms, recurrent step (state in place)",
    owns=("kda.f_b_proj", "kda.gate", "kda.beta", "kda.l2norm", "kda.recurrence"),
    make_inputs=make_inputs,
    variants=(
        Variant("reference", "reference", _reference,
                "op-by-op PyTorch, fp32 math (f_b GEMV, gate, sigmoid, norms, recurrence)"),
        Variant("fused", "fused", _fused,
                "k3lab.kernels.kda_decode: one launch, grid (v-tiles, Hl, M)"),
        Variant("fused+conv", "fused", _fused_conv,
                "kda_decode(conv=...): short-conv step + SiLU fused in front"),
        Variant("fused+out_gate", "fused", _fused_out_gate,
                "kda_decode(out_gate=...): RMSNorm * sigmoid gate fused behind"),
        Variant("fused+conv+out_gate", "fused", _fused_conv_out_gate,
                "kda_decode(conv=..., out_gate=...): the whole KDA decode in one launch"),
        Variant("fla-core", "peer", _fla,
                "fla-core 0.6.0 fused_recurrent_kda kernel (in-kernel gate, L2 norm, beta "
                "sigmoid; state in place) + the separate f_b projection (cuBLAS, fp32 out)",
                devices=("cuda",), requires=("fla.ops.kda.fused_recurrent",)),
        Variant("torch.compile", "peer", compiled(_reference),
                "torch.compile of the reference", devices=("cuda",)),
    ),
    check=check,
    bytes_moved=bytes_moved,
    params={"M": 1},
    applies=lambda cfg: cfg.kda_heads > 0,
)
