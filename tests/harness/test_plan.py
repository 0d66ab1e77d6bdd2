"""harness.plan: the n a sweep needs for a paired half-width, from a pilot."""

import numpy as np

from harness import plan
from tests.helpers.reports import ruler_run


def test_n_needed_from_a_pilot_halves_the_half_width_at_four_times_n(tmp_path, capsys):
    rng = np.random.default_rng(0)
    full = (rng.random(60) < 0.7).astype(float)
    lossy = np.where(rng.random(60) < 0.2, 1 - full, full)  # discordance about 0.2
    ruler_run(tmp_path, "full", full)
    ruler_run(tmp_path, "h2o", lossy, budget=0.2)
    [record] = plan.plan([str(tmp_path)], half_width=5.0, resamples=4000)
    assert record["n"] == 60 and record["discordance"] == np.mean(full != lossy)
    pilot = record["half_width"]
    assert plan.plan([str(tmp_path)], half_width=pilot / 2, resamples=4000)[0]["needed"] == 240
    # the bootstrap and the discordance formula agree on pass/fail scores
    assert abs(record["needed"] - record["needed_from_discordance"]) <= 0.2 * record["needed"]
    assert plan.main([str(tmp_path), "--half-width", "5", "--resamples", "500"]) == 0
    assert "n for ±5" in capsys.readouterr().out


def test_a_pilot_without_a_full_cache_run_is_refused(tmp_path, capsys):
    ruler_run(tmp_path, "h2o", [1, 0, 1], budget=0.2)
    assert plan.main([str(tmp_path), "--half-width", "2"]) == 2
    assert "no setting paired with a full-cache run" in capsys.readouterr().err
    assert plan.main([str(tmp_path), "--half-width", "0"]) == 2


def test_a_pilot_without_variation_cannot_size_a_sweep(tmp_path):
    ruler_run(tmp_path, "full", [1] * 10)
    ruler_run(tmp_path, "h2o", [0] * 10, budget=0.2)  # every sample lost: no variance to scale
    [record] = plan.plan([str(tmp_path)], half_width=2, resamples=200)
    assert "needed" not in record and record["why"].startswith("no variation")
