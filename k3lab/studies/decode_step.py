"""The decode-step notebook's studies (90_decode_step): the catalogue's table, the waterfall's
projected tok/s change by change, launches per layer and whole-layer timelines under a stack,
and the interactive stack picker."""

from __future__ import annotations

import pandas as pd

from k3lab import plots, profile, stack
from k3lab.reference.layer import make_layer

__all__ = ["catalogue", "mode_of", "token_rates", "waterfall_plot", "launches_per_layer",
           "full_stack", "layer_timelines", "headline", "picker"]


def catalogue() -> pd.DataFrame:
    """The changes of ``stack.CATALOGUE``: what each owns, requires and supersedes."""
    return pd.DataFrame([{"change": c.name, "what": c.title, "owns": ", ".join(c.owns),
                          "requires": ", ".join(c.requires),
                          "supersedes": ", ".join(c.supersedes),
                          "seed commit": c.seed_commit or "(vLLM side)"}
                         for c in stack.CATALOGUE])


def mode_of(device) -> str:
    """The mode the waterfall projects from: graph on a GPU, eager on the CPU."""
    return "graph" if str(getattr(device, "type", device)).startswith("cuda") else "eager"


def token_rates(wf: pd.DataFrame, mode: str) -> pd.DataFrame:
    """Per waterfall step (``stack.waterfall`` records): the change added, the projected tok/s
    in ``mode``, the gain over the previous step and over the reference, launches per token."""
    tok = wf[(wf.metric == "tok_per_s") & (wf["mode"] == mode)][["step", "added", "value"]]
    tok = tok.rename(columns={"value": "tok/s"}).reset_index(drop=True)
    tok["gain vs previous"] = tok["tok/s"].pct_change()
    tok["vs reference"] = tok["tok/s"] / tok["tok/s"].iloc[0]
    lpt = wf[wf.metric == "launches_per_token"].groupby("step")["value"].sum()
    tok["launches per token"] = tok["step"].map(lpt)
    return tok


def waterfall_plot(tok: pd.DataFrame, mode: str, title: str):
    """Projected tok/s per step, the reference gray, each bar labelled with its gain."""
    fig, ax = plots.subplots(figsize=(9, 3.8))
    ax.bar(range(len(tok)), tok["tok/s"], color=["#999"] + ["#3a7"] * (len(tok) - 1))
    ax.set_xticks(range(len(tok)), tok["added"], rotation=35, ha="right")
    for i, (v, g) in enumerate(zip(tok["tok/s"], tok["gain vs previous"], strict=True)):
        ax.annotate(f"{v:.3g}" + ("" if pd.isna(g) else f"\n{g:+.1%}"), (i, v), ha="center",
                    va="bottom", fontsize=8)
    ax.set_ylabel(f"projected tok/s ({mode})")
    ax.set_title(title)
    return plots.finish(fig)


def launches_per_layer(wf: pd.DataFrame, tok: pd.DataFrame) -> pd.DataFrame:
    """Launches of each layer kind per waterfall step, indexed by the change added."""
    table = wf[wf.metric == "launches"].pivot_table(index="step", columns="kind", values="value")
    table.index = tok.set_index("step").loc[table.index, "added"]
    return table


def full_stack(wf: pd.DataFrame) -> stack.Stack:
    """The stack of every change the waterfall added."""
    return stack.compose([n for n in dict.fromkeys(wf.added) if n != "reference"])


def layer_timelines(cfg, device, full: stack.Stack, *, seed: int = 0, context: int = 64,
                    expert_format: str = "bf16", num_splits: int = 4) -> dict:
    """{(layer kind, "reference" or "full stack"): one call's timeline} for every layer kind
    the preset has."""
    out = {}
    for kind in [k for k, n in stack.layer_counts(cfg).items() if n]:
        state = make_layer(cfg, kind, device, seed=seed, context=context,
                           expert_format=expert_format)
        for label, st in (("reference", stack.compose([])), ("full stack", full)):
            out[(kind, label)] = profile.timeline(
                lambda s, st=st: stack.run_layer(st, s, num_splits=num_splits), state)
    return out


def headline(tok: pd.DataFrame, per_layer: pd.DataFrame, mode: str) -> dict:
    """Reference and full-stack tok/s, the launch reduction per layer kind, the largest gain."""
    ref_tok, full_tok = float(tok["tok/s"].iloc[0]), float(tok["tok/s"].iloc[-1])
    ref_l, full_l = per_layer.iloc[0], per_layer.iloc[-1]
    head = {f"reference tok/s ({mode}, projected)": round(ref_tok, 2),
            f"full stack tok/s ({mode}, projected)": round(full_tok, 2),
            "full stack speedup": round(full_tok / ref_tok, 2)}
    for kind in per_layer.columns:
        head[f"{kind} layer launches reference -> full"] = (f"{int(ref_l[kind])} -> "
                                                            f"{int(full_l[kind])}")
        head[f"{kind} launch reduction"] = round(float(ref_l[kind] / full_l[kind]), 1)
    if len(tok) > 1:
        best = tok.iloc[1:].sort_values("gain vs previous").iloc[-1]
        head["largest single gain"] = f"{best['added']} {best['gain vs previous']:+.1%}"
    return head


def picker(cfg, device, full: stack.Stack, **measure_kw):
    """Tick changes and press *measure*: ``stack.measure_stack`` of the chosen stack, or why
    it is refused (ipywidgets)."""
    import ipywidgets as widgets
    from IPython.display import display

    boxes = [widgets.Checkbox(value=c.name in full.names, description=c.name, indent=False)
             for c in stack.CATALOGUE]
    button = widgets.Button(description="measure")
    out = widgets.Output()

    def measure(_):
        with out:
            out.clear_output()
            try:
                chosen = stack.compose([b.description for b in boxes if b.value])
            except ValueError as exc:
                print("rejected:", exc)
                return
            display(stack.measure_stack(chosen, cfg, device, **measure_kw))

    button.on_click(measure)
    return widgets.VBox([*boxes, button, out])
