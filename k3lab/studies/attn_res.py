"""The AttnRes notebook's studies (60_attn_res): the per-token schedule of reads, correctness per
read and over a replayed token, launches per token, latency per read against the number of
candidates, and a whole token's reads timed at once.

Every function takes the notebook's :class:`k3lab.studies.Setup` first. Importing this module
imports ``k3lab.kernels``: import it after :func:`k3lab.studies.setup`.
"""

from __future__ import annotations

from collections import Counter

import pandas as pd

from k3lab import plots, profile
from k3lab.kernels import attn_res_norm
from k3lab.reference.attn_res import (
    Read,
    TokenReplay,
    attn_res_norm_reference,
    replay_token,
    replay_weights,
    token_schedule,
)
from k3lab.studies import Setup
from k3lab.weights import make_generator

__all__ = ["READ_FNS", "SPEEDUP_LINE", "deepest", "schedule", "schedule_plot", "read_check",
           "read_checks", "replay_errors", "replay_summary", "replay_plot", "variants",
           "launches_per_read", "token_reads", "TokenReads", "launches_per_token", "depth_sweep",
           "depth_tables", "depth_plot", "token_latency"]

# the read functions of a whole replayed token: the reference and the fused launcher
READ_FNS = {"reference": attn_res_norm_reference, "fused": attn_res_norm}
SPEEDUP_LINE = 5.0  # drawn on the speedup plot


def deepest(s: Setup) -> int:
    """Sealed rows of the preset's deepest read (every sealed row; then live is the last)."""
    return s.cfg.max_attn_res_candidates - 1


def schedule(s: Setup) -> tuple[list[Read], pd.DataFrame]:
    """The token's reads and, per number of candidates, how many reads mix that many."""
    reads = token_schedule(s.cfg)
    per_depth = (pd.DataFrame(reads).groupby("n_candidates").size().rename("reads").to_frame()
                 .assign(sealed_rows_passed_as_bank=lambda d: d.index - 1))
    return reads, per_depth


def schedule_plot(s: Setup, reads: list[Read]):
    """Candidates of every read of one token, by layer, before attention and before the FFN."""
    d = pd.DataFrame(reads)
    fig, ax = plots.subplots(figsize=(10, 2.8))
    for site, marker in (("attn", "o"), ("ffn", "s")):
        sub = d[d.site == site]
        ax.plot(sub.layer, sub.n_candidates, marker, ms=3, label=f"before {site}")
    ax.set(xlabel="layer", ylabel="candidates",
           title=f"AttnRes reads of one token, {s.cfg.describe()}")
    ax.legend()
    return plots.finish(fig)


def read_check(s: Setup, n_sealed: int, m: int | None = None, weight_dtype: str = "bf16"
               ) -> dict:
    """The kernel against the fp32 reference at one depth (raises on a mismatch)."""
    b = s.boundary
    m = s.M if m is None else m
    inputs = b.make_inputs(s.cfg, s.device, s.seed, M=m, n_sealed=n_sealed,
                           weight_dtype=weight_dtype)
    errs = b.check(b.variant("fused").fn(inputs), b.reference.fn(inputs), inputs)
    return {"N sealed": n_sealed, "candidates": n_sealed + 1, "M": m, "weights": weight_dtype,
            "h max err": errs["h"], "h_normed max err": errs["h_normed"]}


def read_checks(s: Setup) -> pd.DataFrame:
    """:func:`read_check` at every depth up to one past the deepest read, and with fp32
    weights for 3 tokens at the deepest."""
    n = deepest(s)
    return pd.DataFrame([read_check(s, k) for k in range(n + 2)]
                        + [read_check(s, n, 3, "fp32")])


def replay_errors(s: Setup, out_gain: float) -> tuple[TokenReplay, pd.DataFrame]:
    """One token replayed through every layer with the reference's reads and with the fused
    ones (``out_gain`` 0: sublayer outputs independent of the reads; else they feed on
    h_normed). Returns the reference's replay and each read's relative norm errors."""
    ref = replay_token(s.cfg, attn_res_norm_reference, m=s.M, seed=s.seed, device=s.device,
                       out_gain=out_gain)
    fused = replay_token(s.cfg, attn_res_norm, m=s.M, seed=s.seed, device=s.device,
                         out_gain=out_gain)

    def rel(xs, ys):
        return [float((a.float() - b.float()).norm() / b.float().norm())
                for a, b in zip(xs, ys, strict=True)]

    return ref, pd.DataFrame({"read": range(len(ref.reads)), "h norm err": rel(fused.h, ref.h),
                              "h_normed norm err": rel(fused.h_normed, ref.h_normed)})


def replay_summary(independent: pd.DataFrame, chained: pd.DataFrame) -> pd.DataFrame:
    """The largest errors of the two replays side by side."""
    return pd.DataFrame({"independent outputs": independent.max(numeric_only=True),
                         "outputs feed on h_normed": chained.max(numeric_only=True)}
                        ).drop("read")


def replay_plot(independent: pd.DataFrame, chained: pd.DataFrame):
    fig, ax = plots.subplots(figsize=(10, 2.8))
    ax.plot(independent.read, independent["h norm err"], ".", label="independent outputs")
    ax.plot(chained.read, chained["h norm err"], ".", label="outputs feed on h_normed")
    ax.set(xlabel="read", ylabel="||h_fused - h_ref|| / ||h_ref||",
           title="replayed token: fused reads against reference reads")
    ax.legend()
    return plots.finish(fig)


def variants(s: Setup) -> list:
    """The available variants other than peers (the per-read and per-token comparisons)."""
    return [v for v in s.boundary.available_variants(s.device) if v.role != "peer"]


