"""The KDA notebook's studies (40_kda): correctness over consecutive decode steps with the state
carried, the fused variants that absorb more ops against references that run those ops too, the
roofline on the state bytes, the sweep over tp and the tp 1 bytes-only skeleton.

Every function takes the notebook's :class:`k3lab.studies.Setup` first. Importing this module
imports ``k3lab.kernels``: import it after :func:`k3lab.studies.setup`.
"""

from __future__ import annotations

import pandas as pd
import torch

from k3lab import config, floors, plots, profile
from k3lab.boundaries import clone_inputs, max_abs_err
from k3lab.boundaries import kda as kda_boundary
from k3lab.reference.kda import out_norm_gate
from k3lab.studies import Setup

__all__ = ["TOL", "STEP_VARIANTS", "EXTENDED", "within", "peers", "run_steps", "step_summary",
           "step_error_plot", "step_records", "extended_references", "versus", "state_roofline",
           "sweep_tps", "tp_sweep", "tp_latency", "tp_sweep_plot", "tp1_skeleton"]

# (atol, rtol) per compared tensor: the boundary's, the ones the tests state
TOL = {"o": (kda_boundary.O_ATOL, kda_boundary.O_RTOL),
       "o_gated": (kda_boundary.O_GATED_ATOL, kda_boundary.O_GATED_RTOL),
       "state": (kda_boundary.STATE_ATOL, kda_boundary.STATE_RTOL)}
STEP_VARIANTS = ("fused", "fused+conv", "fused+out_gate", "fused+conv+out_gate")
# the references that also run what a wider fused variant absorbs: (name, fn, fused variant)
EXTENDED = (("reference+conv", kda_boundary.reference_conv, "fused+conv"),
            ("reference+out_gate", kda_boundary.reference_out_gate, "fused+out_gate"),
            ("reference+conv+out_gate", kda_boundary.reference_conv_out_gate,
             "fused+conv+out_gate"))
STATE_BAR = 0.5  # the tp 1 bar: the state bytes at half the copy bandwidth or better


def within(name: str, out: torch.Tensor, expected: torch.Tensor) -> bool:
    """Every element of ``out`` within :data:`TOL` [name] of ``expected``, and finite."""
    atol, rtol = TOL[name]
    a, e = out.float(), expected.float()
    return bool(((a - e).abs() <= atol + rtol * e.abs()).all() and torch.isfinite(a).all())


def peers(s: Setup) -> list[str]:
    """The peers available on this device."""
    return [v.name for v in s.boundary.variants
            if v.role == "peer" and v.unavailable(s.device) is None]


def run_steps(s: Setup, fixed: dict, tokens: list[dict], names, variant_steps: int
              ) -> pd.DataFrame:
    """Every variant of ``names`` over the decode stream (``kda_boundary.decode_stream``), each
    carrying its own state and conv caches from the same start, against the fp32 reference
    carrying its own; variants other than "fused" stop after ``variant_steps`` steps.

    The conv variants are compared with the reference that convolves the same pre-conv
    projections, the out-gate variants with ``out_norm_gate`` of that reference's output. One
    row per (variant, step): o_err, state_err (max abs) and whether each is within :data:`TOL`."""
    b = s.boundary
    truth = clone_inputs(fixed)       # the reference's own state
    truth_conv = clone_inputs(fixed)  # the reference that convolves in front (for fused+conv)
    carry = {n: clone_inputs(fixed) for n in names}
    rows = []
    for t, tok in enumerate(tokens):
        ref = b.reference.fn({**truth, **tok})
        conv_names = {"fused+conv", "fused+conv+out_gate"} & set(names)
        ref_conv = (kda_boundary.reference_conv({**truth_conv, **tok})
                    if conv_names and t < variant_steps else None)
        for n in names:
            if n != "fused" and t >= variant_steps:
                continue
            out = b.variant(n).fn({**carry[n], **tok})
            base = ref_conv if n in conv_names else ref
            if n.endswith("out_gate"):
                exp = {"o_gated": out_norm_gate(base["o"], tok["g_logits"], fixed["o_norm"],
                                                fixed["eps"])}
                key = "o_gated"
            else:
                exp, key = base, "o"
            state_ref = base["state"]
            rows.append({"variant": n, "step": t, "o_err": max_abs_err(out[key], exp[key]),
                         "state_err": max_abs_err(out["state"], state_ref),
                         "o_ok": within(key, out[key], exp[key]),
                         "state_ok": within("state", out["state"], state_ref)})
    return pd.DataFrame(rows)


