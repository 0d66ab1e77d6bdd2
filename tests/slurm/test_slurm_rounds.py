"""Sequential rounds (harness.sweep.rounds) on a real one-node SLURM cluster (scripts/slurm_local.py):
each round is a job array of its shards and a merge, and a rerun resumes from the ledger.

Run with `make test-slurm` (root, Debian packages: see scripts/slurm_local.py).
"""

import importlib.util
import json
import os
import subprocess
import sys
import time

import pytest

from tests.conftest import PROJECT, STORIES

pytestmark = pytest.mark.slurm

_spec = importlib.util.spec_from_file_location("slurm_local", PROJECT / "scripts" / "slurm_local.py")
slurm_local = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(slurm_local)

ROUNDS = ["hydra/launcher=slurm_cpu", "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=1",
          "hydra.launcher.timeout_min=10", "model=stories260k", "model.device=cpu",
          "runner.threads=1", "task=ruler", "task.lengths=[320]", "task.subtasks=[niah_single]",
          "task.depths=[25,75]", "task.max_new_tokens=8", "task.samples_per_cell=3",
          "method=h2o,snapkv", "method.budget_tokens=24", "runner.shards=2", "rounds.block=2"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    missing = slurm_local.missing_binaries()
    required = os.environ.get("KVH_REQUIRE_SLURM") == "1"
    why = (f"SLURM is not installed (no {', '.join(missing)})" if missing
           else "the local SLURM cluster runs its daemons as root" if os.geteuid() != 0
           else f"{STORIES} is absent" if not STORIES.exists() else None)
    if why and required:  # CI (.ci/run) must run it
        pytest.fail(f"KVH_REQUIRE_SLURM=1 but {why}", pytrace=False)
    if why:
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    env = slurm_local.start(root)
    yield env
    slurm_local.stop(root)


def rounds(env, tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "harness.sweep.rounds", *ROUNDS, *args,
                           f"runner.results_root={tmp_path}",
                           f"rounds.ledger_dir={tmp_path / 'ledger'}"],
                          cwd=PROJECT, env={**env, "PYTHONPATH": str(PROJECT)},
                          capture_output=True, text=True, timeout=900)


def test_rounds_run_as_slurm_arrays_and_resume(cluster, tmp_path):
    first = rounds(cluster, tmp_path, "rounds.max_n=2")
    assert first.returncode == 0, first.stderr[-3000:]
    more = rounds(cluster, tmp_path, "rounds.max_n=4")
    assert more.returncode == 0, more.stderr[-3000:]
    assert "rounds: resuming after round 1" in more.stdout
    ledger = json.loads((tmp_path / "ledger" / "rounds.json").read_text())
    assert [(r["offset"], r["reference_n"]) for r in ledger["rounds"]] == [(0, 2), (2, 4)]
    for number in (1, 2):  # each round: the full cache and both settings, merged from 2 shards
        runs = list((tmp_path / "ledger" / f"round-0{number}").rglob("metrics.json"))
        assert len(runs) == 3
        assert all(json.loads(m.read_text())["run"]["sweep"]["shards"] == 2 for m in runs)
    # every job SLURM ran: per round an array of two shard tasks and one merge; the last merge
    # may still be ending (its result is written before it exits), so its state is awaited
    deadline = time.monotonic() + 120
    while True:
        jobs = subprocess.run(["sacct", "-X", "-n", "-P", "-o", "JobID,State"], env=cluster,
                              capture_output=True, text=True).stdout.split()
        ending = [j for j in jobs if j.endswith(("|RUNNING", "|COMPLETING"))]
        if not ending or time.monotonic() > deadline:
            break
        time.sleep(2)
    assert len(jobs) == 6 and all(j.endswith("|COMPLETED") for j in jobs), jobs
