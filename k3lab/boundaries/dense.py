"""Dense boundary: the model's bf16 projections at batch 1..16, the bytes of a token nobody else
owns.

``docs/model.md``, *Dense projections*. Each shape is one projection of the preset's shard (or
several merged: the input projections of a layer that read the same x, concatenated once at load
time as an engine lays out its checkpoint). The reference is the engine's call (bf16
``F.linear``, i.e. cuBLAS, with the norm, activation or residual as separate ops); the
correctness truth is the fp32 formulation (``k3lab.reference.dense``).
"""

from __future__ import annotations

import torch

from k3lab.boundaries import Boundary, Variant, assert_close, compiled
from k3lab.config import Preset
from k3lab.kernels.dense import dense_gemv
from k3lab.kernels.moe.persistent import fp8_rows_quantize
from k3lab.reference.dense import dense_engine, dense_reference
from k3lab.weights import make_generator, randn

__all__ = ["shapes", "default_shape", "BOUNDARY"]

# Tolerance against the fp32 truth: the output is rounded to bf16 once (one ulp, 2^-7, covers
# the interpreter's truncating cast) and the engine rounds once more (its epilogue ops run on the
# bf16 product: 2^-6 together); inputs rounded to bf16 before the product (the normalized x of
# the engine, and of the kernel's tensor-core path) move each term by 2^-8, at most 2^-8 of
# sum |terms| per output; fp32 summation adds about K 2^-24 of it.
RTOL = 2.0 ** -6
IN_ROUNDING = 2.0 ** -8


