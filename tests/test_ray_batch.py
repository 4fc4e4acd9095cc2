"""k3lab run --ray: each notebook a Ray task on a local Ray cluster (CPU), its files sent back
to the output folder as a local run leaves them. Skipped without the ray extra."""

import json
import shutil
from pathlib import Path

import pytest

from k3lab import cli

pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")

FIXTURES = Path(__file__).parent / "notebooks"


def test_ray_batch_on_a_local_cluster(tmp_path, capsys):
    nbs = tmp_path / "nbs"
    nbs.mkdir()
    for name in ("10_other", "20_broken"):
        shutil.copy(FIXTURES / f"{name}.ipynb", nbs)
    out = tmp_path / "out"
    (out / "20_broken.html").parent.mkdir(parents=True)
    (out / "20_broken.html").write_text("last good")  # a failed run leaves it alone
    rc = cli.main(["run", "--notebooks", str(nbs), "--ray", "local", "-p", "label=ray",
                   "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 1 and "1 ok, 1 failed" in text
    m = json.loads((out / "10_other.metrics.json").read_text())
    assert m["status"] == "ok" and m["records"][0]["label"] == "ray"
    assert m["source"] == str(nbs / "10_other.ipynb")
    assert (out / "10_other.html").is_file() and (out / "10_other.ipynb").is_file()
    assert json.loads((out / "20_broken.failed.json").read_text())["error"].startswith(
        "ZeroDivisionError")
    assert (out / "20_broken.html").read_text() == "last good"
    assert "<b>10_other</b>" in (out / "index.html").read_text()
    assert not [p.name for p in out.iterdir() if p.name.startswith(".")]
