"""The rounds' statistics (harness.stats.sequential) on simulated sweeps with a fixed seed: a planted
ordering is recovered, repeated looks under the null keep the false-ordering rate at or below
alpha (where a fixed-n interval re-checked every round does not), and a stopped setting's
reported interval never changes."""

from __future__ import annotations

import numpy as np
import pytest

from harness.stats import sequential as sq
from harness.stats import intervals as stats

STEPS = 400  # a coarser grid than the harness's: the simulations stay at a few seconds


def run_sweep(values: dict[str, np.ndarray], reference: np.ndarray, levels, design: dict,
              block: int, max_n: int) -> sq.Rounds:
    rounds = sq.Rounds(levels, sq.Design(**design, block=block), steps=STEPS)
    start = 0
    while not rounds.done() and start < max_n:
        stop = min(start + block, max_n)
        rounds.add({k: values[k][start:stop] for k in rounds.active}, reference[start:stop])
        start = stop
    return rounds


def test_cs_covers_and_narrows():
    rng = np.random.default_rng(0)
    d = 100.0 * ((rng.random(400) < 0.6).astype(float) - (rng.random(400) < 0.4).astype(float))
    looks = sq.sequence(d, 100.0, 0.05, [25, 100, 400])
    widths = [iv.high - iv.low for iv in looks]
    assert widths[0] > widths[1] > widths[2]
    assert all(iv.low <= iv.mean <= iv.high for iv in looks)
    assert looks[-1].low > 0  # a 20-point effect is seen at n = 400
    # the price of anytime validity: wider than the fixed-n t interval at the same n, not absurdly
    low, high = stats.clt_interval(d)
    assert 1.0 < widths[-1] / (high - low) < 2.5


def test_planted_ordering_is_recovered():
    """Known effects: `same` equals the reference, then `close` (-10 points), `mid` (-35), `bad`
    (-70). Every setting gets its verdict, the pairs order as planted, the top 1 is `same`,
    and the clear settings stop long before the close one."""
    rng = np.random.default_rng(1)
    probs = {"ref": 0.8, "same": 0.8, "close": 0.7, "mid": 0.45, "bad": 0.1}
    u = rng.random(600)
    noise = {k: rng.random(600) for k in probs}
    values = {k: 100.0 * ((0.8 * u + 0.2 * noise[k]) < p) for k, p in probs.items()}
    values["same"] = values["ref"].copy()  # the method is lossless here
    names = ["same", "close", "mid", "bad"]
    design = {"alpha": 0.05, "margin": 5.0, "top_k": 1}
    rounds = run_sweep(values, values["ref"], {k: "0.5" for k in names}, design, 20, 600)
    assert rounds.done()
    verdicts = {k: rounds.reported[k]["verdict"] for k in names}
    assert verdicts == {"same": "indistinguishable", "close": "worse", "mid": "worse",
                        "bad": "worse"}
    assert {k: rounds.reported[k]["membership"] for k in names} == {
        "same": "in", "close": "out", "mid": "out", "bad": "out"}
    ordered = [p for p in rounds.history[-1]["pairs"] if p["ordered"]]
    assert len(ordered) >= 3  # "same" above each of the others: what the top 1 needs
    for p in ordered:  # and no pair is ever ordered against the planted effects
        higher, lower = (p["a"], p["b"]) if p["low"] > 0 else (p["b"], p["a"])
        assert probs[higher] > probs[lower] or higher == "same", p
    n = {k: rounds.reported[k]["n"] for k in names}
    assert n["bad"] < n["close"] and n["mid"] < n["close"]
    assert sum(n.values()) < 4 * 600 / 2  # far fewer samples than sampling everyone to the end
    # the top 2 asks for more: "close" must be shown above "mid" and "bad"
    top2 = run_sweep(values, values["ref"], {k: "0.5" for k in names},
                     {"alpha": 0.05, "margin": 5.0, "top_k": 2}, 20, 600)
    assert {k for k in names if top2.reported[k]["membership"] == "in"} == {"same", "close"}


def _naive_looks(d: np.ndarray, alpha: float, looks) -> list[bool]:
    """A fixed-n t interval at level alpha, checked again at every look (the mistake)."""
    out = []
    for k in looks:
        low, high = stats.clt_interval(d[:k], 1 - alpha)
        out.append(low > 0 or high < 0)
    return out


def _null_rates(sims: int, alpha: float, block: int, max_n: int) -> tuple[float, float]:
    """Share of simulated null sweeps (three settings and the reference all alike, pass/fail
    p = 0.5) in which some setting is called different from the reference, or some pair is
    ordered, at any round: by the CS, and by a naive fixed-n interval re-checked every round."""
    rng = np.random.default_rng(2)
    levels = {"a": "x", "b": "x", "c": "x"}
    design = sq.Design(alpha=alpha, top_k=1)
    per = sq.per_question_alpha(design, levels)  # Bonferroni over 3 settings + 3 pairs: alpha/6
    looks = list(range(block, max_n + 1, block))
    cs_false = naive_false = 0
    for _ in range(sims):
        values = {k: 100.0 * (rng.random(max_n) < 0.5) for k in ["ref", *levels]}
        diffs = [values[k] - values["ref"] for k in levels]
        diffs += [values[a] - values[b] for a, b in sq.pairs(levels)]
        cs_false += any(iv.excludes_zero() for d in diffs
                        for iv in sq.sequence(d, 100.0, per, looks, STEPS, block))
        naive_false += any(any(_naive_looks(d, per, looks)) for d in diffs)
    return cs_false / sims, naive_false / sims


