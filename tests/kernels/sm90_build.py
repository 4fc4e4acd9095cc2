"""Compile every kernel path a CPU run reaches for sm_90, without a GPU (run as a script by
test_sm90_build.py; prints one JSON line).

The kernels are imported compiled (TRITON_INTERPRET=0) with a stub driver that reports an
H200's target, and every Triton launch becomes a warm-up (compile, never run): the launchers
run as usual on CPU tensors, their outputs are left unwritten. What runs: every fused variant
and peer of the boundary registry at the tiny preset; the route, KDA, MLA (with its absorb
launches), AttnRes and a few dense GEMVs at K3's widths; the integration stack's decode token;
the AttnRes split schedule, the route's gate GEMV (CUDA-core and tensor-core products), its
spread selection and register sort, and the floors.
Constexprs that follow the tensors' device (the MLA split kernel's fp32 dots, PDL keyed on CUDA
tensors) take their CPU values here; those keyed on ``INTERPRETED`` take the GPU's.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
import traceback

os.environ["TRITON_INTERPRET"] = "0"

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from k3lab import sm90  # noqa: E402
from k3lab.sm90 import allow_cpu_tensors, count_front_ends  # noqa: E402, F401

compile_here_for_sm90 = sm90.compile_here


@triton.jit
def _canary(p, BLOCK: tl.constexpr):
    tl.store(p + tl.arange(0, BLOCK), tl.zeros([BLOCK], dtype=tl.float32))


def _absorb(cfg) -> None:
    """Both MLA absorb launches at cfg's head widths (two heads, a 16-row cache)."""
    from k3lab.kernels import mla_absorb_out, mla_absorb_q

    bf, m, h = torch.bfloat16, 1, 2
    nope, r, v, c = cfg.qk_nope, cfg.qk_rope, cfg.v_head, cfg.kv_lora
    kv_b = torch.zeros(h * (nope + v), c, dtype=bf)
    for rope in (False, True):
        mla_absorb_q(torch.zeros(m, h, nope + r, dtype=bf), torch.zeros(m, c + r, dtype=bf),
                     torch.ones(c), kv_b, torch.zeros(m, dtype=torch.int32),
                     torch.zeros(m, 16, c + r, dtype=bf), torch.zeros(m, dtype=torch.int32),
                     qk_nope=nope, v_head=v, eps=1e-6, rope=rope)
    mla_absorb_out(torch.zeros(m, h, c), kv_b, torch.zeros(m, h * v, dtype=bf), qk_nope=nope,
                   v_head=v)


def _read_sums(m: int, n: int, atomic: bool) -> None:
    """K3 tp 8's output projection leaving the sums of a read of n sealed rows, and the read."""
    from k3lab.kernels import attn_res_norm_from_sums, dense_gemv, read_sums
    from k3lab.kernels.dense import GemvConfig

    z = torch.zeros
    bank, w = z(n, m, 7168, dtype=torch.bfloat16), z(7168, dtype=torch.bfloat16)
    config = None if atomic else GemvConfig(block_n=16, pdl=True)
    sums = read_sums(bank, w, w, slot_cols=512 if atomic else 16, atomic=atomic)
    live = dense_gemv(z(m, 1536, dtype=torch.bfloat16), z(7168, 1536, dtype=torch.bfloat16),
                      residual=z(m, 7168, dtype=torch.bfloat16), read_sums=sums, config=config)
    attn_res_norm_from_sums(sums, live, w, clear=z(64))


def _read_input(m: int, n: int) -> None:
    """K3 tp 8's merged KDA input projection taking the attention read of n sealed rows."""
    from k3lab.kernels import dense_gemv, read_input, read_sums

    z = torch.zeros
    bank, w = z(n, m, 7168, dtype=torch.bfloat16), z(7168, dtype=torch.bfloat16)
    sums = read_sums(bank, w, w)
    dense_gemv(z(m, 7168, dtype=torch.bfloat16), z(6284, 7168, dtype=torch.bfloat16),
               splits=[1536, 1536, 1536, 128, 12, 1536],
               read_input=read_input(sums, w, clear=z(64)))