def step_summary(errs: pd.DataFrame) -> pd.DataFrame:
    """Per variant: steps checked, the largest errors, the last state error, all within TOL."""
    return errs.groupby("variant", sort=False).agg(
        steps=("step", "count"), max_o_err=("o_err", "max"), last_state_err=("state_err", "last"),
        max_state_err=("state_err", "max"), o_within_tol=("o_ok", "all"),
        state_within_tol=("state_ok", "all"))


def step_error_plot(s: Setup, errs: pd.DataFrame):
    """The output's and the carried state's error per step, one line per variant."""
    fig, axes = plots.subplots(1, 2, figsize=(11, 3.6))
    for n, d in errs.groupby("variant", sort=False):
        axes[0].plot(d.step, d.o_err.clip(lower=1e-9), ".-", label=n, ms=3)
        axes[1].plot(d.step, d.state_err.clip(lower=1e-12), ".-", label=n, ms=3)
    axes[0].set(yscale="log", xlabel="decode step", ylabel="max |o - o_ref|",
                title="output (o_gated for fused+out_gate)")
    axes[1].axhline(kda_boundary.STATE_ATOL, color="tab:red", ls="--", label="state atol")
    axes[1].set(yscale="log", xlabel="decode step", ylabel="max |S - S_ref|",
                title="recurrent state, carried")
    axes[1].legend(fontsize=8)
    return plots.finish(fig, f"error against the fp32 reference per step, {s.cfg.describe()}, "
                             f"M={s.M}")


def step_records(s: Setup, errs: pd.DataFrame) -> pd.DataFrame:
    """:func:`run_steps`' errors as tidy records (metrics step_o_err, step_state_err)."""
    return pd.DataFrame([
        {**s.base, "variant": r["variant"], "role": s.boundary.variant(r["variant"]).role,
         "mode": "", "metric": f"step_{k}", "value": r[k], "unit": "", "note": f"step {r['step']}"}
        for r in errs.to_dict(orient="records") for k in ("o_err", "state_err")])


def extended_references(s: Setup) -> pd.DataFrame:
    """Launches and latency (cold copies, every mode of the device) of the :data:`EXTENDED`
    references, as tidy records like :func:`profile.measure`'s."""
    copies = s.copies(M=s.M)
    rows = []
    for name, fn, _ in EXTENDED:
        lc = profile.count_launches(fn, clone_inputs(copies[0]))
        rows.append({**s.base, "variant": name, "role": "reference", "mode": "",
                     "metric": "launches", "value": lc.count, "unit": "launches", "note": lc.kind})
        for m in s.modes:
            t = profile.time_variant(fn, [clone_inputs(c) for c in copies], mode=m,
                                     repeats=s.repeats)
            rows.append({**s.base, "variant": name, "role": "reference", "mode": m,
                         "metric": "latency_us", "value": t.median_us, "unit": "us",
                         "note": f"{'cold' if t.cold else 'warm'} x{t.copies}, "
                                 f"{t.repeats} repeats"})
    return pd.DataFrame(rows)


def versus(s: Setup, records: pd.DataFrame, extended: pd.DataFrame) -> pd.DataFrame:
    """Before / after pairs: the reference against fused, each extended reference against its
    fused variant, every peer against fused; launches, latency and speedup per mode."""
    both = pd.concat([records, extended], ignore_index=True)
    v = profile.value
    pairs = ([("reference", "fused")] + [(name, fused) for name, _, fused in EXTENDED]
             + [(p, "fused") for p in peers(s)])
    return pd.DataFrame([{
        "before": before, "after": after,
        "launches before": v(both, before, "launches"),
        "launches after": v(both, after, "launches"),
        **{f"{m} us before": v(both, before, "latency_us", m) for m in s.modes},
        **{f"{m} us after": v(both, after, "latency_us", m) for m in s.modes},
        **{f"{m} speedup": v(both, before, "latency_us", m) / v(both, after, "latency_us", m)
           for m in s.modes},
    } for before, after in pairs])


def state_roofline(s: Setup, records: pd.DataFrame, state_bytes: int) -> pd.DataFrame:
    """Per variant and mode: the state bytes over the latency (TB/s) and their copy time's
    fraction of the latency (the bar's figure)."""
    rows = []
    for name in [*STEP_VARIANTS, "reference", *peers(s)]:
        for m in s.modes:
            lat = profile.value(records, name, "latency_us", m)
            rows.append({"variant": name, "mode": m, "latency_us": lat,
                         "state_bytes": state_bytes,
                         "state_TBps": state_bytes / (lat * 1e-6) / 1e12,
                         "state_copy_frac": state_bytes / s.copy_bw * 1e6 / lat})
    return pd.DataFrame(rows)


