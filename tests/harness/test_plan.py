"""harness.report.plan: the n a sweep needs for a paired half-width, from a pilot."""

import os
from pathlib import Path

import numpy as np
import pytest

from harness.report import plan
from tests.helpers.reports import fidelity_run, ruler_run


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


def pilot(tmp_path: Path) -> Path:
    rng = np.random.default_rng(1)
    full = (rng.random(40) < 0.7).astype(float)
    ruler_run(tmp_path, "full", full)
    ruler_run(tmp_path, "h2o", np.where(rng.random(40) < 0.2, 1 - full, full), budget=0.2)
    return tmp_path


def refused(capsys, *argv: str) -> str:
    assert plan.main(list(argv)) == 2
    out, err = capsys.readouterr()
    assert out == "" and len(err.strip().splitlines()) == 1 and err.startswith("error: ")
    return err


@pytest.mark.parametrize("half_width", ["1e-200", "1e-320", "4.9e-324"])
def test_a_half_width_beneath_any_metrics_resolution_is_refused(half_width, tmp_path, capsys):
    """(pilot / wanted)^2 overflowed here: refused before the pilot is read."""
    err = refused(capsys, str(pilot(tmp_path)), "--half-width", half_width, "--resamples", "300")
    assert "--half-width" in err and "must be a finite number of at least 1e-06" in err


def test_a_half_width_beyond_any_sample_size_names_the_one_within_reach(tmp_path, capsys,
                                                                       monkeypatch):
    """Above the floor, but needing more than 10^12 samples: refused with what n could reach."""
    monkeypatch.setattr(plan, "MIN_HALF_WIDTH", 1e-30)
    err = refused(capsys, str(pilot(tmp_path)), "--half-width", "1e-12", "--resamples", "300")
    assert "would need more than 1e+12 samples" in err and "ask for at least" in err


@pytest.mark.parametrize("argv, expect", [
    (["--half-width", "inf"], "--half-width inf: must be a finite number"),
    (["--half-width", "nan"], "--half-width nan: must be a finite number"),
    (["--half-width", "-3"], "--half-width -3.0: must be a finite number"),
    (["--half-width", "1e400"], "--half-width inf: must be a finite number"),
    (["--half-width", "2", "--resamples", "1"], "--resamples 1: at least 100"),
    (["--half-width", "2", "--resamples", "-7"], "--resamples -7: at least 100"),
    (["--half-width", "2", "--resamples", "5000000000"], "above the 2 GiB limit"),
])
def test_bad_arguments_are_refused_before_a_file_is_read(argv, expect, tmp_path, capsys):
    """The pilot path does not even exist: the arguments are checked first."""
    assert expect in refused(capsys, str(tmp_path / "nope"), *argv)


@pytest.mark.parametrize("plant, expect", [
    (lambda p: os.mkfifo(p), "is a FIFO (named pipe)"),
    (lambda p: os.symlink("/dev/urandom", p), "(a link to /dev/urandom)"),
    (lambda p: p.write_text('{"sample_id": "a", "subtask": "s", "length_tokens": 512, '
                            '"score": NaN}\n'), "line 1 is not JSON (NaN is not a JSON number)"),
    (lambda p: p.write_text('{"sample_id": "a", "subtask": "s", "length_tokens": 512, '
                            '"score": "0.5"}\n'), 'line 1: score="0.5" must be a finite number'),
    (lambda p: p.write_text('[["a", 1.0]]\n'), "line 1 is a JSON array, not an object"),
])
def test_a_pilot_whose_samples_cannot_be_read_is_refused_by_name(plant, expect, tmp_path,
                                                                 capsys):
    folder = pilot(tmp_path)
    samples = next((folder / "ruler").rglob("h2o-*")) / "samples.jsonl"
    samples.unlink()
    plant(samples)
    err = refused(capsys, str(folder), "--half-width", "5", "--resamples", "300")
    assert str(samples) in err and expect in err


def test_the_rounds_plan_saves_samples_on_a_clear_loss_and_says_so(tmp_path, capsys):
    """A setting losing about 40 points: the rounds stop long before the fixed-n design of the
    same power; a setting equal to the full cache on all but a few samples is decided
    "indistinguishable" within a 10-point margin."""
    rng = np.random.default_rng(0)
    full = (rng.random(80) < 0.8).astype(float)
    loser = np.where(rng.random(80) < 0.5, 0.0, full)
    close = np.where(rng.random(80) < 0.03, 1 - full, full)
    ruler_run(tmp_path, "full", full)
    ruler_run(tmp_path, "h2o", loser, budget=0.2)
    ruler_run(tmp_path, "snapkv", close, budget=0.2)
    rounds = {"block": 10, "max_n": 200, "alpha": 0.05, "margin": 10.0}
    records = {r["method"]: r for r in plan.plan([str(tmp_path)], half_width=5.0,
                                                 resamples=500, rounds=rounds)}
    lossy = records["h2o"]
    assert lossy["rounds_power"] == 1.0 and lossy["rounds_expected_n"] < 60
    assert lossy["samples_saved"] > 0 and lossy["fixed_n_same_power"] > lossy["rounds_expected_n"]
    assert records["snapkv"]["rounds_power"] > 0.5  # inside +-10 points, and shown to be
    assert plan.main([str(tmp_path), "--half-width", "5", "--resamples", "300",
                      "--rounds-block", "10", "--rounds-max-n", "200", "--margin", "10"]) == 0
    out = capsys.readouterr().out
    assert "fixed n, same power" in out
    fixed = max(r["fixed_n_same_power"] for r in records.values())
    expected = sum(r["rounds_expected_n"] for r in records.values())
    assert f"a fixed-n sweep of the same power: 2 x {fixed} = {2 * fixed} (saved " \
           f"{2 * fixed - expected:.0f})" in out
    assert plan.main([str(tmp_path), "--half-width", "5", "--rounds-block", "10"]) == 2
    assert "--rounds-block and --rounds-max-n go together" in capsys.readouterr().err


def test_plan_sizes_the_fidelity_figures_from_a_pilot(tmp_path, capsys):
    """--fidelity-half-width: the n for each paired fidelity figure scales as (h0 / h)^2."""
    rng = np.random.default_rng(2)
    scores = (rng.random(40) < 0.6).astype(float)
    fidelity_run(tmp_path, "full", None, scores)
    kl = rng.exponential(0.4, 40)
    fidelity_run(tmp_path, "h2o", 0.2, scores, kl, 1 - kl / 4, -1.0 - kl)
    targets = plan.fidelity_targets(["kl_mean=0.05", "gold_logprob=0.1"])
    records = plan.plan_fidelity([str(tmp_path)], targets, resamples=2000)
    assert [(r["method"], r["figure"]) for r in records] == [("h2o", "kl_mean"),
                                                             ("h2o", "gold_logprob")]
    kl_record = records[0]
    assert kl_record["n"] == 40 and kl_record["difference"] == pytest.approx(kl.mean())
    halved = plan.plan_fidelity([str(tmp_path)], {"kl_mean": kl_record["half_width"] / 2},
                                resamples=2000)[0]
    assert halved["needed"] == 160
    assert plan.main([str(tmp_path), "--half-width", "5", "--resamples", "300",
                      "--fidelity-half-width", "kl_mean=0.05"]) == 0
    assert "n needed" in capsys.readouterr().out
    err = refused(capsys, str(tmp_path), "--half-width", "5", "--fidelity-half-width", "kl=1")
    assert "kl_mean, top_agree_ratio, gold_logprob" in err
