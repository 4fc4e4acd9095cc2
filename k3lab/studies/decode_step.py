"""The decode-step notebook's studies (90_decode_step): the whole token under the engine
baseline, the stacks' waterfalls, where the time goes, the bytes floor, the modeled
all-reduces, the context sweep and the anchors.

The token figures come from ``k3lab.studies.decode_token`` (graph timing, labels, extrapolation)
and ``k3lab.studies.decode_bytes`` (the floor); the stacks from ``k3lab.stack``.
"""

from __future__ import annotations

import dataclasses
import math
import textwrap

import pandas as pd
import torch

from k3lab import plots, profile, stack
from k3lab.reference import layer as ref_layer
from k3lab.studies import decode_token
from k3lab.studies.decode_bytes import token_bytes
from k3lab.studies.decode_token import TokenFigures, allreduces, measure_token

__all__ = ["catalogue", "SEED_ANCHOR", "ALLREDUCE", "MODELS", "configs_for", "build",
           "launch_choices", "compare", "PDL_CHOICES", "CONFIG_CHOICES", "STACK_CHOICES",
           "set_context", "check_token", "split_override", "split_context", "GRAPH_CONTEXT",
           "LOGITS_RTOL", "waterfall", "waterfall_table",
           "waterfall_plot", "floor", "floors", "latent_up_format", "rates", "rates_plot",
           "breakdown", "FLOOR_LABEL",
           "breakdown_plot",
           "layer_timelines", "context_sweep", "headline", "picker", "CUBLAS_LABEL",
           "cublas_stack"]

# The campaign's banked endpoint: the seed PR's own figure and its conditions.
SEED_ANCHOR = {"tok/s": 60.909, "machine": "AMD MI355X", "GPUs": 8,
               "communication": "included", "what": "end-to-end serving decode, the seed PR's "
               "banked endpoint (route-sort + AttnRes integration, +20.3 %)"}
# Default all-reduce latency and where it comes from (issue 25 asks for a public small-message
# figure until it is measured on several GPUs).
ALLREDUCE = {"us": 10.0, "source": "sgl-project/sglang PR #2904 (H100, tp 8, without CUDA "
             "graphs): vLLM's custom all-reduce, the path engines take instead of NCCL for "
             "decode-sized messages, 9.3 us at 4 KiB and 11.8 us at 32 KiB; K3's 14 KiB "
             "(7168 bf16) taken as 10 us. NCCL's ring / tree all-reduce is not latency-optimal "
             "at this size (vLLM PR #2192's design note), so NCCL itself would cost more"}
# the longest MLA context a captured decode graph serves (the split override's length)
GRAPH_CONTEXT = 131072
MODELS = (
    "Modeled: one tp rank's decode token at batch 1: the embedding row, layer 0 (KDA attention "
    "and the dense MLP), a window of consecutive layers with distinct, cold weights and "
    "caches (every AttnRes read, block sums sealed every attn_res_block layers; the sums of "
    "blocks before the window are random rows), the final "
    "AttnRes read + RMSNorm and the LM head over the rank's vocabulary shard, captured and "
    "replayed as one CUDA graph, so the gaps between kernels are in the figure; the remaining "
    "layers are extrapolated at the mean of the window's layers of their kind; the two "
    "all-reduces per layer are modeled as allreduce_us each, shown apart. Left out: sampling "
    "and the host's scheduling between steps, the embedding's all-reduce and the logits' "
    "gather across ranks, overlap of communication with compute, AttnRes reads of depths "
    "other than the window's (a window from layer 1 reads 1 to 3 candidates, where the "
    "model's reads average about 5 and reach 9; first_layer = 0 centres the window in the "
    "model, so its reads are at about the mean depth), "
    "batch sizes above 1, and the accuracy of synthetic weights (the routing of real weights "
    "picks other experts; the bytes are the same).")
# The full stack with its projections left to cuBLAS: every boundary fused, every projection
# bf16 F.linear as the engine baseline runs it (an engine with today's fused boundaries).
CUBLAS_LABEL = "fused boundaries, cuBLAS projections"
LOGITS_RTOL = 0.1  # of the largest |logit|: bf16 hand-offs through every op of every layer


