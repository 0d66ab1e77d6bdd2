"""harness.stats.intervals: coverage by simulation (seeded), hand-computed cases, and the designs."""

import math

import numpy as np
import pytest
from scipy import stats as sps

from harness.stats import intervals as stats
from kvcore.errors import ConfigError


def test_wilson_covers_a_known_rate_in_95_percent_of_1000_repetitions():
    rng = np.random.default_rng(34)
    n, rate = 100, 0.2
    intervals = {k: stats.wilson(k, n) for k in range(n + 1)}
    covered = [intervals[k][0] <= rate <= intervals[k][1] for k in rng.binomial(n, rate, 1000)]
    assert 0.93 <= np.mean(covered) <= 0.97


def test_wilson_by_hand():
    # 3 of 10: centre (3 + z^2/2) / (10 + z^2), half-width z sqrt(pq/n + z^2/4n^2) / (1 + z^2/n)
    z, n, p = 1.959963984540054, 10, 0.3
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    assert stats.wilson(3, 10) == pytest.approx((centre - half, centre + half), abs=1e-12)
    assert stats.wilson(0, 6)[0] == 0 and stats.wilson(6, 6)[1] == pytest.approx(1.0)


def _paired_binary(rng, n, lost, gained):
    """n (reference, run) pass/fail pairs: pass -> fail with probability `lost`, fail -> pass
    with `gained`, the rest concordant (half pass, half fail)."""
    kind = rng.choice(4, size=n, p=[lost, gained, (1 - lost - gained) / 2,
                                    (1 - lost - gained) / 2])
    reference = np.isin(kind, (0, 2)).astype(float)
    run = np.isin(kind, (1, 2)).astype(float)
    return reference, run


def test_paired_difference_covers_the_true_difference_in_95_percent_of_1000_repetitions():
    """Known discordance 0.2 (0.15 lost, 0.05 gained): true difference -0.10."""
    rng = np.random.default_rng(7)
    covered = 0
    for rep in range(1000):
        reference, run = _paired_binary(rng, 100, 0.15, 0.05)
        draws = stats.draws(stats.design(np.stack([reference, run], 1)), 600, seed=rep)
        low, high = stats.percentile(draws[:, 1] - draws[:, 0])
        covered += low <= -0.10 <= high
    assert 0.93 <= covered / 1000 <= 0.97


def test_mcnemar_by_hand():
    # 1 lost, 9 gained: two-sided 2 * P(X <= 1), X ~ Bin(10, 1/2) = 2 * 11 / 1024
    assert stats.mcnemar_exact(1, 9) == pytest.approx(22 / 1024)
    assert stats.mcnemar_exact(9, 1) == pytest.approx(22 / 1024)
    assert stats.mcnemar_exact(0, 0) == 1.0
    assert stats.mcnemar_exact(3, 3) == pytest.approx(1.0)


def test_stratified_interval_by_hand():
    """Stratum A = [0, 100] (weight 1), B = [60, 60, 60] (weight 3). Estimate 0.25 * 50 + 0.75 * 60
    = 57.5 (the pooled mean would be 56). Resampling inside A gives a mean of 0, 50 or 100 with
    probability 1/4, 1/2, 1/4 and B is constant, so the estimate is 45, 57.5 or 70: the 95 %
    interval is [45, 70] (an unstratified resample would reach 0 .. 100)."""
    d = stats.design([0, 100, 60, 60, 60], strata=list("AABBB"), weights={"A": 1, "B": 3})
    assert stats.estimate(d)[0] == pytest.approx(57.5)
    boot = stats.draws(d, 8000, seed=1)[:, 0]
    assert set(np.round(boot, 6)) == {45.0, 57.5, 70.0}
    assert np.mean(boot == 45.0) == pytest.approx(0.25, abs=0.02)
    assert stats.bootstrap_interval(d, 8000, seed=1) == (45.0, 70.0)


