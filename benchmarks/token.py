"""Sweeps of the whole decode token (``python -m benchmarks.run token --sweep NAME``).

A token sweep's points set fields of the launchers' configs inside the full stack's decode token
(``k3lab.stack.Configs``): a key ``"tail.block_k"`` is field ``block_k`` of the config the MoE
tail's GEMV gets, ``"moe.front_overlaps_route"`` a field of the ``MoEConfig``. A field is
replaced on the config the decode step itself passes (``decode_step.configs_for``), else on the
launcher's default config class. The key ``"num_splits"`` sets the point's fixed MLA split
count (the sweep's own, from its params, otherwise; 0 there: ``decode_step.split_override``,
as the reference reports take it). The first point is ``{}``: the decode step's own configs, the
base of every ratio. Every point's token is checked against the fp32 truth first (a point off
it gets a ``check`` row of 0 and is not timed), then measured as the decode-step notebook's
launch-choice table measures its choices (``decode_step.compare``): tok/s, launches, and on a
GPU the window graphs of all points replayed in turn (the base's window time over each point's).
On the CPU the token is interpreted: its figures say that the sweep runs, not how fast.
"""

from __future__ import annotations

import dataclasses

import pandas as pd

__all__ = ["TOKEN", "CONFIG_CLASSES", "SPLITS", "GPU_PARAMS", "CPU_PARAMS", "resolve",
           "run_token_sweep"]

TOKEN = "token"  # the boundary name token sweeps go by
# stack.Configs field -> the config class of its launcher (k3lab.kernels)
CONFIG_CLASSES = {"gemv": "GemvConfig", "tail": "GemvConfig", "front": "GemvConfig",
                  "shared_down": "GemvConfig", "o_proj": "GemvConfig",
                  "route": "RouteConfig",
                  "attn_res": "AttnResConfig", "kda": "KDAConfig", "mla": "MLAConfig",
                  "moe": "MoEConfig"}
SPLITS = "num_splits"  # a point's key for its token's fixed MLA split count
# stack.Configs' own fields a point may set, and the type each takes
SWITCHES = {"read_sums": bool, "read_sums_registers": int, "o_proj_prefetch": int,
            "in_proj_prefetch": int, "kda_rms_in_o_proj": bool, "attn_read_in_proj": bool,
            "attn_read_registers": int, "ffn_read_in_front": bool}
# the token measured: the reference reports' setup on a GPU, a short one under the interpreter
GPU_PARAMS = {"window": 12, "context": 8192, "first_layer": 0, "num_splits": 0,
              "expert_format": "mxfp4"}
CPU_PARAMS = {"window": 3, "context": 24, "first_layer": 1, "num_splits": 4,
              "expert_format": "mxfp4"}
WINDOW_METRICS = {"median": "window_ratio_median", "min": "window_ratio_min",
                  "max": "window_ratio_max"}


def _base_configs(device: str):
    from k3lab.studies.decode_step import configs_for

    return configs_for(device)


