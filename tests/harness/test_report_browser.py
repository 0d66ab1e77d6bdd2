"""report.html as a person sees it: opened in headless Chromium (Debian's `chromium`), it must
show its figures and leaderboard with no console error and no request leaving the file.

Skipped where chromium is absent, unless KVH_REQUIRE_BROWSER=1 (CI: .ci/run installs chromium
and sets it, so CI fails instead of skipping)."""

import io
import json
import os

import pytest

from harness import report
from tests.harness import browser
from tests.helpers.reports import fake_run, ruler_run


def need_chromium() -> None:
    if browser.find_chromium() is None:
        if os.environ.get("KVH_REQUIRE_BROWSER") == "1":
            pytest.fail("KVH_REQUIRE_BROWSER=1 but chromium is not installed "
                        "(apt-get install chromium)", pytrace=False)
        pytest.skip("chromium is not installed (apt-get install chromium); "
                    "KVH_REQUIRE_BROWSER=1 makes this a failure")


def ink_fraction(png: bytes) -> float:
    """Share of the screenshot's pixels that differ from its most common (background) colour."""
    from PIL import Image

    colours = Image.open(io.BytesIO(png)).convert("RGB").getcolors(maxcolors=1 << 24)
    return 1 - max(colours)[0] / sum(n for n, _ in colours)


SORT_JS = """(function(){var t=document.querySelector('table.board');
  var th=Array.from(t.tHead.rows[0].cells).find(function(c){
    return c.textContent.indexOf('kv_held')==0;});
  var col=th.cellIndex; th.click();
  return Array.from(t.tBodies).map(function(b){
    return Array.from(b.rows).filter(function(r){return !r.classList.contains('level');})
      .map(function(r){return +r.cells[col].getAttribute('data-v');});});
})()"""
# What a reader of the leaderboard sees: the level headings, each row's letters, method, height
# in pixels and the decode cell, and the page's whole HTML (to look for absolute paths).
LAYOUT_JS = """JSON.stringify({
  levels: Array.from(document.querySelectorAll('table.board tr.level')).map(function(r){
    return r.textContent;}),
  rows: Array.from(document.querySelectorAll('table.board tr.setting')).map(function(r){
    return {letters: r.cells[0].textContent, method: r.cells[1].textContent,
            tip: r.cells[1].title, height: r.getBoundingClientRect().height,
            decode: r.cells[9].textContent};}),
  line: parseFloat(getComputedStyle(document.querySelector('table.board td')).lineHeight),
  answer: document.querySelector('div.answer').textContent,
  answerRows: Array.from(document.querySelectorAll('table.answer tbody tr')).map(function(r){
    return Array.from(r.cells).map(function(c){return c.innerText.replace(/\\s+/g, ' ');});}),
  html: document.documentElement.outerHTML
})"""
LONG = ("an operating point long enough to wrap any table cell it sat in: model family, "
        "budget, benchmark, prefill protocol, kernels and the paper's own caveats, at length")


def family_tree(root):
    """Full, two budget levels of two methods and one method at its defaults, RULER scores on
    the same 60 samples (pass/fail): h2o at 0.2 fails every sample (told apart from everything),
    the others differ by a few. Speeds of one sweep that decoded 4 settings together."""
    n = 60
    plan = {("full", None): [1] * n, ("h2o", 0.5): [1] * (n - 2) + [0] * 2,
            ("tova", 0.5): [1] * (n - 3) + [0] * 3, ("h2o", 0.2): [0] * n,
            ("tova", 0.2): [1] * (n - 4) + [0] * 4, ("streaming_llm", None): [1] * 30 + [0] * 30}
    for (method, budget), scores in plan.items():
        ruler_run(root, method, scores, budget=budget)
        (folder,) = root.glob(f"ruler/*/{method}/{method}-{budget}-*")
        metrics = json.loads((folder / "metrics.json").read_text())
        metrics["method"]["operating_point"] = LONG
        metrics["method"]["provenance"] = "official code"
        metrics["run"]["sweep"] = {"settings": 6, "decode_batch": 4}
        if method == "streaming_llm":
            metrics["kv"]["held_ratio"] = 0.3
        (folder / "metrics.json").write_text(json.dumps(metrics))