def catalogue() -> pd.DataFrame:
    """The changes of ``stack.CATALOGUE``: what each owns, requires, supersedes and needs, and
    the stacks that hold it."""
    return pd.DataFrame([{"change": c.name, "what": c.title, "owns": ", ".join(c.owns),
                          "requires": ", ".join(c.requires),
                          "supersedes": ", ".join(c.supersedes),
                          "stacks": ", ".join(n for n, s in stack.STACKS.items() if c.name in s),
                          "seed commit": c.seed_commit or "",
                          "kernel here": c.missing() or "yes"}
                         for c in stack.CATALOGUE])


# The token's MoE layout: the shared down-projection and the residual in stage 1's launch, the
# tail loading that sum before its PDL wait (docs/decisions.md, "The shared down-projection
# beside an expert stage")
TOKEN_MOE = {"shared_down_launch": "stage1", "tail_second_first": True}


def configs_for(device) -> stack.Configs:
    """The launchers' configs: their defaults, except the MoE layout of :data:`TOKEN_MOE` and,
    on a GPU, the AttnRes reads' sealed rows loaded before their PDL wait (the token writes a
    bank row only by a plain copy at least two launches before a read that holds it:
    ``AttnResConfig.bank_before_wait``); under the interpreter, few big programs (each
    interpreted program costs the same Python overhead, whatever its size): the route's
    split-K gate tiles (the dense GEMV takes its own interpreter tiling when given none)."""
    from k3lab.kernels import MoEConfig

    moe = MoEConfig(**TOKEN_MOE)
    if torch.device(device).type == "cuda":
        from k3lab.kernels import AttnResConfig
        return stack.Configs(attn_res=AttnResConfig(bank_before_wait=True), moe=moe)
    from k3lab.kernels import RouteConfig
    return stack.Configs(route=RouteConfig(gemv_row_programs=0), moe=moe)


def build(cfg, device, *, window: int = 0, context: int = 8192, expert_format: str = "mxfp4",
          seed: int = 0, first_layer: int = 1) -> dict:
    """The token of ``make_token``; window 0 = one AttnRes block (12 layers at K3); first_layer
    0: the window centred in the model (``window_layers``)."""
    return ref_layer.make_token(cfg, device, window=window or cfg.attn_res_block, seed=seed,
                                context=context, expert_format=expert_format,
                                first_layer=first_layer)


def set_context(token: dict, context: int, seed: int = 0) -> None:
    """Give the token's MLA layers a cache of ``context`` rows (the token at context - 1)."""
    from k3lab.weights import make_generator, mla_cache

    cfg, dev = token["cfg"], token["rows"].device
    for state in token["layers"]:
        if state["kind"] == "mla":
            gen = make_generator(seed + context, dev)
            state["cache"] = mla_cache(cfg, token["m"], context, max(context - 1, 1), gen)
            state["position"].fill_(context - 1)
    token["context"] = context


def _snapshot(token: dict) -> list:
    return [{k: v.clone() for k, v in s["cache"].items()} for s in token["layers"]]


def _restore(token: dict, snap: list) -> None:
    for s, saved in zip(token["layers"], snap, strict=True):
        for k, v in saved.items():
            s["cache"][k].copy_(v)


def _per_label(num_splits, label: str) -> int:
    return num_splits[label] if isinstance(num_splits, dict) else num_splits


def split_context(contexts=()) -> int:
    """The longest MLA context a captured graph serves: :data:`GRAPH_CONTEXT`, or the longest
    of ``contexts`` if longer."""
    contexts = [int(c) for c in contexts]
    if contexts and min(contexts) < 1:
        raise ValueError(f"contexts: expected context lengths of at least 1, got {contexts}")
    return max([GRAPH_CONTEXT, *contexts])


def split_override(cfg, device, contexts=()) -> int:
    """The MLA split count a graph-capturing engine fixes: the kernel's own count
    (``kernels.mla.default_num_splits``) at :func:`split_context`. The kernel reads the
    lengths on the device, so one graph with it serves every shorter context."""
    from k3lab.kernels.mla import default_num_splits

    return default_num_splits(1, cfg.mla_heads, split_context(contexts), device)


