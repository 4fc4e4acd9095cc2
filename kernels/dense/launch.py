"""Launcher of the dense decode GEMV: validation, tiling, workspace."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
import triton

from ..attn_res_sums import ReadInput, ReadSums
from ..runtime import INTERPRETED, check_number, check_tensor
from .config import GemvConfig
from .gemv import ACT_NONE, ACT_SILU, ACT_SITU, dense_gemv_kernel
from .tuned import TUNED_M1, TUNED_M1_E4M3

__all__ = ["MAX_TOKENS", "MAX_SEGMENTS", "GemvLaunch", "dense_gemv", "prepare_gemv",
           "mix_launch",
           "default_config", "heuristic_config", "interpreter_config", "call_config"]

MAX_TOKENS = 16  # decode batches; beyond, a GEMM tile wins
MAX_SEGMENTS = 8
ACTIVATIONS = {None: ACT_NONE, "situ": ACT_SITU, "silu": ACT_SILU}
# The rule, for shapes the measured table (tuned.py) does not list. One token: 8-row tiles (a
# program's rows stay few, so enough programs stream at once), 512-column steps, K split until the
# grid holds about MIN_PROGRAMS programs (thin projections), PDL with an L2 prefetch of the first
# steps for weights under PREFETCH_BELOW bytes (their launch and ramp are a large share). Several
# tokens: 16-row tiles (the tensor-core path). docs/decisions.md has the sweeps behind these.
MIN_PROGRAMS = 160
MAX_UNROLL = 16  # K steps a share unrolls at most (GemvConfig.unroll_k)
MAX_SPLIT = 4
PREFETCH_BELOW = 16 << 20
SUMS_ARGS = ("p_sb", "p_srn", "p_srp", "p_sums", "s_n", "s_sbn", "s_sbm", "s_p", "s_cols")
_tickets: dict = {}


def default_config(m: int, rows: int, k: int, gated: bool = False, *,
                   e4m3: bool = False) -> GemvConfig:
    """The tiling for ``rows`` output rows (per gate/up half when ``gated``) over K at M tokens:
    the measured one-token table where it lists the shape, else :func:`heuristic_config`.
    ``e4m3``: a one-byte weight at one token takes its own table's entry, else the bf16
    tiling's bytes a step, twice its columns (up to K's next power of two); the tensor-core path
    of several tokens keeps the bf16 tiling (at twice the columns it spills: offline sm_90 build
    of K3's tail at M = 4)."""
    key = (rows, k, bool(gated))
    if m > 1:
        return heuristic_config(m, rows, k)
    if e4m3 and key in TUNED_M1_E4M3:
        return TUNED_M1_E4M3[key]
    config = TUNED_M1.get(key) or heuristic_config(m, rows, k)
    if e4m3:
        config = replace(config, block_k=min(2 * config.block_k,
                                             max(16, triton.next_power_of_2(k))))
    return config


def heuristic_config(m: int, rows: int, k: int) -> GemvConfig:
    """The rule's tiling for ``rows`` output rows over K at M tokens."""
    block_k = 512 if k >= 512 else max(16, triton.next_power_of_2(k))
    block_n = 8 if m == 1 else 16
    tiles = triton.cdiv(rows, block_n)
    steps = triton.cdiv(k, block_k)
    split = 1
    while split < MAX_SPLIT and tiles * split < MIN_PROGRAMS and steps >= 4 * split:
        split *= 2
    small = rows * k * 2 < PREFETCH_BELOW
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split,
                      num_stages=4 if rows <= 2304 else 3, pdl=True,
                      prefetch_steps=2 if small else 0)


def interpreter_config(m: int, rows: int, k: int) -> GemvConfig:
    """The tiling ``dense_gemv`` takes under the Triton interpreter when given no config: the
    fewest programs (the interpreter runs programs one after another, so a call costs about its
    program count; a tile choice changes speed only). The GPU tilings stay reachable there by
    passing them (the tests run every candidate of the tune sweep)."""
    return GemvConfig(block_n=min(128, max(8, triton.next_power_of_2(rows))),
                      block_k=max(16, min(256, triton.next_power_of_2(k))), split_k=1,
                      num_stages=1, pdl=False, prefetch_steps=0)