def test_report_html_renders_in_chromium(tmp_path):
    need_chromium()
    family_tree(tmp_path / "runs")
    fake_run(tmp_path / "more", "h2o", 10.0, 100.0, budget=0.2)  # a second folder's runs
    _, out, made = report.build_report([str(tmp_path / "runs"), str(tmp_path / "more")],
                                       tmp_path / "out", resamples=500)
    seen = browser.inspect(out / "report.html", scripts={"sorted_kv_held": SORT_JS,
                                                         "layout": LAYOUT_JS})
    (tmp_path / "screenshot.png").write_bytes(seen["screenshot_png"])
    assert seen["errors"] == [] and seen["requests"] == []
    assert seen["ready"] == "1", "the page's script did not run to its end"
    assert len(seen["images"]) == len(made) >= 3
    assert all(i["complete"] and i["width"] > 100 for i in seen["images"]), seen["images"]
    assert seen["boardRows"] == 7 and seen["text"] > 500
    assert ink_fraction(seen["screenshot_png"]) > 0.02, "the screenshot is blank"
    for column in seen["scripts"]["sorted_kv_held"]:
        assert column == sorted(column)
    layout = json.loads(seen["scripts"]["layout"])
    levels = [t.split(" ·")[0] for t in layout["levels"]]
    assert levels[0] == "budget_ratio 0.2"  # the second folder's perplexity table: no full cache
    levels = levels[levels.index("full cache (reference)"):]  # the RULER table
    assert levels == ["full cache (reference)", "budget_ratio 0.2", "budget_ratio 0.5",
                          "own defaults, KV held 0.25-0.5"]
    ruler = [r for r in layout["rows"] if r["method"] != "full"][1:]
    # budget 0.2: tova (56/60) before h2o (0/60), told apart; budget 0.5: h2o and tova are not
    assert [(r["method"], r["letters"]) for r in ruler] == [
        ("tova", "a"), ("h2o", "b"), ("h2o", "a"), ("tova", "a"), ("streaming_llm", "a")]
    assert all(r["height"] < 1.8 * layout["line"] for r in layout["rows"]), layout["rows"]
    assert all(LONG in r["tip"] for r in ruler)  # the operating point: in the tooltip only
    assert LONG not in layout["answer"] and "shared" in ruler[0]["decode"]
    rows = layout["answerRows"][-4:]  # the RULER column: full, 0.2, 0.5, the defaults band
    assert rows[0][0] == "full cache" and rows[0][1].startswith("100 ")
    assert rows[1][0].startswith("budget_ratio 0.2 2 settings, 1 of 1 pairs told apart")
    assert rows[1][1].startswith("tova budget_ratio=0.2 93.33")
    assert rows[1][2] == "every other setting is told apart from it"
    assert rows[2][1].startswith("h2o budget_ratio=0.5 96.67")
    assert rows[2][2].startswith("tova budget_ratio=0.5 95 (KV held 0.5 ·")
    assert rows[3][2] == "the only setting at this level"
    assert str(tmp_path) not in layout["html"] and "/tmp" not in layout["html"]
    assert "runs more" in layout["html"] or "more/" in layout["html"]


def test_the_check_catches_a_broken_page(tmp_path):
    """The checker itself: a figure that does not decode, a console error, an exception, a
    request to the network, a page whose script never finished and a blank screen are each
    reported."""
    need_chromium()
    page = tmp_path / "broken.html"
    page.write_text("<!DOCTYPE html><html><head><style>img{visibility:hidden}</style></head><body>"
                    '<img alt="bad" src="data:image/png;base64,iVBORw0KGgoAAAAN">'
                    '<img alt="net" src="http://127.0.0.1:9/figure.png">'
                    "<script>console.error('planted'); undefined_function();</script>"
                    "</body></html>")
    seen = browser.inspect(page, settle_s=0.5)
    assert any("planted" in e for e in seen["errors"])
    assert any("undefined_function" in e for e in seen["errors"])
    assert seen["requests"] == ["http://127.0.0.1:9/figure.png"]
    assert seen["ready"] is None
    assert [i["width"] for i in seen["images"]] == [0, 0]
    assert ink_fraction(seen["screenshot_png"]) == 0  # nothing shown: a blank page