def check_token(token: dict, stacks: dict, configs, num_splits) -> pd.DataFrame:
    """Each stack's logits against the fp32 truth (``reference.layer.run_token``) from the same
    caches, the truth's MoE layers using the experts the stack chose (a router near-tie flips
    an expert on a rounding difference; a column says in how many layers the stack chose the
    engine baseline's experts): max abs error, the tolerance (LOGITS_RTOL of the largest
    |logit|), pass. A stack with ``fp8-latent-tail`` is checked against the truth of its own
    weights: the latent up-projection as the e4m3 rows it runs, dequantized (column "truth
    latent up"); the quantization itself is a change of the model's numbers, not an error of
    the kernels. ``configs`` and ``num_splits`` (the MLA split count): one for every stack, or
    one per label; stacks that chose the same experts and weights share one truth."""
    snap = _snapshot(token)
    own: list = []
    truths: list[tuple[list, bool, torch.Tensor]] = []  # (experts chosen, fp8 tail, truth)
    rows = []
    for label, st in stacks.items():
        cfgs = configs[label] if isinstance(configs, dict) else configs
        fp8 = "fp8-latent-tail" in st.names and bool(token["cfg"].latent)
        _restore(token, snap)
        chosen: list = []
        got = stack.run_token(st, token, num_splits=_per_label(num_splits, label), configs=cfgs,
                              record=chosen).float()
        truth = next((t for c, f, t in truths if f == fp8 and _same_experts(c, chosen)), None)
        if truth is None:
            _restore(token, snap)
            truth = ref_layer.run_token(token, topk_ids=chosen,
                                        moe_view=_fp8_tail_view if fp8 else None)
            truths.append((chosen, fp8, truth))
        if not own:
            _restore(token, snap)
            own = _own_routing(token)
        tol = LOGITS_RTOL * float(truth.abs().max())
        err = float((got - truth).abs().max())
        same = sum(a is not None and _same_experts([a], [b]) for a, b in zip(chosen, own,
                                                                             strict=True))
        moe = sum(a is not None for a in chosen)
        rows.append({"stack": label, "max abs error": err, "tolerance": tol, "ok": err <= tol,
                     "routing as the engine baseline's": f"{same} of {moe} MoE layers",
                     "truth latent up": "e4m3 rows" if fp8 else "bf16"})
    _restore(token, snap)
    return pd.DataFrame(rows)


def _fp8_tail_view(moe: dict) -> dict:
    """The MoE weights with the latent up-projection as the FP8 tail runs it: its e4m3 rows
    (``boundaries.moe.fp8_tail_rows``, the stack's own) times their scales."""
    from k3lab.boundaries.moe import fp8_tail_rows

    return {**moe, "latent_up": fp8_tail_rows(moe["latent_up"]).dequantize()}


def _same_experts(a: list, b: list) -> bool:
    """Whether two per-layer records of chosen experts (None: a layer without routing) pick the
    same experts for every token (in any slot order)."""
    return len(a) == len(b) and all(
        (x is None) == (y is None) and (x is None or torch.equal(
            x.sort(-1).values.long(), y.sort(-1).values.long())) for x, y in zip(a, b, strict=True))


def _own_routing(token: dict) -> list:
    """The experts the engine baseline (the reference router) picks per layer."""
    chosen: list = []
    stack.run_token(stack.compose([]), token, record=chosen)
    return chosen


# ---------------------------------------------------------------------------------------------
# waterfalls


def waterfall(token: dict, device, order, *, configs: stack.Configs, num_splits: int,
              repeats: int | None = None, cache: dict | None = None) -> list[tuple]:
    """[(change added, TokenFigures or None, note)] for ``stack.steps(order)``: a change whose
    kernel is absent is skipped with its note (and the step's figures are the previous ones).
    ``cache`` ({stack key: figures}) shares measurements between waterfalls: stacks with the
    same owner map and the same changes that own no op (``fp8-latent-tail`` changes how an
    owner runs) are one measurement."""
    cache = {} if cache is None else cache
    out = []
    for added, names in stack.steps(order):
        st, notes = stack.runnable(stack.compose(names))
        key = (tuple(sorted((op, o) for op, o in st.owner.items() if o)),
               tuple(sorted(c.name for c in st.changes if not c.owns)))
        if key not in cache:
            cache[key] = measure_token(st, token, device, label=added, configs=configs,
                                       num_splits=num_splits, repeats=repeats)
        fresh = [n for n in notes if n.startswith(f"{added} ")]
        out.append((added, cache[key], "; ".join(fresh)))
    return out


