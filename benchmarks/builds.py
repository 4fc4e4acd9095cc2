"""A sweep's kernels compiled for sm_90 without a GPU (``--device sm90``): per point and variant,
every launch's registers a thread, stack bytes and static shared memory, read from its cubin
(``k3lab.sm90``). Nothing runs and nothing is timed; the rows say so."""

from __future__ import annotations

import dataclasses

import pandas as pd

__all__ = ["DEVICE", "METRICS", "NOTE", "build_sweep"]

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
    from k3lab.config import preset as make_preset

    if variants:
        sweep = dataclasses.replace(sweep, variants=tuple(variants))
    resolved = sweeps_mod.resolve(sweep, points)
    b = boundaries.get(sweep.boundary)
    cfg = make_preset(preset, tp)
    if not b.applies(cfg):
        raise ValueError(f"boundary: {sweep.boundary} does not apply to preset {preset} tp {tp}")
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
                launches = [(kernel, sm90.usage(compiled), grid)
                            for kernel, compiled, grid in built]
            except Exception as exc:  # noqa: BLE001
                rows += _failed(base, [name], exc, log)
                continue
            seen: dict[str, int] = {}
            for kernel, use, grid in launches:
                seen[kernel] = seen.get(kernel, 0) + 1
                label = f"{name}/{kernel}" + (f"#{seen[kernel]}" if seen[kernel] > 1 else "")
                note = f"grid {tuple(grid) if not callable(grid) else 'by meta'}; {NOTE}"
                rows += [{**base, "variant": label, "metric": m, "value": float(use[m]),
                          "note": note} for m in METRICS if m in use]
    return pd.DataFrame(rows, columns=columns)


def _failed(base: dict, variants: list[str], exc: Exception, log) -> list[dict]:
    note = f"{type(exc).__name__}: {exc}"[:300]
    log(f"    failed: {note}")
    return [{**base, "variant": v, "metric": "check", "value": 0.0, "note": note}
            for v in variants]
