"""A sweep's kernels compiled for sm_90 without a GPU (``--device sm90``): per point and variant,
every launch's registers a thread, stack bytes and static shared memory, read from its cubin
(``k3lab.sm90``). Nothing runs and nothing is timed; the rows say so.

Inputs are made on the CPU, so a launcher that sizes its grid by the GPU's SM count takes its
CPU size here: a note's grid is the CPU path's, the resources are the GPU build's. A token
sweep builds the full stack's token over a short window of the preset's middle block (from
its second layer to its first MLA layer: reads with the middle block's sealed rows, every
kind of launch) with the GPU's configs (``decode_step.configs_for("cuda")``); a compiled
kernel launched several times gets one set of rows, named after its first launch."""

from __future__ import annotations

import pandas as pd

__all__ = ["DEVICE", "METRICS", "NOTE", "build_sweep", "build_token_sweep",
           "token_window"]

DEVICE = "sm90"
METRICS = ("registers", "stack_bytes", "shared_bytes")
NOTE = ("offline sm_90 builds (Triton's ptxas, cuobjdump -res-usage): resources, not timings; "
        "nothing ran")


def build_sweep(sweep, *, preset: str, tp: int, columns: list[str], meta: dict,
                points: list[int] | None = None, variants: list[str] | None = None,
                seed: int = 0, log=print) -> pd.DataFrame:
    """Rows of ``columns`` for every launch of every point and variant of ``sweep`` (a boundary
    sweep), its inputs made on the CPU at ``preset`` and ``tp``. A variant's launches are named
    ``variant/kernel`` (``#n`` from a kernel's second launch on). A point or variant that raises
    gets a ``check`` row of 0 with the error, and the sweep goes on."""
    from benchmarks import sweeps as sweeps_mod
    from k3lab import boundaries, sm90

    sweep, resolved, b, cfg = sweeps_mod.prepare(sweep, preset, tp, points, variants)
    chosen = list(sweep.variants) if sweep.variants is not None else [
        v.name for v in b.variants if v.role == "fused"]
    rows: list[dict] = []
    made: tuple[str, dict] | None = None  # points that differ in config alone share inputs
    for i, pt in enumerate(resolved):
        point = sweeps_mod.point_json(pt.spec)
        config = "" if pt.config is None else sweeps_mod.point_json(pt.config)
        base = {**meta, "device": DEVICE, "boundary": sweep.boundary, "sweep": sweep.name,
                "point": point, "config": config, "preset": preset, "tp": tp,
                "M": pt.params.get("M", b.params.get("M", 1))}
        log(f"[{i + 1}/{len(resolved)}] {sweep.boundary}/{sweep.name} {point}")
        key = sweeps_mod.point_json(pt.params)
        if made is None or made[0] != key:
            made = None
            try:
                made = key, b.make_inputs(cfg, "cpu", seed, **pt.params)
            except Exception as exc:  # noqa: BLE001 - a failing point is a row, not a crash
                rows += _failed(base, chosen, exc, log)
                continue
        inputs = {**made[1], "config": pt.config} if pt.config is not None else made[1]
        for name in chosen:
            try:
                with sm90.builds() as built:
                    b.variant(name).fn(boundaries.clone_inputs(inputs))
                launches = [(launch.name, sm90.usage(launch.kernel), launch.grid,
                             launch.shapes) for launch in built]
            except Exception as exc:  # noqa: BLE001
                rows += _failed(base, [name], exc, log)
                continue
            seen: dict[str, int] = {}
            for kernel, use, grid, shapes in launches:
                seen[kernel] = seen.get(kernel, 0) + 1
                label = f"{name}/{kernel}" + (f"#{seen[kernel]}" if seen[kernel] > 1 else "")
                note = (f"grid {tuple(grid) if not callable(grid) else 'by meta'}; tensors "
                        f"{_shapes(shapes)}; {NOTE}")
                rows += [{**base, "variant": label, "metric": m, "value": float(use[m]),
                          "note": note} for m in METRICS if m in use]
    return pd.DataFrame(rows, columns=columns)


