"""A task option added after runs were made, recorded at its neutral value (the value the earlier
runs computed with, harness.config.config_check.NEUTRAL), does not split the report: a run recording
it and a run made before it are one column, paired; any other value is its own column."""

import json

from harness import report
from tests.helpers.reports import ruler_run


def with_option(folder, **options):
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["task"]["options"].update(options)
    (folder / "metrics.json").write_text(json.dumps(metrics))


def columns(tmp_path, skip_samples):
    runs = tmp_path / str(skip_samples)
    ruler_run(runs, "full", [1.0] * 40)  # made before the option existed: no key
    with_option(ruler_run(runs, "h2o", [0.0] * 10 + [1.0] * 30, budget=0.2,
                          started="2026-11-29T12:00:00"), skip_samples=skip_samples)
    _, out, _ = report.build_report([str(runs)], runs / "out", resamples=200)
    rows = (out / "comparisons.csv").read_text().splitlines()[1:]
    return [r.split(",")[5] for r in rows if ",h2o," in r], (out / "leaderboard.md").read_text()


def test_an_option_at_its_neutral_value_is_one_column_with_runs_before_it(tmp_path):
    column, board = columns(tmp_path, 0)
    assert column == ["ruler average"] and "skip_samples" not in board


def test_an_option_off_its_neutral_value_is_its_own_column(tmp_path):
    _, board = columns(tmp_path, 5)
    assert "skip_samples=5" in board
