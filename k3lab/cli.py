"""Command line: ``k3lab run [NOTEBOOK...]`` and ``k3lab list``.

Exit codes: 0 all notebooks ok; 1 at least one notebook failed; 2 a usage error (bad preset, tp,
notebook name or parameter), reported on one line before anything runs.
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
    sub = p.add_subparsers(dest="command", metavar="{run,list}")
    r = sub.add_parser("run", parents=[common], help="execute notebooks and write their reports")
    r.add_argument("names", nargs="*", metavar="NOTEBOOK",
                   help="e.g. 00_overview, overview or 00_overview.ipynb (default: all)")
    r.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    r.add_argument("--preset", default="tiny")
    r.add_argument("--tp", type=int, default=1)
    r.add_argument("-p", "--param", action="append", default=[], metavar="KEY=VALUE",
                   help="a notebook parameter, e.g. -p seed=1 -p sizes=[1,2,4] (repeatable)")
    r.add_argument("--out", default=None, metavar="DIR",
                   help="output folder (default: executed/local; GPU reports: executed/h200)")
    r.add_argument("--timeout", type=float, default=None, metavar="S",
                   help="per-cell time limit in seconds")
    r.add_argument("--show-code", action="store_true", help="keep code cells in the HTML")
    sub.add_parser("list", parents=[common], help="show the notebooks and their parameters")
    return p


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
        params = runner.notebook_parameters(path)
        print(path.stem)
        width = max((len(k) for k in params), default=0)
        for key, default in params.items():
            print(f"    {key:<{width}} = {default!r}")
        if not params:
            print("    (no parameters cell)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # argparse has printed its message
        return int(exc.code or 0)
    try:
        if args.command == "list":
            return _list(args.notebooks)
        if args.command == "run":
            results = runner.run(args.names, device=args.device, preset=args.preset, tp=args.tp,
                                 params=_params(args.param), out_dir=args.out,
                                 timeout=args.timeout, hide_code=not args.show_code,
                                 notebook_dir=args.notebooks)
            return 0 if all(r.ok for r in results) else 1
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        print(f"k3lab: error: {exc}", file=sys.stderr)
        return 2
    parser.print_help()
    return 2


if __name__ == "__main__":
    sys.exit(main())
