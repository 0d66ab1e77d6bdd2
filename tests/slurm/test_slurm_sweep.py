"""Sweeps on a real one-node SLURM cluster (scripts/slurm_local.py: munged, MariaDB + slurmdbd,
slurmctld, slurmd) through `hydra/launcher=slurm_cpu` and submitit.

Run with `make test-slurm` (root, Debian packages: see scripts/slurm_local.py); `.ci/run` does.
"""

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import PROJECT, STORIES

pytestmark = pytest.mark.slurm

_spec = importlib.util.spec_from_file_location("slurm_local", PROJECT / "scripts" / "slurm_local.py")
slurm_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slurm_local)

# Two methods x two datasets; text_file without task.path fails (before weights load) in each
# method, so the sweep has successes and failures. One node CPU per member, 1 GB. One array task
# per member (runner.sweep_engine=false), so single members can be cancelled.
RESOURCES = ["hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1",
             "hydra.launcher.mem_gb=1", "hydra.launcher.timeout_min=10", "model=stories260k",
             "model.device=cpu", "runner.threads=1"]
SWEEP = ["-m", *RESOURCES, "method=full,h2o", "task.dataset=pg19,text_file",
         "task.max_tokens=60", "runner.skip_existing=true", "runner.sweep_engine=false"]
# Five RULER samples on stories260K: shard 1 of 2 gets the first two, shard 2 the other three.
RULER = ["task=ruler", "task.lengths=[320]", "task.subtasks=[niah_single]",
         "task.depths=[10,30,50,70,90]", "task.max_new_tokens=8", "method=snapkv,h2o",
         "method.budget_tokens=24"]
CANCELLED = 2  # member #2 = (h2o, pg19): Hydra's order is the product of the overrides
# (h2o, text_file), cancelled while pending: depending on timing sacct records it CANCELLED, keeps
# it PENDING, or has no record of it; the launcher's squeue check covers the last two.
PENDING = 3


def _cannot_run(reason: str) -> None:
    """Skip with the reason; in CI (KVH_REQUIRE_SLURM=1, set by .ci/run) fail instead."""
    if os.environ.get("KVH_REQUIRE_SLURM") == "1":
        pytest.fail(f"KVH_REQUIRE_SLURM=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = slurm_local.missing_binaries()
    if missing:
        _cannot_run(f"SLURM is not installed (no {', '.join(missing)}): "
                    f"apt-get install {' '.join(slurm_local.PACKAGES)}")
    if os.geteuid() != 0:
        _cannot_run("the local SLURM cluster runs its daemons as root")
    if not STORIES.exists():
        _cannot_run(f"{STORIES} is absent (the shared models folder is not next to the project)")
    root = tmp_path_factory.mktemp("slurm")
    env = slurm_local.start(root)
    started = slurm_local.daemon_pids(root)
    yield root, env
    slurm_local.stop(root)
    # Every daemon this cluster started is gone, found by its pid file.
    assert {"slurmctld", "slurmd", "slurmdbd", "mariadb"} <= set(started)
    assert not [n for n, pid in started.items() if slurm_local._alive(pid)]
    assert not slurm_local.running(root)


def harness(env, *args, timeout=600, **popen):
    env = {**env, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(PROJECT)}
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=PROJECT, env=env,
                          capture_output=True, text=True, timeout=timeout, **popen)


def results(root: Path) -> dict[str, Path]:
    """method -> complete run folder."""
    out = {}
    for metrics in root.rglob("metrics.json"):
        if "_sweeps" not in metrics.parts:
            out[json.loads(metrics.read_text())["method"]["name"]] = metrics.parent
    return out


