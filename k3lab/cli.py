"""Command line: ``k3lab run [NOTEBOOK...]``, ``k3lab list``, ``k3lab export RUN_DIR`` and
``k3lab compare A B``.

Exit codes: 0 all notebooks ok; 1 at least one notebook failed (or the index could not be
written); 2 a usage error (bad preset, tp, notebook name, parameter, timeout or output folder,
or a notebook whose estimated memory does not fit the device, unless ``--force``), reported on
one line before anything runs; 130 interrupted (Ctrl-C), on one line.
"""

from __future__ import annotations

import argparse
import sys

from k3lab import runner

__all__ = ["main"]


def _parser() -> argparse.ArgumentParser:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--notebooks", metavar="DIR", default=None,
                        help=f"notebooks folder (default: ${runner.NOTEBOOKS_ENV}, else the "
                             "repo's notebooks/)")
    p = argparse.ArgumentParser(prog="k3lab", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", metavar="{run,list,export,compare}")
    r = sub.add_parser("run", parents=[common], help="execute notebooks and write their reports")
    r.add_argument("names", nargs="*", metavar="NOTEBOOK",
                   help="e.g. 00_overview, overview or 00_overview.ipynb (default: all)")
    r.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="default: cpu (the Triton interpreter), even where a GPU is visible")
    r.add_argument("--preset", default="tiny")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a notebook parameter, e.g. -p seed=1 -p sizes=[1,2,4] (repeatable)")
    r.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default: executed/local; GPU reports: executed/h200)")
    r.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="per-cell time limit in seconds (a positive number; default "
                        "$K3LAB_CELL_TIMEOUT, else none)")
    r.add_argument("--show-code", action="store_true", help="keep code cells in the HTML")
    r.add_argument("-j", "--jobs", type=int, default=None, metavar="N",
                   help="notebooks run at once (default: one per CPU core on the CPU, one per "
                        "GPU on CUDA; a per-cell progress bar needs -j 1)")
    r.add_argument("--ray", metavar="ADDRESS", default=None,
                   help="run each notebook as a Ray task (one GPU each) on the cluster at "
                        "ADDRESS ('local': start one here); needs the ray extra")
    r.add_argument("-q", "--quiet", action="store_true",
                   help="no progress: only errors and the exit code")
    r.add_argument("--profile", action="store_true",
                   help="sample each notebook's host work (compiles, waits on the device, "
                        "weights, plots): a breakdown in each report and NAME.profile.html; "
                        "eager latencies then include the sampler's cost; needs the profile "
                        "extra")
    r.add_argument("--force", action="store_true",
                   help="run even when a notebook's estimated memory at the preset and tp "
                        "exceeds what the device has free")
    sub.add_parser("list", parents=[common],
                   help="show the notebooks, their parameters, defaults and contracts")
    e = sub.add_parser("export", help="write every record of a run folder as one CSV")
    e.add_argument("run_dir", metavar="RUN_DIR")
    e.add_argument("-o", "--output", metavar="FILE", default=None,
                   help="CSV to write (default: RUN_DIR/records.csv; - for stdout)")
    c = sub.add_parser("compare", help="two run folders (or git revisions, run first) side by "
                                       "side, with ratios b / a")
    c.add_argument("a", metavar="A", help="a run folder, or a git revision to run")
    c.add_argument("b", metavar="B", help="a run folder, or a git revision to run")
    c.add_argument("-o", "--output", metavar="FILE", default=None, help="also write it as CSV")
    c.add_argument("--notebooks", nargs="+", metavar="NOTEBOOK", default=None,
                   help="the notebooks to run at a revision (default: those of the other "
                        "side's folder, as they ran there)")
    c.add_argument("--device", default=None, choices=("cpu", "cuda"),
                   help="for the --notebooks a revision runs (default cpu)")
    c.add_argument("--preset", default=None, help="for the --notebooks (default tiny)")
    c.add_argument("--tp", type=int, default=None, help="for the --notebooks (default 1)")
    c.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a notebook parameter for the --notebooks (repeatable)")
    c.add_argument("--keep", metavar="DIR", default=None,
                   help="keep the revision runs under DIR (default: a temporary folder)")
    c.add_argument("--notebook-dir", default="notebooks", metavar="DIR",
                   help="the notebooks folder inside a revision's tree (default notebooks)")
    return p


