"""The profiler on CPU: logical launch counts, timing, cold copies, timeline, measure()."""

import dataclasses
import math
import time
import warnings

import pandas as pd
import pytest
import torch
import triton
import triton.language as tl

from k3lab import profile
from k3lab.boundaries import Boundary, Variant, assert_close
from k3lab.config import preset


@triton.jit
def _double_kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(y_ptr + o, tl.load(x_ptr + o, mask=m) * 2, mask=m)


def fused_double(inputs):
    x = inputs["x"]
    y = torch.empty_like(x)
    _double_kernel[(triton.cdiv(x.numel(), 64),)](x, y, x.numel(), BLOCK=64)
    return y


def reference_double(inputs):
    x = inputs["x"].float()
    return (x.view(-1) + x.view(-1)).reshape(x.shape).to(inputs["x"].dtype)


def wrong_double(inputs):
    return inputs["x"] * 3


def _boundary():
    return Boundary(
        name="toy", title="toy", owns=("toy.op",),
        make_inputs=lambda cfg, device, seed, M=1: {
            "x": torch.randn(M, 100, generator=torch.Generator().manual_seed(seed)).to(device)},
        variants=(Variant("reference", "reference", reference_double),
                  Variant("fused", "fused", fused_double),
                  Variant("wrong", "fused", wrong_double),
                  Variant("gpu-peer", "peer", reference_double, devices=("cuda",))),
        check=lambda out, ref, inputs: {"y": assert_close("y", out, ref, atol=1e-6)},
        bytes_moved=lambda inputs: 2 * inputs["x"].nbytes,
    )


@pytest.mark.interpreter
def test_cpu_launches_count_triton_launches_and_aten_ops_not_views():
    x = {"x": torch.randn(3, 100)}
    fused = profile.count_launches(fused_double, x)
    assert fused.count == 1 and fused.kernels == ["triton::_double_kernel"]
    assert fused.kind.startswith("logical launches")
    ref = profile.count_launches(reference_double, x)
    # .float() on fp32 and the views launch nothing: add, then the copy back is a no-op too
    assert ref.kernels == ["aten::add"]


def test_time_variant_on_cpu_rotates_inputs_and_reports_spread():
    seen = []
    copies = [{"x": torch.full((4,), float(i))} for i in range(3)]
    t = profile.time_variant(lambda inp: seen.append(float(inp["x"][0])), copies, repeats=6,
                             warmup=0)
    assert t.mode == "eager" and t.repeats == 6 and t.copies == 3 and t.cold
    assert t.p10_us <= t.median_us <= t.p90_us
    assert seen[-6:] == [0.0, 1.0, 2.0, 0.0, 1.0, 2.0]


def test_graph_mode_needs_cuda():
    with pytest.raises(ValueError, match="mode"):
        profile.time_variant(reference_double, [{"x": torch.ones(2)}], mode="graph")
    with pytest.raises(ValueError, match="mode: expected"):
        profile.time_variant(reference_double, [{"x": torch.ones(2)}], mode="hot")


def test_cold_copies_cover_the_requested_bytes():
    made = []
    copies = profile.cold_copies(lambda s: made.append(s) or {"x": torch.zeros(256)},
                                 min_bytes=4096)
    assert len(copies) == 4 and made == [0, 1, 2, 3]  # 1 KiB a copy
    assert len(profile.cold_copies(lambda s: {"x": torch.zeros(256)}, device="cpu")) == 1


def test_timeline_lists_launches_in_order():
    df = profile.timeline(reference_double, {"x": torch.randn(2, 100)})
    assert list(df.columns) == ["kernel", "start_us", "end_us", "stream", "dur_us"]
    assert df["kernel"].tolist() == ["aten::add"]
    assert (df["dur_us"] >= 0).all() and df["start_us"].iloc[0] == 0