def _front_read(m: int, n: int) -> None:
    """The MoE front's fused launch at K3 widths mixing the FFN read of n sealed rows (M 4: the
    router's tensor-core tiles)."""
    from k3lab.kernels import RouteConfig, front_route, read_input, read_sums

    z = torch.zeros
    bank, w = z(n, m, 7168, dtype=torch.bfloat16), z(7168, dtype=torch.bfloat16)
    front_route(z(m, 7168, dtype=torch.bfloat16), z(896, 7168, dtype=torch.bfloat16),
                z(896), z(3584 + 1024, 7168, dtype=torch.bfloat16), splits=(3584, 1024),
                activation="silu", top_k=16, out_dim=3584, pdl=True, max_registers=96,
                route_config=RouteConfig(gemv_dot_min_tokens=2) if m > 1 else None,
                read_input=read_input(read_sums(bank, w, w), w, clear=z(64)))


def main() -> dict:
    sm90.compile_here()
    with sm90.builds() as built:
        return _build_all(built)


def _build_all(built: sm90.Built) -> dict:
    try:  # the recipe leans on Triton's internals: a version they do not fit is no finding
        _canary[(1,)](torch.zeros(16), BLOCK=16)
        assert [launch.name for launch in built] == ["_canary"]
        built.clear()
    except Exception:  # noqa: BLE001
        return {"harness": traceback.format_exc(limit=-2)[-1500:]}
    from k3lab import boundaries, stack
    from k3lab.config import preset
    from k3lab.kernels import (
        AttnResConfig,
        KDAConfig,
        MoEConfig,
        RouteConfig,
        attn_res_norm,
        gate_logits,
        route_sort,
    )
    from k3lab.kernels import floors as kfloors
    from k3lab.kernels.dense import GemvConfig, dense_gemv
    from k3lab.studies import decode_step

    cfg, cpu = preset("tiny"), torch.device("cpu")
    failures: dict[str, str] = {}

    def attempt(label, fn):
        t0 = time.perf_counter()
        try:
            fn()
            if os.environ.get("K3LAB_SM90_TIMES"):
                print(f"{time.perf_counter() - t0:7.1f} s {label}", file=sys.stderr)
        except Exception:  # noqa: BLE001 - every failure is reported, the rest still runs
            failures[label] = traceback.format_exc(limit=-3)[-1500:]

    for b in boundaries.all_boundaries():
        if not b.applies(cfg):
            continue
        inputs = b.make_inputs(cfg, cpu, 0)
        for v in b.variants:
            if v.role == "reference" or v.requires or v.name == "torch.compile":
                continue
            attempt(f"{b.name}/{v.name}", lambda v=v, i=inputs: v.fn(boundaries.clone_inputs(i)))
    # K3's widths (tp 8) where they are cheap on the CPU: the tiny preset's are one block wide
    # in places K3's are not (the MLA latent, 512 > one 64-column absorb block)
    k3 = preset("kimi-k3", 8)
    for name, params in (("route", {}), ("kda", {}), ("mla", {"context": 256}),
                         ("attn_res", {})):
        b = boundaries.get(name)
        inputs = b.make_inputs(k3, cpu, 0, **params)
        attempt(f"{name} at kimi-k3", lambda b=b, i=inputs: b.variant("fused").fn(i))
    attempt("mla absorb at kimi-k3", lambda: _absorb(k3))
    for rows, k, act in ((1536, 7168, None), (7168, 1536, None), (1536, 7168, "situ")):
        attempt(f"dense {rows}x{k} {act}", lambda rows=rows, k=k, act=act: dense_gemv(
            torch.zeros(1, k, dtype=torch.bfloat16), torch.zeros(rows, k, dtype=torch.bfloat16),
            activation=act))
    token = decode_step.build(cfg, cpu, window=3, context=64)
    # the integration stack's token (the reviewed one adds the persistent block, run above)
    names = [n for n in stack.STACKS["integration"] if n != "b1-gate-projection"]
    st, _ = stack.runnable(stack.compose(names))
    attempt("integration stack token", lambda: stack.run_token(st, token, num_splits=4))
    for c, split in ((cfg, AttnResConfig(split_h=16, split_min_candidates=1)),
                     (k3, AttnResConfig(split_min_candidates=1)),
                     (k3, AttnResConfig(split_h=0, pdl=True, one_chunk_min_candidates=1)),
                     (k3, AttnResConfig(split_h=0, pdl=True, one_chunk_elems=0)),
                     (k3, AttnResConfig(bank_before_wait=True)),
                     (k3, AttnResConfig(split_min_candidates=1, bank_before_wait=True))):
        a = boundaries.get("attn_res").make_inputs(c, cpu, 0)
        attempt(f"attn_res {split} at {c.name}", lambda a=a, split=split:
                attn_res_norm(a["bank"], a["live"], a["res_norm_weight"], a["res_proj_weight"],
                              a["norm_weight"], config=split))
    a = boundaries.get("attn_res").make_inputs(k3, cpu, 0, n_sealed=2)  # one pass, early bank
    attempt("attn_res one pass bank early at kimi-k3", lambda: attn_res_norm(
        a["bank"], a["live"], a["res_norm_weight"], a["res_proj_weight"], a["norm_weight"],
        config=AttnResConfig(bank_before_wait=True)))
    r = boundaries.get("route").make_inputs(cfg, cpu, 0)
    attempt("gate_logits", lambda: gate_logits(r["hidden"], r["gate_weight"]))
    # the MoE block's overlapping front: a route that lets it start, a GEMV that waits last
    attempt("route early dependents", lambda: route_sort(
        r["hidden"], r["gate_weight"], r["correction_bias"], top_k=cfg.top_k,
        config=RouteConfig(early_dependents=True)))
    moe = boundaries.get("moe")
    mi = moe.make_inputs(cfg, cpu, 0, route=True)
    for name in ("persistent", "fused+dense"):  # routing themselves: the overlapping launches
        fn = moe.variant(name).fn
        attempt(f"moe/{name} with routing", lambda fn=fn: fn(boundaries.clone_inputs(mi)))
    fr = moe.make_inputs(k3, cpu, 0, route=True)
    fr_conf = MoEConfig(dense_projections=True, front_routes=True)
    for regs in (0, 96):  # the router's programs and the front's in one launch, K3 widths
        attempt(f"moe/fused+dense front_routes registers {regs}", lambda regs=regs: moe.variant(
            "fused+dense").fn({**boundaries.clone_inputs(fr), "config": dataclasses.replace(
                fr_conf, front_route_registers=regs)}))
    attempt("moe/fused+dense tail_second_first", lambda: moe.variant("fused+dense").fn(
        {**boundaries.clone_inputs(fr), "config": dataclasses.replace(
            fr_conf, tail_second_first=True)}))
    for where in ("stage1", "stage2"):  # the shared down-projection beside a stage, K3 widths
        attempt(f"moe/fused+dense shared_down_launch {where}", lambda where=where: moe.variant(
            "fused+dense").fn({**boundaries.clone_inputs(fr), "config": dataclasses.replace(
                fr_conf, shared_down_launch=where)}))
    attempt("dense gate/up together", lambda: dense_gemv(
        torch.zeros(1, 7168, dtype=torch.bfloat16), torch.zeros(1536, 7168, dtype=torch.bfloat16),
        activation="situ", config=GemvConfig(block_n=8, split_k=2, pdl=True,
                                             gate_up_together=True)))
    attempt("dense second_first", lambda: dense_gemv(
        torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(64, 512, dtype=torch.bfloat16),
        residual=torch.zeros(1, 64, dtype=torch.bfloat16),
        config=GemvConfig(block_n=16, pdl=True, second_first=True)))
    attempt("dense wait_last", lambda: dense_gemv(
        torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(64, 512, dtype=torch.bfloat16),
        config=GemvConfig(block_n=8, pdl=True, wait_last=True)))
    attempt("dense wait_last, trigger_last", lambda: dense_gemv(
        torch.zeros(1, 512, dtype=torch.bfloat16), torch.zeros(64, 512, dtype=torch.bfloat16),
        config=GemvConfig(block_n=8, split_k=2, pdl=True, wait_last=True, trigger_last=True)))
    for m, n, atomic in ((1, 8, True), (4, 4, False)):  # an AttnRes read's sums, K3 o_proj
        attempt(f"dense read_sums M {m} N {n}", lambda m=m, n=n, atomic=atomic: _read_sums(
            m, n, atomic))
    attempt("integration stack token, read_sums", lambda: stack.run_token(
        st, token, num_splits=4, configs=stack.Configs(read_sums=True)))
    attempt("integration stack token, reads in their consumers",
            lambda: stack.run_token(st, token, num_splits=4, configs=stack.Configs(
                attn_read_in_proj=True, ffn_read_in_front=True)))
    for m, n in ((4, 3),):  # several tokens: the tensor-core paths (the token above: M 1)
        attempt(f"dense read_input M {m} N {n}", lambda m=m, n=n: _read_input(m, n))
        attempt(f"front_route read_input M {m} N {n}", lambda m=m, n=n: _front_read(m, n))
    attempt("integration stack token, KDA RMS in o_proj, early ticket", lambda: stack.run_token(
        st, token, num_splits=4, configs=stack.Configs(
            kda_rms_in_o_proj=True, kda=KDAConfig(early_ticket=True))))
    kd = boundaries.get("kda")
    ki = kd.make_inputs(k3, cpu, 0)
    for name in ("fused", "fused+conv+out_gate"):
        attempt(f"kda/{name} pdl", lambda name=name: kd.variant(name).fn(
            {**boundaries.clone_inputs(ki), "config": KDAConfig(pdl=True)}))
    rk = boundaries.get("route").make_inputs(k3, cpu, 0)
    for m in (1, 4):
        attempt(f"route pdl M {m}", lambda m=m: route_sort(
            rk["hidden"].expand(m, -1).contiguous(), rk["gate_weight"], rk["correction_bias"],
            top_k=k3.top_k, config=RouteConfig(pdl=True)))
    attempt("route spread selection M 64", lambda: route_sort(
        rk["hidden"].expand(64, -1).contiguous(), rk["gate_weight"], rk["correction_bias"],
        top_k=k3.top_k, block_m=16, config=RouteConfig(select_programs_min_tokens=1)))
    for m in (4, 64):
        attempt(f"route gemv dot M {m}", lambda m=m: route_sort(
            rk["hidden"].expand(m, -1).contiguous(), rk["gate_weight"], rk["correction_bias"],
            top_k=k3.top_k, block_m=16, config=RouteConfig(gemv_dot_min_tokens=2)))
    for spread in (0, 1):
        attempt(f"route register sort M 64 spread {spread}", lambda spread=spread: route_sort(
            rk["hidden"].expand(64, -1).contiguous(), rk["gate_weight"], rk["correction_bias"],
            top_k=k3.top_k, block_m=16, config=RouteConfig(
                select_programs_min_tokens=spread, register_sort_max_entries=4096)))
    x = torch.zeros(1 << 16, dtype=torch.bfloat16)
    for then in kfloors.THEN:
        attempt(f"floors stream {then}", lambda then=then: kfloors.stream(x, then=then))
    attempt("floors stream after", lambda: kfloors.stream(x, then="none", after=True))
    attempt("floors update", lambda: kfloors.update(torch.zeros(4096), x))
    compiled: dict[str, int] = {}
    for launch in built:
        compiled[launch.name] = compiled.get(launch.name, 0) + 1
    return {"compiled": compiled, "failures": failures}


if __name__ == "__main__":
    print(json.dumps(main()))
