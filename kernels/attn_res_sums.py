"""An AttnRes read whose sums its producer left (docs/model.md, docs/decisions.md).

Every read in a decode token follows a projection whose epilogue writes the live sum (the
attention's output projection with its residual add). That projection can leave, for the read
after it, the candidates' sums over the columns it owns: the Gram entries G_ij = V_i . V_j and
the dots d_j = V_j . w (w = res_norm_w * res_proj_w) of V = (bank rows, live). The read is then
the split schedule's second launch alone (``attn_res.py``): from all of a token's sums, the
softmax weights p, rstd of h from p^T G p, and each program's chunk of h and h_normed; no
reduction over the columns after its wait.

Layout of the sums (one fp32 buffer, :func:`sums_numel` words): for every token m and slot s of
P = cdiv(H, slot_cols) (columns [s * slot_cols, (s + 1) * slot_cols)), a [NB, NB] Gram block,
then after all of them an [NB] dots block per (m, s); NB = max(16, next_power_of_2(N + 1)),
padded entries 0. ``atomic``: the producer's programs of a slot add into it (the buffer must be
zero before the producer runs: ``clear`` of the read before zeroes the next one); else every
program stores its own slot (slot_cols = its rows a tile: deterministic, more slots to sum).

The read may also have no launch of its own: a dense GEMV consuming its h_normed takes
(:class:`ReadInput`, live) instead (``dense_gemv(live, w, read_input=...)``), each program
mixing its K steps from the sums (``kernels/dense/mix.py``); that GEMV zeroes the next read's
sums (``clear``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton

from .attn_res import MAX_SEALED, AttnResConfig, _attn_res_mix_kernel, _check_weight
from .runtime import INTERPRETED, check_device, check_number

__all__ = ["ReadSums", "read_sums", "sums_numel", "attn_res_norm_from_sums", "SLOT_COLS",
           "ReadInput", "read_input"]

BLOCK_P = 16  # slots the read loads at once
SLOT_COLS = 512  # columns a slot covers by default


def _nb(n_sealed: int) -> int:
    return max(16, triton.next_power_of_2(n_sealed + 1))


def sums_numel(m: int, hidden: int, n_sealed: int, slot_cols: int) -> int:
    """fp32 words of the sums of a read of ``n_sealed`` sealed rows and live over M tokens."""
    nb = _nb(n_sealed)
    return m * triton.cdiv(hidden, slot_cols) * (nb * nb + nb)


@dataclass(frozen=True)
class ReadSums:
    """What a producer GEMV (``dense_gemv(read_sums=...)``) leaves for the read after it, and
    what that read (:func:`attn_res_norm_from_sums`) takes: the sealed rows, the score's
    weights, the sums buffer and its layout. Build it with :func:`read_sums`."""

    bank: torch.Tensor
    res_norm_weight: torch.Tensor
    res_proj_weight: torch.Tensor
    buffer: torch.Tensor
    slot_cols: int
    atomic: bool

    @property
    def n_sealed(self) -> int:
        return self.bank.shape[0]

    @property
    def tokens(self) -> int:
        return self.bank.shape[1]

    @property
    def hidden(self) -> int:
        return self.bank.shape[2]

    @property
    def slots(self) -> int:
        """P: slots a token."""
        return triton.cdiv(self.hidden, self.slot_cols)

    @property
    def nb(self) -> int:
        return _nb(self.n_sealed)

    def gram(self) -> torch.Tensor:
        """The Gram blocks' words (a view of the buffer)."""
        return self.buffer[:self.tokens * self.slots * self.nb * self.nb]

    def dots(self) -> torch.Tensor:
        """The dots blocks' words (a view of the buffer)."""
        n = self.tokens * self.slots
        return self.buffer[n * self.nb * self.nb:n * (self.nb * self.nb + self.nb)]


