"""Kernel cache keys in a fresh process (run as a script by test_cache_keys.py; prints one JSON
line): Triton's merge of a callee's global constexprs into its caller's key as Triton up to 3.6
does it (before the callee's key exists) stands in for the installed one's, the kernels import
compiled, and the keys of ``argv[2:]`` (module:function) are computed in that order after the
first of them; ``argv[1]`` "primed" as k3lab.kernels imports, "unprimed" with every key
forgotten after the import (as without runtime.prime_cache_keys)."""

from __future__ import annotations

import importlib
import json
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"

import triton.runtime.jit as jit  # noqa: E402


def _merge_first(self, func):
    """DependenciesFinder._update_hash as Triton 3.6 has it: the callee's used globals are
    merged before its key (which fills them) is computed."""
    self.used_global_vals.update(func.used_global_vals)
    self.hasher.update((func.cache_key + str(getattr(func, "noinline", False))).encode())


def main() -> dict:
    jit.DependenciesFinder._update_hash = _merge_first
    importlib.import_module("k3lab.kernels")
    if sys.argv[1] == "unprimed":  # back to no key computed yet, as without the priming
        for name, mod in list(sys.modules.items()):
            if name.startswith("k3lab.kernels") and mod is not None:
                for v in vars(mod).values():
                    if isinstance(v, jit.JITFunction):
                        v.hash, v.used_global_vals = None, {}
    keys = {}
    for spec in sys.argv[2:]:
        module, name = spec.split(":")
        keys[spec] = getattr(importlib.import_module(module), name).cache_key
    return keys


if __name__ == "__main__":
    print(json.dumps(main()))
