"""MXFP4 weights (OCP microscaling FP4) as the MoE kernels take them.

Along the last (input) dimension every group of 32 weights shares one uint8 E8M0 scale
``2 ** (s - 127)``; each weight is an FP4 E2M1 code (bit 3 sign, bits 0-2 an index into
``E2M1_VALUES``), two codes per byte, the even element in the low nibble. The codes come in two
layouts: "rows" (the checkpoint's) and "tiled" (16-byte pieces permuted so the tensor-core tiles
read contiguous bytes; see ``mxfp4_tiled_codes``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["E2M1_VALUES", "MXFP4", "MXFP4_GROUP", "mxfp4_quantize", "mxfp4_dequantize",
           "mxfp4_layout", "mxfp4_tiled_codes", "mxfp4_tiled_ok"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
MXFP4_GROUP = 32
MXFP4_LAYOUTS = ("rows", "tiled")
MXFP4_TILE_ROWS, MXFP4_TILE_K = 16, 256  # the tiled layout's blocks
_E2M1_MIDPOINTS = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


@dataclass
class MXFP4:
    """An MXFP4 weight of logical shape ``[..., N, K]``.

    packed: uint8 [..., N, K // 2], two E2M1 codes per byte (even element in the low nibble).
    scales: uint8 [..., N, K // 32], E8M0 exponents (value ``2 ** (s - 127)``).
    layout: "rows" (row r's codes at packed[..., r, :]) or "tiled" (the same bytes in
    mxfp4_tiled_codes' order: what the MoE kernels' tensor-core tiles read fastest; the scales
    keep the row layout). Convert with ``mxfp4_layout``.
    """

    packed: torch.Tensor
    scales: torch.Tensor
    layout: str = "rows"

    def __post_init__(self):
        if self.layout not in MXFP4_LAYOUTS:
            raise ValueError(f"layout: expected one of {MXFP4_LAYOUTS}, got {self.layout!r}")

    @property
    def shape(self) -> tuple[int, ...]:
        return (*self.packed.shape[:-1], self.packed.shape[-1] * 2)

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scales.nbytes

    def dequantize(self) -> torch.Tensor:
        return mxfp4_dequantize(self)


def mxfp4_quantize(w: torch.Tensor) -> MXFP4:
    """Round ``w`` [..., K] (K a multiple of 32) to MXFP4, to the nearest E2M1 value per element.

    The shared exponent of a group is ``floor(log2(amax)) - 2`` (E2M1's largest exponent is 2), as
    in the OCP spec; magnitudes above 6 times the scale saturate to 6.
    """
    k = w.shape[-1]
    if k % MXFP4_GROUP:
        raise ValueError(f"w: MXFP4 needs the last dimension to be a multiple of 32, got {k}")
    g = w.float().reshape(*w.shape[:-1], k // MXFP4_GROUP, MXFP4_GROUP)
    amax = g.abs().amax(-1, keepdim=True)
    exp = torch.floor(torch.log2(amax.clamp_min(2.0 ** -126))) - 2
    exp = exp.clamp(-127, 127)
    v = (g / torch.exp2(exp)).clamp(-6.0, 6.0)
    mids = torch.tensor(_E2M1_MIDPOINTS, device=w.device)
    code = torch.bucketize(v.abs(), mids).to(torch.uint8) | ((v < 0).to(torch.uint8) << 3)
    code = code.reshape(*w.shape[:-1], k)
    packed = code[..., 0::2] | (code[..., 1::2] << 4)
    scales = (exp.squeeze(-1) + 127).to(torch.uint8)
    return MXFP4(packed.contiguous(), scales.contiguous())


def mxfp4_tiled_codes(packed: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """Codes uint8 [..., N, K / 2] (N a multiple of 16, K of 256) from the row layout to the tiled
    one (inverse: back). The tiled layout permutes 16-byte pieces (one group of 32 codes of one
    row each): a 16-row x 256-column block (one K step of a 16-row tile, 2 KB) is stored as
    [row half hi, step half h, row g, quarter t] pieces, row 8 hi + g, group 4 h + t of the
    step, and the blocks follow in (row tile, step) order. A warp of the tensor-core tiles
    (lane 4 g + t holds group t + 4 h of rows g and g + 8) then reads 512 contiguous bytes with
    each 16-byte load instead of 64 bytes of each of 8 rows (docs/decisions.md)."""
    *lead, n, kb = packed.shape
    if packed.dtype != torch.uint8 or n % MXFP4_TILE_ROWS or kb % (MXFP4_TILE_K // 2):
        raise ValueError(f"packed: the tiled layout needs uint8 [..., N, K / 2] with N a multiple "
                         f"of {MXFP4_TILE_ROWS} and K of {MXFP4_TILE_K}, got {packed.dtype} "
                         f"{list(packed.shape)}")
    rows = (n // 16, 2, 8, kb // 128, 2, 4, 16)  # (tile, hi, g, step, h, t, byte)
    tiled = (n // 16, kb // 128, 2, 2, 8, 4, 16)  # (tile, step, hi, h, g, t, byte)
    order = (0, 3, 1, 4, 2, 5, 6)
    if inverse:
        rows, order = tiled, tuple(order.index(i) for i in range(7))
    lead_ix = tuple(range(len(lead)))
    out = packed.reshape(*lead, *rows).permute(*lead_ix, *(len(lead) + i for i in order))
    return out.contiguous().reshape(packed.shape)


def mxfp4_tiled_ok(shape) -> bool:
    """Whether an MXFP4 weight of logical shape [..., N, K] can take the tiled layout."""
    return shape[-2] % MXFP4_TILE_ROWS == 0 and shape[-1] % MXFP4_TILE_K == 0


def mxfp4_layout(q: MXFP4, layout: str) -> MXFP4:
    """``q`` with its codes in ``layout`` ("rows" or "tiled"; a copy of the codes unless ``q``
    has it already; the scales are shared)."""
    if layout not in MXFP4_LAYOUTS:
        raise ValueError(f"layout: expected one of {MXFP4_LAYOUTS}, got {layout!r}")
    if q.layout == layout:
        return q
    return MXFP4(mxfp4_tiled_codes(q.packed, inverse=layout == "rows"), q.scales, layout)


def mxfp4_dequantize(q: MXFP4) -> torch.Tensor:
    """fp32 tensor of shape ``q.shape`` with the exact values the MXFP4 codes represent."""
    table = torch.tensor(E2M1_VALUES, device=q.packed.device)
    packed = mxfp4_layout(q, "rows").packed
    codes = torch.stack((packed & 0xF, packed >> 4), dim=-1).flatten(-2).long()
    vals = table[codes & 7] * (1.0 - 2.0 * (codes >> 3).float())
    scale = torch.exp2(q.scales.float() - 127).repeat_interleave(MXFP4_GROUP, dim=-1)
    return vals * scale
