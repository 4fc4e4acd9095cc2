"""H200, session 8: what the bytes alone cost. Lower bounds for the bars of issues 3, 5 and 6.

Each bar compares a boundary with its bytes at the copy bandwidth. This script times kernels that
only move those bytes, with nothing else to do, in the notebooks' conditions (graph replay, cold
copies rotated past the L2, median, per-call share of one graph): a correct kernel of the
boundary cannot beat the fastest of them.

- read:  one launch streaming the bytes (bf16 / fp32, every program a contiguous chunk, all its
         loads issued up front), each program writing one fp32 partial. Chunk and warps swept;
         torch.sum of the same tensor as a second opinion.
- read + last program: the same, then a completion counter; the last program to finish sums the
         partials (the single-launch shape of the route kernel).
- read + kernel: a second, tiny launch reading the partials (the split + combine shape of MLA;
         plain, and with programmatic dependent launch).
- update: in-place read-modify-write of an fp32 state plus a read of a bf16 weight (KDA's bytes).

Run from the repo root on the GPU: python3 benchmarks/session8/floors.py (writes
$OUT/floors.json).
"""

import json
import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

from k3lab import profile

OUT = os.environ.get("OUT", "/tmp")
DEV = torch.device("cuda")
ROWS = []


@triton.jit
def _read_kernel(p, partial, counter, result, n, CHUNK: tl.constexpr, BLOCK: tl.constexpr,
                 TAIL: tl.constexpr, TRIGGER: tl.constexpr, NP2: tl.constexpr):
    """Program i sums elements [i * CHUNK, (i + 1) * CHUNK) of p (CHUNK / BLOCK unrolled loads)
    into partial[i]; TAIL: the last program to finish sums the partials into result[0]."""
    pid = tl.program_id(0)
    if TRIGGER:
        gdc_launch_dependents()
    base = pid.to(tl.int64) * CHUNK
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(0, CHUNK, BLOCK):
        o = base + j + tl.arange(0, BLOCK)
        acc += tl.load(p + o, mask=o < n, other=0.0).to(tl.float32)
    tl.store(partial + pid, tl.sum(acc, 0))
    if TAIL:
        tl.debug_barrier()
        done = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
        if done == tl.num_programs(0) - 1:
            o_p = tl.arange(0, NP2)
            v = tl.load(partial + o_p, mask=o_p < tl.num_programs(0), other=0.0,
                        cache_modifier=".cg")
            tl.store(result, tl.sum(v, 0))
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


@triton.jit
def _sum_partials_kernel(partial, result, nprog, NP2: tl.constexpr, WAIT: tl.constexpr):
    if WAIT:
        gdc_wait()
    o_p = tl.arange(0, NP2)
    v = tl.load(partial + o_p, mask=o_p < nprog, other=0.0, cache_modifier=".cg")
    tl.store(result, tl.sum(v, 0))


@triton.jit
def _update_kernel(state, w, partial, n_state, n_w, STATE_PROGRAMS, CHUNK: tl.constexpr,
                   BLOCK: tl.constexpr):
    """Programs < STATE_PROGRAMS: state[chunk] = state[chunk] * 0.5 + 1 (fp32, in place); the
    others sum a chunk of w (bf16) into partial."""
    pid = tl.program_id(0)
    if pid < STATE_PROGRAMS:
        base = pid.to(tl.int64) * CHUNK
        for j in tl.static_range(0, CHUNK, BLOCK):
            o = base + j + tl.arange(0, BLOCK)
            m = o < n_state
            tl.store(state + o, tl.load(state + o, mask=m) * 0.5 + 1.0, mask=m)
    else:
        base = (pid - STATE_PROGRAMS).to(tl.int64) * CHUNK
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for j in tl.static_range(0, CHUNK, BLOCK):
            o = base + j + tl.arange(0, BLOCK)
            acc += tl.load(w + o, mask=o < n_w, other=0.0).to(tl.float32)
        tl.store(partial + pid, tl.sum(acc, 0))


def rec(**r):
    ROWS.append(r)
    print(json.dumps(r), flush=True)


def gt(fn, copies):
    return profile.time_variant(fn, copies, mode="graph", repeats=20).median_us


