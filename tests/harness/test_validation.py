"""The fidelity validation (harness.report.validation) on run folders written by hand: fidelity
separates settings that accuracy cannot, a monotone relation gives rank correlation 1, noise
orders almost nothing, and runs without fidelity are refused in one line."""

import json

import numpy as np
import pytest
from scipy import stats as sps

from harness.report import validation
from harness.report.build import build_report
from tests.conftest import STORIES, need_shared
from tests.helpers.reports import fidelity_run
from tests.helpers.sweeps import TASK, sweep_folders

RESAMPLES = 1000  # enough for a 95 % interval; keeps the 2-CPU machine free
N = 40


def planted(root, scores_of, kl_of, seed=0):
    """The full cache and settings 1..len(kl_of): setting i's scores `scores_of(i)`, KL
    `kl_of[i - 1]` per sample plus a little noise (same-top and gold follow the KL)."""
    rng = np.random.default_rng(seed)
    fidelity_run(root, "full", None, scores_of(0))
    for i, level in enumerate(kl_of, start=1):
        kl = level + 0.01 * rng.random(N)
        fidelity_run(root, "h2o", round(0.1 * i, 1), scores_of(i), kl, 1 - kl / 4, -1.0 - kl)


def only(results):
    assert len(results) == 1
    return results[0]


def test_fidelity_orders_settings_that_accuracy_cannot(tmp_path):
    """Identical per-sample scores, KL planted apart: accuracy orders none of the pairs, KL
    (and the figures following it) orders every pair, and never against accuracy."""
    scores = (np.arange(N) % 3 != 0).astype(float)
    planted(tmp_path, lambda i: scores, [0.1, 0.5, 1.0, 1.5, 2.0])
    result = only(validation.run([str(tmp_path)], resamples=RESAMPLES)[0])
    assert result["n_samples"] == N and result["settings_k"] == 5 and result["top_k"] == 5
    pairs = result["pairs"]
    assert pairs["accuracy"]["ordered"] == 0 and pairs["accuracy"]["total"] == 10
    for figure in validation.FIDELITY:
        assert pairs[figure]["ordered"] == 10 > pairs["accuracy"]["ordered"]
        assert result["contradictions"][figure] == []
    assert "h2o budget_ratio=0.1 > h2o budget_ratio=0.5" in pairs["kl_mean"]["which"]
    # accuracy drop is 0 for every setting: the rank correlation is undefined, not invented
    assert result["correlations"]["kl_mean"]["spearman"] is None


def test_a_monotone_relation_gives_rank_correlation_one(tmp_path):
    """Setting i fails 4 i more samples than the full cache and its KL grows with i."""
    planted(tmp_path, lambda i: (np.arange(N) >= 4 * i).astype(float), [0.1, 0.3, 0.6, 1.0])
    result = only(validation.run([str(tmp_path)], resamples=RESAMPLES)[0])
    drops = [s["accuracy"] for s in result["settings"]]
    assert sorted(drops) == pytest.approx([10.0, 20.0, 30.0, 40.0])  # points of RULER's 100
    for figure in validation.FIDELITY:
        c = result["correlations"][figure]
        assert c["spearman"] == pytest.approx(1.0) and c["kendall_tau_b"] == pytest.approx(1.0)
        assert c["spearman_ci95"][1] == pytest.approx(1.0)
    assert all(not found for found in result["contradictions"].values())


def noise_column(seed: int, k: int = 5, n: int = 60) -> validation.Column:
    """k settings with no true difference from one another: pass/fail and fidelity drawn
    independently per sample and setting from one distribution."""
    rng = np.random.default_rng(seed)
    scores = 100 * (rng.random((n, k + 1)) < 0.6)
    fidelity = {"kl_mean": rng.exponential(0.5, (n, k)),
                "top_agree_ratio": rng.random((n, k)) * 0.3,
                "gold_logprob": rng.normal(0.5, 0.3, (n, k))}
    return validation.Column("noise", True, [f"s{i}" for i in range(k)],
                             [f"run{i}" for i in range(k)], "full", scores.astype(float),
                             np.ones(n), np.zeros(n, dtype=int), np.ones(1), "identity",
                             fidelity)