@pytest.mark.interpreter
def test_measure_checks_before_timing_and_reports_ratios():
    df = profile.measure(_boundary(), preset("tiny"), "cpu", params={"M": 2}, repeats=3)
    by = df.set_index(["variant", "metric"])
    assert by.loc[("fused", "check"), "value"] == 1
    assert by.loc[("fused", "launches"), "value"] == 1
    assert by.loc[("reference", "launches"), "value"] == 1
    # the wrong variant fails its check and is never timed
    assert by.loc[("wrong", "check"), "value"] == 0
    assert "max abs error" in by.loc[("wrong", "check"), "note"]
    assert not ((df.variant == "wrong") & (df.metric == "latency_us")).any()
    # a CUDA-only peer is reported unavailable on CPU, with the reason
    assert by.loc[("gpu-peer", "available"), "value"] == 0
    lat = df[(df.metric == "latency_us")]
    assert set(lat["mode"]) == {"eager"} and (lat["value"] > 0).all()
    assert set(df["M"]) == {2} and set(df["preset"]) == {"tiny"}
    sp = df[(df.metric == "speedup_vs_reference") & (df.variant == "reference")]
    assert float(sp["value"].iloc[0]) == 1.0


@pytest.mark.parametrize("repeats,calls", [(None, 2), (3, 5)])
def test_measure_on_cpu_times_the_launch_count_s_call(repeats, calls):
    """On the CPU one call is the timing: the check's call and the launch count's (which is
    timed) are all a variant costs; asked for more repeats, they are timed apart."""
    seen = []

    def counted(inputs):
        seen.append(1)
        return reference_double(inputs)

    b = _boundary()
    b = dataclasses.replace(b, variants=(b.variants[0], Variant("fused", "fused", counted)))
    df = profile.measure(b, preset("tiny"), "cpu", variants=["fused"], repeats=repeats)
    assert len(seen) == calls
    lat = df[(df.metric == "latency_us") & (df.variant == "fused")]
    assert len(lat) == 1 and float(lat["value"].iloc[0]) > 0
    assert lat["note"].iloc[0] == f"cold x1, {1 if repeats is None else 3} repeats"


@pytest.mark.gpu
def test_cuda_graph_timing_and_kernel_count():
    torch.use_deterministic_algorithms(False)  # no NaN fill kernel behind torch.empty_like
    x = {"x": torch.randn(1 << 20, device="cuda")}
    assert profile.count_launches(fused_double, x).count == 1
    t = profile.time_variant(fused_double, [x], mode="graph", repeats=10)
    assert t.mode == "graph" and 0 < t.median_us < 1000
    assert profile.copy_bandwidth("cuda") > 1e11


@pytest.mark.parametrize("call_us,n,want", [(30.0, 2, 16), (30.0, 1, 32), (30.0, 40, 1),
                                             (199.0, 3, 11), (200.0, 2, 1), (4700.0, 1, 1)])
def test_graph_passes_follow_the_gpu_time_a_call(call_us, n, want):
    """Passes over n copies in a timing graph: MIN_GRAPH_CALLS calls, unless a call's replay
    time already reaches AMORTIZED_CALL_US."""
    assert profile.MIN_GRAPH_CALLS == 32 and profile.AMORTIZED_CALL_US == 200.0
    assert profile.graph_passes(call_us, n) == want


