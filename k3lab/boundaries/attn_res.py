"""AttnRes boundary: the attention-residual read and the RMSNorm that follows it.

docs/model.md. Owns both ops of one read (``attn_res.read``, ``attn_res.norm``);
a decode layer runs it twice (before attention, before the FFN). Inputs are one read's: the
sealed bank [N, M, H], the live sum [M, H] and the read's three weights [H].
"""

from __future__ import annotations

import torch

from k3lab.boundaries import Boundary, Variant, assert_close, compiled
from k3lab.config import Preset
from k3lab.kernels import attn_res_norm
from k3lab.ops import ATTN_RES_OPS
from k3lab.reference.attn_res import attn_res_norm_reference
from k3lab.weights import attn_res_inputs, attn_res_weights, make_generator

# Both outputs are bf16. h: one bf16 ulp of the reference (2^-7 relative; fp32 summation order
# decides a rounding) plus a floor for values that cancel to ~0. h_normed inherits h's ulp and is
# rounded once more: two bf16 steps (2^-6).
H_ATOL, H_RTOL = 1e-3, 2.0 ** -7
H_NORMED_ATOL, H_NORMED_RTOL = 1e-3, 2.0 ** -6
# Sealed rows for presets without AttnRes (the boundary does not apply there): K3's worst case.
DEFAULT_SEALED = 8
WEIGHT_DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _default_sealed(cfg: Preset) -> int:
    """The deepest read of the preset: every sealed row (embedding first) plus live."""
    return cfg.max_attn_res_candidates - 1 if cfg.attn_res_block else DEFAULT_SEALED


def make_inputs(cfg: Preset, device, seed: int, M: int = 1, n_sealed: int | None = None,
                weight_dtype: str = "bf16") -> dict:
    """bank [n_sealed, M, H] bf16, live [M, H] bf16, res_norm_weight / res_proj_weight /
    norm_weight [H] (``weight_dtype`` "bf16" or "fp32"), eps (the preset's RMSNorm eps)."""
    if weight_dtype not in WEIGHT_DTYPES:
        raise ValueError(f"weight_dtype: expected one of {sorted(WEIGHT_DTYPES)}, "
                         f"got {weight_dtype!r}")
    n_sealed = _default_sealed(cfg) if n_sealed is None else n_sealed
    if n_sealed < 0:
        raise ValueError(f"n_sealed: expected >= 0, got {n_sealed}")
    gen = make_generator(seed, device)
    weights = attn_res_weights(cfg, gen, dtype=WEIGHT_DTYPES[weight_dtype])
    return {**attn_res_inputs(cfg, n_sealed, M, gen), **weights, "eps": cfg.rms_eps}


def _args(inputs: dict):
    return (inputs["bank"], inputs["live"], inputs["res_norm_weight"],
            inputs["res_proj_weight"], inputs["norm_weight"])


def reference(inputs: dict):
    return attn_res_norm_reference(*_args(inputs), eps=inputs["eps"])


def fused(inputs: dict):
    return attn_res_norm(*_args(inputs), eps=inputs["eps"], config=inputs.get("config"))


def check(out, ref, inputs) -> dict:
    (h, h_normed), (h_ref, h_normed_ref) = out, ref
    return {
        "h": assert_close("h", h, h_ref, atol=H_ATOL, rtol=H_RTOL),
        "h_normed": assert_close("h_normed", h_normed, h_normed_ref, atol=H_NORMED_ATOL,
                                 rtol=H_NORMED_RTOL),
    }


def bytes_moved(inputs: dict) -> int:
    """Read every candidate row and the three weights once; write h and h_normed."""
    bank, live = inputs["bank"], inputs["live"]
    weights = sum(inputs[k].nbytes for k in ("res_norm_weight", "res_proj_weight",
                                              "norm_weight"))
    return bank.nbytes + live.nbytes + weights + 2 * live.nbytes


BOUNDARY = Boundary(
    name="attn_res",
    title="AttnRes read + RMSNorm",
    owns=ATTN_RES_OPS,
    make_inputs=make_inputs,
    variants=(
        Variant("reference", "reference", reference,
                "PyTorch op by op: stack, fp32, RMS per candidate, score, softmax, mix, "
                "bf16, RMSNorm"),
        Variant("fused", "fused", fused,
                "k3lab.kernels.attn_res_norm: one launch per read, two (split columns) for "
                "deep reads"),
        Variant("torch.compile", "peer", compiled(reference),
                "torch.compile of the reference (Inductor)", devices=("cuda",)),
    ),
    check=check,
    bytes_moved=bytes_moved,
    params={"M": 1, "n_sealed": None, "weight_dtype": "bf16"},
    applies=lambda cfg: cfg.attn_res_block > 0,
)
