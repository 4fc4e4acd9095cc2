"""A kernel behind Triton's heuristics wrapper, as peers' kernels often are (fla's KDA decode):
its module attribute is the wrapper, not the JITFunction (kernel_list_check.py lists it)."""

import triton
import triton.language as tl


@triton.heuristics({"BLOCK": lambda args: triton.next_power_of_2(args["n"])})
@triton.jit
def wrapped_fill(p_out, n, value, BLOCK: tl.constexpr):
    o = tl.arange(0, BLOCK)
    tl.store(p_out + o, tl.zeros([BLOCK], tl.float32) + value, mask=o < n)
