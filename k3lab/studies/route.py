"""The route notebook's studies (10_route): every plan field against the reference, the bar and
the bytes-only skeletons, sweeps over tokens and experts, and one token's experts and weights.

Every function takes the notebook's :class:`k3lab.studies.Setup` first. Importing this module
imports ``k3lab.kernels``: import it after :func:`k3lab.studies.setup`.
"""

from __future__ import annotations

import dataclasses

import pandas as pd
import torch

from k3lab import floors, plots, profile
from k3lab.kernels.route import MAX_TOKENS
from k3lab.reference.route import route_sort_by_sorting, route_sort_reference
from k3lab.studies import Setup

__all__ = ["SEED_SPEEDUP", "PLAN_INT_FIELDS", "group_count", "check_case",
           "correctness", "bar", "skeletons", "sweep_point", "sweep", "sweep_plot",
           "TokenExplorer"]

# The route boundary's speedup in the seed PR (MI355X, whole-stack run; docs/model.md, the
# campaign).
SEED_SPEEDUP = 1.62
PLAN_INT_FIELDS = ("topk_ids", "sorted_ids", "block_expert_ids", "num_valid")


def group_count(n_experts: int) -> int:
    """A group count for the grouped-routing case: 8, 4 or 2 groups of at least 2 experts."""
    for g in (8, 4, 2):
        if n_experts % g == 0 and n_experts // g >= 2:
            return g
    raise ValueError(f"n_experts: {n_experts} has no split into 2, 4 or 8 groups of 2 or more")


def check_case(s: Setup, m: int, block_m: int, n_group: int | None = None,
               topk_group: int | None = None, sorting: bool = False) -> dict:
    """The fused plan against the reference for one case (raises on any mismatch); with
    ``sorting`` also the reference against the independent sorting formulation (on the CPU)."""
    b = s.boundary
    inputs = b.make_inputs(s.cfg, s.device, s.seed, M=m, block_m=block_m)
    if n_group:
        inputs.update(n_group=n_group, topk_group=topk_group)
    errs = b.check(b.variant("fused").fn(inputs), b.reference.fn(inputs), inputs)
    row = {"M": m, "block_m": block_m, "groups": f"{inputs['n_group']}/{inputs['topk_group']}",
           **{f"{k} err": v for k, v in errs.items()}}
    if sorting:
        args = [inputs[k].cpu() for k in ("hidden", "gate_weight", "correction_bias")]
        kw = {k: inputs[k] for k in ("top_k", "n_group", "topk_group", "renormalize",
                                     "routed_scaling_factor", "block_m", "out_dim")}
        want = route_sort_reference(*args, **kw).tensors()
        got = route_sort_by_sorting(*args, **kw).tensors()
        row["reference == sorting"] = all(torch.equal(want[k], got[k]) for k in PLAN_INT_FIELDS)
    return row