def waterfall_table(steps: list[tuple]) -> pd.DataFrame:
    """Per step: the change added, tok/s (comm excluded), gain over the previous step and over
    the engine baseline, launches per token, note."""
    rows = [{"added": a, "tok/s": f.tok_per_s, "launches per token": round(f.launches),
             "note": note} for a, f, note in steps]
    t = pd.DataFrame(rows)
    t["gain vs previous"] = t["tok/s"].pct_change()
    t["vs engine baseline"] = t["tok/s"] / t["tok/s"].iloc[0]
    return t


def waterfall_plot(tables: dict, title: str):
    """Both stacks' waterfalls side by side: tok/s per step, launches per token above."""
    fig, axes = plots.subplots(1, len(tables), figsize=(6.5 * len(tables), 4.2), sharey=True)
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, (name, t) in zip(axes, tables.items(), strict=True):
        colors = ["#999"] + ["#bbb" if n else "#3a7" for n in t["note"].iloc[1:]]
        ax.bar(range(len(t)), t["tok/s"], color=colors)
        ax.set_xticks(range(len(t)), t["added"], rotation=40, ha="right", fontsize=8)
        for i, (v, n) in enumerate(zip(t["tok/s"], t["launches per token"], strict=True)):
            ax.annotate(f"{v:.3g}\n{n} l", (i, v), ha="center", va="bottom", fontsize=7)
        ax.set_title(f"{name} stack")
    axes[0].set_ylabel("tok/s, comm excluded (l: launches per token)")
    fig.suptitle(title)
    return plots.finish(fig)


def cublas_stack() -> tuple[stack.Stack, list[str]]:
    """The integration stack's last step without ``dense-gemv`` and ``fp8-latent-tail``
    (:data:`CUBLAS_LABEL`: every boundary fused, every projection bf16 as the model stores it),
    and the runnable notes."""
    names = stack.steps(stack.STACKS["integration"])[-1][1]
    return stack.runnable(stack.compose([n for n in names
                                         if n not in ("dense-gemv", "fp8-latent-tail")]))


# ---------------------------------------------------------------------------------------------
# the launchers' choices in the token

# Launch choices of the small launchers, each toggled in the token: programmatic dependent
# launch (the launch overlapping the previous grid's end, the next launch free to start
# early); (what, the Configs field, the config class).
PDL_CHOICES = (("AttnRes reads", "attn_res", "AttnResConfig"),
               ("KDA decode", "kda", "KDAConfig"))
# Rounds of the launch choices' interleaved replays (launch_choices)
INTERLEAVED_ROUNDS = 7
# Other launch choices timed in the token, each alone on top of the configs given: (label, the
# Configs field, the config class, the fields it sets; a class of None: fields of Configs).
CONFIG_CHOICES = (("AttnRes bank rows after the PDL wait", "attn_res", "AttnResConfig",
                   {"bank_before_wait": False}),
                  ("MLA split kernel by PDL", "mla", "MLAConfig", {"split_pdl": True}),
                  ("MLA absorb kernels plain", "mla", "MLAConfig", {"absorb_pdl": False}),
                  ("MoE router apart from the front", "moe", "MoEConfig",
                   {"front_routes": False}),
                  ("MoE front after the route", "moe", "MoEConfig",
                   {"front_routes": False, "front_overlaps_route": False}),
                  ("MoE shared gate/up beside stage 1", "moe", "MoEConfig",
                   {"shared_beside_stage1": True}),
                  ("MoE shared down-projection in the tail's launch", "moe", "MoEConfig",
                   {"shared_down_launch": "tail", "tail_second_first": False}),
                  # K3's bf16 tail tiling (kernels/dense/tuned.py) against the e4m3 tail's own
                  # (TUNED_M1_E4M3: wider tiles, more bytes a step)
                  ("MoE tail at 16 x 256 steps", "tail", "GemvConfig",
                   {"block_n": 16, "block_k": 256, "num_stages": 3, "pdl": True,
                    "prefetch_steps": 0}),
                  ("Input projections' first weight step not asked of L2 early", None, None,
                   {"in_proj_prefetch": None}))
