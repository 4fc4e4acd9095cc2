"""The memory estimate ``k3lab run`` checks before anything runs: per notebook at the preset and
tp, against the RAM (CPU) or each GPU's free memory, refused with exit 2 and one line unless
``--force``. The device's free memory is faked: the tests must not depend on the machine."""

import pytest

from k3lab import cli, kernelenv, memory
from k3lab.config import preset

NOTEBOOKS = ["00_overview", "10_route", "20_moe", "30_dense", "40_kda", "50_mla",
             "60_attn_res", "90_decode_step"]
GB = memory.GB


@pytest.mark.parametrize("name", NOTEBOOKS)
def test_tiny_fits_a_small_machine(name):
    e = memory.estimate(name, preset("tiny"), "cpu", {})
    assert e is not None and e.bytes < 2 * GB


def test_unknown_notebooks_are_not_estimated():
    assert memory.estimate("00_echo", preset("tiny"), "cpu", {}) is None


def test_k3_sizes_follow_the_weights():
    k3, k3_8 = preset("kimi-k3"), preset("kimi-k3", 8)
    # 896 experts x (2 x 3072 x 3584 + 3584 x 3072) bf16: the 59 GB of the notebooks' notes
    assert 59 * GB < memory.moe_set(k3, "bf16") < 60 * GB
    assert memory.moe_set(k3, "mxfp4") < 0.6 * memory.moe_set(k3, "bf16")
    assert memory.moe_set(k3_8, "bf16") < memory.moe_set(k3, "bf16") / 7
    overview = memory.estimate("00_overview", k3, "cpu", {"expert_format": "bf16"})
    assert overview.bytes > 100 * GB and "MoE" in overview.what
    assert memory.estimate("00_overview", k3_8, "cpu", {}).bytes < overview.bytes / 5
    # 20_moe's default tp sweep holds the tp 1 bf16 experts whatever the comparison's tp
    moe = memory.estimate("20_moe", k3_8, "cuda", {})
    assert moe.bytes > 59 * GB and "tp 1, bf16" in moe.what
    assert memory.estimate("20_moe", k3_8, "cuda", {"sweep_tp": [8]}).bytes < 30 * GB


@pytest.mark.parametrize("name", ["00_overview", "20_moe", "90_decode_step"])
def test_the_committed_h200_runs_fit_an_h200(name):
    """The reference reports ran at kimi-k3 tp 8 on one H200 (about 149 GB free)."""
    params = {"window": 12, "context": 8192} if name == "90_decode_step" else {}
    e = memory.estimate(name, preset("kimi-k3", 8), "cuda", params)
    assert memory.check([e], "cuda", free=([149 * GB], "free")) is None


def test_check_says_needed_and_available_on_one_line():
    e = memory.estimate("00_overview", preset("kimi-k3"), "cpu", {"expert_format": "bf16"})
    line = memory.check([e], "cpu", free=([16 * GB], "RAM available"))
    assert line.startswith("memory: 00_overview at kimi-k3 tp 1 needs about ")
    assert "16.0 GB RAM available" in line and "--force" in line and "\n" not in line
    assert memory.check([e], "cpu", free=([1000 * GB], "RAM available")) is None
    assert memory.check([e], "cpu", free=([], "RAM available")) is None  # cannot tell


def test_cpu_jobs_share_the_ram_and_gpus_do_not():
    cfg = preset("kimi-linear")
    es = [memory.estimate(n, cfg, "cpu", {}) for n in ("00_overview", "20_moe")]
    one = max(e.bytes for e in es)
    room = ([one * 1.2], "RAM available")
    assert memory.check(es, "cpu", jobs=1, free=room) is None
    assert "run at once (--jobs 2)" in memory.check(es, "cpu", jobs=2, free=room)
    gpus = [memory.estimate(n, cfg, "cuda", {}) for n in ("00_overview", "20_moe")]
    big = max(e.bytes for e in gpus) * 1.2
    assert memory.check(gpus, "cuda", jobs=2, free=([big, big], "free")) is None
    assert "00_overview" in memory.check(gpus, "cuda", jobs=2, free=([big, 1 * GB], "free"))


def test_cpu_available_is_a_positive_number():
    (free,), where = memory.available("cpu")
    assert free > 0 and "RAM" in where


@pytest.fixture
def small_machine(monkeypatch):
    monkeypatch.setattr(memory, "_cpu_available", lambda: 16 * GB)
    # past the memory check, stop before a kernel starts
    monkeypatch.setattr(kernelenv, "check_kernel",
                        lambda: (_ for _ in ()).throw(RuntimeError("past the memory check")))


def test_overview_at_k3_on_a_cpu_is_refused_early(small_machine, tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["run", "00_overview", "--preset", "kimi-k3", "--out", str(out)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("k3lab: error: memory: 00_overview at kimi-k3 tp 1 needs about")
    assert "16.0 GB RAM available" in err and "\n" not in err and not out.exists()


def test_force_skips_the_memory_check(small_machine, tmp_path, capsys):
    args = ["run", "00_overview", "--preset", "kimi-k3", "--out", str(tmp_path / "o")]
    assert cli.main([*args, "--force"]) == 2
    assert "past the memory check" in capsys.readouterr().err


def test_tiny_passes_the_memory_check(small_machine, tmp_path, capsys):
    assert cli.main(["run", "--out", str(tmp_path / "o")]) == 2
    assert "past the memory check" in capsys.readouterr().err
