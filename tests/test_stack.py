"""The campaign stacks: single-owner composition, the layer and the token under a stack."""

import pytest
import torch

from k3lab.config import preset
from k3lab.ops import layer_ops
from k3lab.reference.layer import make_layer, make_token
from k3lab.reference.layer import run_layer as reference_layer
from k3lab.reference.layer import run_token as reference_token
from k3lab.stack import (
    CATALOGUE,
    CHANGES,
    STACKS,
    TOKEN_OPS,
    Change,
    compose,
    run_layer,
    run_token,
    runnable,
    steps,
)
from k3lab.studies.decode_step import check_token, configs_for

# the integration stack's changes that keep the model's weights (fp8-latent-tail quantizes the
# latent up-projection: tests/test_decode_step.py checks it against the truth of its e4m3 rows)
INTEGRATION = [n for n in STACKS["integration"] if n not in ("b1-gate-projection",
                                                             "fp8-latent-tail")]
# the layer output is bf16 of O(1) values after ~10 rounded hand-offs between ops
LAYER_ATOL, LAYER_RTOL = 6e-2, 2e-2


def test_catalogue_holds_the_seed_changes_attn_res_dense_and_the_reviewed_ones():
    names = [c.name for c in CATALOGUE]
    assert len(names) == len(set(names)) == 16
    assert sum(bool(c.seed_commit) for c in CATALOGUE) == 9
    assert {"attn-res-rmsnorm", "dense-gemv", "persistent-moe", "fp8-latent-tail",
            "kda-conv-fusion", "kda-out-gate-fusion", "mla-absorb-fusion"} <= set(names)
    for order in STACKS.values():
        assert set(order) <= set(names)
    from k3lab.stack import CANDIDATES
    assert set(CANDIDATES) <= set(names)
    assert not set(CANDIDATES) & {n for order in STACKS.values() for n in order}


def test_every_claimed_op_is_an_op_of_the_decode_token():
    ops = set(layer_ops("kda")) | set(layer_ops("mla")) | set(TOKEN_OPS)
    for c in CATALOGUE:
        assert set(c.owns) <= ops, c.name


def test_integration_stack_has_one_owner_per_op_and_leaves_the_rest_to_the_engine():
    st = compose(INTEGRATION)
    assert st.owner["moe.gate_proj"] == "route-sort"
    assert st.owner["kda.q_proj"] == "dense-gemv" and st.owner["token.lm_head"] == "dense-gemv"
    assert st.owner["moe.stage1"] == "stage1-direct-tile"
    assert st.owner["kda.short_conv"] == "kda-conv-fusion"
    assert st.owner["kda.out_norm_gate"] == "kda-out-gate-fusion"
    for op in ("mla.kv_a_norm", "mla.cache_append", "mla.q_absorb", "mla.v_absorb",
               "mla.out_gate"):
        assert st.owner[op] == "mla-absorb-fusion", op
    assert compose([]).owner["kda.q_proj"] is None and not compose([]).fused("kda.q_proj")


def test_reviewed_stack_gives_the_persistent_boundary_what_the_seed_says_it_owns():
    st = compose(STACKS["reviewed"])
    for op in ("moe.route_select", "moe.sort", "moe.expert_align", "moe.stage1", "moe.stage2"):
        assert st.owner[op] == "persistent-moe", op
    assert st.owner["moe.gate_proj"] == "b1-gate-projection"          # the seed's #6
    assert st.owner["moe.latent_up"] == "fused-latent-tail"           # #17
    assert st.owner["kda.f_b_proj"] == "kda-fb-fusion"                # #16
    assert "route-sort" not in st.names and "atomic-stage2" not in st.names


@pytest.mark.parametrize("tile", ["stage1-direct-tile", "atomic-stage2",
                                  "prepared-routing-handoff"])
def test_a_stage_tile_beside_the_persistent_boundary_is_refused_naming_both(tile):
    with pytest.raises(ValueError, match=rf"has two owners: 'persistent-moe' and '{tile}'"):
        compose(["persistent-moe", tile])
    with pytest.raises(ValueError, match=rf"has two owners: '{tile}' and 'persistent-moe'"):
        compose([tile, "persistent-moe"])


def test_second_owner_of_routing_is_rejected_naming_both_and_the_op():
    rogue = Change("persistent-router", "another routing kernel", ("moe.route_select",))
    with pytest.raises(ValueError, match=r"op 'moe.route_select' has two owners: "
                                         r"'route-sort' and 'persistent-router'"):
        compose(["route-sort", rogue])