def read_sums(bank: torch.Tensor, res_norm_weight: torch.Tensor,
              res_proj_weight: torch.Tensor, *, buffer: torch.Tensor | None = None,
              slot_cols: int = SLOT_COLS, atomic: bool = True) -> ReadSums:
    """Validated :class:`ReadSums` for a read of ``bank`` [N, M, H] bf16 (0 <= N <=
    MAX_SEALED sealed rows, hidden dimension contiguous) and the live sum its producer writes.
    res_norm_weight, res_proj_weight: [H] bf16 or fp32, the read's score weights.
    buffer: fp32, contiguous, at least :func:`sums_numel` words, zero where ``atomic`` (None:
    a zeroed one is allocated). slot_cols: columns a slot covers (a positive multiple of the
    producer's tile rows; without ``atomic`` exactly its tile rows)."""
    if not isinstance(bank, torch.Tensor):
        raise ValueError(f"bank: expected a torch.Tensor, got {type(bank).__name__}")
    if bank.dtype != torch.bfloat16 or bank.dim() != 3:
        raise ValueError(f"bank: expected bf16 [N, M, H], got {bank.dtype} "
                         f"{list(bank.shape)}")
    n, m, h = bank.shape
    if n > MAX_SEALED:
        raise ValueError(f"bank: expected at most MAX_SEALED={MAX_SEALED} sealed rows, got N={n}")
    if m < 1 or h < 1:
        raise ValueError(f"bank: expected M >= 1 tokens and H >= 1, got {list(bank.shape)}")
    check_device("bank", bank)
    if n and bank.stride(2) != 1:
        raise ValueError(f"bank: expected the hidden (last) dimension contiguous, got strides "
                         f"{bank.stride()}")
    _check_weight("res_norm_weight", res_norm_weight, h, bank.device)
    _check_weight("res_proj_weight", res_proj_weight, h, bank.device)
    if isinstance(slot_cols, bool) or not isinstance(slot_cols, int) or slot_cols < 1:
        raise ValueError(f"slot_cols: expected a positive int, got {slot_cols!r}")
    if not isinstance(atomic, bool):
        raise ValueError(f"atomic: expected a bool, got {atomic!r}")
    need = sums_numel(m, h, n, slot_cols)
    if buffer is None:
        buffer = torch.zeros(need, dtype=torch.float32, device=bank.device)
    elif (not isinstance(buffer, torch.Tensor) or buffer.dtype != torch.float32
          or buffer.device != bank.device or not buffer.is_contiguous()
          or buffer.numel() < need):
        raise ValueError(f"buffer: expected a contiguous fp32 tensor of at least {need} words "
                         f"on {bank.device}, got "
                         f"{buffer.dtype if isinstance(buffer, torch.Tensor) else type(buffer)}"
                         f" {getattr(buffer, 'shape', '')}")
    return ReadSums(bank, res_norm_weight, res_proj_weight, buffer.view(-1)[:need], slot_cols,
                    atomic)


