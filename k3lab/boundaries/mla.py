"""MLA decode attention boundary (docs/model.md): split-KV absorbed attention over the
latent cache, the split count picked from host shapes (or fixed, for one CUDA graph at every
length)."""

from __future__ import annotations

import torch

from k3lab.boundaries import Boundary, Variant, assert_close, compiled
from k3lab.config import Preset
from k3lab.kernels import mla_decode
from k3lab.reference.mla import mla_decode_reference
from k3lab.weights import make_generator, mla_cache, randn

__all__ = ["BOUNDARY", "make_inputs", "check", "bytes_moved", "seq_lens_for",
           "O_LAT_ATOL", "O_LAT_RTOL"]

# o_lat is a softmax-weighted mean of unit-RMS latent rows: the kernel's bf16 output rounding
# (2^-9 relative) plus, on the GPU, bf16 probabilities in the P @ C product.
O_LAT_ATOL = 1e-2
O_LAT_RTOL = 1e-2
# The serving-engine default this boundary is compared with (vLLM's Triton MLA decode).
PEER_FIXED_SPLITS = 4


def seq_lens_for(m: int, context: int) -> list[int]:
    """Per-token lengths: token 0 has ``context``, the others shorter and all different (down to
    about half), so an M > 1 batch exercises per-token lengths."""
    return [max(1, context - (i * context) // (2 * m)) for i in range(m)]


def make_inputs(cfg: Preset, device, seed: int, M: int = 1, context: int = 4096,
                num_splits: int | None = None) -> dict:
    """q_lat [M, Hl, C] and q_rope [M, Hl, R] bf16, std 1 (the std ``q_nope @ W_uk`` has with
    ``mla_weights``' kv_b gain 2: 128 * 4 / 512 = 1, so scores have std about 1.6 and the softmax
    is neither flat nor one-hot); kv_cache [M, context, C + R] bf16 and seq_lens [M] int32 from
    ``k3lab.weights.mla_cache`` (lengths from :func:`seq_lens_for`); sm_scale = (nope+rope)^-0.5;
    num_splits for the fused variant (None = heuristic)."""
    gen = make_generator(seed, device)
    hl, c, r = cfg.mla_heads, cfg.kv_lora, cfg.qk_rope
    inputs = {
        "q_lat": randn((M, hl, c), gen),
        "q_rope": randn((M, hl, r), gen),
        **mla_cache(cfg, M, context, seq_lens_for(M, context), gen),
        "sm_scale": cfg.qk_head ** -0.5,
        "num_splits": num_splits,
    }
    return inputs


def _args(inputs: dict):
    return inputs["q_lat"], inputs["q_rope"], inputs["kv_cache"], inputs["seq_lens"]


def _reference(inputs: dict) -> torch.Tensor:
    return mla_decode_reference(*_args(inputs), sm_scale=inputs["sm_scale"])


def _fused(inputs: dict) -> torch.Tensor:
    return mla_decode(*_args(inputs), sm_scale=inputs["sm_scale"],
                      num_splits=inputs.get("num_splits"), config=inputs.get("config"))


def _fixed_splits(inputs: dict) -> torch.Tensor:
    return mla_decode(*_args(inputs), sm_scale=inputs["sm_scale"], num_splits=PEER_FIXED_SPLITS)


def check(out, ref, inputs) -> dict:
    return {"o_lat": assert_close("o_lat", out, ref, atol=O_LAT_ATOL, rtol=O_LAT_RTOL)}


def bytes_moved(inputs: dict) -> int:
    """KV-cache bytes actually read (sum of lengths x row bytes) plus q in and o_lat out."""
    kv = inputs["kv_cache"]
    row = kv.shape[-1] * kv.element_size()
    q = inputs["q_lat"].nbytes + inputs["q_rope"].nbytes
    return int(inputs["seq_lens"].sum()) * row + q + inputs["q_lat"].nbytes


BOUNDARY = Boundary(
    name="mla",
    title="MLA decode attention (split-KV, absorbed)",
    owns=("mla.attention",),
    make_inputs=make_inputs,
    variants=(
        Variant("reference", "reference", _reference,
                "absorbed attention in fp32 PyTorch over the masked cache"),
        Variant("fused", "fused", _fused,
                "split partials + lse combine (two Triton kernels), split count from the "
                "heuristic unless num_splits is given"),
        Variant(f"fused-{PEER_FIXED_SPLITS}-splits", "peer", _fixed_splits,
                f"our kernels at {PEER_FIXED_SPLITS} fixed splits, the count a serving engine "
                "hard-codes (vLLM Triton MLA decode)"),
        Variant("torch.compile", "peer", compiled(_reference),
                "torch.compile of the reference", devices=("cuda",)),
    ),
    check=check,
    bytes_moved=bytes_moved,
    params={"M": 1, "context": 4096, "num_splits": None},
    applies=lambda cfg: cfg.mla_heads > 0,
)