def _failed(base: dict, variants: list[str], exc: Exception, log) -> list[dict]:
    note = f"{type(exc).__name__}: {exc}"[:300]
    log(f"    failed: {note}")
    return [{**base, "variant": v, "metric": "check", "value": 0.0, "note": note}
            for v in variants]


def token_window(cfg) -> dict:
    """make_token's window for a token sweep's builds: from the second layer of the preset's
    middle AttnRes block to its first MLA layer after that (3 layers where it has none)."""
    block = cfg.attn_res_block
    first = (cfg.n_layers // 2) // block * block + 1
    mla = [i for i in cfg.mla_layers if i >= first]
    window = mla[0] - first + 1 if mla and mla[0] - first < block else 3
    return {"first_layer": min(first, cfg.n_layers - 1), "window": window}


def build_token_sweep(sweep, *, preset: str, tp: int, columns: list[str], meta: dict,
                      points: list[int] | None = None, log=print) -> pd.DataFrame:
    """Rows of ``columns`` for every distinct compiled kernel of the full stack's token at each
    point of token sweep ``sweep``, named "<segment>, <category>: <kernel>" after its first
    launch (the segment: embed, layer i or head; the category: ``stack.CATEGORIES``), `` #n``
    for the n-th build first launched there."""
    from benchmarks import token as token_mod
    from benchmarks.sweeps import point_json
    from k3lab import sm90, stack
    from k3lab.config import preset as make_preset
    from k3lab.studies import decode_step

    resolved = token_mod.resolve(sweep, points, "cuda")
    cfg = make_preset(preset, tp)
    params = {**token_mod.GPU_PARAMS, **sweep.params, **token_window(cfg)}
    num_splits = params.pop(token_mod.SPLITS) or decode_step.split_override(
        cfg, "cpu", [params["context"]])
    log(f"{token_mod.TOKEN}/{sweep.name}: building the token ({cfg.describe()}, {params})")
    token = decode_step.build(cfg, "cpu", **params)
    full, _ = stack.runnable(stack.compose(stack.steps(stack.STACKS["integration"])[-1][1]))
    rows: list[dict] = []
    for i, (spec, configs) in enumerate(resolved):
        point = point_json(spec)
        base = {**meta, "device": DEVICE, "boundary": token_mod.TOKEN,
                "variant": "full stack", "sweep": sweep.name, "point": point, "config": point,
                "preset": preset, "tp": tp, "M": 1}
        log(f"[{i + 1}/{len(resolved)}] {token_mod.TOKEN}/{sweep.name} {point}")
        where = {"segment": "embed", "category": ""}

        def tag(label: str, where=where) -> None:
            if label.startswith("segment "):
                where["segment"] = label.removeprefix("segment ")
            else:
                where["category"] = label

        try:
            with sm90.builds(lambda where=where: f"{where['segment']}, "
                                                 f"{where['category']}") as built:
                stack.run_token(full, token, num_splits=spec.get(token_mod.SPLITS, num_splits),
                                configs=configs, tag=tag)
            kernels: dict = {}  # a compiled kernel's hash -> [its first launch, launches]
            for launch in built:
                key = getattr(launch.kernel, "hash", id(launch.kernel))
                kernels.setdefault(key, [launch, 0])[1] += 1
            launches, seen = [], {}
            for launch, n in kernels.values():
                name = f"{launch.label}: {launch.name}"
                seen[name] = seen.get(name, 0) + 1
                name += f" #{seen[name]}" if seen[name] > 1 else ""
                launches.append((name, n, sm90.usage(launch.kernel), launch.shapes))
        except Exception as exc:  # noqa: BLE001 - a failing point is a row, not a crash
            rows += _failed(base, ["full stack"], exc, log)
            continue
        for label, n, use, shapes in launches:
            note = (f"{n} launch{'es' if n > 1 else ''} in the window; tensors of the first "
                    f"{_shapes(shapes)}; {NOTE}")
            rows += [{**base, "variant": label, "metric": m, "value": float(use[m]),
                      "note": note} for m in METRICS if m in use]
    return pd.DataFrame(rows, columns=columns)


def _shapes(shapes) -> str:
    """A launch's tensor arguments' shapes, compactly: 1x7168 6284x7168 ..."""
    return " ".join("x".join(map(str, shape)) or "scalar" for shape in shapes) or "none"
