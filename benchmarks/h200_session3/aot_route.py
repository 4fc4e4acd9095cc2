"""Compile ``_route_sort_kernel`` for sm_90 without a GPU, with whichever Triton is importable,
at the constexprs the launcher would pick on CUDA: finds compile failures of a Triton version
(the H200 machine has 3.6.0) before device time is spent.

    python3 -m pip install --no-deps --target /tmp/t36 triton==3.6.0
    PYTHONPATH=/tmp/t36 python3 benchmarks/h200_session3/aot_route.py "[(64, 7168, 1, 16)]"

Each case is (E, H, M, top_k[, block_m, n_group, topk_group]); prints ok (shared memory bytes)
or the compiler's first error line.
"""

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "0"  # real JIT functions (the launch is captured, not run)
import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

rs = importlib.import_module("k3lab.kernels.route_sort")
os.environ["TRITON_INTERPRET"] = "1"  # after the decorators: only for the launcher's CPU check
_gemv_blocks = rs._gemv_blocks
rs._gemv_blocks = lambda E, H, on_gpu, be, bk: _gemv_blocks(E, H, True, be, bk)  # GPU tiles
TYPES = {torch.bfloat16: "*bf16", torch.float32: "*fp32", torch.int32: "*i32",
         torch.int64: "*i64", torch.float16: "*fp16", torch.uint8: "*u8"}
_launch = {}


class _Capture:
    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            _launch.update(args=args, kwargs=kwargs, grid=grid)
        return launch


def compile_case(E, H, M, top_k, block_m=16, n_group=1, topk_group=1):
    """The sm_90 kernel of one route_sort call on CPU stand-in tensors (launch captured)."""
    kernel = rs._route_sort_kernel
    rs._route_sort_kernel = _Capture()
    rs._COUNTERS.setdefault(torch.device("cpu"), torch.zeros(1, dtype=torch.int32))
    try:
        rs.route_sort(torch.randn(M, H).bfloat16(), torch.randn(E, H).bfloat16(), torch.rand(E),
                      top_k=top_k, n_group=n_group, topk_group=topk_group, block_m=block_m,
                      out_dim=64)
    finally:
        rs._route_sort_kernel = kernel
    kwargs = dict(_launch["kwargs"])
    num_warps = kwargs.pop("num_warps", 4)
    signature, constexprs, attrs = {}, {}, {}
    for i, name in enumerate(kernel.arg_names):
        if name in kwargs:
            signature[name], constexprs[name] = "constexpr", kwargs[name]
            continue
        arg = _launch["args"][i]
        if isinstance(arg, torch.Tensor):
            signature[name] = TYPES[arg.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(arg, int):
            signature[name] = "i32"
            if arg and arg % 16 == 0:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    compiled = triton.compile(ASTSource(kernel, signature=signature, constexprs=constexprs,
                                        attrs=attrs),
                              target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
    return compiled.metadata.shared


if __name__ == "__main__":
    print("triton", triton.__version__, flush=True)
    for case in eval(sys.argv[1]) if len(sys.argv) > 1 else [(896, 7168, 1, 16)]:
        try:
            print(case, "ok, shared bytes", compile_case(*case), flush=True)
        except Exception as e:  # report and go on
            msg = str(e)
            at = msg.find("error:")
            print(case, "FAIL", type(e).__name__, msg[at:at + 200] if at >= 0 else msg[:200],
                  flush=True)
