"""The report's answer per budget level: levels, pairwise verdicts inside a level, letters, and
speed marked shared when one batched step timed several settings."""

import json

import pytest

from harness import report
from harness.report import budgets
from tests.helpers.reports import ruler_run


@pytest.mark.parametrize("setting, held, label", [
    ("budget_ratio=0.2", 0.31, "budget_ratio 0.2"),
    ("window_tokens=508 budget_ratio=0.5", 0.53, "budget_ratio 0.5"),
    ("k_bits=2 v_bits=2", 0.17, "own defaults, KV held <= 0.25"),
    ("compression_ratio=5.0", 0.38, "own defaults, KV held 0.25-0.5"),
    ("", 0.57, "own defaults, KV held 0.5-1"),
    ("alpha=5.0", 1.47, "own defaults, KV held > 1"),
    ("", None, "own defaults, KV held unknown"),
])
def test_budget_level_is_the_ratio_else_the_band_of_kv_held(setting, held, label):
    assert budgets.level({"setting": setting, "kv_held": held})[1] == label


def test_speed_is_shared_only_when_a_step_decoded_several_settings():
    by_run = {"a": {"_metrics": {"run": {"sweep": {"decode_batch": 32}}}},
              "b": {"_metrics": {"run": {"sweep": {"decode_batch": 1}}}},
              "c": {"_metrics": {"run": {}}}}
    assert budgets.speed_shared({"cells": {"x": "a"}}, by_run) == 32
    assert budgets.speed_shared({"cells": {"x": "b"}}, by_run) is None
    assert budgets.speed_shared({"cells": {"x": "c"}}, by_run) is None


def test_report_answers_per_budget_with_letters(tmp_path):
    n = 40
    for method, budget, scores in (("full", None, [1] * n), ("h2o", 0.2, [0] * n),
                                   ("tova", 0.2, [1] * (n - 1) + [0]),
                                   ("snapkv", 0.2, [1] * (n - 2) + [0] * 2)):
        ruler_run(tmp_path / "runs", method, scores, budget=budget)
    _, out, _ = report.build_report([str(tmp_path / "runs")], tmp_path / "out", resamples=300)
    text = (out / "report.md").read_text()
    answer = text[text.index("## Which setting at this budget"):text.index("## Leaderboard")]
    assert "- full cache: 100" in answer
    line = next(x for x in answer.splitlines() if "budget_ratio 0.2" in x)
    assert "(3 settings, 2 of 3 pairs told apart): best tova budget_ratio=0.2 97.5" in line
    assert "cannot be told from it: snapkv budget_ratio=0.2 95" in line and "h2o" not in line
    board = (out / "leaderboard.md").read_text()
    assert board.index("Which setting at this budget") < board.index("## Leaderboard")
    csv_text = (out / "leaderboard.csv").read_text().splitlines()
    header = csv_text[0].split(",")
    letters = header.index("ruler average letters")
    tova = next(x for x in csv_text if ",tova," in x).split(",")
    assert tova[letters] == "a" and tova[header.index("level")] == "budget_ratio 0.2"


def test_a_shared_decode_step_is_marked_in_the_markdown_leaderboard(tmp_path):
    for method, budget in (("full", None), ("h2o", 0.2)):
        ruler_run(tmp_path / "runs", method, [1, 0] * 10, budget=budget)
    (folder,) = (tmp_path / "runs").glob("ruler/*/h2o/*")
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["run"]["sweep"] = {"settings": 2, "decode_batch": 2}
    (folder / "metrics.json").write_text(json.dumps(metrics))
    _, out, _ = report.build_report([str(tmp_path / "runs")], tmp_path / "out", resamples=300)
    rows = [x for x in (out / "leaderboard.md").read_text().splitlines() if x.startswith("| ")]
    h2o = next(x for x in rows if x.startswith("| h2o"))
    full = next(x for x in rows if x.startswith("| full"))
    assert " 11.11 shared |" in h2o and "shared" not in full


def test_letters_stay_with_their_settings_in_the_page(tmp_path):
    for method, budget, scores in (("h2o", 0.5, [0] * 30), ("tova", 0.5, [1] * 30)):
        ruler_run(tmp_path / "runs", method, scores, budget=budget)
    _, out, _ = report.build_report([str(tmp_path / "runs")], tmp_path / "out", resamples=300)
    page = (out / "report.html").read_text()
    tova = page.index('data-v="tova"')
    h2o = page.index('data-v="h2o"')
    assert tova < h2o  # best first inside the level
    assert page[page.rindex('class="letters text">', 0, tova):tova].count(">a<") == 1
    assert page[page.rindex('class="letters text">', 0, h2o):h2o].count(">b<") == 1
    assert json.dumps(str(tmp_path))[1:-1] not in page
