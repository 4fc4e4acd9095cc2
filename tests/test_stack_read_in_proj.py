"""stack.Configs.attn_read_in_proj and ffn_read_in_front in the full stack's token: the
attention reads past a block's first layer, and the FFN reads, have no launch; the dense GEMV
before each leaves its sums and its consumer (the merged input projection; the MoE front's
fused launch or layer 0's gate/up projection) mixes its input from them. The logits meet the
fp32 truth twice in a row (each mixed read zeroes the next one's sums, the last the first's)
with one launch fewer a mixed read."""

from dataclasses import replace

import pytest

from k3lab.config import preset
from k3lab.profile import count_launches
from k3lab.reference.layer import make_token
from k3lab.stack import STACKS, compose, run_token, runnable, steps
from k3lab.stack.token import _mixed_reads
from k3lab.studies.decode_step import check_token, configs_for


@pytest.mark.parametrize("window,first", [(1, None), (3, 0)], ids=["one-layer", "centred"])
def test_attn_reads_in_the_input_projections(window, first, device):
    cfg = preset("tiny")
    full, _ = runnable(compose(steps(STACKS["integration"])[-1][1]))
    base = configs_for(device)
    mixed = replace(base, attn_read_in_proj=True)
    kw = {} if first is None else {"first_layer": first}
    token = make_token(cfg, device, window=window, seed=4, context=24, expert_format="mxfp4",
                       **kw)
    reads = _mixed_reads(full, token)
    assert reads == [i for i in range(1, len(token["layer_ids"]))
                     if not token["schedule"][token["layer_ids"][i]][1]]
    assert reads, token["layer_ids"]
    for _ in range(2):
        checks = check_token(token, {"base": full, "mixed": full},
                             {"base": base, "mixed": mixed}, num_splits=3)
        assert checks["ok"].all(), checks
        zero = [int(token["attn_sums"][i].count_nonzero()) == 0 for i in reads]
        if len(reads) > 1:  # the first read's zeroed by the last one, the others held
            assert zero[0] and not any(zero[1:]), zero
        else:  # zeroed by a launch of its own before its producer
            assert not zero[0]
    kernels = {k: count_launches(lambda t, c=c: run_token(full, t, num_splits=3, configs=c),
                                 token).kernels for k, c in (("base", base), ("mixed", mixed))}
    alone = 1 if len(reads) == 1 else 0  # a single mixed read's sums zeroed by a launch
    assert len(kernels["base"]) - len(kernels["mixed"]) == len(reads) - alone


def test_attn_read_in_proj_needs_the_dense_gemv(device):
    """Without the dense GEMV the option has no read to move: the token runs as without it."""
    cfg = preset("tiny")
    names = [n for n in steps(STACKS["integration"])[-1][1] if n != "dense-gemv"]
    stack, _ = runnable(compose(names))
    token = make_token(cfg, device, window=2, seed=4, context=24, expert_format="mxfp4")
    assert _mixed_reads(stack, token) == []
    base = configs_for(device)
    checks = check_token(token, {"base": stack, "mixed": stack},
                         {"base": base, "mixed": replace(base, attn_read_in_proj=True)},
                         num_splits=3)
    assert checks["ok"].all(), checks


def test_attn_read_in_proj_fields_are_checked():
    from k3lab.stack import Configs
    with pytest.raises(ValueError, match="Configs.attn_read_in_proj: expected a bool"):
        Configs(attn_read_in_proj=1)
    for name in ("attn_read_registers", "read_sums_registers"):
        for bad in (-1, 256, True, 72.0):
            with pytest.raises(ValueError, match=f"Configs.{name}: expected an int in 0..255"):
                Configs(**{name: bad})


def test_the_input_projection_takes_the_register_cap():
    """The mixing input projection runs its tiling capped at attn_read_registers (0: not)."""
    from dataclasses import replace as rep

    import torch

    from k3lab.kernels.dense import call_config
    from k3lab.stack import Configs
    from k3lab.stack.base import _gemv_config
    w = torch.empty(6284, 7168)
    tiling = call_config(None, 1, 6284, 7168)
    for cap in (128, 96):
        got = _gemv_config(Configs(attn_read_registers=cap, in_proj_prefetch=None), "kda.q_proj",
                           1, w, None, read=True)
        assert got == rep(tiling, max_registers=cap)
    assert _gemv_config(Configs(attn_read_registers=0, in_proj_prefetch=None), "kda.q_proj", 1,
                        w, None, read=True) is None


def test_ffn_and_attn_reads_in_their_consumers(device):
    """Both options from layer 1: every FFN read (layer 0's in its gate/up projection) and
    every attention read past layer 0's go."""
    cfg = preset("tiny")
    full, _ = runnable(compose(steps(STACKS["integration"])[-1][1]))
    base = configs_for(device)
    mixed = replace(base, ffn_read_in_front=True, attn_read_in_proj=True)
    token = make_token(cfg, device, window=3, seed=4, context=24, expert_format="mxfp4")
    reads = _mixed_reads(full, token)
    for _ in range(2):
        checks = check_token(token, {"base": full, "mixed": full},
                             {"base": base, "mixed": mixed}, num_splits=3)
        assert checks["ok"].all(), checks
        zero = [int(token["attn_sums"][i].count_nonzero()) == 0 for i in reads]
        assert len(reads) > 1 and zero[0] and not any(zero[1:]), zero
    kernels = {k: count_launches(lambda t, c=c: run_token(full, t, num_splits=3, configs=c),
                                 token).kernels for k, c in (("base", base), ("mixed", mixed))}
    n_reads = lambda ks: sum("_attn_res" in n for n in ks)  # noqa: E731
    layers = len(token["layer_ids"])
    assert n_reads(kernels["base"]) - n_reads(kernels["mixed"]) == layers + len(reads)
    assert not any("_attn_res_mix_kernel" in n for n in kernels["mixed"])