class _FakeGPU:
    """Stand-in for the torch.cuda calls of time_variant's graph path, on CPU: a GPU clock that
    an eager call advances by its kernels' ``call_us`` or, when the host launches slower, by the
    host's ``host_us``; graphs that count the calls made while they capture and replay them at
    ``call_us`` each (plus ``replay_us`` a replay); events that read the clock."""

    def __init__(self, call_us: float, host_us: float, replay_us: float = 10.0,
                 wall: bool = False):
        self.call_us, self.host_us, self.replay_us = call_us, host_us, replay_us
        self.wall = wall  # replays also take their time on the wall clock
        self.now, self.capturing, self.graphs = 0.0, None, []

    def launch(self):
        if self.capturing is not None:
            self.capturing.calls += 1
        else:
            self.now += max(self.call_us, self.host_us)

    def install(self, monkeypatch):
        import contextlib
        import types

        gpu = self

        class Graph:
            def __init__(self):
                self.calls = 0
                gpu.graphs.append(self)

            def replay(self):
                us = gpu.replay_us + self.calls * gpu.call_us
                gpu.now += us
                if gpu.wall:
                    time.sleep(us * 1e-6)

        class Event:
            def __init__(self, **_):
                self.t = None

            def record(self):
                self.t = gpu.now

            def elapsed_time(self, other):
                return (other.t - self.t) / 1e3

        @contextlib.contextmanager
        def capture(graph):
            gpu.capturing = graph
            yield
            gpu.capturing = None

        stream = types.SimpleNamespace(wait_stream=lambda other: None)
        for name, value in {"Stream": lambda device=None: stream,
                            "current_stream": lambda device=None: stream,
                            "stream": lambda s: contextlib.nullcontext(),
                            "synchronize": lambda device=None: None, "CUDAGraph": Graph,
                            "graph": capture, "Event": Event}.items():
            monkeypatch.setattr(torch.cuda, name, value)
        monkeypatch.setattr(profile, "_device_of", lambda inputs: torch.device("cuda"))
        monkeypatch.setitem(profile.WARMUP_SECONDS, "cuda", 0.0)


@pytest.mark.parametrize("call_us,calls", [(30.0, 32), (300.0, 2)])
def test_graph_path_sizes_its_graph_by_the_gpu_time(call_us, calls, monkeypatch):
    """time_variant's graph path on a stand-in GPU, with a host that takes 1 ms to launch each
    call: a 30 us call gets a 32-call graph (a one-pass graph first, to time it), a 300 us call
    keeps the one-pass graph; the figure is a replay over its calls."""
    import time as _time

    gpu = _FakeGPU(call_us, host_us=1000.0)
    gpu.install(monkeypatch)

    def fn(inputs):
        _time.sleep(gpu.host_us * 1e-6)
        gpu.launch()

    t = profile.time_variant(fn, [{}, {}], mode="graph", repeats=10)
    assert t.note == f"{calls} calls per graph replay"
    assert [g.calls for g in gpu.graphs] == ([2, 32] if calls == 32 else [2])
    assert t.median_us == pytest.approx(call_us + gpu.replay_us / calls)


@pytest.mark.parametrize("per_s,repeats,want", [(1e-5, 50, 50), (0.01, 50, 25), (0.1, 50, 5),
                                                 (10.0, 50, 5), (10.0, 3, 3), (0.0, 7, 7)])
def test_budget_samples(per_s, repeats, want):
    """Samples within TIME_BUDGET_S: all ``repeats`` for a fast call, never below MIN_SAMPLES."""
    assert profile.TIME_BUDGET_S == 0.25 and profile.MIN_SAMPLES == 5
    assert profile.budget_samples(per_s, repeats) == want


def test_slow_graph_gets_fewer_replays(monkeypatch):
    """A replay that takes longer than the budget allows gets MIN_SAMPLES replays, a fast one
    ``repeats // 2``; the Timing says how many. The fast case's budget is wide, so that a busy
    host's wall-clock replays cannot cut its samples."""
    for call_us, budget_s, want in ((5000.0, 0.02, profile.MIN_SAMPLES), (10.0, 10.0, 20)):
        monkeypatch.setattr(profile, "TIME_BUDGET_S", budget_s)
        gpu = _FakeGPU(call_us, host_us=0.0, wall=True)
        gpu.install(monkeypatch)
        t = profile.time_variant(lambda inputs, g=gpu: g.launch(), [{}], mode="graph",
                                 repeats=40, min_calls=1)
        assert t.repeats == want, (call_us, t)