# Changes of the catalogue timed in the token against the full stack, each alone with the
# configs given: (label, the change, True: added to the full stack / False: taken out of it).
# A change joins the integration stack once measured here; one in it stays measured by its
# absence.
STACK_CHOICES = (("FP8 latent tail (#18) in the fused tail's dense GEMV", "fp8-latent-tail",
                  True),
                 ("bf16 latent tail (the full stack without #18)", "fp8-latent-tail", False))


def stack_choices(full: stack.Stack) -> dict:
    """label -> the full stack with that :data:`STACK_CHOICES` change added (where it is not in
    it) or taken out (where it is), for the stacks that compose (the others' notes printed)."""
    out = {}
    for label, name, add in STACK_CHOICES:
        if (name in full.names) == add:
            continue
        names = [*full.names, name] if add else [n for n in full.names if n != name]
        try:
            st, notes = stack.runnable(stack.compose(names))
        except ValueError as exc:  # it cannot join (or leave) this stack
            print(f"launch choices: {label}: left out ({exc})")
            continue
        for note in notes:
            print(f"launch choices: {label}: {note}")
        if (name in st.names) == add:
            out[label] = st
    return out


def _checked(checks: pd.DataFrame, choices: dict, stacks: dict, full) -> pd.DataFrame:
    """The truth check's rows of the choices to time. A stack choice that misses the truth (a
    change of the numerics, e.g. FP8 weights, may) is said and dropped from ``choices`` and
    ``stacks``; a launch choice that misses it is an error."""
    for label, ok in zip(list(choices), checks["ok"], strict=True):
        if not ok and stacks[label] is not full:
            r = checks[checks["stack"] == label].iloc[0]
            print(f"launch choices: {label}: logits off the fp32 truth by "
                  f"{r['max abs error']:.4g} (tolerance {r['tolerance']:.4g}); not timed")
            del choices[label], stacks[label]
    checks = checks[checks["stack"].isin(list(choices))].reset_index(drop=True)
    bad = checks[~checks["ok"]]
    if len(bad):
        raise AssertionError("logits off the fp32 truth: " + "; ".join(
            f"{r['stack']} by {r['max abs error']:.4g} (tolerance {r['tolerance']:.4g})"
            for _, r in bad.iterrows()))
    return checks


def launch_choices(token: dict, device, full: stack.Stack, *, configs: stack.Configs,
                   num_splits: int, repeats: int | None = None) -> pd.DataFrame:
    """The full stack's token with ``configs`` ("defaults"), then with each of
    :data:`PDL_CHOICES` toggled (by PDL where the default is a plain launch, plain where it is
    PDL), then all of them toggled, then each of :data:`CONFIG_CHOICES` alone, then each of
    :data:`STACK_CHOICES` (the full stack with one more change; one that cannot join it, or
    whose logits miss the truth, is left out, its note printed; a launch choice that misses
    it is an error), measured back to back in this run, each checked against the
    fp32 truth first: tok/s, launches,
    ratio to the defaults; then the window's graphs of every choice replayed in turn over
    :data:`INTERLEAVED_ROUNDS` rounds (``profile.time_interleaved``): the defaults' window
    time over each choice's, its median, min and max over the rounds (the spread says how
    much of a ratio is noise; left out, with the reason printed, where the replays fail).
    Empty on the CPU: the interpreter runs plain launches, so the rows would differ by noise
    alone."""
    if torch.device(device).type != "cuda":
        return pd.DataFrame()

    from k3lab import kernels

    def current(field, cls):  # the configs' own, else the launcher's default
        return getattr(configs, field) or getattr(kernels, cls)()

    toggled, labels = {}, {}
    for what, field, cls in PDL_CHOICES:
        default = current(field, cls)
        toggled[field] = dataclasses.replace(default, pdl=not default.pdl)
        labels[field] = f"{what} {'plain' if default.pdl else 'by PDL'}"
    choices = {"defaults": configs,
               **{labels[f]: dataclasses.replace(configs, **{f: c}) for f, c in toggled.items()},
               "all of them toggled": dataclasses.replace(configs, **toggled)}
    for label, field, cls, changes in CONFIG_CHOICES:
        choices[label] = dataclasses.replace(configs, **changes) if cls is None else \
            dataclasses.replace(configs, **{field: dataclasses.replace(current(field, cls),
                                                                       **changes)})
    stacks = dict.fromkeys(choices, full)
    for label, st in stack_choices(full).items():
        stacks[label], choices[label] = st, configs
    checks = _checked(check_token(token, stacks, choices, num_splits), choices, stacks, full)
    out = compare(token, device, choices, stacks, num_splits=num_splits, repeats=repeats)
    out.insert(4, "max abs error", checks["max abs error"].to_numpy())
    return out


