"""One decode layer under a stack: its AttnRes reads, its attention (KDA or MLA) and its
FFN (layer 0's dense MLP or the latent MoE)."""

from __future__ import annotations

from collections.abc import Callable

import torch

from k3lab.config import Preset
from k3lab.reference import attn_res as ref_attn_res
from k3lab.reference import kda as ref_kda
from k3lab.reference import mla as ref_mla

from .base import _act, _kernels, _linear, _noop, _Run
from .changes import Stack
from .configs import Configs
from .moe import _ffn_mixes, _moe


def _read(run: _Run, state: dict, bank, live, site: str, sums=None, clear=None
          ) -> torch.Tensor:
    w, cfg = state[f"res_{site}"], state["cfg"]
    if sums is not None:  # the projection that wrote live left the sums
        return _kernels().attn_res_norm_from_sums(sums, live, w["norm_weight"],
                                                  eps=cfg.rms_eps, clear=clear,
                                                  config=run.configs.attn_res)[1]
    args = (bank, live, w["res_norm_weight"], w["res_proj_weight"], w["norm_weight"])
    if run.fused(f"attn_res.read@{site}"):
        return _kernels().attn_res_norm(*args, eps=cfg.rms_eps, return_h=False,
                                        config=run.configs.attn_res)[1]
    return ref_attn_res.attn_res_norm_reference(*args, eps=cfg.rms_eps)[1]


def _ffn_sums(run: _Run, state: dict, bank, buffers):
    """The FFN read's ReadSums for the attention's output projection to fill (None where
    ``Configs.read_sums`` is off or the read or the projection is not fused), and the buffer
    its read clears. buffers: (this read's zeroed sums, the next read's or None); None: a
    zeroed one is allocated."""
    o_proj = f"{state['kind']}.o_proj"
    if not ((run.configs.read_sums or run.configs.ffn_read_in_front)
            and run.fused("attn_res.read@ffn")
            and run.stack.owned_by(o_proj, "dense-gemv")):
        return None, None
    from k3lab.kernels.attn_res_sums import read_sums
    w = state["res_ffn"]
    buf, clear = buffers if buffers is not None else (None, None)
    return read_sums(bank, w["res_norm_weight"], w["res_proj_weight"], buffer=buf), clear


def _kda(run: _Run, x, w: dict, cache: dict, cfg: Preset, residual, sums=None, read=None
         ) -> torch.Tensor:
    tag = run.tag
    m, hl, d = x.shape[0], cfg.kda_heads, cfg.kda_head_dim
    tag("dense projections")
    q, k, v, f_low, b_logits, g = _linear(run, "kda.q_proj", x, w["in_proj"],
                                          splits=w["in_splits"], read_input=read)
    tag("KDA")
    conv = gate = None
    if run.fused("kda.short_conv"):  # the kernel takes the projections before the conv
        conv = _kernels().KDAConv(*(cache[f"{n}_conv_state"] for n in "qkv"),
                                  *(w[f"{n}_conv"] for n in "qkv"))
        q, k, v = (t.contiguous().view(m, hl, d) for t in (q, k, v))
    else:
        q, k, v = (ref_kda.short_conv_step(t, cache[f"{n}_conv_state"], w[f"{n}_conv"])
                   .view(m, hl, d).to(x.dtype) for n, t in zip("qkv", (q, k, v), strict=True))
    if run.fused("kda.out_norm_gate"):
        gate = _kernels().KDAOutGate(g.contiguous().view(m, hl, d), w["o_norm"], cfg.rms_eps,
                                     rms_by_consumer=run.configs.kda_rms_in_o_proj)
    if run.fused("kda.recurrence"):
        f_b = w["f_b"]
        if not run.fused("kda.f_b_proj"):
            if m != 1:
                raise ValueError("x: the stack runs KDA without the f_b fusion at batch 1 only")
            # f_b projection as the reference does it; the kernel then gets f through a rank-1
            # identity: f_b' = f^T [Hl*d, 1], f_low' = [[1]]
            f_b = (f_low.float() @ w["f_b"].float().T).to(x.dtype).view(hl * d, 1)
            f_low = torch.ones(1, 1, dtype=x.dtype, device=x.device)
        o = _kernels().kda_decode(q, k, v, f_low.contiguous(), f_b, w["A_log"], w["dt_bias"],
                                  b_logits.contiguous(), cache["state"],
                                  lower_bound=cfg.kda_lower_bound, conv=conv, out_gate=gate,
                                  config=run.configs.kda)
    else:
        o = ref_kda.kda_decode_reference(q, k, v, f_low, w["f_b"], w["A_log"], w["dt_bias"],
                                         b_logits, cache["state"],
                                         lower_bound=cfg.kda_lower_bound)
    head = {}
    if gate is None:
        o = ref_kda.out_norm_gate(o, g.reshape(m, hl, d), w["o_norm"], cfg.rms_eps)
    elif gate.rms_by_consumer:
        o, head_sums = o  # the gated o; each head's rsqrt is the output projection's
        if run.stack.owned_by("kda.o_proj", "dense-gemv"):  # in its prologue
            head = dict(head_sums=head_sums, head_dim=d, eps=cfg.rms_eps)
        else:
            o = o.float() * torch.rsqrt(head_sums.sum(-1, keepdim=True) / d + cfg.rms_eps)
    tag("dense projections")
    return _linear(run, "kda.o_proj", o.reshape(m, hl * d).to(x.dtype), w["o_proj"],
                   residual=residual, read_sums=sums, **head)