@pytest.mark.gpu
def test_graph_timing_ignores_slow_host_launches():
    """A call whose launch costs the host more than AMORTIZED_CALL_US but the GPU a few us
    still gets MIN_GRAPH_CALLS calls a replay (session 12: the eager pass's time chose one
    pass, 2 calls, for MoE stage 2)."""
    import time as _time

    torch.use_deterministic_algorithms(False)
    x = {"x": torch.randn(1 << 16, device="cuda")}

    def slow_host(i):
        _time.sleep(3 * profile.AMORTIZED_CALL_US * 1e-6)
        return fused_double(i)

    t = profile.time_variant(slow_host, [x, x], mode="graph", repeats=10)
    assert t.note == f"{profile.MIN_GRAPH_CALLS} calls per graph replay", t.note
    assert t.median_us < profile.AMORTIZED_CALL_US


def test_warm_up_lasts_its_time(monkeypatch):
    """Warm-up runs its batch at least once, and repeats it until WARMUP_SECONDS have passed."""
    import time as _time

    calls = []
    monkeypatch.setattr(profile, "_LAST_BUSY", {})
    monkeypatch.setitem(profile.WARMUP_SECONDS, "cpu", 0.0)
    profile._warm(lambda: calls.append(1), torch.device("cpu"))
    assert len(calls) == 1
    monkeypatch.setitem(profile.WARMUP_SECONDS, "cpu", 0.05)
    profile._LAST_BUSY.clear()
    t0 = _time.perf_counter()
    profile._warm(lambda: (calls.append(1), _time.sleep(0.01)), torch.device("cpu"))
    assert _time.perf_counter() - t0 >= 0.05 and len(calls) >= 1 + 5


def test_warm_up_back_to_back_is_short_and_after_a_pause_whole(monkeypatch):
    """Within HOT_GAP_S of the device's last work the warm-up lasts HOT_WARMUP_SECONDS; after a
    longer pause (or first in the process) WARMUP_SECONDS."""
    import time as _time

    dev = torch.device("cpu")
    monkeypatch.setattr(profile, "_LAST_BUSY", {})
    monkeypatch.setitem(profile.WARMUP_SECONDS, "cpu", 0.2)
    monkeypatch.setitem(profile.HOT_WARMUP_SECONDS, "cpu", 0.02)
    monkeypatch.setattr(profile, "HOT_GAP_S", 0.1)

    def timed() -> float:
        t0 = _time.perf_counter()
        profile._warm(lambda: _time.sleep(0.005), dev)
        return _time.perf_counter() - t0

    assert timed() >= 0.2  # first in the process
    hot = timed()
    assert 0.02 <= hot < 0.2
    profile._done(dev)
    assert timed() < 0.2  # right after a timing
    _time.sleep(0.15)
    assert timed() >= 0.2  # after a pause longer than HOT_GAP_S


# ---------------------------------------------------------------- helpers over measure()'s rows

def test_value_picks_variant_metric_and_mode():
    rows = pd.DataFrame([
        {"variant": "fused", "metric": "launches", "mode": "", "value": 1},
        {"variant": "fused", "metric": "latency_us", "mode": "eager", "value": 5.0},
        {"variant": "fused", "metric": "latency_us", "mode": "graph", "value": 2.0},
        {"variant": "reference", "metric": "launches", "mode": None, "value": 9},
    ])
    assert profile.value(rows, "fused", "latency_us", "graph") == 2.0
    assert profile.value(rows, "fused", "launches") == 1.0
    assert profile.value(rows, "reference", "launches") == 9.0  # a missing mode reads as ""
    assert math.isnan(profile.value(rows, "fused", "latency_us"))
    assert math.isnan(profile.value(rows, "peer", "launches"))


@pytest.mark.interpreter
def test_launch_lists_and_timelines_per_variant():
    b, x = _boundary(), {"x": torch.randn(2, 100)}
    lists = profile.launch_lists(b, x, "cpu", ["reference", "fused"])
    assert lists.to_dict(orient="list") == {"reference": ["aten::add"],
                                            "fused": ["triton::_double_kernel"]}
    assert "gpu-peer" not in profile.launch_lists(b, x, "cpu")  # available variants only
    tls = profile.variant_timelines(b, x, "cpu", ["reference", "fused"])
    assert list(tls) == ["reference", "fused"]
    assert tls["fused"]["kernel"].tolist() == ["triton::_double_kernel"]
    assert set(tls["fused"]["stream"]) == {"fused"}