def test_superseded_change_beside_its_successor_is_rejected_and_alone_accepted():
    with pytest.raises(ValueError, match="'route-sort' supersedes 'b1-gate-projection'"):
        compose(["b1-gate-projection", "route-sort"])
    assert compose(["route-sort"]).owner["moe.gate_proj"] == "route-sort"
    assert compose(["b1-gate-projection"]).owner["moe.gate_proj"] == "b1-gate-projection"


def test_requirements_unknown_names_and_duplicates():
    with pytest.raises(ValueError, match="'kda-fb-fusion' requires 'fused-kda-decode'"):
        compose(["kda-fb-fusion"])
    for name in ("kda-conv-fusion", "kda-out-gate-fusion"):
        with pytest.raises(ValueError, match=f"'{name}' requires 'fused-kda-decode'"):
            compose([name])
    with pytest.raises(ValueError, match="'fp8-latent-tail' requires 'fused-latent-tail'"):
        compose(["fp8-latent-tail"])
    with pytest.raises(ValueError, match="unknown change 'warp-speed'"):
        compose(["warp-speed"])
    with pytest.raises(ValueError, match="listed twice"):
        compose(["route-sort", "route-sort"])
    with pytest.raises(ValueError, match="no op of the decode step"):
        compose([Change("x", "x", ("moe.teleport",))])


def test_a_change_without_its_kernel_is_skipped_with_a_note_naming_the_variant():
    from k3lab.boundaries import get

    names = {v.name for v in get("moe").variants}
    st, notes = runnable(compose(STACKS["reviewed"]))
    if "persistent" in names:
        assert "persistent-moe" in st.names
    else:
        assert "persistent-moe" not in st.names
        assert any("persistent-moe skipped" in n and "'persistent'" in n for n in notes)
    assert "fused-kda-decode" in st.names and "dense-gemv" in st.names
    assert CHANGES["dense-gemv"].missing() is None


def test_steps_skip_changes_that_cannot_join_at_their_turn():
    got = [added for added, _ in steps(STACKS["integration"])]
    assert got[0] == "engine baseline" and "b1-gate-projection" not in got
    assert got[-1] == STACKS["integration"][-1] and len(got) == len(STACKS["integration"])
    got = [a for a, _ in steps(["kda-fb-fusion", "fused-kda-decode", "kda-fb-fusion"])]
    assert got == ["engine baseline", "fused-kda-decode", "kda-fb-fusion"]
    assert [a for a, _ in steps(STACKS["reviewed"])][1:] == list(STACKS["reviewed"])


LAYER_STACKS = {
    "engine": [],
    "gate-only": ["b1-gate-projection", "stage1-direct-tile"],
    "kda-no-fb": ["fused-kda-decode", "atomic-stage2"],
    "kda-neighbours": ["fused-kda-decode", "kda-conv-fusion", "kda-out-gate-fusion"],
    "integration": INTEGRATION,
    "integration-no-mla-absorb": [n for n in INTEGRATION if n != "mla-absorb-fusion"],
}


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("name", list(LAYER_STACKS))
def test_layer_under_a_stack_matches_the_reference_layer(kind, name, device):
    cfg = preset("tiny")
    ref_state = make_layer(cfg, kind, device, seed=3, context=40)
    state = make_layer(cfg, kind, device, seed=3, context=40)
    expected = reference_layer(ref_state)
    st = compose(LAYER_STACKS[name])
    got = run_layer(st, state, num_splits=3)
    torch.testing.assert_close(got.float(), expected.float(), atol=LAYER_ATOL, rtol=LAYER_RTOL)
    if kind == "kda":  # the recurrent state moved the same way; the GEMV's bf16 q, k, v can
        # differ from the reference's by one ulp (the interpreter truncates its casts)
        tol = 1e-2 if st.fused("kda.q_proj") else 2e-3
        torch.testing.assert_close(state["cache"]["state"], ref_state["cache"]["state"],
                                   atol=tol, rtol=tol)
        for n in "qkv":  # the conv caches hold the bf16 projections, shifted by one step
            key = f"{n}_conv_state"
            torch.testing.assert_close(state["cache"][key], ref_state["cache"][key],
                                       atol=tol, rtol=tol)


def test_merged_input_projection_is_one_weight_with_row_views():
    st = make_layer(preset("tiny"), "kda", "cpu", seed=1)
    w = st["attn"]
    assert w["in_proj"].shape[0] == sum(w["in_splits"])
    assert w["q_proj"].data_ptr() == w["in_proj"].data_ptr()
    assert w["g_proj"].data_ptr() + w["g_proj"].nbytes == (w["in_proj"].data_ptr()
                                                          + w["in_proj"].nbytes)


@pytest.mark.parametrize("names", [[], ["attn-res-rmsnorm", "dense-gemv"]],
                         ids=["engine", "token-ops-fused"])