def compare(token: dict, device, choices: dict, stacks: dict, *, num_splits,
            repeats: int | None = None) -> pd.DataFrame:
    """Each labelled token (``stacks[label]`` run with ``choices[label]``, a ``stack.Configs``,
    and ``num_splits``, one MLA split count or one per label; the first label is the base,
    "defaults") measured back to back: tok/s, token us, launches,
    its tok/s over the base's; on a GPU, then the window's graphs of every label replayed in
    turn over :data:`INTERLEAVED_ROUNDS` rounds (``profile.time_interleaved``): the base's
    window time over each label's, its median, min and max over the rounds (left out, with the
    reason printed, where the replays fail). The caller checks the tokens against the truth."""
    rows = []
    for label, cfgs in choices.items():
        f = measure_token(stacks[label], token, device, label=label, configs=cfgs,
                          num_splits=_per_label(num_splits, label), repeats=repeats)
        rows.append({"choice": label, "token us": f.token_us, "tok/s": f.tok_per_s,
                     "launches per token": round(f.launches)})
    out = pd.DataFrame(rows)
    out["vs defaults"] = out["tok/s"] / out["tok/s"].iloc[0]
    if torch.device(device).type != "cuda":  # CUDA graphs only
        return out
    splits = {label: _per_label(num_splits, label) for label in choices}
    runs = {label: (lambda tk, c=cfgs, st=stacks[label], n=splits[label]: stack.run_token(
                st, tk, num_splits=n, configs=c))
            for label, cfgs in choices.items()}
    try:
        r = profile.interleaved_ratios(profile.time_interleaved(runs, token,
                                                                rounds=INTERLEAVED_ROUNDS),
                                       next(iter(choices)))
    except RuntimeError as exc:  # the table above stands without its spread; say why
        print(f"launch choices: the interleaved replays failed ({exc}); no spread columns")
        return out
    for col in ("median", "min", "max"):
        out[f"window vs defaults, interleaved {col}"] = out["choice"].map(r[col]).to_numpy()
    return out


# ---------------------------------------------------------------------------------------------
# floor, rates, where the time goes


def latent_up_format(st: stack.Stack | None, cfg) -> str:
    """How ``st`` stores the latent MoE tail's up-projection: "e4m3" with ``fp8-latent-tail``
    (a latent preset), else the model's "bf16"."""
    return "e4m3" if st is not None and cfg.latent and "fp8-latent-tail" in st.names else "bf16"


def floor(token: dict, device, st: stack.Stack | None = None, *,
          bandwidth: float | None = None) -> dict:
    """The token's bytes by category as stack ``st`` stores its weights (None: as the model
    does; ``fp8-latent-tail`` halves the latent up-projection's), the copy bandwidth measured
    in this run (or ``bandwidth``, measured earlier in it), the floor in us and the roofline
    tok/s."""
    fmt = latent_up_format(st, token["cfg"])
    b = token_bytes(token["cfg"], token["context"], token["expert_format"], fmt)
    bw = profile.copy_bandwidth(device) if bandwidth is None else bandwidth
    us = profile.roofline_us(int(sum(b.values())), bw)
    return {"bytes": b, "total bytes": sum(b.values()), "copy bandwidth": bw, "floor_us": us,
            "roofline tok/s": 1e6 / us, "latent up": fmt}


def floors(token: dict, device, stacks: dict) -> dict:
    """label -> :func:`floor` of each stack's own weight formats, over one copy bandwidth
    measured in this run."""
    bw = profile.copy_bandwidth(device)
    return {label: floor(token, device, st, bandwidth=bw) for label, st in stacks.items()}