def test_noise_orders_few_pairs_and_the_family_wise_rate_stays_low():
    """Over 50 data sets with no true difference, the share with any ordered pair (a false
    ordering) stays <= 0.1 for every figure: BH over the pairs of a figure bounds it by 5 %
    under the complete null."""
    false = {f: 0 for f in validation.FIGURES}
    for seed in range(50):
        result = validation.validate(noise_column(seed), resamples=500)
        for f, p in result["pairs"].items():
            false[f] += p["ordered"] > 0
    assert all(count / 50 <= 0.1 for count in false.values()), false


def test_vectorised_rank_correlations_are_scipys():
    rng = np.random.default_rng(1)
    x, y = rng.normal(size=(20, 6)), rng.normal(size=(20, 6))
    x[:, 0] = x[:, 1]  # ties
    rho, tau = validation._spearman_rows(x, y), validation._kendall_rows(x, y)
    for i in range(20):
        assert rho[i] == pytest.approx(sps.spearmanr(x[i], y[i]).statistic)
        assert tau[i] == pytest.approx(sps.kendalltau(x[i], y[i]).statistic)


def test_pairs_are_among_the_top_k_by_accuracy(tmp_path):
    planted(tmp_path, lambda i: (np.arange(N) >= 4 * i).astype(float), [0.1, 0.3, 0.6, 1.0])
    result = only(validation.run([str(tmp_path)], top=3, resamples=RESAMPLES)[0])
    assert result["top_k"] == 3 and result["pairs"]["accuracy"]["total"] == 3
    named = {p["a"] for p in result["pairs"]["kl_mean"]["pairs"]} | \
        {p["b"] for p in result["pairs"]["kl_mean"]["pairs"]}
    assert "h2o budget_ratio=0.4" not in named  # the worst by accuracy


def test_runs_without_fidelity_are_refused_in_one_line(tmp_path, capsys):
    fidelity_run(tmp_path, "full", None, np.ones(N))
    for b in (0.2, 0.4, 0.6):
        fidelity_run(tmp_path, "h2o", b, np.ones(N))
    assert validation.main([str(tmp_path), "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("error: no fidelity validation")
    assert "0 of 3 settings" in err and "task.fidelity_tokens" in err
    assert not (tmp_path / "v").exists()


def test_cli_writes_markdown_and_json_and_the_report_carries_the_section(tmp_path, capsys):
    runs = tmp_path / "runs"
    planted(runs, lambda i: (np.arange(N) >= 4 * i).astype(float), [0.1, 0.3, 0.6])
    out = tmp_path / "v"
    assert validation.main([str(runs), "--out", str(out), "--resamples", "200"]) == 0
    printed = capsys.readouterr().out
    assert f"n = {N} samples, k = 3 settings" in printed and "Benjamini-Hochberg" in printed
    assert "Spearman" in printed and "Kendall" in printed
    saved = json.loads((out / "validation.json").read_text())
    assert saved["columns"][0]["correlations"]["kl_mean"]["spearman"] == pytest.approx(1.0)
    assert (out / "validation.md").read_text() in printed
    build_report([str(runs)], tmp_path / "report", resamples=200)
    assert "## Fidelity validation" in (tmp_path / "report" / "leaderboard.md").read_text()


def test_the_report_leaves_the_section_out_below_three_settings(tmp_path):
    planted(tmp_path / "runs", lambda i: np.ones(N), [0.1, 0.3])
    build_report([str(tmp_path / "runs")], tmp_path / "report", resamples=200)
    assert "Fidelity validation" not in (tmp_path / "report" / "leaderboard.md").read_text()


def test_end_to_end_on_a_tiny_real_sweep(tmp_path):
    """stories260k on RULER: the full cache and three evicting settings swept with
    task.fidelity_tokens=4 are validated from their folders (the paired samples, n, k)."""
    need_shared(STORIES)
    knobs = [["method=full"], ["method=streaming_llm", "method.window_tokens=24"],
             ["method=h2o", "method.budget_tokens=24"],
             ["method=snapkv", "method.budget_tokens=48"]]
    sweep_folders([[*TASK, "task.fidelity_tokens=4", *k] for k in knobs], tmp_path)
    result = only(validation.run([str(tmp_path / "sweep")], resamples=200)[0])
    assert result["settings_k"] == 3 and result["n_samples"] == 2  # depths 25 and 75
    assert all(s["kl_mean"] > 0 for s in result["settings"])  # 24 of ~310 tokens kept
    assert result["pairs"]["kl_mean"]["total"] == 3