def test_token_under_a_stack_matches_the_fp32_token_with_its_routing(names, device):
    """Embedding, layer 0's dense MLP, a block seal (tiny seals every 4 layers) and the head;
    the token's own fused ops (final read, dense MLP and LM head GEMVs) in the second case (the
    layer tests above cover the other kernels inside a layer)."""
    cfg = preset("tiny")
    a = make_token(cfg, device, window=4, seed=2, context=24, expert_format="mxfp4")
    b = make_token(cfg, device, window=4, seed=2, context=24, expert_format="mxfp4")
    chosen: list = []
    got = run_token(compose(names), b, num_splits=3, record=chosen,
                    configs=configs_for(device))  # few big programs under the interpreter
    assert chosen[0] is None and all(c is not None for c in chosen[1:])
    truth = reference_token(a, topk_ids=chosen)
    assert got.shape == truth.shape == (1, cfg.vocab)
    err = float((got.float() - truth).abs().max())
    assert err <= 0.1 * float(truth.abs().max()), err
    assert int(b["rows"][1].abs().sum()) != 0  # the block sum of layers 0..3 was sealed


def test_router_in_the_front_launch_in_the_token(device):
    """MoEConfig.front_routes (the default) in the full stack's token: the logits meet the fp32
    truth of the experts it chose, with one launch fewer per MoE layer than the route and the
    front apart."""
    from dataclasses import replace

    from k3lab.kernels import MoEConfig
    from k3lab.profile import count_launches
    from k3lab.stack import runnable, steps

    cfg = preset("tiny")
    full, _ = runnable(compose(steps(STACKS["integration"])[-1][1]))
    fused = configs_for(device)
    base = replace(fused, moe=MoEConfig(front_routes=False))
    token = make_token(cfg, device, window=3, seed=4, context=24, expert_format="mxfp4")
    checks = check_token(token, {"apart": full, "fused": full}, {"apart": base, "fused": fused},
                         num_splits=3)
    assert checks["ok"].all(), checks
    kernels = {k: count_launches(lambda t, c=c: run_token(full, t, num_splits=3, configs=c),
                                 token).kernels for k, c in (("apart", base), ("fused", fused))}
    routes = sum("_route_sort_kernel" in n for n in kernels["apart"])
    assert routes >= 1 and not any("_route_sort_kernel" in n for n in kernels["fused"])
    assert sum("_front_route_kernel" in n for n in kernels["fused"]) == routes
    assert len(kernels["apart"]) - len(kernels["fused"]) == routes


@pytest.mark.parametrize("where", ["stage1", "stage2"])
def test_shared_down_beside_a_stage_in_the_token(where, device):
    """MoEConfig.shared_down_launch in the full stack's token: the shared down-projection and
    the residual run in stage 1's or stage 2's launch and the MoE tail adds their sum (with
    tail_second_first: before its wait only from stage 1's); the logits meet the fp32 truth
    with as many launches as the default, every MoE layer's stage the combined launch."""
    from dataclasses import replace

    from k3lab.kernels import MoEConfig
    from k3lab.profile import count_launches
    from k3lab.stack import runnable, steps

    cfg = preset("tiny")
    full, _ = runnable(compose(steps(STACKS["integration"])[-1][1]))
    base = replace(configs_for(device), moe=MoEConfig())  # the tail's second product
    down = replace(base, moe=MoEConfig(shared_down_launch=where, tail_second_first=True))
    token = make_token(cfg, device, window=3, seed=4, context=24, expert_format="mxfp4")
    checks = check_token(token, {"base": full, "down": full}, {"base": base, "down": down},
                         num_splits=3)
    assert checks["ok"].all(), checks
    kernels = {k: count_launches(lambda t, c=c: run_token(full, t, num_splits=3, configs=c),
                                 token).kernels for k, c in (("base", base), ("down", down))}
    assert len(kernels["base"]) == len(kernels["down"])
    alone = "_moe_stage1_kernel" if where == "stage1" else "_moe_stage2_tail_kernel"
    stages = sum(alone in n for n in kernels["base"])
    assert stages >= 3 and not any(alone in n for n in kernels["down"])
    assert sum(f"_{where}_shared_down_kernel" in n for n in kernels["down"]) == stages


def test_window_layers_from_a_layer_or_centred():
    """Layer 0, then the window from first_layer (0: centred in the model); bad values named."""
    from k3lab.reference.layer import window_layers

    k3 = preset("kimi-k3")
    assert window_layers(k3, 12) == list(range(13))
    assert window_layers(k3, 12, 0) == [0, *range(40, 52)]  # blocks 3 and 4 of 8
    assert window_layers(k3, 12, 88) == [0, *range(88, 93)]  # cut at the last layer
    assert window_layers(preset("tiny"), 3, 0) == [0, 5, 6, 7]
    for bad in (-1, 93, 1.0, True):
        with pytest.raises(ValueError, match="first_layer: expected 0"):
            window_layers(k3, 12, bad)


