"""The rounds driver (harness.sweep.rounds): knobs and sweep shapes refused in one line, rounds that
sample only the undecided settings on consecutive sample windows, a ledger that resumes after a
cut without answering any (setting, sample) twice, and the whole thing through the CLI on
stories260K."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from harness.sweep import rounds as rd
from kvcore.errors import ConfigError
from tests.conftest import PROJECT, STORIES, need_shared
from tests.helpers.rounds import FakeLaunch
from tests.helpers.runs import cli_here


@pytest.mark.parametrize("raw, match", [
    ({"block": 0}, "rounds.block=0 must be an integer >= 1"),
    ({"block": 20, "max_n": 10}, r"rounds.max_n=10 must be a multiple of rounds.block=20"),
    ({"block": 20, "max_n": 50}, r"rounds.max_n=50 must be a multiple of rounds.block=20"),
    ({"alpha": 1.0}, r"rounds.alpha=1.0 must be a number in \(0, 1\)"),
    ({"margin_points": -1}, r"rounds.margin_points=-1 must be a number in \[0, 100\)"),
    ({"top_k": 0}, "rounds.top_k=0 must be an integer >= 1 or null"),
    ({"blocks": 3}, "rounds.blocks is not a rounds knob; allowed: rounds.block"),
])
def test_bad_knobs_are_one_line(raw, match):
    with pytest.raises(ConfigError, match=match):
        rd.check_knobs(raw)


@pytest.mark.parametrize("args, match", [
    (["model=a,b", "method=h2o"], "model has several values"),
    (["method=h2o", "task.limit=10"], "task.limit is set by the rounds"),
    (["method=full"], "no setting to compare with the full cache"),
])
def test_sweeps_rounds_cannot_run_are_refused(args, match):
    with pytest.raises(ConfigError, match=match):
        rd.plan(args)


def test_the_plan_has_settings_levels_and_one_reference():
    p = rd.plan(["task=ruler", "method=full,h2o,snapkv", "method.budget_ratio=0.2,0.5",
                 "method.recent_ratio=0.5"])
    assert sorted(p.settings) == ["method=h2o method.budget_ratio=0.2",
                                  "method=h2o method.budget_ratio=0.5",
                                  "method=snapkv method.budget_ratio=0.2",
                                  "method=snapkv method.budget_ratio=0.5"]
    assert p.levels["method=h2o method.budget_ratio=0.2"] == "budget_ratio=0.2"
    assert p.reference == ["task=ruler", "method=full"]  # no method knob of the settings


def test_rounds_sample_the_undecided_only_and_resume_after_a_cut(tmp_path):
    knobs = rd.check_knobs({"block": 20, "max_n": 400, "margin_points": 5, "top_k": 1,
                            "ledger_dir": str(tmp_path / "ledger")})
    args = ["task=ruler", "method=same,bad,close,refused"]
    first = FakeLaunch(tmp_path / "sweep1", cut_at=3)
    with pytest.raises(KeyboardInterrupt):
        rd.run_rounds(args, knobs, "ruler", str(tmp_path), tmp_path / "sweep1", first,
                      say=lambda line: None)
    ledger = json.loads((tmp_path / "ledger" / rd.LEDGER).read_text())
    assert len(ledger["rounds"]) == 2 and ledger["status"] == "running"
    again = FakeLaunch(tmp_path / "sweep2")
    lines = []
    ledger = rd.run_rounds(args, knobs, "ruler", str(tmp_path), tmp_path / "sweep2", again,
                           say=lines.append)
    assert lines[0].startswith("rounds: resuming after round 2")
    # the cut round's jobs had not run; nothing finished ran again
    answered = first.ran + again.ran
    assert len(answered) == len(set(answered))
    windows = [(r["offset"], r["block"]) for r in ledger["rounds"]]
    assert windows == [(20 * i, 20) for i in range(len(windows))]
    reported = ledger["reported"]
    assert ledger["skipped"] == {"method=refused": "skipped: no budget knob"}
    assert "method=refused" not in reported and "  method=refused: not run (skipped: no budget " \
        "knob)" in lines
    assert all("method=refused" not in r["ran"] for r in ledger["rounds"])
    assert reported["method=bad"]["verdict"] == "worse"
    assert reported["method=same"]["verdict"] == "indistinguishable"
    assert reported["method=same"]["membership"] == "in"
    # the clear loser stopped first, and was never sampled after its stopping round
    stop = reported["method=bad"]["round"]
    assert all("method=bad" not in r["ran"] for r in ledger["rounds"][stop:])
    assert reported["method=bad"]["n"] == 20 * stop < reported["method=close"]["n"]
    assert ledger["status"] == "done"
    table = (tmp_path / "ledger" / rd.TABLE).read_text().splitlines()
    bad = reported["method=bad"]
    assert (f"| method=bad | default | worse | {bad['versus_reference']['mean']:+.1f} | "
            f"[{bad['versus_reference']['low']:+.1f}, {bad['versus_reference']['high']:+.1f}] | "
            f"{bad['n']} | {bad['round']} | out |") in table
    # a rerun of a finished sweep replays its rounds and runs nothing
    idle = FakeLaunch(tmp_path / "sweep3")
    rd.run_rounds(args, knobs, "ruler", str(tmp_path), tmp_path / "sweep3", idle,
                  say=lambda line: None)
    assert idle.ran == []


def test_a_ledger_of_another_sweep_is_refused(tmp_path):
    knobs = rd.check_knobs({"block": 20, "max_n": 40, "ledger_dir": str(tmp_path / "l")})
    rd.run_rounds(["method=same,bad"], knobs, "ruler", str(tmp_path), tmp_path / "s",
                  FakeLaunch(tmp_path / "s"), say=lambda line: None)
    other = rd.check_knobs({"block": 10, "max_n": 40, "ledger_dir": str(tmp_path / "l")})
    with pytest.raises(ConfigError, match="records another sweep"):
        rd.run_rounds(["method=same,bad"], other, "ruler", str(tmp_path), tmp_path / "s2",
                      FakeLaunch(tmp_path / "s2"), say=lambda line: None)


STORIES_RULER = ["model=stories260k", "task=ruler", "task.lengths=[320]",
                 "task.subtasks=[niah_single]", "task.depths=[25,75]", "task.max_new_tokens=8",
                 "task.samples_per_cell=3", "runner.threads=1", "method=h2o,snapkv",
                 "method.budget_tokens=24"]


def _cli(args, tmp_path):
    return subprocess.run([sys.executable, "-m", "harness.sweep.rounds", *STORIES_RULER, *args,
                           f"runner.results_root={tmp_path}"],
                          cwd=PROJECT, env={**os.environ, "PYTHONPATH": str(PROJECT)},
                          capture_output=True, text=True, timeout=600)


def test_the_cli_runs_rounds_and_resumes_on_stories260k(tmp_path, monkeypatch):
    need_shared(STORIES)
    ledger_dir = tmp_path / "ledger"

    def refused(*args):  # the command's refusals, in this process (no torch import to wait for)
        status, _, err = cli_here(monkeypatch, *args, f"runner.results_root={tmp_path}",
                                  entry=rd.main)
        assert status == 2, err[-3000:]
        assert not any(tmp_path.iterdir())  # refused before anything ran: nothing left behind
        return err.strip().splitlines()[-1]

    assert refused(*STORIES_RULER, "rounds.block=0") == (
        "error: rounds.block=0 must be an integer >= 1 (samples a round adds per setting)")
    assert refused("model=stories260k", "task=perplexity", "method=h2o,snapkv") == (
        "error: task=perplexity has no task.skip_samples (a window of its samples): rounds run "
        "on task=ruler")
    assert refused(*STORIES_RULER, "rounds.block=2", "rounds.max_n=8") == (  # 3 a cell x 2 cells
        "error: rounds.max_n=8 is more than the task's 6 samples (task.samples_per_cell=3 x 2 "
        "cells); allowed: task.samples_per_cell >= 4, or a smaller rounds.max_n")
    one = _cli(["rounds.block=2", "rounds.max_n=2", f"rounds.ledger_dir={ledger_dir}"], tmp_path)
    assert one.returncode == 0, one.stderr[-3000:]
    first = sorted(p.parent for p in (ledger_dir / "round-01").rglob("metrics.json"))
    assert len(first) == 3  # the full cache, h2o, snapkv
    two = _cli(["rounds.block=2", "rounds.max_n=4", f"rounds.ledger_dir={ledger_dir}"], tmp_path)
    assert two.returncode == 0, two.stderr[-3000:]
    assert "rounds: resuming after round 1" in two.stdout
    assert sorted(p.parent for p in (ledger_dir / "round-01").rglob("metrics.json")) == first
    ledger = json.loads((ledger_dir / rd.LEDGER).read_text())
    assert [(r["round"], r["offset"], r["reference_n"]) for r in ledger["rounds"]] == [
        (1, 0, 2), (2, 2, 4)]
    samples = [json.loads(line) for f in sorted((ledger_dir / "round-02").rglob("samples.jsonl"))
               for line in f.read_text().splitlines()]
    ids_1 = {json.loads(line)["sample_id"] for f in first
             for line in (f / "samples.jsonl").read_text().splitlines()}
    assert len(samples) == 6 and not ids_1 & {s["sample_id"] for s in samples}
    # killed after round 2's jobs, before its ledger entry: the rerun reuses the round's runs
    second = sorted(p.parent for p in (ledger_dir / "round-02").rglob("metrics.json"))
    ledger["rounds"] = ledger["rounds"][:1]
    (ledger_dir / rd.LEDGER).write_text(json.dumps(ledger))
    cut = _cli(["rounds.block=2", "rounds.max_n=4", f"rounds.ledger_dir={ledger_dir}"], tmp_path)
    assert cut.returncode == 0, cut.stderr[-3000:]
    assert cut.stdout.count("skipped: a complete result for this config") == 3
    assert sorted(p.parent for p in (ledger_dir / "round-02").rglob("metrics.json")) == second
    assert len(json.loads((ledger_dir / rd.LEDGER).read_text())["rounds"]) == 2


def test_a_round_unbalanced_over_the_cells_is_named():
    assert rd.unbalanced(14, 7) is None
    assert rd.unbalanced(20, 7) == (
        "rounds.block=20 is not a multiple of the task's 7 cells: a round does not hold every "
        "cell equally often, so the intervals' coverage of the cells' mean is approximate; e.g. "
        "rounds.block=21")


def test_rounds_arguments_are_read_apart_from_the_sweep():
    knobs, rest = rd.split_argv(["-m", "method=h2o,snapkv", "rounds.block=10",
                                 "rounds.top_k=null", "rounds.alpha=0.1", "task=ruler"])
    assert knobs == {"block": 10, "top_k": None, "alpha": 0.1}
    assert rest == ["method=h2o,snapkv", "task=ruler"]
    with pytest.raises(ConfigError, match="give rounds.block=<value>"):
        rd.split_argv(["rounds.block"])
    with pytest.raises(ConfigError, match="a backslash cannot pass"):
        rd.check_knobs({"ledger_dir": "a\\b"})


def test_a_budget_beyond_the_task_samples_is_refused():
    assert rd.too_few_samples(70, 7, 10) is None
    assert rd.too_few_samples(200, 7, 10) == (
        "rounds.max_n=200 is more than the task's 70 samples (task.samples_per_cell=10 x 7 "
        "cells); allowed: task.samples_per_cell >= 29, or a smaller rounds.max_n")


def test_the_task_cells_count_ruler_cycle():
    from omegaconf import OmegaConf

    from harness import CONF_DIR
    from hydra_plugins.kvh_rounds.rounds_sweeper import task_cells

    cfg = OmegaConf.create({"task": OmegaConf.load(CONF_DIR / "task" / "ruler.yaml")})
    cfg.task.subtasks, cfg.task.lengths = ["niah_single", "niah_multikey", "vt"], [1024]
    cfg.task.limit, cfg.task.samples_per_cell = 3, 4  # neither changes the cycle
    assert task_cells(cfg) == 7  # niah_single at 5 depths, 2 other sub-tasks
    cfg.task.lengths = [1024, 4096]
    assert task_cells(cfg) == 14
