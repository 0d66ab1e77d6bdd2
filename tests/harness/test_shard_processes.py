"""A sweep's shard processes die with it: killed by SIGKILL (no handler of the sweep's runs),
its shards are stopped by the kernel's parent-death signal or by their own parent check, never
left computing for nobody."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import PROJECT, STORIES, need_shared
from tests.helpers.processes import alive, gone_within

# The sweep: two shards of a RULER sweep long enough to outlive the test by far if not stopped.
SWEEP = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from hydra import compose, initialize_config_dir
    from harness.sweep.shards import start_local
    with initialize_config_dir(config_dir=sys.argv[1], version_base="1.3"):
        cfg = compose(config_name="config", overrides=[
            "model=stories260k", "task=ruler", "task.lengths=[320]", "task.samples_per_cell=50",
            "method=h2o", "runner.threads=1", "runner.shards=2",
            "runner.results_root=" + sys.argv[2]])
    procs = start_local([cfg], None, 2, Path(sys.argv[2]) / "shards")
    print(" ".join(str(p.pid) for p, _ in procs), flush=True)
    time.sleep(300)
""")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc (Linux)")
def test_shards_die_when_their_sweep_is_killed(tmp_path):
    need_shared(STORIES)
    sweep = subprocess.Popen([sys.executable, "-c", SWEEP, str(PROJECT / "conf"),
                              str(tmp_path)], cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    try:
        shards = [int(p) for p in sweep.stdout.readline().split()]
        assert len(shards) == 2 and all(alive(p) for p in shards)
        time.sleep(1.0)  # the shards are importing torch, far from done
        sweep.send_signal(signal.SIGKILL)
        sweep.wait()
        assert gone_within(shards, 10), "a shard outlived its killed sweep"
    finally:
        sweep.kill()
        for pid in shards if "shards" in locals() else []:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def test_a_shard_checks_its_parent_itself(tmp_path):
    """Where the parent-death signal is not armed (another system, or a parent gone before it
    was), the shard's own check stops it."""
    child = ("import os, sys, time; from harness.sweep.shards import watch_parent; "
             "watch_parent(int(sys.argv[1]), every_s=0.1); time.sleep(60)")
    parent = subprocess.Popen([sys.executable, "-c", textwrap.dedent(f"""
        import os, subprocess, sys, time
        p = subprocess.Popen([sys.executable, "-c", {child!r}, str(os.getpid())])
        print(p.pid, flush=True)
        time.sleep(60)
    """)], cwd=PROJECT, stdout=subprocess.PIPE, text=True)
    pid = int(parent.stdout.readline())
    time.sleep(1.5)  # the child is watching
    assert alive(pid)
    parent.kill()
    parent.wait()
    assert gone_within([pid], 10)


def test_shards_are_bounded(tmp_path):
    """More shard processes than this machine's CPUs (a local sweep) or than a SLURM array
    takes: one line naming runner.shards, before any shard starts, nothing written."""
    from tests.helpers.runs import cli

    need_shared(STORIES)
    cpus = len(os.sched_getaffinity(0))
    root = tmp_path / "results"
    base = ["-m", "model=stories260k", "task=ruler", "task.lengths=[320]", "method=full,h2o",
            "runner.threads=1", f"runner.results_root={root}",
            f"hydra.sweep.dir={tmp_path}/sweeps"]
    local = cli(*base, f"runner.shards={cpus + 1}")
    assert f"runner.shards={cpus + 1} starts {cpus + 1} shard processes" in local.stderr
    assert not (tmp_path / "sweeps" / "shards").exists() and not list(root.rglob("*.jsonl"))
    huge = cli(*[a for a in base[1:] if not a.startswith("method=")], "method=full",
               "runner.shards=1001")
    assert huge.returncode == 2 and "runner.shards=1001: allowed 1..1000" in huge.stderr