def rates(figs: dict, fl: dict, cfg, allreduce_us: float) -> pd.DataFrame:
    """Per stack: per-token us, tok/s without and with the modeled all-reduces, the roofline
    tok/s and the fraction of it reached, launches per token. ``fl``: one :func:`floor` for
    every stack, or label -> the stack's own (:func:`floors`)."""
    comm = allreduces(cfg) * allreduce_us
    rows = []
    for label, f in figs.items():
        own = fl if "floor_us" in fl else fl[label]
        rows.append({"stack": label, "token us": f.token_us, "tok/s (comm excluded)":
                     f.tok_per_s, "all-reduce us": comm,
                     "tok/s (comm included)": 1e6 / (f.token_us + comm),
                     "roofline tok/s": own["roofline tok/s"],
                     "fraction of floor": own["floor_us"] / f.token_us,
                     "launches per token": round(f.launches),
                     "latent up": own.get("latent up", "bf16")})
    return pd.DataFrame(rows)


def rates_plot(r: pd.DataFrame, title: str):
    """tok/s per stack without and with the all-reduces, the roofline and the seed's anchor."""
    fig, ax = plots.subplots(figsize=(8, 3.8))
    x = range(len(r))
    ax.bar([i - 0.2 for i in x], r["tok/s (comm excluded)"], 0.4, label="comm excluded",
           color="#3a7")
    ax.bar([i + 0.2 for i in x], r["tok/s (comm included)"], 0.4, label="comm included (modeled)",
           color="#27a")
    ax.scatter(list(x), r["roofline tok/s"], marker="_", s=900, color="#a33", zorder=3,
               label="bytes floor (the stack's own weight formats)")
    ax.axhline(SEED_ANCHOR["tok/s"], color="#777", ls=":",
               label=f"seed {SEED_ANCHOR['tok/s']} ({SEED_ANCHOR['machine']}, "
                     f"{SEED_ANCHOR['GPUs']} GPUs, comm included)")
    ax.set_xticks(list(x), _tick_labels(r["stack"]), fontsize=8)
    ax.set_ylabel("tok/s (one tp rank)")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return plots.finish(fig)


FLOOR_LABEL = "bytes floor"


def breakdown(figs: dict, comm_us: float, fl: dict | None = None) -> pd.DataFrame:
    """us per token by category (and the modeled all-reduces), one column per stack; with the
    token's :func:`floor` ``fl``, a last column :data:`FLOOR_LABEL`: each category's bytes over
    the copy bandwidth (0 for the launch gaps and the all-reduces), so that a category's excess
    over its bytes reads off its row."""
    cols = {}
    for label, f in figs.items():
        cols[label] = {**f.categories, "all-reduce (modeled)": comm_us}
    out = pd.DataFrame(cols)
    if fl is not None:
        unknown = set(fl["bytes"]) - set(out.index)
        if unknown:
            raise ValueError(f"fl: bytes of categories the stacks do not have: {sorted(unknown)}")
        out[FLOOR_LABEL] = [fl["bytes"].get(c, 0.0) / fl["copy bandwidth"] * 1e6
                            for c in out.index]
    return out


def _tick_labels(labels) -> list[str]:
    """Stack names wrapped to fit under a bar."""
    return [textwrap.fill(str(x), 16) for x in labels]


ZOOM = 4.0  # the breakdown adds a panel of the stacks within this factor of the fastest


def breakdown_plot(b: pd.DataFrame, title: str):
    """Stacked bars of :func:`breakdown` (a negative value drawn as 0); when some stacks
    take more than ZOOM x the fastest one's time, a second panel shows the others alone."""
    totals = b.clip(lower=0).sum()
    near = [c for c in b.columns if totals[c] <= ZOOM * totals.min()]
    panels = [list(b.columns)] + ([near] if len(near) < b.shape[1] else [])
    fig, axes = plots.subplots(1, len(panels), figsize=(7 * len(panels), 4.2))
    axes = axes if hasattr(axes, "__len__") else [axes]
    for ax, cols in zip(axes, panels, strict=True):
        bottom = [0.0] * len(cols)
        for cat, row in b[cols].iterrows():
            vals = [max(float(v), 0.0) for v in row]
            ax.bar(range(len(cols)), vals, bottom=bottom, label=cat)
            bottom = [a + v for a, v in zip(bottom, vals, strict=True)]
        ax.set_xticks(range(len(cols)), _tick_labels(cols), fontsize=8)
        ax.set_ylabel("us per token")
    axes[0].set_title(title)
    if len(axes) > 1:
        axes[1].set_title(f"the stacks within {ZOOM:g}x of the fastest")
    return plots.finish(fig, legend=True)