def read_floor(name, nbytes, dtype=torch.bfloat16):
    """Best read / read + last program / read + kernel (plain, PDL) over chunk and warps."""
    numel = nbytes // torch.tensor([], dtype=dtype).element_size()

    def make(i):
        return torch.randn(numel, device=DEV).to(dtype)

    copies = profile.cold_copies(make, bytes_per_copy=nbytes)
    counter = torch.zeros(1, dtype=torch.int32, device=DEV)
    result = torch.zeros(1, dtype=torch.float32, device=DEV)
    best = {}
    for chunk_kb in (16, 32, 64, 128):
        chunk = chunk_kb * 1024 // copies[0].element_size()
        block = min(chunk, 4096 if dtype == torch.bfloat16 else 2048)
        grid = triton.cdiv(numel, chunk)
        if grid > 65536:
            continue
        np2 = triton.next_power_of_2(grid)
        partial = torch.empty(grid, dtype=torch.float32, device=DEV)
        for warps in (4, 8):
            kw = dict(CHUNK=chunk, BLOCK=block, NP2=np2, num_warps=warps)

            def read(x, tail=False, trigger=False):
                _read_kernel[(grid,)](x, partial, counter, result, numel, TAIL=tail,
                                      TRIGGER=trigger, **kw)

            def read_kernel(x, pdl=False):
                read(x, trigger=pdl)
                _sum_partials_kernel[(1,)](partial, result, grid, NP2=np2, WAIT=pdl,
                                           num_warps=4, **({"launch_pdl": True} if pdl else {}))

            for shape, fn in (("read", read), ("read+last", lambda x: read(x, tail=True)),
                              ("read+kernel", read_kernel),
                              ("read+kernel pdl", lambda x: read_kernel(x, pdl=True))):
                try:
                    us = gt(fn, copies)
                except Exception as e:  # a config that does not compile is not a floor
                    print("ERR", shape, chunk_kb, warps, repr(e)[:200], flush=True)
                    continue
                rec(k=name, shape=shape, chunk_kb=chunk_kb, warps=warps, grid=grid,
                    bytes=nbytes, us=round(us, 3))
                if us < best.get(shape, (float("inf"),))[0]:
                    best[shape] = (us, chunk_kb, warps)
    us = gt(lambda x: x.sum(dtype=torch.float32), copies)
    rec(k=name, shape="torch.sum", bytes=nbytes, us=round(us, 3))
    return best, us


def update_floor(name, state_bytes, w_bytes):
    n_state, n_w = state_bytes // 4, w_bytes // 2

    def make(i):
        return (torch.randn(n_state, device=DEV), torch.randn(n_w, device=DEV).to(torch.bfloat16))

    copies = profile.cold_copies(make, bytes_per_copy=2 * state_bytes + w_bytes)
    best = (float("inf"),)
    for chunk_kb in (8, 16, 32, 64):
        chunk = chunk_kb * 1024 // 4
        sp = triton.cdiv(n_state, chunk)
        wp = triton.cdiv(n_w, chunk)
        partial = torch.empty(sp + wp, dtype=torch.float32, device=DEV)
        for warps in (4, 8):
            def fn(io):
                _update_kernel[(sp + wp,)](io[0], io[1], partial, n_state, n_w, sp,
                                           CHUNK=chunk, BLOCK=min(chunk, 2048), num_warps=warps)
            us = gt(fn, copies)
            rec(k=name, shape="update", chunk_kb=chunk_kb, warps=warps, grid=sp + wp,
                bytes=2 * state_bytes + w_bytes, us=round(us, 3))
            best = min(best, (us, chunk_kb, warps))
    return best


def main():
    bw = profile.copy_bandwidth(DEV)
    tiny = [torch.zeros(1, device=DEV) for _ in range(64)]
    launch = profile.time_variant(lambda x: x.add_(1), tiny, mode="graph", repeats=20).median_us
    rec(k="conditions", copy_TBps=round(bw / 1e12, 3), launch_us=round(launch, 3),
        gpu=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__)
    summary = {}
    # issue 3: K3 gate weight [896, 7168] bf16; bar: 1.5 x (bytes / copy bw + one launch)
    gate = 896 * 7168 * 2
    best, ts = read_floor("route gate", gate)
    floor = gate / bw * 1e6 + launch
    summary["route"] = dict(bar_us=round(1.5 * floor, 3), torch_sum_us=round(ts, 3),
                            **{k: round(v[0], 3) for k, v in best.items()})
    # issue 6: K3 tp 8 latent cache, 576 bf16 a position; bar: bytes / copy bw / 0.75
    for ctx in (32768, 65536, 131072):
        kv = ctx * 576 * 2
        best, ts = read_floor(f"mla {ctx}", kv)
        summary[f"mla {ctx}"] = dict(bar_us=round(kv / bw * 1e6 / 0.75, 3),
                                     torch_sum_us=round(ts, 3),
                                     **{k: round(v[0], 3) for k, v in best.items()})
    # issue 5: K3 state [Hl, 128, 128] fp32 read and written, f_b [Hl * 128, 128] bf16 read
    for tp, hl in ((1, 96), (8, 12)):
        state = hl * 128 * 128 * 4
        best = update_floor(f"kda tp{tp}", state, hl * 128 * 128 * 2)
        summary[f"kda tp{tp}"] = dict(update_us=round(best[0], 3),
                                      bar_tp1_frac_us=round(2 * state / bw * 1e6 / 0.5, 3))
    rec(k="summary", **summary)
    with open(f"{OUT}/floors.json", "w") as fh:
        json.dump(ROWS, fh, indent=1)


if __name__ == "__main__":
    main()
