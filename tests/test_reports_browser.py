"""Reports as a reader sees them: index.html and every report it links, opened in headless
Chromium (Debian's ``chromium``; ``.ci/run`` installs it). A page fails on a console error, a
request that fails (a CDN the report should not need), a broken link or an image that does not
decode, or a stylesheet it links that is missing. A screenshot of each page is saved under the
test's temporary folder.

Pages checked: a fresh CPU batch of the fixture notebooks (the views fixture with a timeline,
its Perfetto trace, a widget and a summary card among them), and the committed reports
under ``executed/h200`` (H200) and ``executed/h100`` (H100) when present.
"""

import json
import shutil
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from k3lab import runner

REPO = Path(__file__).resolve().parents[1]
FIXTURES = Path(__file__).parent / "notebooks"
VIEWS = FIXTURES / "views" / "30_views.ipynb"
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")

pytestmark = [
    pytest.mark.skipif(CHROMIUM is None, reason="headless Chromium is not installed "
                       "(Debian package 'chromium'; .ci/run installs it)"),
]
sync_api = pytest.importorskip("playwright.sync_api",
                               reason="playwright is not installed (pip install -e '.[dev]')")


class _Links(HTMLParser):
    def __init__(self):
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag, attrs):
        href = dict(attrs).get("href")
        if tag in ("a", "link") and href:  # links, and the shared stylesheet of _assets/
            self.hrefs.append(href)


def _local_targets(page: Path) -> list[Path]:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    targets = []
    for href in parser.hrefs:
        url = urlparse(href)
        if url.scheme in ("http", "https", "mailto") or href.startswith("#"):
            continue
        targets.append((page.parent / unquote(url.path)).resolve())
    return targets


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        yield b
        b.close()


def _check_page(browser, page_path: Path, shots: Path) -> list[str]:
    problems: list[str] = []
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.on("console", lambda m: m.type == "error" and problems.append(f"console: {m.text}"))
    page.on("pageerror", lambda e: problems.append(f"page error: {e}"))
    page.on("requestfailed", lambda r: problems.append(f"request failed: {r.url}"))
    page.goto(page_path.as_uri(), wait_until="load")
    broken = page.evaluate(
        "[...document.images].filter(i => !i.complete || i.naturalWidth === 0)"
        ".map(i => (i.src || '').slice(0, 80))")
    problems += [f"broken image: {src}" for src in broken]
    problems += [f"broken link: {t}" for t in _local_targets(page_path) if not t.exists()]
    shots.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(shots / f"{page_path.stem}.png"), full_page=True)
    page.close()
    return problems


def _pages(index: Path) -> list[Path]:
    return [index] + sorted({t for t in _local_targets(index) if t.suffix == ".html"})


@pytest.fixture(scope="module")
def fresh_reports(tmp_path_factory):
    out = tmp_path_factory.mktemp("reports")
    runner.run(["00_echo", "10_other", str(VIEWS)], out_dir=out, notebook_dir=FIXTURES,
               progress=False)
    return out


def test_fresh_reports_open_cleanly(browser, fresh_reports, tmp_path):
    pages = _pages(fresh_reports / "index.html")
    assert len(pages) == 4  # the index and the three reports it links
    for page in pages:
        assert _check_page(browser, page, tmp_path / "shots") == [], page.name
    assert (tmp_path / "shots" / "index.png").stat().st_size > 0


COMMITTED = [REPO / "executed" / gpu / "index.html" for gpu in ("h200", "h100")]


@pytest.mark.parametrize("index", COMMITTED, ids=lambda p: p.parent.name)
def test_committed_reports_open_cleanly(browser, tmp_path, index):
    if not index.exists():
        pytest.skip(f"no committed reports ({index.parent.relative_to(REPO)})")
    pages = _pages(index)
    assert len(pages) > 1
    problems = {p.name: _check_page(browser, p, tmp_path / "shots") for p in pages}
    assert {k: v for k, v in problems.items() if v} == {}


def test_checker_catches_a_broken_page(browser, tmp_path):
    bad = tmp_path / "bad.html"
    bad.write_text('<html><head><link rel="stylesheet" href="_assets/gone.css"></head><body>'
                   '<a href="missing.html">x</a><img src="nope.png">'
                   "<script>console.error('boom')</script></body></html>")
    problems = _check_page(browser, bad, tmp_path / "shots")
    kinds = {p.split(":")[0] for p in problems}
    assert {"console", "broken image", "broken link"} <= kinds
    assert any(p.startswith("broken link") and p.endswith("gone.css") for p in problems)