def test_stratified_half_width_matches_the_formula():
    """Large strata: half-width ~ 1.96 sqrt(sum_s w_s^2 var_s / n_s)."""
    rng = np.random.default_rng(3)
    a, b = rng.normal(10, 2, 400), rng.normal(50, 8, 100)
    d = stats.design(np.concatenate([a, b]), strata=[0] * 400 + [1] * 100)
    low, high = stats.bootstrap_interval(d, 6000)
    by_hand = 1.96 * math.sqrt(0.25 * a.var() / 400 + 0.25 * b.var() / 100)
    assert (high - low) / 2 == pytest.approx(by_hand, rel=0.06)


def test_cluster_bootstrap_counts_conversations_not_turns():
    """Turns of one conversation all equal: 10 conversations carry the information of 10
    samples, not 40; an independent-turn bootstrap would be about twice too narrow."""
    rng = np.random.default_rng(5)
    per_conversation = rng.integers(0, 2, 10).astype(float)
    turns = np.repeat(per_conversation, 4)
    clustered = stats.bootstrap_interval(stats.design(turns, clusters=np.repeat(range(10), 4)))
    conversations = stats.bootstrap_interval(stats.design(per_conversation))
    naive = stats.bootstrap_interval(stats.design(turns))
    assert clustered == pytest.approx(conversations, abs=0.03)
    assert naive[1] - naive[0] < 0.7 * (clustered[1] - clustered[0])