def test_repeated_looks_under_the_null():
    alpha = 0.05
    cs_rate, naive_rate = _null_rates(sims=150, alpha=alpha, block=10, max_n=200)
    assert cs_rate <= alpha
    # the same Bonferroni split, but intervals built for one look, checked at 20: the test above
    # can fail, and does for the naive design
    assert naive_rate > alpha


def test_stopping_never_changes_a_reported_interval():
    rng = np.random.default_rng(3)
    probs = {"ref": 0.7, "a": 0.1, "b": 0.6, "c": 0.65}
    u = rng.random(300)
    values = {k: 100.0 * ((0.6 * u + 0.4 * rng.random(300)) < p) for k, p in probs.items()}
    levels = {"a": "0.2", "b": "0.2", "c": "0.2"}
    design = sq.Design(alpha=0.05, margin=2.0, top_k=1, block=15)
    rounds = sq.Rounds(levels, design, steps=STEPS)
    seen: dict[str, dict] = {}
    start = 0
    while not rounds.done() and start < 300:
        rounds.add({k: values[k][start:start + 15] for k in rounds.active},
                   values["ref"][start:start + 15])
        start += 15
        for name, report in rounds.reported.items():
            assert seen.setdefault(name, report) == report  # fixed from its stopping round on
            # and it is what the last round's ledger says of it
            last = rounds.history[-1]
            assert last["versus_reference"][name] == report["versus_reference"]
            assert last["n"][name] == report["n"]
    assert "a" in seen  # the clear loser stopped early ...
    stopped = seen["a"]
    assert stopped["n"] < start
    # ... its interval is its CS at its own n, recomputed from its samples alone
    n = stopped["n"]
    again = sq.sequence(values["a"][:n] - values["ref"][:n], 100.0,
                        sq.per_question_alpha(design, levels), [n], STEPS, block=15)[0]
    assert again.as_dict() == stopped["versus_reference"]
    # ... and it can never be sampled again
    with pytest.raises(ValueError, match="active settings only"):
        rounds.add({"a": [0.0] * 15, **{k: [0.0] * 15 for k in rounds.active}}, [0.0] * 15)


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        sq.Design(alpha=1.5)
    with pytest.raises(ValueError, match="margin"):
        sq.Design(margin=-1)
    with pytest.raises(ValueError, match="top_k"):
        sq.Design(top_k=0)
    with pytest.raises(ValueError, match="within"):
        sq.sequence([150.0], 100.0, 0.05)
    with pytest.raises(ValueError, match="multiples of block=10"):
        sq.sequence([0.0] * 30, 100.0, 0.05, [15], block=10)
    with pytest.raises(ValueError, match="block"):
        sq.Design(block=0)


def test_cells_of_different_means_keep_coverage_with_round_bets():
    """RULER's order: the samples cycle over cells whose differences have different means
    (+30, -30, +20, -20, 0 points: 0 on average). With rounds holding each cell twice and bets
    fixed per round, the CS of the cells' mean (0) stays valid over 20 looks."""
    rng = np.random.default_rng(5)
    cell_means = np.array([0.3, -0.3, 0.2, -0.2, 0.0])
    misses = 0
    for _ in range(150):
        shift = np.tile(cell_means, 40)  # 200 samples, round-robin over the 5 cells
        up = rng.random(200) < 0.4 + np.clip(shift, 0, None)
        down = rng.random(200) < 0.4 + np.clip(-shift, 0, None)
        d = 100.0 * (up.astype(float) - down)
        looks = list(range(10, 201, 10))
        misses += any(iv.excludes_zero() for iv in sq.sequence(d, 100.0, 0.05, looks, STEPS, 10))
    assert misses / 150 <= 0.05


def test_settings_equal_within_the_margin_are_tied_not_sampled_forever():
    """Two settings identical on every sample cannot be ordered; with a margin their pair is
    shown equal, their top-1 membership is "tied", and the rounds stop."""
    rng = np.random.default_rng(4)
    ref = 100.0 * (rng.random(400) < 0.8)
    twin = np.where(rng.random(400) < 0.5, 0.0, ref)  # about 40 points below the reference
    values = {"a": twin, "b": twin.copy(), "c": 100.0 * (rng.random(400) < 0.05)}
    levels = {k: "0.2" for k in values}
    tied = run_sweep(values, ref, levels, {"alpha": 0.05, "margin": 10.0, "top_k": 1}, 20, 400)
    assert tied.done()
    assert {k: tied.reported[k]["membership"] for k in values} == {
        "a": "tied", "b": "tied", "c": "out"}
    endless = run_sweep(values, ref, levels, {"alpha": 0.05, "margin": 0.0, "top_k": 1}, 20, 400)
    assert not endless.done() and len(endless.reference) == 400  # no margin: never settled