def test_index_card_is_visible(browser, tmp_path):
    """The summary card of a report's metrics shows at the top of its index row, its verdicts
    coloured, and the folded headline opens on a click."""
    records = [{"boundary": "route", "variant": v, "role": r, "metric": m, "mode": mode,
                "value": x, "sweep": None}
               for v, r, m, mode, x in (("reference", "reference", "launches", "", 53.0),
                                        ("fused", "fused", "launches", "", 1.0),
                                        ("fused", "fused", "latency_us", "graph", 9.09),
                                        ("fused", "fused", "speedup_vs_reference", "graph",
                                         15.4))]
    (tmp_path / "10_route.metrics.json").write_text(json.dumps({
        "notebook": "10_route", "status": "ok", "seconds": 1.0, "records": records,
        "headline": {"bar met": False, "fused launches": 1},
        "manifest": {"device": "cuda", "gpu": "NVIDIA H200", "date": "2026-01-01"}}))
    index = runner.update_index(tmp_path)
    assert _check_page(browser, index, tmp_path / "shots") == []
    page = browser.new_page()
    page.goto(index.as_uri(), wait_until="load")
    card = page.locator(".k3lab-card").first
    assert card.is_visible() and "53 → 1" in card.inner_text() and "15.4x" in card.inner_text()
    bar = page.locator(".k3lab-bar").first
    assert "bar met: no" in bar.inner_text()
    assert page.evaluate("getComputedStyle(document.querySelector('.k3lab-bar')).color") \
        == "rgb(153, 0, 0)"
    assert not page.locator("table.head").first.is_visible()  # folded
    page.locator("details summary").first.click()
    assert page.locator("table.head").first.is_visible()
    page.close()


def _trace_targets(page, page_path: Path) -> list[Path]:
    hrefs = page.locator("a.k3lab-trace").evaluate_all(
        "as => as.map(a => a.getAttribute('href'))")
    return [(page_path.parent / unquote(urlparse(h).path)).resolve() for h in hrefs]


def test_report_card_traces_and_widget_stand_in(browser, fresh_reports):
    """The views report as a reader sees it: the summary card at the top (above every output
    of the notebook), the Perfetto trace links there and under the timeline resolving to trace
    files, the same link in the index, and the widget's static stand-in with its saved view."""
    path = fresh_reports / "30_views.html"
    page = browser.new_page(viewport={"width": 1200, "height": 900})
    page.goto(path.as_uri(), wait_until="load")

    card = page.locator(".k3lab-card").first
    assert card.is_visible() and "7 → 1" in card.inner_text() and "3.5x" in card.inner_text()
    assert "bar met: yes" in card.inner_text() and "not GPU figures" in card.inner_text()
    card_y = card.bounding_box()["y"]
    assert card_y < 400  # in the first screen
    first_output = page.locator(".jp-OutputArea-output").nth(1).bounding_box()["y"]
    assert card_y < first_output

    links = page.locator("a.k3lab-trace")
    assert links.count() >= 2 and all(links.nth(i).is_visible() for i in range(links.count()))
    targets = _trace_targets(page, path)
    assert {t.name for t in targets} == {"30_views.call.trace.json"}
    for t in targets:
        events = json.loads(t.read_text())["traceEvents"]
        assert any(e["ph"] == "X" and e["name"].startswith("aten::") for e in events)
    assert "wall clock" in page.locator(".k3lab-traces").first.inner_text()

    stand_in = page.locator(".k3lab-widget").first
    assert stand_in.is_visible() and "Interactive in JupyterLab" in stand_in.inner_text()
    slider = stand_in.locator("input[type=range]")
    assert slider.is_visible() and slider.is_disabled() and slider.input_value() == "2"
    assert "4" in stand_in.locator("table").first.inner_text()  # the saved view: token 2 squared
    page.close()

    index = browser.new_page()
    index.goto((fresh_reports / "index.html").as_uri(), wait_until="load")
    row = index.locator("tr", has=index.locator("b", has_text="30_views"))
    assert row.locator(".k3lab-card").is_visible()
    assert [t.name for t in _trace_targets(row, fresh_reports / "index.html")] == [
        "30_views.call.trace.json"]
    assert all(t.is_file() for t in _trace_targets(index, fresh_reports / "index.html"))
    index.close()