def call_config(config: GemvConfig | None, m: int, rows: int, k: int, gated: bool = False, *,
                e4m3: bool = False) -> GemvConfig:
    """The tiling :func:`dense_gemv` runs given ``config`` for ``rows`` output rows (per
    gate/up half when gated) over K at M tokens: ``config`` itself, else under the interpreter
    :func:`interpreter_config`, else :func:`default_config`; for a caller that changes one
    field of whatever the call would take."""
    if config is not None:
        if not isinstance(config, GemvConfig):
            raise ValueError(f"config: expected a GemvConfig or None, got {type(config).__name__}")
        return config
    if INTERPRETED:
        return interpreter_config(m, rows, k)
    return default_config(m, rows, k, gated=gated, e4m3=e4m3)


def _number(name, v, *, positive=False):
    return check_number(name, v, positive=positive)


def _ticket_buffer(device: torch.device, tiles: int) -> torch.Tensor:
    """Zeroed int32 tickets of the split-K reduction, one per row tile, kept per device and
    stream: each launch leaves them zero again, so one allocation serves every call and every
    CUDA-graph replay (make the first call before capturing)."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (str(device), stream)
    buf = _tickets.get(key)
    if buf is None or buf.numel() < tiles:
        buf = torch.zeros(max(tiles, 4096), dtype=torch.int32, device=device)
        _tickets[key] = buf
    return buf


@dataclass(frozen=True)
class GemvLaunch:
    """A validated dense GEMV launch: dense_gemv_kernel's positional arguments and named
    constexprs, its grid (row tiles, K shares), warps, whether it goes by PDL and its register
    cap (0: none; a fused launch, kernels/moe/front_route.py, runs the same programs inside its
    own grid)."""

    args: tuple
    constexprs: dict
    grid: tuple[int, int]
    num_warps: int
    pdl: bool
    max_registers: int = 0
    # the AttnRes read's sums (kernels/attn_res_sums.py): off unless read_sums is given
    sums_args: dict = field(default_factory=lambda: dict(zip(SUMS_ARGS, (0,) * 8 + (1,),
                                                              strict=True)))
    sums_constexprs: dict = field(default_factory=lambda: {"SUMS": 0, "S_NB": 16,
                                                           "S_BLOCK_C": 16,
                                                           "S_PREFETCH": False})
    # x scaled per head by its producer's RMS (head_sums: dense_gemv's own launch only) or mixed
    # from an AttnRes read's sums (read_input: MIX)
    prologue_constexprs: dict = field(default_factory=dict)

    def inner_constexprs(self, pdl: bool) -> dict:
        """The constexprs, named ``F_<name>``, of these programs run inside another kernel's
        1-D grid (kernels/moe/front_route.py, shared_down.py): ``pdl``, whether they wait
        for the previous grid (then with the tiling's L2 prefetch before it); never waiting
        last."""
        const = {**self.constexprs, "PDL": pdl, "WAIT_LAST": False, "TRIGGER_LAST": False,
                 "PREFETCH": self.constexprs["PREFETCH"] if pdl else 0}
        return {f"F_{k}": v for k, v in const.items()}


def dense_gemv(x: torch.Tensor, weight: torch.Tensor, *, splits=None, activation=None,
               residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
               x2: torch.Tensor | None = None, weight2: torch.Tensor | None = None,
               weight_scale: torch.Tensor | None = None, eps: float = 1e-5,
               situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
               out_dtype: torch.dtype = torch.bfloat16, config: GemvConfig | None = None,
               read_sums: ReadSums | None = None, head_sums: torch.Tensor | None = None,
               head_dim: int = 0, read_input: ReadInput | None = None):
    """y = x @ weight^T for a decode batch, one launch.

    x: bf16 or fp32 [M, K], 1 <= M <= MAX_TOKENS (fp32 x meets the weights in fp32 at one
    token; several tokens round it to bf16 for the tensor cores).
    weight: bf16 [N, K] (with ``activation``, [2S, K]: gate rows then up rows, and
    y = act(x @ gate^T, x @ up^T) is [M, S]); or e4m3 (torch.float8_e4m3fn) [N, K] with
    ``weight_scale``, fp32 [N], y = x @ (weight * weight_scale[:, None])^T (no activation, no
    splits; ``x2 @ weight2^T`` is added unscaled).
    splits: row counts summing to N (merged projections): returns a tuple of contiguous
        [M, n_i] tensors, one per segment, instead of one [M, N] tensor. With ``activation``:
        (plain rows, 2S gate/up rows), returning ([M, plain], act [M, S]).
    activation: None, "situ" (beta situ_beta, linear beta situ_linear_beta) or "silu".
    residual: bf16 or fp32 [M, N_out] added to the output (single output only).
    norm_weight: [K] (fp32 or bf16): y = RMSNorm(x; eps) @ weight^T, the norm in the prologue.
    x2, weight2: a second product added in the same launch, y += x2 @ weight2^T (x2 bf16 or fp32
        [M, K2], weight2 bf16 [N, K2]; not normalized; single output, no activation).
    out_dtype: bf16 or fp32. config: GemvConfig (None: ``default_config``; under the
    interpreter ``interpreter_config``).
    read_sums: a :class:`~kernels.attn_res_sums.ReadSums` for the AttnRes read of the output
        as its live sum (bf16 [M, N] output, N its hidden size, no activation or splits): the
        epilogue leaves that read's sums (``attn_res_norm_from_sums``).
    head_sums, head_dim: x is a per-head output of ``head_dim`` columns a head (K a multiple
        of it) whose producer left, per token and head, partial sums of its squares: fp32
        [M, K / head_dim, P], P a power of two up to 16 (``kda_decode``'s deferred RMS). Each
        column is scaled by rsqrt(sum / head_dim + eps) in the prologue, so x's per-head
        RMSNorm costs no pass of its own (no ``norm_weight``; the norm's weight is the
        producer's).
    read_input: a :class:`~kernels.attn_res_sums.ReadInput`: x is the live sum [M, H] bf16 of
        an AttnRes read whose sums x's producer left, and the projection's input is that
        read's h_normed, mixed from the sums as each program loads its K steps: the read
        costs no launch (no ``norm_weight``, ``head_sums``, ``x2``, or ``wait_last``).
    """
    launch, outputs = prepare_gemv(
        x, weight, splits=splits, activation=activation, residual=residual,
        norm_weight=norm_weight, x2=x2, weight2=weight2, weight_scale=weight_scale, eps=eps,
        situ_beta=situ_beta, situ_linear_beta=situ_linear_beta, out_dtype=out_dtype,
        config=config, read_sums=read_sums)
    if head_sums is not None or head_dim:
        launch = _head_launch(launch, x, head_sums, head_dim, norm_weight, eps)
    if read_input is not None:
        launch = mix_launch(launch, x, read_input, config)
    dense_gemv_kernel[launch.grid](*launch.args, **launch.sums_args, **launch.constexprs,
                                   **launch.sums_constexprs, **launch.prologue_constexprs,
                                   num_warps=launch.num_warps,
                                   **({"launch_pdl": True} if launch.pdl else {}),
                                   **({"maxnreg": launch.max_registers}
                                      if launch.max_registers else {}))
    return outputs()


def prepare_gemv(x: torch.Tensor, weight: torch.Tensor, *, splits=None, activation=None,
                 residual: torch.Tensor | None = None, norm_weight: torch.Tensor | None = None,
                 x2: torch.Tensor | None = None, weight2: torch.Tensor | None = None,
                 weight_scale: torch.Tensor | None = None, eps: float = 1e-5,
                 situ_beta: float = 4.0, situ_linear_beta: float = 25.0,
                 out_dtype: torch.dtype = torch.bfloat16, config: GemvConfig | None = None,
                 default_tiling=None, read_sums: ReadSums | None = None):
    """Validate and lay out :func:`dense_gemv`'s launch (same arguments); returns
    (:class:`GemvLaunch`, a function giving dense_gemv's result once the launch has run).
    ``default_tiling(m, rows, k, gated)``: the compiled launch's tiling when ``config`` is None
    (rows: output rows, per gate/up half when gated), instead of :func:`default_config`.
    """
    check_tensor("x", x, dtypes=(torch.bfloat16, torch.float32), dim=2)
    dev = x.device
    check_tensor("weight", weight, dtypes=(torch.bfloat16, torch.float8_e4m3fn), dim=2,
                 device=dev)
    m, k = x.shape
    if (weight.dtype == torch.float8_e4m3fn) != (weight_scale is not None):
        raise ValueError("weight_scale: expected fp32 [N] row scales with an e4m3 weight, and "
                         f"none with a bf16 one; got weight {weight.dtype}, weight_scale "
                         f"{None if weight_scale is None else weight_scale.dtype}")
    if weight_scale is not None:
        check_tensor("weight_scale", weight_scale, dtypes=(torch.float32,), dim=1, device=dev)
        if weight_scale.numel() != weight.shape[0]:
            raise ValueError(f"weight_scale: expected [N={weight.shape[0]}], got "
                             f"{list(weight_scale.shape)}")
        if activation is not None or splits is not None:
            raise ValueError("weight_scale: an e4m3 weight takes no activation and no splits")
    if not 1 <= m <= MAX_TOKENS:
        raise ValueError(f"x: expected 1 <= M <= {MAX_TOKENS} tokens (a decode batch), got "
                         f"M={m}")
    if weight.shape[1] != k:
        raise ValueError(f"weight: expected [N, K={k}] (K of x), got {list(weight.shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'situ' or 'silu', got {activation!r}")
    act = ACTIVATIONS[activation]
    rows = weight.shape[0]
    bounds, mixed, ng = [0], False, 0
    if splits is not None:
        if residual is not None:
            raise ValueError("splits: merged outputs take no residual")
        if (not isinstance(splits, (list, tuple)) or not splits or len(splits) > MAX_SEGMENTS
                or any(isinstance(s, bool) or not isinstance(s, int) or s < 1 for s in splits)):
            raise ValueError(f"splits: expected 1..{MAX_SEGMENTS} positive ints, got {splits!r}")
        if sum(splits) != rows:
            raise ValueError(f"splits: expected row counts summing to N={rows}, got "
                             f"{list(splits)} (sum {sum(splits)})")
        if act and (len(splits) != 2 or splits[1] % 2):
            raise ValueError(f"splits: with activation={activation!r} expected (plain rows, "
                             f"2S gate/up rows), got {list(splits)}")
        mixed = bool(act)
        for s in splits[:-1]:
            bounds.append(bounds[-1] + s)
    if mixed:  # plain rows, then the activation's gate/up rows
        n, ng = splits[0], splits[1] // 2
    elif act:
        if rows % 2:
            raise ValueError(f"weight: with activation={activation!r} expected [2S, K] (gate "
                             f"rows then up rows), got an odd row count {rows}")
        n = rows // 2
    else:
        n = rows
    beta = _number("situ_beta", situ_beta, positive=True)
    linear_beta = _number("situ_linear_beta", situ_linear_beta, positive=True)
    eps = _number("eps", eps, positive=True)
    if out_dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"out_dtype: expected torch.bfloat16 or torch.float32, got {out_dtype}")
    if config is None and default_tiling is not None and not INTERPRETED:
        config = default_tiling(m, n + ng, k, bool(act))
    elif config is None:
        config = call_config(None, m, n + ng, k, bool(act), e4m3=weight_scale is not None)
    elif not isinstance(config, GemvConfig):
        raise ValueError(f"config: expected a GemvConfig or None, got {type(config).__name__}")
    if residual is not None:
        check_tensor("residual", residual, dtypes=(torch.bfloat16, torch.float32), dim=2,
                     device=dev)
        if tuple(residual.shape) != (m, n):
            raise ValueError(f"residual: expected [M, N] = [{m}, {n}], got "
                             f"{list(residual.shape)}")
    if norm_weight is not None:
        check_tensor("norm_weight", norm_weight, dtypes=(torch.float32, torch.bfloat16), dim=1,
                     device=dev)
        if norm_weight.numel() != k:
            raise ValueError(f"norm_weight: expected [K={k}], got {list(norm_weight.shape)}")
    if (x2 is None) != (weight2 is None):
        raise ValueError("x2: give both x2 and weight2, or neither")
    k2 = 0
    if x2 is not None:
        if act or splits is not None:
            raise ValueError("x2: a second product takes no activation and no splits")
        check_tensor("x2", x2, dtypes=(torch.bfloat16, torch.float32), dim=2, device=dev)
        check_tensor("weight2", weight2, dtypes=(torch.bfloat16,), dim=2, device=dev)
        k2 = x2.shape[1]
        if x2.shape[0] != m or tuple(weight2.shape) != (n, k2):
            raise ValueError(f"weight2: expected x2 [M={m}, K2] and weight2 [N={n}, K2], got "
                             f"x2 {list(x2.shape)}, weight2 {list(weight2.shape)}")
    if config.second_first and x2 is None and residual is None:
        raise ValueError("config: second_first moves the second product (x2, weight2) and the "
                         "residual before the first product; this call has neither")
    block_m = 1 if m == 1 else 16
    if block_m > 1 and config.block_n < 16:
        raise ValueError(f"config: block_n={config.block_n} serves one token only; M={m} takes "
                         f"the tensor-core path, which needs block_n >= 16")
    t0 = triton.cdiv(n, config.block_n)
    tiles = t0 + triton.cdiv(ng, config.block_n)
    steps = triton.cdiv(k, config.block_k)
    split = min(config.split_k, steps)
    k_split = triton.cdiv(steps, split) * config.block_k
    split = triton.cdiv(k, k_split)  # no empty share
    unroll = k_split // config.block_k if config.unroll_k else 0
    if unroll > MAX_UNROLL:
        raise ValueError(f"config: unroll_k unrolls a K share of {unroll} steps of "
                         f"{config.block_k} columns; at most {MAX_UNROLL} (a wider block_k or "
                         f"split_k, or unroll_k=False)")
    k2_split = triton.cdiv(triton.cdiv(k2, config.block_k), split) * config.block_k if k2 else 0
    y = torch.empty(m * (n + ng), dtype=out_dtype, device=dev)
    ws_cols = n + 2 * ng if mixed else n * (2 if act or x2 is not None else 1)
    ws = torch.empty(split * m * ws_cols, dtype=torch.float32, device=dev) if split > 1 else y
    cnt = _ticket_buffer(dev, tiles) if split > 1 else y
    if mixed:
        bounds = [0]
    starts = bounds[1:] + [n] * (MAX_SEGMENTS - len(bounds))  # scalars: nothing to copy
    pdl = config.pdl and not INTERPRETED
    launch = GemvLaunch(
        args=(x, weight, y, residual if residual is not None else x,
              norm_weight if norm_weight is not None else x, ws, cnt,
              x2 if x2 is not None else x, weight2 if weight2 is not None else weight,
              weight_scale if weight_scale is not None else y, *starts,
              m, n, k, k_split, k2, k2_split, t0, ng, eps, beta, linear_beta),
        constexprs=dict(
            SCALED=weight_scale is not None, BLOCK_M=block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, SPLIT_K=split,
            ACT=act, NORM=norm_weight is not None, RESIDUAL=residual is not None,
            N_SEG=len(bounds), DUAL=x2 is not None, MIXED=mixed, DOT_FP32=INTERPRETED, PDL=pdl,
            PREFETCH=config.prefetch_steps if pdl else 0, NUM_STAGES=config.num_stages,
            WAIT_LAST=pdl and config.wait_last, GATE_UP_TOGETHER=config.gate_up_together,
            UNROLL=unroll, TRIGGER_LAST=pdl and config.wait_last and config.trigger_last,
            SECOND_FIRST=config.second_first),
        grid=(tiles, split), num_warps=config.num_warps, pdl=pdl,
        max_registers=0 if INTERPRETED else config.max_registers)
    if read_sums is not None:
        launch = replace(launch, **_sums_launch(read_sums, m, n, act, splits, out_dtype, dev,
                                                config.block_n))
    return launch, lambda: _outputs(y, m, n, ng, mixed, splits)


def _head_launch(launch: GemvLaunch, x, head_sums, head_dim, norm_weight, eps) -> GemvLaunch:
    """``launch`` with x scaled per head by rsqrt(sum of head_sums / head_dim + eps)."""
    m, k = x.shape
    if head_sums is None:
        raise ValueError("head_sums: expected fp32 [M, K / head_dim, P] with head_dim, got None")
    if isinstance(head_dim, bool) or not isinstance(head_dim, int) or head_dim < 1 \
            or k % head_dim:
        raise ValueError(f"head_dim: expected a positive int dividing K={k}, got {head_dim!r}")
    if norm_weight is not None:
        raise ValueError("head_sums: a per-head RMS from the producer takes no norm_weight")
    check_tensor("head_sums", head_sums, dtypes=(torch.float32,), dim=3, device=x.device)
    p = head_sums.shape[2]
    if tuple(head_sums.shape[:2]) != (m, k // head_dim) or p not in (1, 2, 4, 8, 16):
        raise ValueError(f"head_sums: expected [M={m}, K/head_dim={k // head_dim}, P] with P a "
                         f"power of two up to 16, got {list(head_sums.shape)}")
    args = list(launch.args)
    args[4] = head_sums  # the norm weight's slot (p_g)
    return replace(launch, args=tuple(args), prologue_constexprs=dict(
        HEAD_NV=head_sums.shape[2], HEAD_D=head_dim, HEAD_EPS=float(eps)))


def mix_launch(launch: GemvLaunch, x, read, config) -> GemvLaunch:
    """``launch`` (of tiling ``config``, None: the launcher's) with x the live sum of the
    AttnRes read ``read`` (a ReadInput), which the programs mix into their input."""
    if not isinstance(read, ReadInput):
        raise ValueError(f"read_input: expected a ReadInput (read_input()), got "
                         f"{type(read).__name__}")
    if launch.constexprs["NORM"] or launch.prologue_constexprs or launch.sums_constexprs["SUMS"] \
            or launch.constexprs["DUAL"]:
        raise ValueError("read_input: the read's norm is the prologue; no norm_weight, "
                         "head_sums, x2 or read_sums beside it")
    sums = read.sums
    m, k = x.shape
    if x.dtype != torch.bfloat16 or (sums.tokens, sums.hidden) != (m, k) \
            or sums.bank.device != x.device:
        raise ValueError(f"read_input: x is the read's live sum, expected bf16 [M, H] = "
                         f"[{sums.tokens}, {sums.hidden}] on {sums.bank.device}, got "
                         f"{x.dtype} {list(x.shape)} on {x.device}")
    if launch.constexprs["WAIT_LAST"] or (config is not None and config.pdl
                                          and config.wait_last):
        raise ValueError("config: wait_last reads x before the wait; a read_input's sums are "
                         "the previous launch's")
    args = list(launch.args)
    args[4] = read.norm_weight  # the norm weight's slot (p_g)
    args[-3] = read.eps  # eps (then beta, linear_beta)
    n = sums.n_sealed
    clear = read.clear
    return replace(launch, args=tuple(args), sums_args=dict(zip(SUMS_ARGS, (
        sums.bank if n else sums.buffer, clear if clear is not None else sums.buffer,
        sums.buffer, sums.buffer, n, sums.bank.stride(0) if n else 0,
        sums.bank.stride(1) if n else 0, sums.slots,
        clear.numel() if clear is not None else 0), strict=True)),
        sums_constexprs={"SUMS": 0, "S_NB": sums.nb,
                         "S_BLOCK_C": triton.next_power_of_2(n + 1), "S_PREFETCH": False},
        prologue_constexprs={"MIX": True})


def _sums_launch(sums, m, n, act, splits, out_dtype, dev, block_n) -> dict:
    """GemvLaunch's sums fields for ``read_sums``, validated against the call."""
    if not isinstance(sums, ReadSums):
        raise ValueError(f"read_sums: expected a ReadSums (read_sums()), got "
                         f"{type(sums).__name__}")
    if act or splits is not None or out_dtype != torch.bfloat16:
        raise ValueError("read_sums: the output must be one bf16 [M, N] live sum (no "
                         "activation, no splits, out_dtype bfloat16)")
    if (sums.tokens, sums.hidden) != (m, n) or sums.bank.device != dev:
        raise ValueError(f"read_sums: expected a bank of [N, M={m}, H={n}] on {dev}, got "
                         f"{list(sums.bank.shape)} on {sums.bank.device}")
    if sums.slot_cols % block_n or (not sums.atomic and sums.slot_cols != block_n):
        raise ValueError(f"read_sums: slot_cols={sums.slot_cols} must be a multiple of the "
                         f"tiling's block_n={block_n} (equal to it without atomic)")
    bank = sums.bank if sums.n_sealed else sums.buffer
    return dict(
        sums_args=dict(zip(SUMS_ARGS, (
            bank, sums.res_norm_weight, sums.res_proj_weight, sums.buffer, sums.n_sealed,
            sums.bank.stride(0) if sums.n_sealed else 0,
            sums.bank.stride(1) if sums.n_sealed else 0, sums.slots, sums.slot_cols),
            strict=True)),
        sums_constexprs={"SUMS": 1 if sums.atomic else 2, "S_NB": sums.nb,
                         "S_BLOCK_C": triton.next_power_of_2(sums.n_sealed + 1),
                         "S_PREFETCH": not INTERPRETED})


def _outputs(y, m, n, ng, mixed, splits):
    """dense_gemv's return value over its output buffer."""
    if mixed:
        return y[:m * n].view(m, n), y[m * n:].view(m, ng)
    if splits is None:
        return y.view(m, n)
    outs, off = [], 0
    for s in splits:
        outs.append(y[off * m:(off + s) * m].view(m, s))
        off += s
    return tuple(outs)
