"""report.html as a person sees it: opened in headless Chromium (Debian's `chromium`), it must
show its figures and leaderboard with no console error and no request leaving the file.

Skipped where chromium is absent, unless KVH_REQUIRE_BROWSER=1 (CI: .ci/run installs chromium
and sets it, so CI fails instead of skipping)."""

import io
import os

import pytest

from harness import report
from tests.harness import browser
from tests.helpers.reports import fake_run


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
  return Array.from(t.tBodies[0].rows).map(function(r){
    return +r.cells[col].getAttribute('data-v');});
})()"""


def test_report_html_renders_in_chromium(tmp_path):
    need_chromium()
    for method, budgets in (("full", [None]), ("h2o", [0.5, 0.2]), ("tova", [0.2, 0.5])):
        for budget in budgets:
            fake_run(tmp_path / "runs", method, 50.0 / (budget or 1.0) ** 0.1, 100.0,
                     budget=budget, density=budget or 1.0)
    _, out, made = report.build_report([str(tmp_path / "runs")], tmp_path / "out")
    seen = browser.inspect(out / "report.html", scripts={"sorted_kv_held": SORT_JS})
    (tmp_path / "screenshot.png").write_bytes(seen["screenshot_png"])
    assert seen["errors"] == [] and seen["requests"] == []
    assert seen["ready"] == "1", "the page's script did not run to its end"
    assert len(seen["images"]) == len(made) >= 4
    assert all(i["complete"] and i["width"] > 100 for i in seen["images"]), seen["images"]
    assert seen["boardRows"] == 5 and seen["text"] > 500
    assert ink_fraction(seen["screenshot_png"]) > 0.02, "the screenshot is blank"
    assert seen["scripts"]["sorted_kv_held"] == sorted(seen["scripts"]["sorted_kv_held"])


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