def _mla(run: _Run, x, state: dict, residual, sums=None, read=None) -> torch.Tensor:
    tag, num_splits = run.tag, run.num_splits
    cfg, w, cache = state["cfg"], state["attn"], state["cache"]
    m = x.shape[0]
    hm, nope, r, v = cfg.mla_heads, cfg.qk_nope, cfg.qk_rope, cfg.v_head
    tag("dense projections")
    q_a, kv, g = _linear(run, "mla.q_a_proj", x, w["in_proj"], splits=w["in_splits"],
                         read_input=read)
    q = _linear(run, "mla.q_b_proj", q_a.contiguous(), w["q_b"], norm_weight=w["q_a_norm"],
                eps=cfg.rms_eps).view(m, hm, nope + r)
    tag("MLA")
    kv_cache, seq_lens = cache["kv_cache"], cache["seq_lens"]
    prep = dict(qk_nope=nope, v_head=v, eps=cfg.rms_eps, rope=cfg.mla_rope)
    if run.fused("mla.q_absorb"):  # mla-absorb-fusion: the neighbours on both sides
        q_lat, q_rope = _kernels().mla_absorb_q(q, kv.contiguous(), w["kv_a_norm"], w["kv_b"],
                                                state["position"], kv_cache, seq_lens, **prep,
                                                config=run.configs.mla)
    else:
        q_lat, q_rope = ref_mla.mla_absorb_q_reference(q, kv, w["kv_a_norm"], w["kv_b"],
                                                       state["position"], kv_cache, seq_lens,
                                                       **prep)
    sm_scale = (nope + r) ** -0.5
    if run.fused("mla.attention"):
        o_lat = _kernels().mla_decode(q_lat.to(kv_cache.dtype), q_rope.to(kv_cache.dtype),
                                      kv_cache, seq_lens, sm_scale=sm_scale,
                                      num_splits=num_splits, config=run.configs.mla)
    else:
        o_lat = ref_mla.mla_decode_reference(q_lat, q_rope, kv_cache, seq_lens,
                                             sm_scale=sm_scale)
    if run.fused("mla.v_absorb"):
        o = _kernels().mla_absorb_out(o_lat, w["kv_b"], g.contiguous(), qk_nope=nope, v_head=v,
                                      out_dtype=x.dtype, config=run.configs.mla)
    else:
        o = ref_mla.mla_absorb_out_reference(o_lat.float(), w["kv_b"], g, qk_nope=nope,
                                             v_head=v).to(x.dtype)
    tag("dense projections")
    return _linear(run, "mla.o_proj", o, w["o_proj"], residual=residual, read_sums=sums)


def leaves_read_sums(stack: Stack, state: dict) -> bool:
    """Whether the layer's last launch under ``stack`` is a dense GEMV writing the live sum,
    which can leave the next read's sums (``run_layer(next_sums=...)``)."""
    if "mlp" in state:
        return stack.owned_by("mlp.down", "dense-gemv")
    cfg = state["cfg"]
    return (not stack.owned_by("moe.stage1", "persistent-moe") and stack.fused("moe.latent_up")
            and bool(cfg.latent) and bool(cfg.shared_intermediate))


