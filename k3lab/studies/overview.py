"""The overview notebook's studies (00_overview): who owns each op of the decode step, and the
unfused reference of every boundary measured side by side."""

from __future__ import annotations

import pandas as pd

from k3lab import boundaries, config, ops, profile

__all__ = ["DENSE", "UNOWNED", "owners", "owner_of", "op_table", "ops_by_owner",
           "reference_records", "reference_table", "headline", "explorer"]

DENSE = "(dense projection, cuBLAS)"
UNOWNED = "(no boundary: reference)"


def owners() -> dict[str, str]:
    """op -> the first boundary (registry order) that owns it."""
    owner: dict[str, str] = {}
    for b in boundaries.all_boundaries():
        for op in b.owns:
            owner.setdefault(op, b.name)
    return owner


def owner_of(op: str, owner: dict[str, str]) -> str:
    """The boundary owning ``op`` (its ``@site`` suffix ignored), else :data:`DENSE` for a
    projection, else :data:`UNOWNED`."""
    base = op.split("@")[0]
    if base in owner:
        return owner[base]
    return DENSE if base.endswith("_proj") else UNOWNED


def op_table(cfg) -> pd.DataFrame:
    """Every op of a KDA layer (when the preset has KDA) and an MLA layer, in order, with its
    owner."""
    owner = owners()
    kinds = [k for k in ("kda", "mla") if k == "mla" or cfg.kda_heads]
    return pd.DataFrame([{"layer": k, "step": i, "op": op, "owner": owner_of(op, owner)}
                         for k in kinds for i, op in enumerate(ops.layer_ops(k))])


def ops_by_owner(cfg) -> pd.DataFrame:
    """:func:`op_table` grouped: per layer kind and owner, its ops in order."""
    return (op_table(cfg).groupby(["layer", "owner"], sort=False)["op"].apply(", ".join)
            .to_frame("ops"))


def reference_records(cfg, device, *, seed: int = 0, context: int = 256,
                      expert_format: str = "bf16", repeats: int | None = None) -> pd.DataFrame:
    """:func:`profile.measure` of every applicable boundary's reference (MLA at ``context``,
    the MoE with ``expert_format`` experts)."""
    frames = []
    for b in boundaries.all_boundaries():
        if not b.applies(cfg):
            continue
        params = {"context": context} if "context" in b.params else {}
        if "expert_format" in b.params:
            params["expert_format"] = expert_format
        frames.append(profile.measure(b, cfg, device, variants=[b.reference.name], seed=seed,
                                      params=params, repeats=repeats))
    return pd.concat(frames, ignore_index=True)


def reference_table(records: pd.DataFrame) -> pd.DataFrame:
    """Per boundary (registry order): launches, bytes, latency per mode, the roofline time."""
    lat = records[records.metric == "latency_us"].pivot_table(
        index="boundary", columns="mode", values="value", sort=False)
    lat.columns = [f"{c} us" for c in lat.columns]
    other = records[records.metric.isin(["launches", "bytes"])].pivot_table(
        index="boundary", columns="metric", values="value", sort=False
    ).reindex(columns=["launches", "bytes"])
    roof = records[records.metric == "roofline_us"].groupby("boundary", sort=False)["value"].first()
    return other.join(lat).assign(**{"roofline us": roof})


def headline(table: pd.DataFrame, kind: str, layer_launches: int) -> dict:
    """The reference launches and latencies of every boundary, and one layer's launches."""
    head = {f"{b} reference launches": int(r["launches"]) for b, r in table.iterrows()}
    for b, r in table.iterrows():
        for col in ("eager us", "graph us"):
            if col in r and pd.notna(r[col]):
                head[f"{b} reference {col.split()[0]} (us)"] = round(float(r[col]), 1)
    head[f"reference {kind} layer launches"] = layer_launches
    return head


def explorer(cfg, device, **measure_kw):
    """A preset and tp picker that re-measures :func:`reference_table` (ipywidgets)."""
    import ipywidgets as widgets
    from IPython.display import display

    pick = widgets.Dropdown(options=config.preset_names(), value=cfg.name, description="preset")
    tp_box = widgets.IntText(value=cfg.tp, description="tp")
    button = widgets.Button(description="refresh")
    out = widgets.Output()

    def refresh(_):
        with out:
            out.clear_output()
            try:
                chosen = config.preset(pick.value, tp_box.value)
                display(reference_table(reference_records(chosen, device, **measure_kw)))
            except ValueError as exc:
                print(exc)

    button.on_click(refresh)
    return widgets.VBox([widgets.HBox([pick, tp_box, button]), out])