def test_request_that_cannot_fit_is_one_line(cluster, tmp_path):
    _, env = cluster
    # The GPU profile on a node without GPUs: sbatch refuses at once (EnforcePartLimits=ALL).
    proc = harness(env, "-m", "hydra/launcher=slurm", "model=stories260k", "method=full",
                   f"runner.results_root={tmp_path}", f"hydra.sweep.dir={tmp_path}/s", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "SLURM refused the jobs" in errors[0], proc.stderr[-2000:]
    assert "gpus_per_node=1" in errors[0] and "Traceback" not in proc.stderr
    assert not results(tmp_path)


def test_sweep_failures_cancel_and_resume(cluster, tmp_path):
    _, env = cluster
    sweep = [*SWEEP, f"runner.results_root={tmp_path}"]
    # One member at a time; member #2 is cancelled while it runs, #3 while it waits.
    first = subprocess.Popen(
        [sys.executable, "-m", "harness", *sweep, "hydra.launcher.array_parallelism=1",
         f"hydra.sweep.dir={tmp_path}/_sweeps/first"], cwd=PROJECT,
        env={**env, "HYDRA_FULL_ERROR": "0", "PYTHONPATH": str(PROJECT)},
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        array_id = _wait_for_running(env, CANCELLED)
        subprocess.run(["scancel", f"{array_id}_{CANCELLED}", f"{array_id}_{PENDING}"], env=env,
                       check=True, timeout=30)
        _, err = first.communicate(timeout=600)
    finally:
        first.kill()  # no-op once it has exited
    assert first.returncode == 1, err[-3000:]  # failed members make the sweep exit 1
    summary = json.loads((tmp_path / "_sweeps/first/summary.json").read_text())
    assert summary["counts"] == {"ok": 1, "inactive": 0, "skipped": 0, "failed": 3}, summary
    by_job = {m["job"]: m for m in summary["members"]}
    assert "CANCELLED" in by_job[CANCELLED]["detail"] and by_job[CANCELLED]["status"] == "failed"
    # Whichever saw it first (sacct, or the launcher's squeue check), it is reported, not awaited.
    assert by_job[PENDING]["status"] == "failed" and any(
        said in by_job[PENDING]["detail"] for said in ("CANCELLED", "no longer in the queue"))
    assert "task.dataset=text_file needs task.path" in by_job[1]["detail"]
    done = results(tmp_path)
    assert set(done) == {"full"}
    # SLURM's own accounting saw the cancellation (slurmdbd answers sacct).
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j", str(array_id)],
                          env=env, capture_output=True, text=True, timeout=30).stdout
    assert f"{array_id}_{CANCELLED}|CANCELLED" in acct, acct

    again = harness(env, *sweep, f"hydra.sweep.dir={tmp_path}/_sweeps/again")
    assert again.returncode == 1, again.stderr[-3000:]  # text_file still fails, on purpose
    summary = json.loads((tmp_path / "_sweeps/again/summary.json").read_text())
    assert summary["counts"] == {"ok": 2, "inactive": 0, "skipped": 0, "failed": 2}, summary
    resumed = results(tmp_path)
    assert set(resumed) == {"full", "h2o"}
    assert resumed["full"] == done["full"]  # reused, not rerun
    logs = "".join(p.read_text() for p in (tmp_path / "_sweeps/again/.submitit").rglob("*.out"))
    assert logs.count("skipped: a complete result") == 1
    for folder in resumed.values():
        metrics = json.loads((folder / "metrics.json").read_text())
        assert metrics["run"]["status"] == "ok" and metrics["accuracy"]["ppl"] > 1


def _wait_for_running(env, task: int, timeout_s=400) -> str:
    """The array id once array task `task` runs."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        rows = subprocess.run(["squeue", "-h", "-r", "-t", "R", "-o", "%F %K"], env=env,
                              capture_output=True, text=True, timeout=30).stdout.split("\n")
        for array_id, index in (r.split() for r in rows if r.strip()):
            if index == str(task):
                return array_id
        time.sleep(0.3)
    raise AssertionError(f"array task {task} of the sweep never ran")


def test_a_two_shard_array_merges_to_the_unsharded_sweep(cluster, tmp_path):
    """runner.shards=2 under SLURM: one array of two tasks, each running both members on its
    samples, then one merge job; each member's folder equals the unsharded sweep's (run here,
    through the default local launcher)."""
    from tests.helpers.sweeps import folder_figures

    _, env = cluster
    sharded = harness(env, "-m", *RESOURCES, *RULER, "runner.shards=2",
                      f"runner.results_root={tmp_path}/slurm",
                      f"hydra.sweep.dir={tmp_path}/slurm/_sweeps/s")
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    summary = json.loads((tmp_path / "slurm/_sweeps/s/summary.json").read_text())
    assert summary["counts"]["ok"] == 2, summary
    # The array's two tasks, as SLURM's accounting saw them, and the merge job.
    jobs = sorted(p.name for p in (tmp_path / "slurm/_sweeps/s/.submitit").iterdir()
                  if p.is_dir() and p.name[0].isdigit())
    array = [j for j in jobs if "_" in j]  # submitit also keeps a folder per array id
    jobs = array + [j for j in jobs if "_" not in j and j != array[0].split("_")[0]]
    assert len(array) == 2 and len(jobs) == 3 and array[0].endswith("_0"), jobs
    acct = subprocess.run(["sacct", "-n", "-X", "-P", "-o", "JobID,State", "-j",
                           ",".join(j.split("_")[0] for j in jobs)], env=env,
                          capture_output=True, text=True, timeout=30).stdout
    # The merge job may still be ending (its result is written before it exits).
    assert {row.split("|")[0] for row in acct.splitlines() if "|COMPLETED" in row} >= set(array), \
        acct
    logs = "".join(p.read_text() for p in (tmp_path / "slurm/_sweeps/s/.submitit").rglob("*.out"))
    assert logs.count("sweep engine: 2 settings") == 3  # two shards and the merge
    assert "merging the records of 2 shards (10 (setting, sample) answers)" in logs

    local = harness(env, "-m", "model=stories260k", "runner.threads=1", *RULER,
                    f"runner.results_root={tmp_path}/local",
                    f"hydra.sweep.dir={tmp_path}/local/_sweeps/s")
    assert local.returncode == 0, local.stderr[-3000:]
    alone = json.loads((tmp_path / "local/_sweeps/s/summary.json").read_text())
    for a, b in zip(alone["members"], summary["members"]):
        assert folder_figures(Path(b["detail"])) == folder_figures(Path(a["detail"]))
    assert not list((tmp_path / "slurm/_sweep_records").iterdir())