def launches_per_read(s: Setup, reads: list[Read]) -> pd.DataFrame:
    """Launches of one read of every variant at every depth the schedule uses, with how many
    reads of the token have that depth."""
    depths = Counter(r.n_candidates for r in reads)
    rows = []
    for c in sorted(depths):
        inputs = s.boundary.make_inputs(s.cfg, s.device, s.seed, M=s.M, n_sealed=c - 1)
        for v in variants(s):
            rows.append({"variant": v.name, "candidates": c, "reads": depths[c],
                         "launches per read": profile.count_launches(v.fn, inputs).count})
    return pd.DataFrame(rows)


class TokenReads:
    """All of a token's reads with one read function on a fixed residual buffer (``inputs``:
    rows and one weight set per read), as one variant function for the profiler."""

    def __init__(self, read_fn, reads: list[Read], eps: float):
        self.read_fn, self.reads, self.eps = read_fn, reads, eps

    def __call__(self, inputs: dict) -> list:
        rows = inputs["rows"]
        return [self.read_fn(rows[:r.n_candidates - 1], rows[r.n_candidates - 1],
                             w["res_norm_weight"], w["res_proj_weight"], w["norm_weight"],
                             eps=self.eps)
                for r, w in zip(self.reads, inputs["weights"], strict=True)]


def token_reads(s: Setup, reads: list[Read], replayed: TokenReplay) -> tuple[dict, dict]:
    """(the inputs of a whole token's reads: the replayed residual rows and every read's
    weights, {variant: :class:`TokenReads`} for :data:`READ_FNS`)."""
    inputs = {"rows": replayed.rows, "weights": replay_weights(s.cfg,
                                                               make_generator(s.seed, s.device))}
    return inputs, {n: TokenReads(fn, reads, s.cfg.rms_eps) for n, fn in READ_FNS.items()}


def launches_per_token(per_read: pd.DataFrame, token_inputs: dict, token_fns: dict,
                       n_reads: int) -> pd.DataFrame:
    """Per variant: launches per read summed over the token's reads, beside the whole token's
    reads counted in one go (they must agree)."""
    table = (per_read.assign(launches=lambda d: d["launches per read"] * d.reads)
             .groupby("variant").launches.sum().rename("launches per token (sum)").to_frame())
    table["launches per token (counted)"] = [
        profile.count_launches(token_fns[v], token_inputs).count for v in table.index]
    table["reads per token"] = n_reads
    table["sum == counted"] = table.iloc[:, 0] == table.iloc[:, 1]
    return table


def depth_sweep(s: Setup, sealed: list[int]) -> pd.DataFrame:
    """Every variant (not peers) at every depth in ``sealed``, cold copies, each mode of the
    device, checked before timed (raises on a mismatch). Wide rows: latency_us, p10_us, p90_us,
    copies, bytes."""
    b = s.boundary
    s.compile_ahead(s.fused_calls([(s.cfg, {"M": s.M, "n_sealed": n}) for n in sealed]))
    rows = []
    for n in sealed:
        copies = s.copies(M=s.M, n_sealed=n)
        b.check(b.variant("fused").fn(copies[0]), b.reference.fn(copies[0]), copies[0])
        for v in variants(s):
            for mode in s.modes:
                t = profile.time_variant(v.fn, copies, mode=mode, repeats=s.repeats)
                rows.append({**s.base, "variant": v.name, "role": v.role, "mode": mode,
                             "n_sealed": n, "candidates": n + 1, "latency_us": t.median_us,
                             "p10_us": t.p10_us, "p90_us": t.p90_us, "copies": t.copies,
                             "bytes": b.bytes_moved(copies[0])})
        del copies
    return pd.DataFrame(rows)


def depth_tables(s: Setup, sweep: pd.DataFrame) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(latency per candidates x (mode, variant), reference / fused per mode)."""
    lat = sweep.pivot_table(index="candidates", columns=["mode", "variant"], values="latency_us")
    speedup = pd.DataFrame({m: lat[(m, "reference")] / lat[(m, "fused")] for m in s.modes})
    return lat, speedup


def depth_plot(s: Setup, lat: pd.DataFrame, speedup: pd.DataFrame):
    fig, (ax1, ax2) = plots.subplots(1, 2, figsize=(11, 3.8))
    for (mode, v), col in lat.items():
        ax1.plot(lat.index, col, "o-" if v == "fused" else "s--", label=f"{v} ({mode})")
    ax1.set(yscale="log", xlabel="candidates (sealed rows + live)",
            ylabel="latency per read (us)", title="latency per read")
    ax1.legend()
    for mode in s.modes:
        ax2.plot(speedup.index, speedup[mode], "o-", label=mode)
    ax2.axhline(SPEEDUP_LINE, color="tab:red", ls="--", label=f"{SPEEDUP_LINE:g}x")
    ax2.set(xlabel="candidates", ylabel="reference / fused", title="speedup per read")
    ax2.legend()
    return plots.finish(fig, f"{s.cfg.describe()}, M={s.M}{s.note}")


def token_latency(s: Setup, token_inputs: dict, token_fns: dict, per_token: pd.DataFrame
                  ) -> pd.DataFrame:
    """A whole token's reads back to back, warm (one working set), as one graph on a GPU and
    eager on the CPU; with the launches counted and the time per read."""
    table = pd.DataFrame([
        {"variant": v, "mode": s.mode,
         "token us": profile.time_variant(fn, [token_inputs], mode=s.mode,
                                          repeats=s.repeats).median_us}
        for v, fn in token_fns.items()]).set_index("variant")
    table["launches"] = per_token["launches per token (counted)"]
    table["us per read"] = table["token us"] / per_token["reads per token"].iloc[0]
    return table