def attn_res_norm_from_sums(sums: ReadSums, live: torch.Tensor, norm_weight: torch.Tensor, *,
                            eps: float = 1e-5, return_h: bool = False,
                            clear: torch.Tensor | None = None,
                            config: AttnResConfig | None = None
                            ) -> tuple[torch.Tensor | None, torch.Tensor]:
    """``attn_res_norm(sums.bank, live, sums.res_norm_weight, sums.res_proj_weight,
    norm_weight)`` from the sums the producer of ``live`` left (one launch; the result of the
    split schedule: h's sum of squares before its rounding, p^T G p).

    live: [M, H] bf16, the producer's output. norm_weight: [H] bf16 or fp32. clear: None, or an
    fp32 contiguous tensor the launch zeroes (the next read's atomic sums: that read's producer
    must run after this launch). config: the mix grid's ``split_h``, ``split_warps`` and
    ``split_pdl`` (None: the defaults). Returns ``(h or None, h_normed)``, [M, H] bf16.
    """
    if not isinstance(sums, ReadSums):
        raise ValueError(f"sums: expected a ReadSums (read_sums()), got {type(sums).__name__}")
    if not isinstance(live, torch.Tensor) or live.dtype != torch.bfloat16:
        raise ValueError(f"live: expected a bf16 torch.Tensor, got "
                         f"{getattr(live, 'dtype', type(live).__name__)}")
    m, h = sums.tokens, sums.hidden
    if tuple(live.shape) != (m, h):
        raise ValueError(f"live: expected [M, H] = [{m}, {h}] (the bank's), got "
                         f"{list(live.shape)}")
    if live.device != sums.bank.device or live.stride(1) != 1:
        raise ValueError(f"live: expected a row-contiguous tensor on {sums.bank.device}, got "
                         f"strides {live.stride()} on {live.device}")
    _check_weight("norm_weight", norm_weight, h, live.device)
    eps = check_number("eps", eps, positive=True)
    if not isinstance(return_h, bool):
        raise ValueError(f"return_h: expected a bool, got {return_h!r}")
    _check_clear(clear, sums, "live")
    if config is not None and not isinstance(config, AttnResConfig):
        raise ValueError(f"config: expected an AttnResConfig or None, got "
                         f"{type(config).__name__}")
    cfg = config or AttnResConfig()
    block_h = cfg.split_h or min(triton.next_power_of_2(h), cfg.max_block_h)
    out = torch.empty((2, m, h), dtype=torch.bfloat16, device=live.device)
    n = sums.n_sealed
    bank_arg = sums.bank if n else live
    pdl = cfg.split_pdl and not INTERPRETED
    _attn_res_mix_kernel[(triton.cdiv(h, block_h), m)](
        bank_arg, live, norm_weight, out[0], out[1], sums.gram(), sums.dots(),
        clear if clear is not None else sums.buffer,
        sums.bank.stride(0) if n else 0, sums.bank.stride(1) if n else 0, live.stride(0), h,
        n, h, float(eps), sums.slots, clear.numel() if clear is not None else 0,
        PDL=pdl, BLOCK_NB=sums.nb, BLOCK_H=block_h, BLOCK_P=min(BLOCK_P, triton.next_power_of_2(
            sums.slots)), STORE_H=return_h, CLEAR=clear is not None,
        num_warps=cfg.split_warps, **({"launch_pdl": True} if pdl else {}))
    return (out[0] if return_h else None), out[1]


def _check_clear(clear, sums: ReadSums, where: str) -> None:
    """clear: None, or a contiguous fp32 tensor on the sums' device other than their buffer."""
    if clear is None:
        return
    if (not isinstance(clear, torch.Tensor) or clear.dtype != torch.float32
            or clear.device != sums.bank.device or not clear.is_contiguous()):
        raise ValueError(f"clear: expected None or a contiguous fp32 tensor on the device of "
                         f"{where}")
    if clear.data_ptr() == sums.buffer.data_ptr():
        raise ValueError("clear: the read's own sums; give the next read's buffer")


@dataclass(frozen=True)
class ReadInput:
    """A projection's input given as the AttnRes read of its live sum: the sums its producer
    left (``dense_gemv(read_sums=sums)``), the read's norm weight and eps, and the next read's
    sums buffer the projection zeroes (None: none). Build it with :func:`read_input`."""

    sums: ReadSums
    norm_weight: torch.Tensor
    eps: float
    clear: torch.Tensor | None


def read_input(sums: ReadSums, norm_weight: torch.Tensor, *, eps: float = 1e-5,
               clear: torch.Tensor | None = None) -> ReadInput:
    """Validated :class:`ReadInput`: ``sums`` atomic (slots summed by the producer's programs),
    norm_weight [H] bf16 or fp32, eps > 0, clear None or a contiguous fp32 tensor on the
    bank's device other than the sums' own buffer."""
    if not isinstance(sums, ReadSums):
        raise ValueError(f"sums: expected a ReadSums (read_sums()), got {type(sums).__name__}")
    if not sums.atomic:
        raise ValueError("sums: a projection's read takes atomic sums (a slot of many "
                         "programs); stored per-tile slots are the mix launch's")
    _check_weight("norm_weight", norm_weight, sums.hidden, sums.bank.device)
    eps = check_number("eps", eps, positive=True)
    _check_clear(clear, sums, "the bank")
    return ReadInput(sums, norm_weight, float(eps), clear)
