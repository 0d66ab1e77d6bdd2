"""harness.stats.uncertainty: a cell's interval from its samples, and pairing by content id only."""

import math
import random

import numpy as np
import pytest

from harness.stats.uncertainty import PairingError, cell_uncertainty, compare, pair
from tasks.base import content_id


def ruler_rows(scores, subtask="niah_single", length=256):
    return [{"sample_id": content_id([i, subtask, length], ["123"]), "subtask": subtask,
             "length_tokens": length, "score": float(s)} for i, s in enumerate(scores)]


def test_content_id_is_stable_and_follows_the_content():
    assert content_id([1, 2, 3], ["a"]) == content_id([1, 2, 3], ["a"])
    assert len({content_id([1, 2, 3], ["a"]), content_id([1, 2, 4], ["a"]),
                content_id([1, 2, 3], ["b"])}) == 3


def test_pass_fail_cell_gets_a_wilson_interval_in_points():
    cell = cell_uncertainty("ruler", {"average": 50.0}, ruler_rows([1, 0] * 3))
    assert cell["n"] == 6 and cell["interval"] == "Wilson score interval"
    assert cell["ci95"] == pytest.approx([18.76, 81.24], abs=0.01)  # the ±40 points of n = 6


def test_ruler_average_is_stratified_with_rulers_weights():
    rows = ruler_rows([1] * 8, "niah_single") + ruler_rows([1, 0], "vt")
    cell = cell_uncertainty("ruler", {"average": 75.0}, rows, resamples=2000)
    assert cell["estimate"] == pytest.approx(75.0)  # (100 + 50) / 2, not the pooled 90
    assert "stratified" in cell["interval"] and cell["ci95"] == pytest.approx([50.0, 100.0])


def test_perplexity_interval_is_on_ppl_from_token_blocks():
    rng = np.random.default_rng(0)
    nll = (3 + rng.normal(0, 1, 343)).round(6).tolist()
    cell = cell_uncertainty("perplexity", {"ppl": math.exp(np.mean(nll))},
                            [{"sample_id": "s", "token_nll": nll}], resamples=2000)
    assert cell["n"] == 343 and cell["clusters"] == 49  # blocks of ceil(343^(1/3)) = 7 tokens
    assert cell["ci95"][0] < cell["value"] < cell["ci95"][1]
    assert "block bootstrap" in cell["interval"]


def test_a_task_without_samples_has_no_interval_and_says_why():
    cell = cell_uncertainty("perplexity", {"ppl": 5.0}, [{"sample_id": "x"}])
    assert cell["ci95"] is None and cell["interval"].startswith("none: no token_nll")


def test_pairing_is_by_content_id_whatever_the_order():
    reference = ruler_rows([1, 1, 1, 0, 0, 1, 1, 0, 1, 1])
    run = [dict(r) for r in reference]
    run[0]["score"] = 0.0  # one lost
    run[3]["score"] = 1.0  # one gained
    random.Random(1).shuffle(run)
    result = compare("ruler", reference, run, resamples=2000)
    assert result["lost"] == 1 and result["gained"] == 1 and result["discordance"] == 0.2
    assert result["difference"] == 0.0 and result["p_value"] == 1.0
    assert result["test"] == "exact McNemar"


def test_runs_on_different_samples_are_refused_naming_what_differs():
    reference = ruler_rows([1, 0, 1, 1])
    run = reference[:2] + reference[3:]  # one sample dropped
    with pytest.raises(PairingError, match=r"1 sample\(s\) of the reference are not in the run "
                                           rf"\(e.g. {reference[2]['sample_id']}\)"):
        pair("ruler", reference, run)
    other = run + ruler_rows([1], length=512)
    with pytest.raises(PairingError, match=r"1 sample\(s\) of the run are not in the reference"):
        compare("ruler", reference, other)
    with pytest.raises(PairingError, match="lack sample_id"):
        pair("ruler", [{"subtask": "x", "length_tokens": 1, "score": 1.0}], reference)


def test_a_dropped_sample_never_shifts_the_pairing():
    """The planted bug this guards against: pairing by position. The run's sample 2 was dropped
    from its place and written last (a retried request); position pairing would set 3 vs 4,
    4 vs 5, ... and find 6 changes that are not there. By id the runs agree exactly."""
    reference = ruler_rows([1, 0, 1, 0, 1, 0, 1, 0])
    run = reference[:2] + reference[3:] + reference[2:3]
    result = compare("ruler", reference, run, resamples=500)
    assert result["discordance"] == 0.0 and result["difference"] == 0.0
    assert result["n"] == 8


def test_multiturn_pairs_turns_inside_conversations():
    def rows(flips):
        return [{"sample_id": f"c{i}", "turns": [{"correct": float(c)} for c in conv]}
                for i, conv in enumerate(flips)]
    reference = rows([[1, 1], [1, 0], [1, 1]])
    run = rows([[1, 0], [1, 0], [1, 1]])
    result = compare("multiturn", reference, run, resamples=1000)
    assert result["n"] == 6 and result["n_unit"] == "turns"
    assert result["difference"] == pytest.approx(-100 / 6)
    assert result["test"] == "paired bootstrap"  # turns share a context: no McNemar


def test_an_interval_around_another_estimate_says_so():
    """lm-eval's acc_mean of a group weights its tasks its own way: the samples alone give the
    equal-weight estimate, and the record says the interval is around that one."""
    rows = [{"sample_id": f"{t}{i}", "task": t, "acc": float(a)}
            for t, accs in (("a", [1, 1, 1, 1]), ("b", [0, 0])) for i, a in enumerate(accs)]
    cell = cell_uncertainty("lm_eval", {"acc_mean": 4 / 6}, rows, resamples=200)
    assert cell["estimate"] == 0.5 and "NOTE: around the design's estimate 0.5" in cell["interval"]
    assert "NOTE" not in cell_uncertainty("lm_eval", {"acc_mean": 0.5}, rows, 200)["interval"]
