"""Sweeps end to end (Hydra multirun through the CLI): skipped combinations, failing members,
resume after kill -9, submitit_local, experiment presets, W&B offline, determinism."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir

from harness.run import run
from kvcore.errors import ConfigError
from tests.conftest import PROJECT, STORIES, need_shared
from tests.helpers.reports import fake_run
from tests.helpers.runs import ST, cli_here

BASE = ["model=stories260k", "task.max_tokens=60", "task.dataset=pg19"]


def cli(*args, timeout=300, **popen):
    env = dict(os.environ, HYDRA_FULL_ERROR="0", WANDB_MODE="offline")
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=timeout, **popen)


def complete_runs(root: Path) -> list[Path]:
    return sorted(p.parent for p in root.rglob("metrics.json") if "_sweeps" not in p.parts)


@pytest.fixture(autouse=True)
def _stories():
    need_shared(STORIES)


def test_sweep_skips_what_a_method_cannot_take_and_reports_failures(tmp_path):
    proc = cli("-m", "method=full,h2o", "method.budget_ratio=0.2", "task.dataset=pg19,text_file",
               *BASE[:2], f"runner.results_root={tmp_path}")
    # full x budget: skipped (2); h2o x pg19: ok; h2o x text_file without a path: failed
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads(next(tmp_path.glob("_sweeps/*/summary.json")).read_text())
    assert summary["counts"] == {"ok": 1, "inactive": 0, "skipped": 2, "failed": 1}
    failed = [m for m in summary["members"] if m["status"] == "failed"][0]
    assert "task.dataset=text_file needs task.path" in failed["detail"]
    assert "1 ok, 2 skipped, 1 failed, 0 inactive" in proc.stdout
    assert len(complete_runs(tmp_path)) == 1


def test_kill_9_then_rerun_resumes(tmp_path):
    # 300 tokens: each member's own pass takes long enough (even on a loaded machine) for the
    # kill to land between the first result and the last
    args = ["-m", "method=full,h2o,streaming_llm,oracle_topk", "model=stories260k",
            "task.dataset=pg19", "task.max_tokens=300",
            "runner.skip_existing=true", f"runner.results_root={tmp_path}"]
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    proc = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=PROJECT, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    deadline = time.time() + 240
    while len(complete_runs(tmp_path)) < 1 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    before = complete_runs(tmp_path)
    assert 1 <= len(before) < 4, "the kill should land mid-sweep"
    again = cli(*args)
    assert again.returncode == 0, again.stderr[-2000:]
    after = complete_runs(tmp_path)
    assert len(after) == 4 and set(before) <= set(after)  # finished runs reused, not redone
    assert again.stdout.count("skipped: a complete result") == len(before)
    for folder in after:
        json.loads((folder / "metrics.json").read_text())  # every result parses
    leftovers = [p for p in tmp_path.rglob("*partial*") if p.is_dir()]
    assert all(not (p / "metrics.json").exists() for p in leftovers)


def test_submitit_local_launcher(tmp_path):
    proc = cli("-m", "hydra/launcher=submitit_local", "method=full,h2o", *BASE,
               f"runner.results_root={tmp_path}", f"hydra.sweep.dir={tmp_path}/_sweeps/s")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert len(complete_runs(tmp_path)) == 2


def test_experiment_presets_compose():
    for path in sorted((PROJECT / "conf" / "experiment").glob("*.yaml")):
        with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
            cfg = compose("config", [f"experiment={path.stem}"], return_hydra_config=True)
        assert cfg.model.name and cfg.task.name, path.name


def test_slurm_launcher_config_composes():
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        cfg = compose("config", ["hydra/launcher=slurm"], return_hydra_config=True)
    assert cfg.hydra.launcher._target_.endswith("SlurmLauncher")
    assert cfg.hydra.launcher.gpus_per_node == 1 and cfg.hydra.launcher.timeout_min == 240


def _cfg(*overrides):
    with initialize_config_dir(config_dir=str(PROJECT / "conf"), version_base="1.3"):
        return compose("config", list(overrides))


def test_same_config_twice_gives_identical_accuracy(tmp_path):
    a = run(_cfg(*BASE, "method=h2o", f"runner.results_root={tmp_path}/a"))
    b = run(_cfg(*BASE, "method=h2o", f"runner.results_root={tmp_path}/b"))
    ma, mb = (json.loads((x / "metrics.json").read_text()) for x in (a, b))
    assert ma["accuracy"] == mb["accuracy"]
    assert ma["run"]["config_hash"] == mb["run"]["config_hash"]
    assert ma["env"]["git"].keys() == {"commit", "dirty"} and ma["protocol"]["seed"] == 0


def test_wandb_offline_run_holds_the_metrics(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = run(_cfg(*BASE, "logger=wandb", f"runner.results_root={tmp_path}"))
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["logger"]["mode"] == "offline"
    # the sync hint a user copies names the final folder, which exists (not the staging one)
    printed = capfd.readouterr()
    assert ".partial-" not in printed.out + printed.err
    assert f"wandb sync {out}/wandb/offline-run-" in printed.out
    assert Path(metrics["logger"]["dir"]).is_dir() and str(out) in metrics["logger"]["dir"]
    runs = list((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1
    blob = runs[0].read_bytes()
    assert b"accuracy/ppl" in blob and json.dumps(metrics["accuracy"]["ppl"]).encode() in blob
    assert b"nll_per_block" in blob and b"kv_tokens_per_layer" in blob


def test_sweep_with_output_dir_is_refused_in_one_line(tmp_path, monkeypatch):
    status, _, err = cli_here(monkeypatch, "-m", "method=full,h2o", *BASE,
                              f"runner.output_dir={tmp_path}/pinned",
                              f"runner.results_root={tmp_path}")
    assert status == 2, err[-2000:]
    assert err.strip().splitlines() == [
        "error: runner.output_dir cannot be used with a sweep (-m): every member would write the "
        "same folder. Drop it: each member gets its own folder under runner.results_root"]
    assert not list(tmp_path.iterdir())


def test_unknown_member_is_recorded_and_the_others_run(tmp_path):
    proc = cli("-m", "method=full,nosuch,h2o", *BASE, f"runner.results_root={tmp_path}")
    assert proc.returncode == 1, proc.stderr[-2000:]
    summary = json.loads(next(tmp_path.glob("_sweeps/*/summary.json")).read_text())
    assert summary["counts"] == {"ok": 2, "inactive": 0, "skipped": 0, "failed": 1}
    failed = [m for m in summary["members"] if m["status"] == "failed"][0]
    assert failed["detail"].startswith("method=nosuch is unknown; allowed: ")
    allowed = failed["detail"].split("allowed: ", 1)[1].split(", ")
    assert {"full", "h2o", "duo_attention"} <= set(allowed) and allowed == sorted(allowed)
    assert "_shared" not in failed["detail"]
    assert "3 members, 2 ok, 0 skipped, 1 failed" in proc.stdout
    assert len(complete_runs(tmp_path)) == 2


def test_two_sweeps_at_once_keep_their_own_folders(tmp_path):
    """Started together (usually in the same second): each has its own folder and summary, and
    the one with a failing member says so and exits non-zero."""
    env = dict(os.environ, HYDRA_FULL_ERROR="0")
    common = ["-m", *BASE[:2], f"runner.results_root={tmp_path}"]
    procs = [subprocess.Popen([sys.executable, "-m", "harness", *common, *extra], cwd=PROJECT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for extra in (["method=full", "task.dataset=text_file"], ["method=h2o"])]
    (bad_out, _), (good_out, good_err) = (p.communicate(timeout=300) for p in procs)
    assert [p.returncode for p in procs] == [1, 0], good_err[-2000:]
    assert "1 members, 0 ok, 0 skipped, 1 failed" in bad_out
    assert "1 members, 1 ok, 0 skipped, 0 failed" in good_out
    summaries = sorted(tmp_path.glob("_sweeps/*/summary.json"))
    assert len(summaries) == 2


def test_claimed_sweep_folders_are_unique(tmp_path):
    from harness.config.multirun import claim_sweep_dir

    base = tmp_path / "_sweeps" / "20261130-120000"
    first, second = claim_sweep_dir(base), claim_sweep_dir(base)
    assert first == base and second == base.with_name("20261130-120000-2")


def test_explicit_sweep_folder_with_earlier_statuses_is_refused(tmp_path, monkeypatch):
    sweep = tmp_path / "s"
    (sweep / "status").mkdir(parents=True)
    (sweep / "status" / "0000.json").write_text('{"job": 0, "status": "failed", "detail": "old"}')
    status, _, err = cli_here(monkeypatch, "-m", "method=full", *BASE,
                              f"runner.results_root={tmp_path}", f"hydra.sweep.dir={sweep}")
    assert status == 2 and "already holds an earlier sweep's" in err
    assert not complete_runs(tmp_path)


def test_a_member_that_reported_nothing_counts_as_failed(tmp_path):
    from harness.config.multirun import read_statuses

    for num in (0, 1):
        (tmp_path / str(num)).mkdir()
    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "0000.json").write_text('{"job": 0, "status": "ok", "detail": "x"}')
    statuses = read_statuses(tmp_path)
    assert [s["status"] for s in statuses] == ["ok", "failed"]
    assert "without reporting" in statuses[1]["detail"]


def test_options_added_later_keep_earlier_runs_resumable():
    """A run made before runner.kv_device_limit_mib / kv_admission / task.query existed has the
    identity of one made with them at their neutral values; any other value is a different run."""
    from omegaconf import OmegaConf

    from harness.config.multirun import config_hash

    base = {"runner": {"batch_size": 1}, "task": {"name": "ruler"}, "method": {"name": "full"}}
    neutral = {"runner": {"batch_size": 1, "kv_device_limit_mib": None, "kv_admission": "request"},
               "task": {"name": "ruler", "query": "aware"}, "method": {"name": "full"}}
    assert config_hash(OmegaConf.create(base)) == config_hash(OmegaConf.create(neutral))
    for group, key, value in (("runner", "kv_device_limit_mib", 64),
                              ("runner", "kv_admission", "layerkv"), ("task", "query", "agnostic")):
        other = OmegaConf.create(neutral)
        other[group][key] = value
        assert config_hash(other) != config_hash(OmegaConf.create(base)), key


@pytest.mark.usefixtures("shared_folder")
def test_sweep_into_a_users_folder_is_refused(tmp_path, monkeypatch):
    users = tmp_path / "mine"
    users.mkdir()
    (users / "multirun.yaml").write_text("my own notes\n")
    status, _, err = cli_here(monkeypatch, "-m", *ST, "method=full,h2o",
                              f"runner.results_root={tmp_path / 'r'}", f"hydra.sweep.dir={users}")
    assert status == 2, err[-2000:]
    assert "is a non-empty folder that is not a sweep of this harness" in err
    assert (users / "multirun.yaml").read_text() == "my own notes\n"
    assert sorted(p.name for p in users.iterdir()) == ["multirun.yaml"]
    assert not (tmp_path / "r").exists()


@pytest.mark.usefixtures("shared_folder")
def test_refused_sweep_leaves_no_sweep_folder(tmp_path, monkeypatch):
    root = tmp_path / "r"
    status, _, err = cli_here(monkeypatch, "-m", *ST, "model=stories260k,hf", "model.path=/x",
                              f"runner.results_root={root}")
    assert status == 2, err[-2000:]
    assert err.strip().splitlines() == [err.strip()]
    assert "model.path is not a key of model=hf" in err
    assert not root.exists(), sorted(map(str, root.rglob("*")))


@pytest.mark.usefixtures("shared_folder")
def test_sweep_with_an_added_unknown_key_is_refused_before_any_member(tmp_path, monkeypatch):
    root = tmp_path / "r"
    status, _, err = cli_here(monkeypatch, "-m", *ST, "+runner.foo=1,2",
                              f"runner.results_root={root}")
    assert status == 2, err[-2000:]
    assert "runner.foo is not a key of runner" in err
    assert not root.exists()


def test_read_only_sweep_root_and_report_out_are_one_line(tmp_path, monkeypatch, capsys):
    from harness import report
    from harness.store import results
    from harness.config import multirun as sweep

    def read_only(*a, **k):
        raise OSError(errno.EROFS, "Read-only file system")

    monkeypatch.setattr(Path, "mkdir", read_only)
    with pytest.raises(ConfigError, match="runner.results_root=/ro: cannot create the sweep "
                                          "folder .*Read-only file system"):
        sweep.claim_sweep_dir(Path("/ro/_sweeps/20260101-000000"), "runner.results_root=/ro")
    monkeypatch.undo()
    fake_run(tmp_path / "runs", "full", 50.0, 100.0)
    monkeypatch.setattr(results.tempfile, "mkstemp", read_only)
    assert report.main([str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "--out" in err and "Read-only file system" in err and len(err.splitlines()) == 1