def resolve(sweep, points: list[int] | None = None, device: str = "cpu") -> list[tuple]:
    """[(point spec, stack.Configs)] of ``sweep``'s points (or the chosen indices); raises
    SweepError (an unknown field or point, a first point that is not ``{}``) or ValueError (a
    value the config refuses), naming the point, before anything runs."""
    from benchmarks.sweeps import SweepError, _replace, point_json
    from k3lab import kernels

    if not sweep.points or sweep.points[0]:
        raise SweepError(f"sweep {TOKEN}/{sweep.name}: its first point must be {{}} (the "
                         f"decode step's own configs, the base of the ratios)")
    base = _base_configs(device)
    chosen = range(len(sweep.points)) if points is None else points
    out = []
    for i in chosen:
        if not 0 <= i < len(sweep.points):
            raise SweepError(f"sweep {TOKEN}/{sweep.name}: no point {i} "
                             f"(it has {len(sweep.points)})")
        spec = sweep.points[i]
        where = f"sweep {TOKEN}/{sweep.name}, point {i} {point_json(spec)}"
        configs = base
        for key, value in spec.items():
            if key == SPLITS:
                if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                    raise ValueError(f"{where}: {SPLITS}={value!r}: expected an MLA split "
                                     f"count of at least 1")
                continue
            if key in SWITCHES:
                kind = SWITCHES[key]
                if type(value) is not kind:
                    raise ValueError(f"{where}: {key}={value!r}: expected "
                                     f"{'an' if kind is int else 'a'} {kind.__name__}")
                try:
                    configs = dataclasses.replace(configs, **{key: value})
                except ValueError as exc:
                    raise ValueError(f"{where}: {exc}") from exc
                continue
            field, _, attr = key.partition(".")
            if field not in CONFIG_CLASSES or not attr:
                raise SweepError(f"{where}: {key!r} names no config field; expected "
                                 f"'<field>.<name>' with <field> one of "
                                 f"{sorted(CONFIG_CLASSES)}, or one of "
                                 f"{[SPLITS, *SWITCHES]}")
            current = getattr(configs, field) or getattr(kernels, CONFIG_CLASSES[field])()
            try:
                changed = _replace(current, attr, value, where)
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{where}: {key}={value!r}: {exc}") from exc
            configs = dataclasses.replace(configs, **{field: changed})
        out.append((spec, configs))
    return out


def run_token_sweep(sweep, *, device: str = "cpu", preset: str = "tiny", tp: int = 1,
                    repeats: int | None = None, points: list[int] | None = None,
                    meta: dict | None = None, columns=(), log=print) -> pd.DataFrame:
    """Measure token sweep ``sweep`` on the full stack's token; tidy rows (``columns``)."""
    from benchmarks.sweeps import point_json
    from k3lab import stack
    from k3lab.config import preset as make_preset
    from k3lab.studies import decode_step

    resolved = resolve(sweep, points, device)
    cfg = make_preset(preset, tp)
    params = {**(GPU_PARAMS if device.startswith("cuda") else CPU_PARAMS), **sweep.params}
    num_splits = params.pop("num_splits") or decode_step.split_override(cfg, device,
                                                                        [params["context"]])
    log(f"{TOKEN}/{sweep.name}: building the token ({cfg.describe()}, {params}, "
        f"MLA splits {num_splits})")
    token = decode_step.build(cfg, device, **params)
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    choices = {point_json(spec): configs for spec, configs in resolved}
    splits = {point_json(spec): spec.get(SPLITS, num_splits) for spec, _ in resolved}
    stacks = dict.fromkeys(choices, full)
    base = {**(meta or {}), "device": device, "boundary": TOKEN, "variant": "full stack",
            "sweep": sweep.name, "preset": preset, "tp": tp, "M": 1}
    rows: list[dict] = []
    checks = decode_step.check_token(token, stacks, choices, splits)
    for label, ok, err, tol in zip(checks["stack"], checks["ok"], checks["max abs error"],
                                   checks["tolerance"], strict=True):
        note = "" if ok else f"logits off the fp32 truth by {err:.4g} (tolerance {tol:.4g})"
        rows += [{**base, "point": label, "config": label, "metric": "check",
                  "value": float(ok), "note": note},
                 {**base, "point": label, "config": label, "metric": "max_abs_err",
                  "value": float(err), "note": ""}]
        if not ok:
            log(f"    {label}: {note}; not timed")
            if label == next(iter(choices)):
                return pd.DataFrame(rows, columns=list(columns) or None)
            del choices[label], stacks[label]
    log(f"{TOKEN}/{sweep.name}: timing {len(choices)} points")
    t = decode_step.compare(token, device, choices, stacks, num_splits=splits,
                            repeats=repeats)
    for r in t.to_dict("records"):
        got = {"tok_per_s": r["tok/s"], "token_us": r["token us"],
               "launches": r["launches per token"]}
        for k, metric in WINDOW_METRICS.items():
            v = r.get(f"window vs defaults, interleaved {k}")
            if v is not None:
                got[metric] = v
        rows += [{**base, "point": r["choice"], "config": r["choice"], "metric": m,
                  "value": float(v), "note": ""} for m, v in got.items()]
    return pd.DataFrame(rows, columns=list(columns) or None)
