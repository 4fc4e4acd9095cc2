"""The campaign stack: single-owner composition and the layer run under a stack."""

import pytest
import torch

from k3lab.config import preset
from k3lab.ops import layer_ops
from k3lab.reference.layer import make_layer
from k3lab.reference.layer import run_layer as reference_layer
from k3lab.stack import CATALOGUE, Change, compose, measure_stack, run_layer, waterfall

ALL = [c.name for c in CATALOGUE if c.name != "b1-gate-projection"]
# the layer output is bf16 of O(1) values after ~10 rounded hand-offs between ops
LAYER_ATOL, LAYER_RTOL = 6e-2, 2e-2


def test_catalogue_holds_the_seed_changes_and_attn_res():
    names = [c.name for c in CATALOGUE]
    assert len(names) == 10 and len(set(names)) == 10
    assert sum(bool(c.seed_commit) for c in CATALOGUE) == 9
    assert "attn-res-rmsnorm" in names


def test_every_claimed_op_is_an_op_of_the_decode_step():
    ops = set(layer_ops("kda")) | set(layer_ops("mla"))
    for c in CATALOGUE:
        assert set(c.owns) <= ops, c.name


def test_full_stack_has_one_owner_per_op_and_leaves_the_rest_to_the_reference():
    stack = compose(ALL)
    owned = [op for op, who in stack.owner.items() if who]
    assert len(owned) == sum(len(CATALOGUE[i].owns) for i in range(10)) - 1  # gate proj once
    assert stack.owner["moe.gate_proj"] == "route-sort"
    assert stack.owner["kda.q_proj"] is None and not stack.fused("kda.q_proj")


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
    with pytest.raises(ValueError, match="unknown change 'warp-speed'"):
        compose(["warp-speed"])
    with pytest.raises(ValueError, match="listed twice"):
        compose(["route-sort", "route-sort"])
    with pytest.raises(ValueError, match="no op of the decode step"):
        compose([Change("x", "x", ("moe.teleport",))])


STACKS = {
    "reference": [],
    "gate-only": ["b1-gate-projection", "stage1-direct-tile"],
    "kda-no-fb": ["fused-kda-decode", "atomic-stage2"],
    "full": ALL,
}


@pytest.mark.parametrize("kind", ["kda", "mla"])
@pytest.mark.parametrize("name", list(STACKS))
def test_layer_under_a_stack_matches_the_reference_layer(kind, name, device):
    cfg = preset("tiny")
    ref_state = make_layer(cfg, kind, device, seed=3, context=40)
    state = make_layer(cfg, kind, device, seed=3, context=40)
    expected = reference_layer(ref_state)
    got = run_layer(compose(STACKS[name]), state, num_splits=3)
    torch.testing.assert_close(got.float(), expected.float(), atol=LAYER_ATOL, rtol=LAYER_RTOL)
    if kind == "kda":  # the recurrent state moved the same way
        torch.testing.assert_close(state["cache"]["state"], ref_state["cache"]["state"],
                                   atol=2e-3, rtol=2e-3)


def test_measure_stack_and_waterfall_on_cpu():
    cfg = preset("tiny")
    full = measure_stack(compose(ALL), cfg, "cpu", context=24, repeats=1)
    ref = measure_stack(compose([]), cfg, "cpu", context=24, repeats=1)
    launches = lambda df: df[df.metric == "launches"].set_index("kind")["value"]
    assert (launches(full) < launches(ref)).all()
    assert set(full[full.kind == "token"].metric) == {"token_us", "tok_per_s"}
    wf = waterfall(cfg, "cpu", order=["route-sort", "b1-gate-projection", "kda-fb-fusion",
                                      "fused-kda-decode"], context=24, repeats=1)
    # the superseded gate projection and the f_b fusion (requirement not yet met) are skipped
    assert list(dict.fromkeys(wf.added)) == ["reference", "route-sort", "fused-kda-decode"]