def takes_read_input(stack: Stack, state: dict) -> bool:
    """Whether the layer's attention read can be its merged input projection's prologue
    (``run_layer(attn_read=...)``): the read and that projection fused, the latter the dense
    GEMV's."""
    op = "kda.q_proj" if state["kind"] == "kda" else "mla.q_a_proj"
    return stack.fused("attn_res.read@attn") and stack.owned_by(op, "dense-gemv")


def run_layer(stack: Stack, state: dict, *, num_splits: int = 4, bank=None, live=None,
              start: bool = False, ffn_bank=None, configs: Configs | None = None,
              tag: Callable[[str], None] | None = None, record: list | None = None,
              sums_buffers: tuple | None = None, attn_read=None, next_sums=None
              ) -> torch.Tensor:
    """One decode layer of ``state`` (``k3lab.reference.layer.make_layer``) under ``stack``;
    returns the new live sum [M, H] bf16.

    bank, live: the AttnRes candidates (default: the state's own); start: the layer opens a
    block, so its attention read sees ``bank`` and ``live`` as the sealed rows only, the
    attention output starts the live sum and the FFN read mixes ``ffn_bank`` (the sealed rows
    in one tensor) with it. num_splits: the fixed MLA split count of the split
    override (graph-safe). configs: the launchers' :class:`Configs` (None: their defaults).
    tag: called with a category before each group of launches. record: a list the layer
    appends its MoE's chosen experts to (None for layer 0's dense MLP), for checks.
    sums_buffers: with ``Configs.read_sums``, (this layer's zeroed sums buffer, the one its
    FFN read clears or None) as :func:`sums_buffers` lays them out (None: a zeroed one).
    attn_read: a ReadInput whose sums the previous layer left: the attention read is the
    merged input projection's prologue (live is its live sum; :func:`takes_read_input`).
    next_sums: a ReadSums the layer's last dense GEMV fills for the next layer's attention
    read (:func:`leaves_read_sums`).
    """
    tag = tag or _noop
    run = _Run(stack, num_splits, configs or Configs(), tag, record)
    cfg = state["cfg"]
    bank = state["bank"] if bank is None else bank
    live = state["live"] if live is None else live
    if attn_read is not None:
        if start or not takes_read_input(stack, state):
            raise ValueError("attn_read: the layer's attention read is its input projection's "
                             "prologue only past a block's first layer, with both fused")
        x = live
    else:
        tag("AttnRes")
        x = _read(run, state, bank, live, "attn")
    if next_sums is not None and not leaves_read_sums(stack, state):
        raise ValueError("next_sums: the layer's last launch is not a dense GEMV writing the "
                         "live sum")
    if start:
        bank = torch.cat([bank, live.unsqueeze(0)]) if ffn_bank is None else ffn_bank
    residual = None if start else live
    sums, clear = _ffn_sums(run, state, bank, sums_buffers)
    if state["kind"] == "kda":
        live = _kda(run, x, state["attn"], state["cache"], cfg, residual, sums, attn_read)
    else:
        live = _mla(run, x, state, residual, sums, attn_read)
    live = live.to(torch.bfloat16)
    read = None
    if sums is not None and run.configs.ffn_read_in_front and _ffn_mixes(run, state):
        from k3lab.kernels.attn_res_sums import read_input
        read = read_input(sums, state["res_ffn"]["norm_weight"], eps=cfg.rms_eps, clear=clear)
        x = live  # the consumer mixes its input from the sums
    else:
        tag("AttnRes")
        x = _read(run, state, bank, live, "ffn", sums, clear)
    if "mlp" in state:  # layer 0's dense MLP, its residual add in the down projection
        tag("dense projections")
        mlp = state["mlp"]
        if record is not None:
            record.append(None)
        a = _linear(run, "mlp.gate_up", x, mlp["gate_up"], **_act(cfg), read_input=read)
        return _linear(run, "mlp.down", a, mlp["down"], residual=live, read_sums=next_sums)
    f, added = _moe(run, x, state["moe"], cfg, live, next_sums, read)
    if added:
        return f
    tag("dense projections")
    return (live + f.to(live.dtype)) if f.dtype == live.dtype else (
        live.float() + f.float()).to(live.dtype)
