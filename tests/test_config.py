"""Presets and tensor-parallel sharding."""

import pytest

from k3lab.config import PRESETS, preset


def test_k3_full_model_sizes():
    cfg = preset("kimi-k3")
    assert (cfg.hidden, cfg.n_layers, cfg.n_experts, cfg.top_k) == (7168, 93, 896, 16)
    assert (cfg.latent, cfg.moe_intermediate, cfg.shared_intermediate) == (3584, 3072, 6144)
    assert len(cfg.mla_layers) == 24 and len(cfg.kda_layers) == 69
    # 1-based 4, 8, ..., 92 and 93
    assert cfg.mla_layers[:2] == (3, 7) and cfg.mla_layers[-2:] == (91, 92)
    assert cfg.max_attn_res_candidates == 9


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_k3_sharding_divides_heads_and_intermediates_only(tp):
    base, cfg = preset("kimi-k3"), preset("kimi-k3", tp)
    assert cfg.tp == tp
    assert cfg.kda_heads == base.kda_heads // tp and cfg.mla_heads == base.mla_heads // tp
    assert cfg.moe_intermediate == base.moe_intermediate // tp
    assert cfg.shared_intermediate == base.shared_intermediate // tp
    assert (cfg.hidden, cfg.latent, cfg.n_experts) == (base.hidden, base.latent, base.n_experts)


def test_k3_tp8_expert_shape_matches_kernel_libraries():
    cfg = preset("kimi-k3", 8)
    assert (cfg.moe_in, cfg.moe_intermediate, cfg.n_experts, cfg.top_k) == (3584, 384, 896, 16)


def test_presets_are_frozen():
    cfg = preset("tiny")
    with pytest.raises(AttributeError):
        cfg.hidden = 3


@pytest.mark.parametrize("name", list(PRESETS))
def test_every_preset_loads(name):
    assert preset(name).name == name


def test_unknown_preset_is_a_clear_error():
    with pytest.raises(ValueError, match="preset: unknown preset 'kimi-k4'"):
        preset("kimi-k4")


@pytest.mark.parametrize("tp", [0, -1, 2.0, "8"])
def test_bad_tp_type(tp):
    with pytest.raises(ValueError, match="tp: expected a positive integer"):
        preset("kimi-k3", tp)


def test_tp_that_does_not_divide_names_the_field():
    with pytest.raises(ValueError, match=r"tp: 7 does not divide kda_heads=96"):
        preset("kimi-k3", 7)