def test_graph_launch_is_nan_on_cpu():
    assert math.isnan(profile.graph_launch_us("cpu"))


def test_quiet_warnings_silence_only_their_notices():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        profile.quiet_warnings()
        warnings.warn("Warning: Profiler clears events at the end of each cycle. Only ...",
                      UserWarning, stacklevel=1)
        warnings.warn("TensorFloat32 tensor cores for float32 matrix multiplication available "
                      "but not enabled.", UserWarning, stacklevel=1)
        warnings.warn("\nOnline softmax is disabled on the fly since Inductor decides to",
                      UserWarning, stacklevel=1)
        warnings.warn("a warning worth reading", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["a warning worth reading"]


@pytest.mark.parametrize("name, short", [
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>, "
     "std::array<char*, 1ul> >(int, at::native::FillFunctor<float>, std::array<char*, 1ul>)",
     "vectorized_elementwise_kernel<4, FillFunctor<float>, array<char*, 1ul> >"),
    ("std::enable_if<!(false), void>::type internal::gpu_kernel_impl_nocast<"
     "at::native::MulFunctor<float> >(at::TensorIteratorBase&, at::native::MulFunctor<float> "
     "const&)", "internal::gpu_kernel_impl_nocast<MulFunctor<float> >"),
    ("std::enable_if<!true, void>::type at::native::(anonymous namespace)::"
     "elementwise_kernel<128, 4>(int, Foo)", "elementwise_kernel<128, 4>"),
    ("void f(int)", "f"), ("triton_poi_fused_add_0", "triton_poi_fused_add_0"),
    ("Memcpy DtoD (Device -> Device)", "Memcpy DtoD (Device -> Device)"),
    ("nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT", "nvjet_tst_64x8_64x16_4x1_v_bz_splitK_TNT"),
], ids=["vectorized", "enable_if-paren", "enable_if-anon", "void", "triton", "memcpy", "nvjet"])
def test_short_kernel_name_drops_return_types_and_arguments(name, short):
    assert profile.short_kernel_name(name) == short


# ---------------------------------------------------------------- the torch.compile peers

def test_compiled_peer_recompiles_past_dynamos_default_limit_or_fails(monkeypatch):
    """A peer meeting more input signatures than Dynamo's default limit (8) compiles each one
    (no silent eager fallback under the torch.compile label); past the peers' own limit it
    fails instead of falling back."""
    import torch._dynamo
    import torch._dynamo.config as dynamo

    from k3lab import boundaries

    for name in ("recompile_limit", "accumulated_recompile_limit",
                 "fail_on_recompile_limit_hit"):
        monkeypatch.setattr(dynamo, name, getattr(dynamo, name))
    torch._dynamo.reset()
    frames = []

    def count(gm, example_inputs):
        frames.append(1)
        return gm.forward

    peer = boundaries.compiled(lambda inputs: inputs["x"] * 2 + 1, backend=count, dynamic=False)
    for n in range(1, 13):
        x = torch.arange(n, dtype=torch.float32)
        assert torch.equal(peer({"x": x}), x * 2 + 1)
    assert len(frames) == 12 and dynamo.recompile_limit >= boundaries.PEER_RECOMPILE_LIMIT
    torch._dynamo.reset()
    monkeypatch.setattr(boundaries, "PEER_RECOMPILE_LIMIT", 2)
    monkeypatch.setattr(dynamo, "recompile_limit", 1)
    small = boundaries.compiled(lambda inputs: inputs["x"] - 1, backend=count, dynamic=False)
    small({"x": torch.zeros(1)})
    small({"x": torch.zeros(2)})
    with pytest.raises(Exception, match="(?i)recompil"):
        small({"x": torch.zeros(3)})
    torch._dynamo.reset()