def sweep_tps(cfg, tps=()) -> list[int]:
    """``tps``, else 1, 2, 4, 8; where fewer than four of those divide the preset's KDA heads,
    the first four tps that do."""
    if tps:
        return list(tps)
    heads = config.preset(cfg.name, 1).kda_heads
    chosen = [t for t in (1, 2, 4, 8) if heads % t == 0]
    if len(chosen) < 4:
        chosen = [t for t in range(1, heads + 1) if heads % t == 0][:4]
    return chosen


def tp_sweep(s: Setup, tps: list[int]) -> pd.DataFrame:
    """Reference, fused and the peers (not torch.compile) checked then timed at every tp, with
    ``state_bytes``; the latency rows also get ``state_copy_frac``. Returns the tidy records."""
    names = ["reference", "fused"] + [p for p in peers(s) if p != "torch.compile"]
    frames = []
    for t in tps:
        c = config.preset(s.cfg.name, t)
        r = profile.measure(s.boundary, c, s.device, variants=names, seed=s.seed,
                            params={"M": s.M}, modes=s.modes, repeats=s.repeats, launches=False)
        r["state_bytes"] = kda_boundary.state_bytes(s.boundary.make_inputs(c, s.device, s.seed,
                                                                           M=s.M))
        frames.append(r)
    return pd.concat(frames, ignore_index=True)


def tp_latency(s: Setup, sweep: pd.DataFrame) -> pd.DataFrame:
    """The latency rows of :func:`tp_sweep` with the state bytes' copy-time fraction."""
    lat = sweep[sweep.metric == "latency_us"].copy()
    lat["state_copy_frac"] = lat.state_bytes / s.copy_bw * 1e6 / lat.value
    return lat


def tp_sweep_plot(s: Setup, lat: pd.DataFrame, tps: list[int]):
    """Latency per tp, and the fraction of the copy bandwidth on the state (the tp 1 bar)."""
    fig, axes = plots.subplots(1, 2, figsize=(11, 3.6))
    for (v, m), d in lat.groupby(["variant", "mode"]):
        style = "o-" if m == s.mode else "o:"
        axes[0].plot(d.tp, d.value, style, label=f"{v} ({m})")
        if v != "reference":
            axes[1].plot(d.tp, d.state_copy_frac, style, label=f"{v} ({m})")
    axes[0].set(xscale="log", yscale="log", xlabel="tp", ylabel="latency (us)",
                title="latency per KDA layer step")
    axes[1].axhline(STATE_BAR, color="tab:red", ls="--", label="bar (tp 1)")
    axes[1].set(xscale="log", xlabel="tp", ylabel="state bytes / latency / copy bw",
                title="fraction of copy bandwidth on the state")
    for ax in axes:
        ax.set_xticks(tps, [str(t) for t in tps])
        ax.minorticks_off()
        ax.legend(fontsize=7)
    return plots.finish(fig, f"{s.cfg.name}, M={s.M}{s.note}")


def tp1_skeleton(s: Setup, lat: pd.DataFrame) -> pd.Series:
    """The tp 1 bar (state bytes at half the copy bandwidth) against the bytes-only skeleton
    (the state read and written in place, f_b read; NaN on the CPU) and the fused latency."""
    c1 = config.preset(s.cfg.name, 1)
    in1 = s.boundary.make_inputs(c1, s.device, s.seed, M=s.M)
    sb1, fb1 = kda_boundary.state_bytes(in1), in1["f_b"].nbytes
    del in1
    fused = lat[(lat.tp == 1) & (lat.variant == "fused") & (lat["mode"] == s.mode)].value
    row = pd.Series({
        "tp 1 state MB (read + written)": sb1 / 1e6, "f_b MB (read)": fb1 / 1e6,
        "bar us (state bytes / copy bw / 0.5)": sb1 / s.copy_bw * 1e6 / STATE_BAR,
        "skeleton us (state in place + f_b read)": floors.update_floor_us(sb1 // 2, fb1,
                                                                          s.device),
        "fused us": float(fused.iloc[0]) if len(fused) else float("nan"),
    })
    row["room under the bar us"] = (row["bar us (state bytes / copy bw / 0.5)"]
                                    - row["skeleton us (state in place + f_b read)"])
    return row
