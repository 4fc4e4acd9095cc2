"""Route boundary (docs/model.md): the router's gate projection with FP32 logits,
sigmoid, correction bias, (grouped) top-k, weight renormalization and the MoE sort metadata,
producing the :class:`k3lab.kernels.plan.RoutePlan` the expert stages consume."""

from __future__ import annotations

from k3lab.boundaries import Boundary, Variant, assert_close, compiled
from k3lab.config import Preset
from k3lab.kernels import route_sort
from k3lab.kernels.plan import RoutePlan
from k3lab.reference.route import route_sort_reference
from k3lab.weights import hidden_states, make_generator, router_weights

__all__ = ["BOUNDARY", "make_inputs", "check", "bytes_moved", "route_kwargs",
           "WEIGHTS_ATOL", "WEIGHTS_RTOL", "EXACT_FIELDS"]

# Weights are sigmoid scores of fp32 logits renormalized over top_k: a different summation order
# of the 7168-long dot product moves a logit by ~1e-6 and a weight by well under 1e-6.
WEIGHTS_ATOL = 2e-6
WEIGHTS_RTOL = 1e-5
# Integer fields (and the zeroed out buffer) must match bit for bit.
EXACT_FIELDS = ("topk_ids", "sorted_ids", "block_expert_ids", "num_valid", "out")
ROUTE_KEYS = ("top_k", "n_group", "topk_group", "renormalize", "routed_scaling_factor",
              "block_m", "out_dim")


def make_inputs(cfg: Preset, device, seed: int, M: int = 1, block_m: int = 1) -> dict:
    """hidden [M, H] bf16 (unit RMS), gate_weight [E, H] bf16 and correction_bias [E] fp32 from
    ``k3lab.weights.router_weights``, and the preset's routing parameters; ``out_dim`` is the
    stage-2 accumulation width (``cfg.moe_in``: the latent size, or hidden without latent MoE).
    """
    gen = make_generator(seed, device)
    hidden = hidden_states(cfg, M, gen)
    return {
        "hidden": hidden,
        **router_weights(cfg, gen),
        "top_k": cfg.top_k,
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "renormalize": cfg.renormalize,
        "routed_scaling_factor": cfg.routed_scaling,
        "block_m": block_m,
        "out_dim": cfg.moe_in,
    }


def route_kwargs(inputs: dict) -> dict:
    """The keyword arguments shared by the reference and the kernel."""
    return {k: inputs[k] for k in ROUTE_KEYS}


def _reference(inputs: dict) -> RoutePlan:
    return route_sort_reference(inputs["hidden"], inputs["gate_weight"],
                                inputs["correction_bias"], **route_kwargs(inputs))


def _fused(inputs: dict) -> RoutePlan:
    return route_sort(inputs["hidden"], inputs["gate_weight"], inputs["correction_bias"],
                      **route_kwargs(inputs), config=inputs.get("config"))


def check(out: RoutePlan, ref: RoutePlan, inputs: dict) -> dict:
    """Every RoutePlan field: integers and ``out`` exact, weights within WEIGHTS_ATOL/RTOL."""
    got, want = out.tensors(), ref.tensors()
    if set(got) != set(want):
        raise AssertionError(f"fields: {sorted(got)} != {sorted(want)}")
    if out.block_m != ref.block_m:
        raise AssertionError(f"block_m: {out.block_m} != {ref.block_m}")
    errs = {}
    for name, expected in want.items():
        actual = got[name]
        if actual.dtype != expected.dtype:
            raise AssertionError(f"{name}: dtype {actual.dtype} != {expected.dtype}")
        if name in EXACT_FIELDS:
            errs[name] = assert_close(name, actual, expected, atol=0.0)
        else:
            errs[name] = assert_close(name, actual, expected, atol=WEIGHTS_ATOL,
                                      rtol=WEIGHTS_RTOL)
    return errs


def bytes_moved(inputs: dict) -> int:
    """Gate weight + hidden + bias read, plus the plan written (ids, weights, sorted arrays,
    tile ids, count, the zeroed out buffer). At K3 B1 the gate weight is >99% of it."""
    m, e = inputs["hidden"].shape[0], inputs["gate_weight"].shape[0]
    top_k, block_m = inputs["top_k"], inputs["block_m"]
    cap = m * top_k + e * (block_m - 1)
    reads = inputs["gate_weight"].nbytes + inputs["hidden"].nbytes
    reads += inputs["correction_bias"].nbytes
    writes = 4 * (2 * m * top_k + 2 * cap + cap // block_m + 1)
    if inputs.get("out_dim"):
        writes += 4 * m * inputs["out_dim"]
    return int(reads + writes)


BOUNDARY = Boundary(
    name="route",
    title="Routing + MoE sort metadata (gate GEMV, sigmoid, bias, top-k, sort)",
    owns=("moe.gate_proj", "moe.route_select", "moe.sort"),
    make_inputs=make_inputs,
    variants=(
        Variant("reference", "reference", _reference,
                "op-by-op PyTorch: fp32 GEMV, sigmoid, bias, (grouped) stable top-k, gather, "
                "renormalize, then one-hot counts, cumsum and scatters for the sort metadata"),
        Variant("fused", "fused", _fused,
                "one Triton launch: split-K gate GEMV (+ padding fill); the last program to "
                "finish (an atomic counter) does the selection and the whole sort metadata"),
        Variant("torch.compile", "peer", compiled(_reference),
                "torch.compile of the reference", devices=("cuda",)),
    ),
    check=check,
    bytes_moved=bytes_moved,
    params={"M": 1, "block_m": 1},
)
