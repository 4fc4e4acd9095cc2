"""stack.Configs.kda_rms_in_o_proj and KDAConfig.early_ticket in the full stack's token: the
KDA decode's v-tiles leave each head's RMS to the output projection's prologue and take the
conv caches' ticket early; the logits meet the fp32 truth twice in a row (the conv caches and
tickets carried over) with as many launches as the defaults."""

from dataclasses import replace

import pytest

from k3lab.config import preset
from k3lab.kernels import KDAConfig
from k3lab.profile import count_launches
from k3lab.reference.layer import make_token
from k3lab.stack import STACKS, compose, run_token, runnable, steps
from k3lab.studies.decode_step import check_token, configs_for


@pytest.mark.parametrize("block_v,gemv", [(None, True), (8, True), (8, False)],
                         ids=["whole-head", "BV8", "BV8-engine-o_proj"])
def test_kda_rms_in_the_output_projection(block_v, gemv, device):
    """gemv False: the stack without the dense GEMV, o_proj the engine's call after a torch
    scaling of the heads (launches of their own)."""
    cfg = preset("tiny")
    names = [n for n in steps(STACKS["integration"])[-1][1] if gemv or n != "dense-gemv"]
    full, _ = runnable(compose(names))
    base = replace(configs_for(device), kda=KDAConfig(block_v=block_v))
    moved = replace(base, kda_rms_in_o_proj=True,
                    kda=KDAConfig(block_v=block_v, early_ticket=True))
    token = make_token(cfg, device, window=3, seed=4, context=24, expert_format="mxfp4")
    for _ in range(2):
        checks = check_token(token, {"base": full, "moved": full},
                             {"base": base, "moved": moved}, num_splits=3)
        assert checks["ok"].all(), checks
    kernels = {k: count_launches(lambda t, c=c: run_token(full, t, num_splits=3, configs=c),
                                 token).kernels for k, c in (("base", base), ("moved", moved))}
    if gemv:  # the scaling rides in the dense GEMV's prologue
        assert len(kernels["base"]) == len(kernels["moved"])
    else:  # torch ops of their own before the engine's o_proj
        assert len(kernels["moved"]) > len(kernels["base"])


def test_kda_rms_flag_is_checked():
    from k3lab.stack import Configs
    with pytest.raises(ValueError, match="Configs.kda_rms_in_o_proj: expected a bool"):
        Configs(kda_rms_in_o_proj=1)


def test_o_proj_config_reaches_the_output_projections(device):
    """Configs.o_proj: the attention's output projections' GemvConfig (KDA and MLA), gemv's
    for the others; a config that is not one is refused by the o_proj launch, named."""
    from k3lab.kernels.dense import GemvConfig
    from k3lab.stack import Configs
    tiling, other = GemvConfig(block_n=16, block_k=256), GemvConfig(block_n=8)
    c = Configs(gemv=other, o_proj=tiling)
    assert c.for_op("kda.o_proj") is tiling and c.for_op("mla.o_proj") is tiling
    assert c.for_op("kda.q_proj") is other and Configs(gemv=other).for_op("mla.o_proj") is other
    cfg = preset("tiny")
    full, _ = runnable(compose(steps(STACKS["integration"])[-1][1]))
    token = make_token(cfg, device, window=1, seed=4, context=24, expert_format="mxfp4")
    with pytest.raises(ValueError, match="config: expected a GemvConfig"):
        run_token(full, token, num_splits=3,
                  configs=replace(configs_for(device), o_proj="not a config"))