def layer_timelines(f: TokenFigures, token: dict) -> dict:
    """{(kind, layer): that layer's launches} for the window's first KDA and first MLA layer."""
    mla = set(token["cfg"].mla_layers)
    out = {}
    for kind in ("kda", "mla"):
        layer = next((x for x in token["layer_ids"][1:] if (x in mla) == (kind == "mla")), None)
        if layer is not None:
            tl = f.timeline[f.timeline["segment"] == f"layer {layer}"]
            out[(kind, layer)] = tl[["kernel", "start_us", "end_us", "dur_us", "stream",
                                     "category"]].reset_index(drop=True)
    return out


def context_sweep(token: dict, device, contexts, stacks: dict, *, configs, num_splits,
                  allreduce_us: float, repeats=None) -> pd.DataFrame:
    """tok/s of each stack (with and without the all-reduces) and the roofline per MLA context;
    the token's caches are rebuilt for each context and left at the last."""
    rows = []
    for c in contexts:
        set_context(token, int(c))
        fl = floors(token, device, stacks)
        figs = {label: measure_token(st, token, device, label=label, configs=configs,
                                     num_splits=num_splits, repeats=repeats)
                for label, st in stacks.items()}
        rows.append(rates(figs, fl, token["cfg"], allreduce_us).assign(context=int(c)))
    return pd.concat(rows, ignore_index=True)


def headline(r: pd.DataFrame, fl: dict, tables: dict, choices: pd.DataFrame | None = None
             ) -> dict:
    """The report's headline: every stack's tok/s with and without the all-reduces, its
    roofline (its own weight formats) and the fraction reached, launches; the model's roofline
    (``fl``: the floor of the model's formats), the copy bandwidth, the seed's anchor; with
    ``choices`` (:func:`launch_choices`), each launch choice's tok/s over the defaults'."""
    by = r.set_index("stack")
    head = {}
    for label in by.index:
        head[f"{label} tok/s (comm excluded)"] = round(float(by.loc[label,
                                                                   "tok/s (comm excluded)"]), 2)
        head[f"{label} tok/s (comm included)"] = round(float(by.loc[label,
                                                                   "tok/s (comm included)"]), 2)
        head[f"{label} fraction of floor"] = round(float(by.loc[label, "fraction of floor"]), 3)
        if by.loc[label, "roofline tok/s"] != fl["roofline tok/s"]:
            head[f"{label} roofline tok/s"] = round(float(by.loc[label, "roofline tok/s"]), 2)
        head[f"{label} launches per token"] = int(by.loc[label, "launches per token"])
    head["roofline tok/s"] = round(fl["roofline tok/s"], 2)
    head["copy bandwidth TB/s"] = round(fl["copy bandwidth"] / 1e12, 3)
    head["seed anchor tok/s (MI355X, 8 GPUs, comm included)"] = SEED_ANCHOR["tok/s"]
    for name, t in tables.items():
        head[f"{name} stack end tok/s"] = round(float(t["tok/s"].iloc[-1]), 2)
    for c in ([] if choices is None else choices.iloc[1:].to_dict("records")):
        head[f"full stack, {c['choice']}: tok/s / defaults' (one run)"] = round(
            float(c["vs defaults"]), 3)
        for k in ("min", "max"):
            v = c.get(f"window vs defaults, interleaved {k}")
            if v is not None:
                head[f"full stack, {c['choice']}: defaults' window / its, interleaved {k}"] = \
                    round(float(v), 3)
    return {k: v for k, v in head.items() if not (isinstance(v, float) and math.isnan(v))}


def picker(token: dict, device, full: stack.Stack, **measure_kw):
    """Tick changes and press *measure*: the chosen stack's token figures, or why it is refused
    (ipywidgets)."""
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
            st, notes = stack.runnable(chosen)
            f = decode_token.measure_token(st, token, device, **measure_kw)
            display(pd.Series({"tok/s": f.tok_per_s, "launches per token": f.launches,
                               **f.categories, "notes": "; ".join(notes + f.notes)}))

    button.on_click(measure)
    return widgets.VBox([*boxes, button, out])


