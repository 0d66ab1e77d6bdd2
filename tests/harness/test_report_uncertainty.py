"""The report's uncertainty: flags, verdicts after BH, rank intervals, on RULER-like runs."""

from harness import report
from tests.helpers.reports import ruler_run


def board_text(tmp_path):
    _, out, _ = report.build_report([str(tmp_path)], tmp_path / "out", resamples=1000)
    return (out / "leaderboard.md").read_text(), (out / "comparisons.csv").read_text()


def test_a_full_cache_near_zero_is_non_discriminative(tmp_path):
    ruler_run(tmp_path, "full", [1] + [0] * 29)  # 3.3 %, Wilson [0.6, 16.7]
    ruler_run(tmp_path, "h2o", [0] * 30, budget=0.2)
    text, _ = board_text(tmp_path)
    assert "ruler average: non-discriminative" in text
    assert "3.333 [0.5909, 16.67] n=30" in text  # every cell: value [95 % interval] n


def test_a_budget_curve_non_monotonic_beyond_its_intervals_is_flagged(tmp_path):
    ruler_run(tmp_path, "full", [1] * 30)
    ruler_run(tmp_path, "h2o", [1] * 28 + [0] * 2, budget=0.2)
    ruler_run(tmp_path, "h2o", [1] * 5 + [0] * 25, budget=0.5)  # less at a larger budget
    ruler_run(tmp_path, "h2o", [1] * 26 + [0] * 4, budget=0.7)  # within noise of 0.2
    text, csv_text = board_text(tmp_path)
    assert text.count("non-monotonic beyond its intervals") == 1  # 0.2 beats 0.5 (0.7 > 0.5 is not)
    assert "budget_ratio=0.5 (KV held 0.5)" in text
    # McNemar: 25 lost of 30 is worse after BH; 2 lost (p = 0.5) and 4 lost (p = 0.125) are not
    assert csv_text.count("worse than full") == 1 and csv_text.count("not distinguishable") == 2
    assert "exact McNemar" in csv_text
    assert "1000 paired-bootstrap resamples" in text  # the count used, not the default
    assert "#1-2" in text or "#1-3" in text  # the full cache and h2o 0.2 share ranks


def test_a_setting_compressing_while_decoding_is_paired_with_the_full_cache(tmp_path):
    """runner.decode_interval_tokens is in the protocol label (its own leaderboard section), but
    the full cache never acts on it: its reference is the full cache of the same protocol
    without it, on the same samples."""
    import json

    ruler_run(tmp_path, "full", [1] * 30)
    ruler_run(tmp_path, "snapkv", [1] * 10 + [0] * 20, budget=0.2)
    metrics = next(tmp_path.rglob("snapkv*/metrics.json"))
    m = json.loads(metrics.read_text())
    m["protocol"]["decode_interval_tokens"] = 128
    metrics.write_text(json.dumps(m))
    text, csv_text = board_text(tmp_path)
    assert "decode_every=128" in text
    [row] = [line for line in csv_text.splitlines() if ",snapkv," in line]
    assert "decode_every=128" in row and "worse than full" in row and "exact McNemar" in row
