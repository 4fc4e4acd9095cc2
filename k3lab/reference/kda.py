"""KDA (Kimi Delta Attention) decode, op by op (docs/model.md).

The unfused truth of the ``kda`` boundary, written the way the model's code runs one decode token:
every op below is its own kernel launch (its launch count is the honest "before"). All math is in
fp32 whatever the input dtypes; the recurrent state (fp32) and the short-convolution caches are
updated in place.

Shapes (M tokens of independent sequences, Hl heads on this GPU, d = head dim, R = f rank,
C = conv taps):

    q, k, v   [M, Hl, d]  after the short convolution and SiLU
    f_low     [M, R]      x @ f_a^T, the low-rank forget-gate input
    f_b       [Hl*d, R]
    A_log     [Hl]        fp32
    dt_bias   [Hl*d]      fp32
    b_logits  [M, Hl]     beta before its sigmoid
    state     [M, Hl, d (k), d (v)] fp32, updated in place

Two formulations: the vectorized reference (:func:`kda_decode_reference`) and a plain loop over
tokens and heads with the delta rule written the other way round
(:func:`kda_decode_loop`, :func:`kda_recurrent_loop`) that the tests use to validate it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from k3lab.config import Preset

__all__ = [
    "L2_EPS", "short_conv_step", "kda_gate", "l2norm", "kda_decode_reference",
    "out_norm_gate", "kda_layer_reference", "kda_decode_loop", "kda_recurrent_loop",
]

L2_EPS = 1e-6  # q / sqrt(sum(q^2) + eps), as in the model's l2norm


def short_conv_step(x_proj: torch.Tensor, conv_state: torch.Tensor,
                    conv_weight: torch.Tensor) -> torch.Tensor:
    """One decode step of the depthwise causal short convolution, then SiLU (op kda.short_conv).

    x_proj [M, N] (N = Hl*d channels, the projection of the current token); conv_state
    [M, N, C-1] the C-1 past inputs, oldest first (updated in place: shifted by one, x_proj
    appended, in its own dtype); conv_weight [N, C], the last tap multiplies the current token.
    Returns SiLU(conv) [M, N] fp32.
    """
    window = torch.cat((conv_state.float(), x_proj.float().unsqueeze(-1)), dim=-1)  # [M, N, C]
    y = (window * conv_weight.float()).sum(-1)
    conv_state.copy_(window[..., 1:])
    return F.silu(y)


def kda_gate(f: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor,
             lower_bound: float) -> torch.Tensor:
    """Log-space per-channel decay (op kda.gate): ``lower_bound * sigmoid(exp(A_log[h]) *
    (f + dt_bias))``. f [M, Hl, d]; A_log [Hl]; dt_bias [Hl*d]. Returns fp32 [M, Hl, d]."""
    hl, d = f.shape[-2:]
    a = A_log.float().exp().view(hl, 1)
    return lower_bound * torch.sigmoid(a * (f.float() + dt_bias.float().view(hl, d)))


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x / sqrt(sum(x^2) + 1e-6) over the last dim, fp32 (op kda.l2norm)."""
    x = x.float()
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + L2_EPS)


def kda_decode_reference(q, k, v, f_low, f_b, A_log, dt_bias, b_logits, state, *,
                         lower_bound: float = -5.0, scale: float | None = None) -> torch.Tensor:
    """The recurrent step of KDA for one token per sequence (same signature as
    ``k3lab.kernels.kda_decode``). Updates ``state`` in place; returns o [M, Hl, d] fp32."""
    m, hl, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    f = (f_low.float() @ f_b.float().T).view(m, hl, d)             # kda.f_b_proj
    g = kda_gate(f, A_log, dt_bias, lower_bound)                    # kda.gate
    beta = torch.sigmoid(b_logits.float())                          # kda.beta
    q = l2norm(q) * scale                                           # kda.l2norm
    k = l2norm(k)
    # kda.recurrence, per head: S = S * exp(g)[:, None]; u = beta (v - S^T k); S += k u^T
    s = state.float() * g.exp().unsqueeze(-1)                       # [M, Hl, dk, dv]
    u = beta.unsqueeze(-1) * (v.float() - torch.einsum("mhkv,mhk->mhv", s, k))
    s = s + k.unsqueeze(-1) * u.unsqueeze(-2)
    o = torch.einsum("mhkv,mhk->mhv", s, q)
    state.copy_(s)
    return o