def test_centred_token_reads_the_blocks_before_it_and_matches_the_truth(device):
    """A window past the first blocks: their sums are rows of the token (random, not zero), its
    reads see them, and the fused token still matches the fp32 truth."""
    cfg = preset("tiny")
    kw = dict(window=3, seed=4, context=24, expert_format="bf16", first_layer=0)
    a, b = make_token(cfg, device, **kw), make_token(cfg, device, **kw)
    assert a["layer_ids"] == [0, 5, 6, 7]
    assert int(a["rows"][1].abs().sum()) != 0 and int(a["rows"][2].abs().sum()) == 0
    chosen: list = []
    got = run_token(compose(["attn-res-rmsnorm", "dense-gemv"]), b, num_splits=3, record=chosen,
                    configs=configs_for(device))
    truth = reference_token(a, topk_ids=chosen)
    err = float((got.float() - truth).abs().max())
    assert err <= 0.1 * float(truth.abs().max()), err


def test_read_sums_in_the_token(device):
    """Configs.read_sums: the attention's output projections leave the FFN reads' sums and the
    reads only mix. The token meets the fp32 truth twice in a row with as many launches as the
    plain reads: each read clears the next layer's buffer before that layer's projection adds
    into it, the last read the first layer's (the others hold the token's sums until then)."""
    from dataclasses import replace

    from k3lab.profile import count_launches
    from k3lab.stack import runnable, steps

    cfg = preset("tiny")
    full, _ = runnable(compose(steps(STACKS["integration"])[-1][1]))
    plain = configs_for(device)
    sums = replace(plain, read_sums=True)
    token = make_token(cfg, device, window=3, seed=4, context=24, expert_format="mxfp4")
    for _ in range(2):
        checks = check_token(token, {"plain": full, "sums": full},
                             {"plain": plain, "sums": sums}, num_splits=3)
        assert checks["ok"].all(), checks
        assert len(token["read_sums"]) == len(token["layer_ids"])
        first, *rest = token["read_sums"]
        assert int(first.count_nonzero()) == 0 and all(int(b.count_nonzero()) for b in rest)
    kernels = {k: count_launches(lambda t, c=c: run_token(full, t, num_splits=3, configs=c),
                                 token).kernels for k, c in (("plain", plain), ("sums", sums))}
    assert len(kernels["plain"]) == len(kernels["sums"])
    mixes = sum("_attn_res_mix_kernel" in n for n in kernels["sums"])
    assert mixes - sum("_attn_res_mix_kernel" in n for n in kernels["plain"]) == len(
        token["layer_ids"])


def test_projection_prefetch_configs():
    """Configs.o_proj_prefetch / in_proj_prefetch: checked; they set the L2 prefetch steps (and
    PDL) of the attention's output and merged input projections on the tiling the launcher
    would take, and of no other projection; read_sums_registers caps the sums' producer."""
    from dataclasses import replace

    from k3lab.kernels.dense import GemvConfig, call_config
    from k3lab.stack import Configs
    from k3lab.stack.base import _gemv_config

    for name in ("o_proj_prefetch", "in_proj_prefetch"):
        for bad in (9, -1, True, 1.0):
            with pytest.raises(ValueError, match=f"^Configs.{name}: expected None or an int"):
                Configs(**{name: bad})
    configs = Configs(o_proj_prefetch=3, in_proj_prefetch=1)
    w = torch.empty(7168, 1536)
    want = replace(call_config(None, 1, 7168, 1536), pdl=True, prefetch_steps=3)
    for op in ("kda.o_proj", "mla.o_proj"):
        assert _gemv_config(configs, op, 1, w, None) == want
    given = GemvConfig(block_n=8, block_k=256)
    assert _gemv_config(configs, "kda.q_proj", 1, w, given) == replace(given, pdl=True,
                                                                         prefetch_steps=1)
    for op in ("moe.latent_up", "mla.q_b_proj", "moe.shared"):
        assert _gemv_config(configs, op, 1, w, given) is given
    assert _gemv_config(Configs(), "kda.o_proj", 1, w, None) is None
    # the sums' producer (Configs.read_sums) takes its register cap on that tiling
    assert _gemv_config(Configs(), "kda.o_proj", 1, w, None, sums=True) == replace(
        call_config(None, 1, 7168, 1536), max_registers=72)
    assert _gemv_config(Configs(read_sums_registers=0), "kda.o_proj", 1, w, None,
                        sums=True) is None