def shapes(cfg: Preset) -> dict[str, dict]:
    """The dense projections of ``cfg``'s shard: name -> {rows, K, what, and the launch's
    epilogue: splits (merged outputs), activation, norm (an RMSNorm of x first), residual}."""
    h = cfg.hidden
    out: dict[str, dict] = {}

    def add(name, rows, k, what, **kw):
        out[name] = dict(rows=rows, K=k, what=what, **kw)

    if cfg.kda_heads:
        hd, hk = cfg.kda_heads * cfg.kda_head_dim, cfg.kda_heads
        add("kda.q_proj", hd, h, "KDA q (k, v, g alike)")
        add("kda.f_a_proj", cfg.kda_f_rank, h, "KDA low-rank forget gate, first half")
        add("kda.beta_proj", hk, h, "KDA beta")
        add("kda.in_proj", 4 * hd + cfg.kda_f_rank + hk, h,
            "KDA q, k, v, f_a, beta, g merged", splits=(hd, hd, hd, cfg.kda_f_rank, hk, hd))
        add("kda.o_proj", h, hd, "KDA output projection + residual", residual=True)
    if cfg.mla_heads:
        hv, kv = cfg.mla_heads * cfg.v_head, cfg.kv_lora + cfg.qk_rope
        add("mla.q_a_proj", cfg.q_lora, h, "MLA q down-projection")
        add("mla.kv_a_proj", kv, h, "MLA latent KV + rope columns")
        add("mla.in_proj", cfg.q_lora + kv + hv, h, "MLA q_a, kv_a, g merged",
            splits=(cfg.q_lora, kv, hv))
        add("mla.q_b_proj", cfg.mla_heads * cfg.qk_head, cfg.q_lora,
            "MLA q up-projection, its RMSNorm in the prologue", norm=True)
        add("mla.o_proj", h, hv, "MLA output projection + residual", residual=True)
    if cfg.latent:
        add("moe.latent_down", cfg.latent, h, "latent down-projection")
        add("moe.latent_up", h, cfg.latent, "latent up-projection, its RMSNorm in the prologue",
            norm=True)
    if cfg.shared_intermediate:
        s = cfg.shared_intermediate
        add("moe.shared_gate_up", 2 * s, h, "shared experts' gate/up + activation",
            activation=cfg.activation)
        add("moe.shared_down", h, s, "shared experts' down + residual", residual=True)
    add("moe.router", cfg.n_experts, h, "router (fp32 logits)", fp32=True)
    if cfg.first_dense:
        i = cfg.dense_intermediate
        add("mlp.gate_up", 2 * i, h, "layer 0's dense MLP gate/up + activation",
            activation=cfg.activation)
        add("mlp.down", h, i, "layer 0's dense MLP down + residual", residual=True)
    add("lm_head", cfg.vocab // cfg.tp, h, "LM head (vocab shard)")
    return out


def default_shape(cfg: Preset) -> str:
    """The merged input projection of the preset's first attention kind."""
    return "kda.in_proj" if cfg.kda_heads else "mla.in_proj"


WEIGHT_FORMATS = ("bf16", "e4m3")


def make_inputs(cfg: Preset, device, seed: int, M: int = 1, shape: str | None = None,
                weight_format: str = "bf16") -> dict:
    """x bf16 [M, K]; weight bf16 [rows, K]; the launch's keyword arguments (``kwargs``).
    shape: a name of ``shapes(cfg)`` (None: ``default_shape``). weight_format "e4m3": the
    weight as e4m3 values with one fp32 scale per row (``kwargs["weight_scale"]``, quantized
    once as at load time; the seed's FP8 latent tail, #18), for shapes without merged outputs
    or an activation."""
    table = shapes(cfg)
    shape = default_shape(cfg) if shape is None else shape
    if shape not in table:
        raise ValueError(f"shape: {cfg.describe()} has no projection {shape!r}; expected one "
                         f"of {sorted(table)}")
    s = table[shape]
    if weight_format not in WEIGHT_FORMATS:
        raise ValueError(f"weight_format: expected one of {WEIGHT_FORMATS}, got "
                         f"{weight_format!r}")
    if weight_format == "e4m3" and (s.get("splits") or s.get("activation")):
        raise ValueError(f"weight_format: 'e4m3' serves projections without merged outputs or "
                         f"an activation; {shape} has "
                         f"{'merged outputs' if s.get('splits') else 'an activation'}")
    gen = make_generator(seed, device)
    x = randn((M, s["K"]), gen)
    weight = randn((s["rows"], s["K"]), gen, std=s["K"] ** -0.5)
    kwargs: dict = {}
    if s.get("splits"):
        kwargs["splits"] = s["splits"]
    if s.get("activation"):
        kwargs.update(activation=s["activation"], situ_beta=cfg.situ_beta,
                      situ_linear_beta=cfg.situ_linear_beta)
    if s.get("norm"):
        kwargs.update(norm_weight=1.0 + 0.1 * randn((s["K"],), gen, dtype=torch.float32),
                      eps=cfg.rms_eps)
    if s.get("residual"):
        kwargs["residual"] = randn((M, s["rows"]), gen)
    if s.get("fp32"):
        kwargs["out_dtype"] = torch.float32
    if weight_format == "e4m3":
        q = fp8_rows_quantize(weight)
        weight, kwargs["weight_scale"] = q.values, q.scales
    return {"x": x, "weight": weight, "kwargs": kwargs, "shape": shape}


def reference(inputs: dict):
    """The engine's call; an e4m3 weight is dequantized to bf16 first (at every call: cuBLAS
    has no B1 e4m3 GEMV with row scales)."""
    kw = dict(inputs["kwargs"])
    out_dtype = kw.pop("out_dtype", None)
    scale, w = kw.pop("weight_scale", None), inputs["weight"]
    if scale is not None:
        w = (w.float() * scale[:, None]).to(torch.bfloat16)
    y = dense_engine(inputs["x"], w, **kw)
    return y.to(out_dtype) if out_dtype is not None else y


def fused(inputs: dict):
    return dense_gemv(inputs["x"], inputs["weight"], **inputs["kwargs"],
                      config=inputs.get("config"))


def check(out, ref, inputs) -> dict:
    """Every output against the fp32 truth (``ref``, the engine's bf16, is not the truth)."""
    kw = {k: v for k, v in inputs["kwargs"].items() if k != "out_dtype"}
    truth = dense_reference(inputs["x"], inputs["weight"], **kw)
    x, w = inputs["x"].float().abs(), inputs["weight"].float().abs()
    if "weight_scale" in kw:
        w = w * kw["weight_scale"][:, None]
    if "norm_weight" in kw:
        xf = inputs["x"].float()
        x = x * kw["norm_weight"].float().abs() * torch.rsqrt(
            xf.pow(2).mean(-1, keepdim=True) + kw["eps"])
    terms = float((x @ w.T).max())
    k = inputs["x"].shape[1]
    atol = (IN_ROUNDING + k * 2.0 ** -24) * terms + 1e-5
    outs, truths = (out, truth) if isinstance(out, tuple) else ((out,), (truth,))
    return {f"y{i}": assert_close(f"y{i}", o, t, atol=atol, rtol=RTOL)
            for i, (o, t) in enumerate(zip(outs, truths, strict=True))}


def bytes_moved(inputs: dict) -> int:
    """The weight once (its row scales too), x, the output, and the epilogue's extra tensors."""
    kw = inputs["kwargs"]
    rows = inputs["weight"].shape[0] // (2 if kw.get("activation") else 1)
    out_elem = 4 if kw.get("out_dtype") == torch.float32 else 2
    extra = sum(kw[k].nbytes for k in ("residual", "norm_weight", "weight_scale") if k in kw)
    return (inputs["weight"].nbytes + inputs["x"].nbytes + inputs["x"].shape[0] * rows * out_elem
            + extra)


BOUNDARY = Boundary(
    name="dense",
    title="Dense projections (B1 GEMV)",
    owns=("kda.q_proj", "kda.k_proj", "kda.v_proj", "kda.f_a_proj", "kda.beta_proj",
          "kda.g_proj", "kda.o_proj", "mla.q_a_proj", "mla.q_a_norm", "mla.q_b_proj",
          "mla.kv_a_proj", "mla.g_proj", "mla.o_proj"),
    make_inputs=make_inputs,
    variants=(
        Variant("reference", "reference", reference,
                "the engine's call: bf16 F.linear (cuBLAS on a GPU), epilogue ops apart"),
        Variant("fused", "fused", fused,
                "one Triton GEMV launch with its prologue / epilogue (k3lab.kernels.dense)"),
        Variant("torch.compile", "peer", compiled(reference),
                "torch.compile of the engine's call (Inductor)", devices=("cuda",)),
    ),
    check=check,
    bytes_moved=bytes_moved,
    params={"M": 1, "shape": None, "weight_format": "bf16"},
)