def out_norm_gate(o: torch.Tensor, g_logits: torch.Tensor, o_norm_weight: torch.Tensor,
                  eps: float) -> torch.Tensor:
    """Per-head RMSNorm of o times sigmoid of the output gate (op kda.out_norm_gate).

    o, g_logits [M, Hl, d]; o_norm_weight [d]. Returns fp32 [M, Hl, d]."""
    o = o.float()
    o = o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * o_norm_weight.float()
    return o * torch.sigmoid(g_logits.float())


def kda_layer_reference(x: torch.Tensor, weights: dict, cache: dict, cfg: Preset) -> torch.Tensor:
    """The whole KDA attention of one decode token, op by op.

    x [M, hidden] (after the input RMSNorm); weights from ``k3lab.weights.kda_weights``; cache from
    ``k3lab.weights.kda_cache`` (conv windows and the recurrent state, updated in place).
    The projections accumulate in fp32 and are rounded to x's dtype, like the model's bf16
    GEMMs (the conv caches hold those values); everything after them is fp32 math.
    Returns the attention output [M, hidden] fp32.
    """
    m, hl, d = x.shape[0], cfg.kda_heads, cfg.kda_head_dim
    xf = x.float()

    def proj(name):
        return (xf @ weights[name].float().T).to(x.dtype)

    q, k, v = (short_conv_step(proj(f"{n}_proj"), cache[f"{n}_conv_state"], weights[f"{n}_conv"])
               .view(m, hl, d) for n in "qkv")
    f_low = proj("f_a")                                             # kda.f_a_proj
    b_logits = proj("b_proj")                                       # kda.beta_proj
    o = kda_decode_reference(q, k, v, f_low, weights["f_b"], weights["A_log"],
                             weights["dt_bias"], b_logits, cache["state"],
                             lower_bound=cfg.kda_lower_bound)
    o = out_norm_gate(o, proj("g_proj").view(m, hl, d), weights["o_norm"], cfg.rms_eps)
    return o.reshape(m, hl * d) @ weights["o_proj"].float().T       # kda.o_proj


# ---------------------------------------------------------------------------------------------
# plain loop formulation (validates the vectorized reference)


def kda_decode_loop(q, k, v, f_low, f_b, A_log, dt_bias, b_logits, state, *,
                    lower_bound: float = -5.0, scale: float | None = None) -> torch.Tensor:
    """Same contract as :func:`kda_decode_reference`, written as an explicit loop over tokens and
    heads with per-head vectors and the delta rule in fla's naive form
    ``S += (beta k) (v - k^T S)^T``; the gate is computed channel by channel."""
    m_tok, hl, d = q.shape
    scale = d ** -0.5 if scale is None else scale
    o = torch.empty(m_tok, hl, d, dtype=torch.float32, device=q.device)
    for m in range(m_tok):
        for h in range(hl):
            rows = slice(h * d, (h + 1) * d)
            a = float(torch.exp(A_log[h].float()))
            f = f_b[rows].float() @ f_low[m].float()
            g = torch.empty(d, dtype=torch.float32, device=q.device)
            for c in range(d):
                z = a * float(f[c] + dt_bias[h * d + c].float())
                g[c] = lower_bound / (1.0 + torch.exp(torch.tensor(-z, dtype=torch.float32)))
            beta = 1.0 / (1.0 + torch.exp(-b_logits[m, h].float()))
            qv, kv = q[m, h].float(), k[m, h].float()
            qv = qv / torch.sqrt(torch.dot(qv, qv) + L2_EPS) * scale
            kv = kv / torch.sqrt(torch.dot(kv, kv) + L2_EPS)
            s = state[m, h].float() * torch.exp(g)[:, None]
            s = s + torch.outer(beta * kv, v[m, h].float() - kv @ s)
            o[m, h] = qv @ s
            state[m, h] = s
    return o


def kda_recurrent_loop(steps: list[dict], state: torch.Tensor, *, lower_bound: float = -5.0,
                       scale: float | None = None) -> list[torch.Tensor]:
    """Run :func:`kda_decode_loop` over T consecutive tokens: ``steps[t]`` holds that token's
    q, k, v, f_low, f_b, A_log, dt_bias, b_logits. Updates ``state``; returns the T outputs."""
    return [kda_decode_loop(s["q"], s["k"], s["v"], s["f_low"], s["f_b"], s["A_log"],
                            s["dt_bias"], s["b_logits"], state, lower_bound=lower_bound,
                            scale=scale) for s in steps]
