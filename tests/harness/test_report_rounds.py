"""The report over a sweep run in rounds (harness.sweep.rounds): it finds the ledger above the
runs, shows each setting's anytime-valid confidence sequence and verdict from it, and says that
its own fixed-n intervals do not hold for those runs; runs outside a ledger get no such section,
and a ledger it cannot read is named, not fatal."""

import json
import shutil

import numpy as np

from harness import report
from harness.report import ledgers
from harness.sweep import rounds as rd
from tests.helpers.reports import ruler_run
from tests.helpers.rounds import FakeLaunch


def rounds_sweep(tmp_path):
    """A finished rounds sweep (planted scores) whose run folders hold metrics.json too."""
    knobs = rd.check_knobs({"block": 20, "max_n": 60, "margin_points": 5,
                            "ledger_dir": str(tmp_path / "runs" / "ledger")})
    rd.run_rounds(["task=ruler", "method=same,bad,close"], knobs, "ruler", str(tmp_path),
                  tmp_path / "sweep", FakeLaunch(tmp_path / "sweep"), say=lambda line: None)
    folders = sorted(p.parent for p in (tmp_path / "runs" / "ledger").rglob("samples.jsonl"))
    for k, folder in enumerate(folders):
        scores = [json.loads(line)["score"] for line in (folder / "samples.jsonl").open()]
        made = ruler_run(tmp_path / "scratch" / str(k), folder.parent.name, scores,
                         budget=None if folder.parent.name == "full" else 0.2)
        metrics = json.loads((made / "metrics.json").read_text())
        metrics["task"]["options"] = {"skip_samples": int(folder.parent.parent.name[-2:]) * 20}
        metrics["run"]["config_hash"] += str(k)
        (folder / "metrics.json").write_text(json.dumps(metrics))
    return tmp_path / "runs" / "ledger", folders


def test_the_report_shows_the_rounds_ledger_beside_the_runs(tmp_path):
    home, folders = rounds_sweep(tmp_path)
    ledger = json.loads((home / ledgers.LEDGER).read_text())
    assert ledger["reported"]["method=bad"]["stopped"]  # a clear loser stopped early
    _, out, _ = report.build_report([str(tmp_path / "runs")], tmp_path / "out", resamples=200)
    text = (out / "report.md").read_text()
    section = text[text.index("## Sweeps in rounds"):]
    assert section.splitlines()[2].startswith("runs/ledger: block 20, max_n 60, alpha 0.05")
    assert f"{len(folders)} of the runs above were sampled in these rounds" in section
    bad = ledger["reported"]["method=bad"]
    v = bad["versus_reference"]
    assert (f"| method=bad | {ledger['levels']['method=bad']} | worse | {v['mean']:+.1f} | "
            f"[{v['low']:+.1f}, {v['high']:+.1f}] | {bad['n']} | {bad['round']} |") in section
    assert "## Sweeps in rounds" in (out / "leaderboard.md").read_text()
    page = (out / "report.html").read_text()
    assert "<h3>Sweeps in rounds</h3>" in page and str(tmp_path) not in page


def test_runs_outside_a_ledger_get_no_rounds_section(tmp_path):
    for method, budget in (("full", None), ("h2o", 0.2)):
        ruler_run(tmp_path / "runs", method, [1, 0] * 10, budget=budget)
    _, out, _ = report.build_report([str(tmp_path / "runs")], tmp_path / "out", resamples=200)
    assert "Sweeps in rounds" not in (out / "report.md").read_text()


def test_an_unreadable_ledger_is_named_and_the_report_still_made(tmp_path):
    home, _ = rounds_sweep(tmp_path)
    (home / ledgers.LEDGER).write_text("{not json")
    said = []
    _, out, _ = report.build_report([str(tmp_path / "runs")], tmp_path / "out", warn=said.append,
                                    resamples=200)
    assert any(f"skipped the rounds ledger {home / ledgers.LEDGER}: not readable" in line
               for line in said)
    assert "Sweeps in rounds" not in (out / "report.md").read_text()


def test_a_run_copied_out_of_its_rounds_folder_is_not_claimed(tmp_path):
    home, folders = rounds_sweep(tmp_path)
    alone = tmp_path / "elsewhere" / "run"
    shutil.copytree(folders[0], alone)
    assert ledgers.covering([alone, folders[0]]) == {home.resolve(): [folders[0]]}
    assert np.isfinite(json.loads((home / ledgers.LEDGER).read_text())["max_n"])