def correctness(s: Setup, block_m: int) -> pd.DataFrame:
    """:func:`check_case` at the comparison's M and block_m, batch 1, block_m 16, 64 tokens
    (several per expert) and grouped routing, each with the sorting cross-check."""
    ng = group_count(s.cfg.n_experts)
    cases = [(s.M, block_m), (1, 1), (1, 16), (min(64, MAX_TOKENS), 16),
             (3, 16, ng, max(1, ng // 2))]
    return pd.DataFrame([check_case(s, *c, sorting=True) for c in cases])


def bar(s: Setup, records: pd.DataFrame, gate_bytes: int) -> tuple[pd.DataFrame, dict]:
    """The issue's bar from :func:`profile.measure` records: fused in at most 2 launches, at
    least 3x the reference and 2x torch.compile, within 1.5x of the floor (the gate bytes at the
    copy bandwidth plus one launch's share of a long graph). On the CPU the rows hold no verdict.

    Returns (the bar's table, the figures it used: fused_us, ref_us, comp_us, gate_floor_us,
    graph_launch_us, floor_us, fused_launches, ref_launches)."""
    lat = lambda v: profile.value(records, v, "latency_us", s.mode)  # noqa: E731
    f = {"fused_us": lat("fused"), "ref_us": lat("reference"), "comp_us": lat("torch.compile"),
         "gate_floor_us": profile.roofline_us(gate_bytes, s.copy_bw),
         "graph_launch_us": profile.graph_launch_us(s.device, s.repeats),
         "fused_launches": profile.value(records, "fused", "launches"),
         "ref_launches": profile.value(records, "reference", "launches")}
    f["floor_us"] = f["gate_floor_us"] + f["graph_launch_us"]
    gpu = s.on_gpu
    table = pd.DataFrame([
        {"check": "fused launches <= 2", "measured": f["fused_launches"], "target": 2,
         "ok": f["fused_launches"] <= 2, "note": f"reference: {f['ref_launches']:.0f} launches"},
        {"check": f"speedup vs reference ({s.mode})", "measured": f["ref_us"] / f["fused_us"],
         "target": 3.0, "ok": f["ref_us"] / f["fused_us"] >= 3.0 if gpu else None},
        {"check": f"speedup vs torch.compile ({s.mode})",
         "measured": f["comp_us"] / f["fused_us"], "target": 2.0,
         "ok": f["comp_us"] / f["fused_us"] >= 2.0 if gpu else None},
        {"check": "fused / floor (gate bytes / copy bw + one graph launch)",
         "measured": f["fused_us"] / f["floor_us"], "target": 1.5,
         "ok": f["fused_us"] / f["floor_us"] <= 1.5 if gpu else None,
         "note": f"gate {gate_bytes / 1e6:.2f} MB -> {f['gate_floor_us']:.2f} us + launch "
                 f"{f['graph_launch_us']:.2f} us"},
    ])
    return table, f


def skeletons(s: Setup, gate_bytes: int, floor_us: float, fused_us: float) -> pd.DataFrame:
    """The gate read alone, with the last-program selection shape (one launch) and with a
    PDL-launched second kernel (two), against the bar (1.5x the floor); NaN on the CPU."""
    rows = pd.DataFrame([
        {"skeleton": "gate read alone (1 launch)",
         "us": floors.stream_floor_us(gate_bytes, s.device, "none")},
        {"skeleton": "gate read + last program (1 launch)",
         "us": floors.stream_floor_us(gate_bytes, s.device, "last")},
        {"skeleton": "gate read + PDL kernel (2 launches)",
         "us": floors.stream_floor_us(gate_bytes, s.device, "pdl")},
    ]).set_index("skeleton")
    rows["bar us (1.5 x floor)"] = 1.5 * floor_us
    rows["room under the bar us"] = rows["bar us (1.5 x floor)"] - rows.us
    rows["fused us"] = fused_us
    return rows


def sweep_point(s: Setup, cfg, m: int, block_m: int, label: str) -> list[dict]:
    """Reference and fused at (cfg, m, block_m), cold copies, checked before timed (raises on a
    mismatch): one wide row per variant with latency_us, p10_us, p90_us and gate_bytes."""
    b = s.boundary
    copies = s.copies(cfg, M=m, block_m=block_m)
    b.check(b.variant("fused").fn(copies[0]), b.reference.fn(copies[0]), copies[0])
    rows = []
    for v in (b.reference, b.variant("fused")):
        t = profile.time_variant(v.fn, copies, mode=s.mode, repeats=s.repeats)
        rows.append({**s.base, "preset": cfg.name, "M": m, "variant": v.name, "role": v.role,
                     "mode": s.mode, "experts": cfg.n_experts, "sweep": label,
                     "latency_us": t.median_us, "p10_us": t.p10_us, "p90_us": t.p90_us,
                     "gate_bytes": copies[0]["gate_weight"].nbytes})
    return rows


def sweep(s: Setup, *, tokens: list[int] = (), experts: list[int] = (),
          block_m: int = 16) -> pd.DataFrame:
    """:func:`sweep_point` over M (``tokens``, at block_m) or, at M = 1, over the expert count
    (``experts``: the preset with E experts, ungrouped; counts below top_k are left out), with
    ``gate_frac_of_copy`` (the gate bytes' copy time over the latency)."""
    if bool(tokens) == bool(experts):
        raise ValueError("sweep: give tokens or experts, not both")
    if tokens:
        points = [(s.cfg, m) for m in tokens]
    else:
        points = [(dataclasses.replace(s.cfg, n_experts=e, n_group=1, topk_group=1), 1)
                  for e in experts if e >= s.cfg.top_k]
    s.compile_ahead(s.fused_calls([(c, {"M": m, "block_m": block_m}) for c, m in points]))
    rows = [r for c, m in points
            for r in sweep_point(s, c, m, block_m, "M" if tokens else "experts")]
    d = pd.DataFrame(rows)
    d["gate_frac_of_copy"] = (d.gate_bytes / s.copy_bw * 1e6) / d.latency_us
    return d


def sweep_plot(s: Setup, d: pd.DataFrame, x: str, title: str):
    """Latency (p10-p90 bars) against ``x`` beside the gate-byte floor, and the floor's fraction
    of each latency."""
    fig, (a1, a2) = plots.subplots(1, 2, figsize=(11, 3.6))
    for name, g in d.groupby("variant", sort=False):
        a1.errorbar(g[x], g.latency_us, yerr=[g.latency_us - g.p10_us, g.p90_us - g.latency_us],
                    fmt="o-", capsize=3, label=name)
        a2.plot(g[x], g.gate_frac_of_copy, "o-", label=name)
    a1.plot(d[x].drop_duplicates(), d.drop_duplicates(x).gate_bytes / s.copy_bw * 1e6, "k--",
            label="gate bytes / copy bw")
    a1.set(xscale="log", yscale="log", xlabel=x, ylabel=f"latency (us, {s.mode})")
    a2.set(xscale="log", xlabel=x, ylabel="gate-byte floor / latency")
    a1.legend(fontsize=7)
    a2.legend(fontsize=7)
    return plots.finish(fig, title + s.note)


class TokenExplorer:
    """One call's tokens routed by the fused kernel and the reference: per token, every expert's
    biased score (the chosen ones marked) and the chosen experts' weights with where each entry
    landed in the sorted plan."""

    def __init__(self, s: Setup, tokens: int, block_m: int):
        b = s.boundary
        inputs = b.make_inputs(s.cfg, s.device, s.seed, M=max(1, min(tokens, MAX_TOKENS)),
                               block_m=block_m)
        self.plan = b.variant("fused").fn(inputs)
        self.ref = b.reference.fn(inputs)
        with torch.no_grad():
            logits = inputs["hidden"].float() @ inputs["gate_weight"].float().T
            self.scores = torch.sigmoid(logits).cpu()
        self.biased = self.scores + inputs["correction_bias"].cpu()
        self.sorted_ids = self.plan.sorted_ids.cpu()

    @property
    def num_tokens(self) -> int:
        return self.plan.num_tokens

    def clamp(self, t: int) -> int:
        return min(max(t, 0), self.num_tokens - 1)

    def table(self, t: int) -> pd.DataFrame:
        k = self.plan.top_k
        ids = self.plan.topk_ids[t].cpu()
        pos = [int((self.sorted_ids == t * k + j).nonzero()[0]) for j in range(k)]
        return pd.DataFrame({"slot": range(k), "expert": ids.tolist(),
                             "biased score": self.biased[t, ids].tolist(),
                             "score": self.scores[t, ids].tolist(),
                             "weight (fused)": self.plan.topk_weights[t].cpu().tolist(),
                             "weight (reference)": self.ref.topk_weights[t].cpu().tolist(),
                             "sorted position": pos,
                             "tile": [p // self.plan.block_m for p in pos]})

    def figure(self, t: int):
        ids = self.plan.topk_ids[t].cpu()
        sb = self.biased
        e = sb.shape[1]
        fig, (a1, a2) = plots.subplots(1, 2, figsize=(12, 3.6),
                                       gridspec_kw={"width_ratios": [2, 1]})
        a1.vlines(range(e), 0, sb[t], color="lightgray", lw=1)
        a1.plot(ids, sb[t, ids], "o", color="tab:blue", ms=4, label="chosen")
        a1.axhline(float(sb[t, ids[-1]]), color="tab:red", ls=":", lw=1, label="k-th score")
        a1.set(xlabel="expert", ylabel="sigmoid + bias", ylim=(0, None),
               title=f"token {t}: top-{len(ids)} of {e} experts")
        a1.legend(fontsize=7)
        x = torch.arange(len(ids))
        a2.bar(x - 0.2, self.plan.topk_weights[t].cpu(), 0.4, label="fused")
        a2.bar(x + 0.2, self.ref.topk_weights[t].cpu(), 0.4, label="reference")
        a2.set_xticks(x.tolist(), [str(i) for i in ids.tolist()], rotation=90, fontsize=7)
        a2.set(xlabel="expert (slot order)", ylabel="weight", title="routing weights")
        a2.legend(fontsize=7)
        return plots.finish(fig)

    def widget(self, token: int = 0):
        """A slider over the tokens showing :meth:`figure` and :meth:`table` (ipywidgets)."""
        import ipywidgets as widgets
        from IPython.display import display

        slider = widgets.IntSlider(value=self.clamp(token), min=0, max=self.num_tokens - 1,
                                   description="token")
        view = widgets.interactive_output(
            lambda t: (display(self.figure(t)), display(self.table(t))), {"t": slider})
        return widgets.VBox([slider, view])