def test_block_bootstrap_reports_perplexity_and_widens_for_correlated_losses():
    rng = np.random.default_rng(11)
    drift = np.repeat(rng.normal(0, 0.5, 20), 25)  # losses correlated over 25 tokens
    nll = 3.0 + drift + rng.normal(0, 0.1, 500)
    blocks = stats.design(nll, clusters=np.arange(500) // 25, transform="exp")
    assert stats.estimate(blocks)[0] == pytest.approx(math.exp(nll.mean()))
    low, high = stats.bootstrap_interval(blocks)
    iid_low, iid_high = stats.bootstrap_interval(stats.design(nll, transform="exp"))
    assert low < math.exp(nll.mean()) < high
    assert high - low > 3 * (iid_high - iid_low)


def test_paired_retained_fraction_and_mcnemar():
    reference = np.array([1.0] * 40 + [0.0] * 10)
    run = reference.copy()
    run[:8] = 0  # 8 lost, none gained
    result = stats.paired(stats.design(np.stack([reference, run], 1)), 4000, seed=2,
                          lost_gained=(8, 0))
    assert result.difference == pytest.approx(-8 / 50)
    assert result.difference_ci95[1] < 0
    assert result.retained == pytest.approx(32 / 40)
    assert result.retained_ci95[0] < 0.8 < result.retained_ci95[1] <= 1.0
    assert result.p_value == pytest.approx(2 / 2 ** 8) and result.test == "exact McNemar"


def test_benjamini_hochberg_by_hand():
    adjusted, rejected = stats.benjamini_hochberg([0.01, 0.02, 0.03, 0.5])
    assert rejected == [True, True, True, False]  # p_(3) = .03 <= 3/4 * .05, p_(4) > .05
    assert adjusted == pytest.approx([0.04, 0.04, 0.04, 0.5])
    assert adjusted == pytest.approx(list(sps.false_discovery_control([0.01, 0.02, 0.03, 0.5])))
    assert stats.benjamini_hochberg([0.04, 0.045])[1] == [True, True]
    assert stats.benjamini_hochberg([0.03, 0.2])[1] == [False, False]  # .03 > 1/2 * .05


def test_rank_intervals_share_ranks_between_indistinguishable_entries():
    rng = np.random.default_rng(0)
    draws = np.stack([rng.normal(90, 1, 4000), rng.normal(50, 3, 4000),
                      rng.normal(50.5, 3, 4000)], axis=1)
    assert stats.rank_intervals(draws, higher_is_better=True) == [(1, 1), (2, 3), (2, 3)]
    assert stats.rank_intervals(draws, higher_is_better=False) == [(3, 3), (1, 2), (1, 2)]


def test_samples_needed_from_a_pilot():
    assert stats.n_for_paired_binary(0.2, 0.0, 0.05) == math.ceil(1.959963984540054 ** 2
                                                                  * 0.2 / 0.0025)
    # a pilot of 100 with discordance 0.2: its half-width halves at 4x the samples
    rng = np.random.default_rng(4)
    reference, run = _paired_binary(rng, 100, 0.1, 0.1)
    draws = stats.draws(stats.design(np.stack([reference, run], 1)), 4000)
    low, high = stats.percentile(draws[:, 1] - draws[:, 0])
    needed = stats.n_for_half_width(100, (high - low) / 2, (high - low) / 4)
    assert needed == 400
    by_discordance = stats.n_for_paired_binary(stats.discordance(reference, run),
                                               run.mean() - reference.mean(), (high - low) / 4)
    assert by_discordance == pytest.approx(needed, rel=0.15)


def test_bad_designs_are_refused():
    with pytest.raises(ValueError, match="no units"):
        stats.design([])
    with pytest.raises(ValueError, match="finite"):
        stats.design([1.0, float("nan")])
    with pytest.raises(ValueError, match="no weight for stratum 'B'"):
        stats.design([1, 2], strata=["A", "B"], weights={"A": 1})


@pytest.mark.parametrize("half_width", [1e-200, 1e-310, 5e-324])
def test_a_half_width_no_sample_size_reaches_is_refused_not_overflowed(half_width):
    """(pilot / wanted)^2 overflows (OverflowError, or ceil(inf)) for a tiny wanted width. A
    process whose CPU flushes subnormals to zero (a library built with fast-math loaded earlier
    sets it process-wide) reads 1e-310 as 0.0: then it is refused as no width at all."""
    why = "needs more than 1e\\+12 samples" if half_width > 0 else "finite number above 0"
    with pytest.raises(ValueError, match=why):
        stats.n_for_half_width(60, 5.0, half_width)
    with pytest.raises(ValueError, match=why):
        stats.n_for_paired_binary(0.2, 0.0, half_width)
    assert stats.n_for_paired_binary(0.0, 0.0, half_width) == 1  # no variance: any n


@pytest.mark.parametrize("half_width", [0.0, -1.0, float("inf"), float("nan")])
def test_a_half_width_that_is_no_width_is_refused(half_width):
    with pytest.raises(ValueError, match="finite number above 0"):
        stats.n_for_half_width(60, 5.0, half_width)
    with pytest.raises(ValueError, match="finite number above 0"):
        stats.n_for_paired_binary(0.2, 0.0, half_width)


def test_the_half_width_a_sample_reaches_inverts_the_sample_size():
    n = stats.n_for_half_width(60, 5.0, 1.25)
    assert n == 960 and stats.half_width_for_n(60, 5.0, n) == pytest.approx(1.25)


@pytest.mark.parametrize("resamples, columns, expect", [
    (0, 2, "at least 100"), (-5, 2, "at least 100"), (99, 2, "at least 100"),
    (10**9, 2, "above the 2 GiB limit (harness.stats.intervals.MEMORY_LIMIT_BYTES)"),
    (10**6, 55, "the bootstrap of 55 run(s) side by side would hold about 5.37 GiB"),
    (2**63, 1, "above the 2 GiB limit"),
])
def test_resample_counts_are_bounded_by_an_estimate_of_memory(resamples, columns, expect):
    with pytest.raises(ConfigError) as info:
        stats.check_resamples(resamples, columns)
    assert expect in str(info.value) and str(info.value).startswith(f"--resamples {resamples}:")


def test_the_largest_accepted_count_fits_the_limit_and_is_named():
    with pytest.raises(ConfigError, match=r"at most (\d+) here") as info:
        stats.check_resamples(10**8, 10)
    most = int(str(info.value).rsplit("at most ", 1)[1].split()[0])
    stats.check_resamples(most, 10)  # the count it names is accepted
    assert stats.bootstrap_bytes(most, 10) <= stats.MEMORY_LIMIT_BYTES
    assert stats.bootstrap_bytes(most + 1, 10) > stats.MEMORY_LIMIT_BYTES
    stats.check_resamples(stats.RESAMPLES, 200)  # the default, for a large report