def _export(run_dir: str, output: str | None) -> int:
    from pathlib import Path

    from k3lab import compare

    df = compare.records(run_dir)
    if output == "-":
        df.to_csv(sys.stdout, index=False)
        return 0
    path = Path(output) if output else Path(run_dir) / "records.csv"
    df.to_csv(path, index=False)
    print(f"k3lab: {len(df)} records of {df['notebook'].nunique()} notebook(s) -> {path}")
    return 0


def _compare(args) -> int:
    import pandas as pd

    from k3lab import compare

    options = {k: getattr(args, k) for k in ("device", "preset", "tp")
               if getattr(args, k) is not None}
    table, a, b = compare.compare_sides(
        args.a, args.b, notebooks=args.notebooks, options=options,
        params=_params(args.param), keep=args.keep, notebook_dir=args.notebook_dir,
        say=lambda text: print(text, file=sys.stderr, flush=True))
    output = args.output
    if table.empty:
        print(f"k3lab: no record of {a} matches one of {b}")
        return 1
    if output:  # before printing: a pager closed early must not lose it
        table.to_csv(output, index=False)
        print(f"k3lab: {len(table)} rows -> {output}", file=sys.stderr)
    shown = table.loc[:, [c for c in table.columns if (table[c] != "").any()]]
    shown = shown.apply(lambda col: col.str.slice(0, 28) if col.dtype == object
                        or pd.api.types.is_string_dtype(col) else col)
    with pd.option_context("display.max_rows", None, "display.width", 250,
                           "display.float_format", "{:.4g}".format):
        print(f"a: {a}\nb: {b}\n" + shown.to_string(index=False))
    return 0


def _params(pairs: list[str]) -> dict[str, str]:
    out = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"-p {pair!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def _list(nb_dir) -> int:
    paths = runner.list_notebooks(nb_dir)
    if not paths:
        print(f"no notebooks in {runner.notebook_dir(nb_dir)}")
    for path in paths:
        params = runner.declared(path)
        print(path.stem)
        width = max((len(k) for k in params), default=0)
        dwidth = max((len(repr(p.default)) for p in params.values()), default=0)
        for key, p in params.items():
            note = p.help or ("(comment unreadable by papermill: no '=' in parameter comments)"
                              if not p.read_by_papermill else "")
            line = f"    {key:<{width}} = {p.default!r:<{dwidth}}"
            print(f"{line}  # {note}" if note else line.rstrip())
        if not params:
            print("    (no parameters cell)")
    return 0


def _gpu_visible() -> bool:
    import torch
    return torch.cuda.is_available()


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its message
        return int(exc.code or 0)
    try:
        if args.command == "list":
            return _list(args.notebooks)
        if args.command == "export":
            return _export(args.run_dir, args.output)
        if args.command == "compare":
            return _compare(args)
        if args.command == "run":
            quiet = args.quiet
            device = args.device or "cpu"
            if args.device is None and args.preset != "tiny" and _gpu_visible():
                print(f"k3lab: note: --preset {args.preset} runs on the CPU under the Triton "
                      "interpreter; pass --device cuda for the GPU", file=sys.stderr)
            results = runner.run(args.names, device=device, preset=args.preset, tp=args.tp,
                                 params=_params(args.param), out_dir=args.out,
                                 timeout=args.timeout, hide_code=not args.show_code,
                                 notebook_dir=args.notebooks, progress=not quiet,
                                 cells=not quiet and sys.stderr.isatty(), jobs=args.jobs,
                                 ray=args.ray, force=args.force, profile=args.profile)
            if results.interrupted:
                return 130
            return 0 if results.ok else 1
    except BrokenPipeError:  # output piped into head or less, closed early
        return 0
    except (ValueError, TypeError, OSError, RuntimeError) as exc:
        print(f"k3lab: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("k3lab: interrupted before any notebook ran; nothing was written", file=sys.stderr)
        return 130
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
