"""A sweep's comparison on W&B (offline): the leaderboard as one table and the report's figures,
in one run of the sweep's group, from the members' complete runs."""

import json
import time

from omegaconf import OmegaConf

from harness.report.loggers import comparison_table
from harness.report import leaderboard
from harness.report.collect import collect
from harness.sweep.summary import SweepSummary
from tests.helpers.reports import fake_run


def sweep_of_runs(tmp_path):
    folders = [fake_run(tmp_path / "runs", "full", 50.0, 100.0, density=1.0),
               fake_run(tmp_path / "runs", "h2o", 55.0, 90.0, budget=0.2, density=0.21),
               fake_run(tmp_path / "runs", "h2o", 52.0, 85.0, budget=0.5, density=0.51)]
    statuses = [{"job": i, "status": "ok", "detail": str(f)} for i, f in enumerate(folders)]
    statuses.append({"job": 3, "status": "failed", "detail": "ConfigError: no"})
    sweep_dir = tmp_path / "_sweeps" / "20261201-120000"
    sweep_dir.mkdir(parents=True)
    return folders, statuses, sweep_dir


def test_sweep_logs_one_comparison_table_and_the_figures(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "offline")
    folders, statuses, sweep_dir = sweep_of_runs(tmp_path)
    config = OmegaConf.create({"logger": {"name": "wandb", "project": "kvh-test", "entity": None,
                                          "group": None, "mode": "offline"}})
    SweepSummary._log_comparison(config, sweep_dir, statuses)
    assert "comparison: 3 leaderboard rows" in capsys.readouterr().out
    assert (sweep_dir / "report" / "report.html").is_file()
    files = next(sweep_dir.glob("wandb/offline-run-*/files"))
    tables = list(files.glob("media/table/leaderboard_*.table.json"))
    assert len(tables) == 1
    logged = json.loads(tables[0].read_text())
    columns, data = comparison_table(leaderboard.build(collect([str(f) for f in folders])))
    made = list((sweep_dir / "report").glob("*.png"))
    assert logged["columns"] == columns and len(logged["data"]) == len(data) == 3
    held = columns.index("kv_held")
    assert [c for c in columns if c.startswith("perplexity")][1:] == [
        f"perplexity ppl {part}" for part in leaderboard.INTERVAL_PARTS]  # each cell's interval
    assert sorted(r[held] for r in logged["data"]) == [0.2, 0.5, 1.0]
    images = list(files.glob("media/images/figures/*.png"))
    assert len(images) == len(made) >= 4
    log = next(sweep_dir.glob("wandb/offline-run-*/run-*.wandb"))
    for _ in range(100):  # W&B's service may still be appending to its log (busy machines)
        if sweep_dir.name.encode() in log.read_bytes():
            break
        time.sleep(0.1)
    assert sweep_dir.name.encode() in log.read_bytes()  # the group: the sweep folder's name


def test_no_logger_logs_nothing(tmp_path):
    _, statuses, sweep_dir = sweep_of_runs(tmp_path)
    SweepSummary._log_comparison(OmegaConf.create({"logger": {"name": "none"}}), sweep_dir,
                                 statuses)
    assert list(sweep_dir.iterdir()) == []
