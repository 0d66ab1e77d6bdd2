"""The cross-engine noise floor: another engine's full cache (harness.engines.vllm_engine's runs) paired
with ours on the same samples is a noise floor like eager vs sdpa: shown with the floors, left
out of the board, and a method's difference within it is a tie, not the method's."""

import json

from harness import report
from tests.helpers.reports import ruler_run

N = 60


def scores_losing(k: int) -> list[float]:
    """60 RULER scores, the first `k` lost (the others answered)."""
    return [0.0] * k + [1.0] * (N - k)


def engine_run(root, lost: int, method_active=None, started="2026-11-29T11:00:00"):
    """Another engine's run on the same samples (an `engine` section, as vLLM runs write it);
    `method_active` absent: it compresses nothing, i.e. that engine's full cache."""
    folder = ruler_run(root, "vllm", scores_losing(lost), started=started)
    metrics = json.loads((folder / "metrics.json").read_text())
    metrics["engine"] = {"name": "vllm", "vllm": "0.32.0"}
    if method_active is not None:
        metrics["kv"]["method_active"] = method_active
    (folder / "metrics.json").write_text(json.dumps(metrics))
    return folder


def verdict_and_board(tmp_path, with_engine: bool, engine_active=None):
    runs = tmp_path / ("with" if with_engine else "without")
    ruler_run(runs, "full", scores_losing(0))
    ruler_run(runs, "h2o", scores_losing(12), budget=0.2, started="2026-11-29T12:00:00")
    if with_engine:
        engine_run(runs, lost=15, method_active=engine_active)
    _, out, _ = report.build_report([str(runs)], runs / "out", resamples=400)
    rows = [line for line in (out / "comparisons.csv").read_text().splitlines()
            if line.startswith("stories260k") and ",h2o," in line]
    return rows[0].rsplit(",", 2)[-2], (out / "leaderboard.md").read_text()


def test_a_difference_within_the_engines_floor_is_a_tie(tmp_path):
    alone, _ = verdict_and_board(tmp_path, with_engine=False)
    assert alone == "worse than full"  # 12 of 60 lost: told apart from the full cache
    beside, board = verdict_and_board(tmp_path, with_engine=True)
    assert beside == "tie (noise floor)"  # the two engines' full caches differ by more
    assert "engine: vllm vs ours: difference -25" in board
    assert "vllm" not in board.split("Noise floors")[0]  # a floor run is not a board row


def test_an_engine_run_that_compresses_is_a_setting_not_a_floor(tmp_path):
    verdict, board = verdict_and_board(tmp_path, with_engine=True, engine_active=True)
    assert verdict == "worse than full" and "engine: vllm" not in board
    assert "| vllm" in board.split("Noise floors")[0]  # on the board, paired with full


def test_a_method_run_by_another_engine_is_named_with_it(tmp_path):
    """Quest inside vLLM beside our Quest: two rows, told apart by the engine's name."""
    runs = tmp_path / "runs"
    ruler_run(runs, "full", scores_losing(0))
    ruler_run(runs, "quest", scores_losing(10), budget=0.2, started="2026-11-29T12:00:00")
    theirs = ruler_run(runs, "quest", scores_losing(10), budget=0.2, started="2026-11-29T13:00:00")
    metrics = json.loads((theirs / "metrics.json").read_text())
    metrics["engine"] = {"name": "vllm"}
    metrics["kv"]["method_active"] = True
    (theirs / "metrics.json").write_text(json.dumps(metrics))
    _, out, _ = report.build_report([str(runs)], runs / "out", resamples=200)
    board = (out / "leaderboard.md").read_text().split("Noise floors")[0]
    assert "| quest (vllm) |" in board and "| quest |" in board
