"""SLURM sweeps: what hydra-submitit's launcher adds for us (the launcher class itself lives in
hydra_plugins/kvh_slurm/, where Hydra requires it). Two failure modes become one line each.

* A request the cluster cannot serve (more memory, CPUs or GPUs than the partition's nodes have, a
  partition that does not exist) is refused by `sbatch` (`EnforcePartLimits=ALL` on the cluster):
  the sweep stops before anything runs with `error: SLURM refused the jobs (...)` naming the
  resources asked for, instead of a submitit traceback.
* A member whose job was cancelled (`scancel`), killed or timed out before writing its result is
  recorded as failed in `<sweep dir>/status/` with SLURM's state, so the sweep summary reports it
  and the other members' results still count, instead of one traceback ending the sweep.

submitit learns that a job ended from `sacct`, which misses some ends: an array task cancelled
while pending leaves no accounting record, and without slurmdbd `sacct` cannot answer at all. So
the launcher also reads `squeue` (`queue_states`, `ended_in_queue`): a job that ended there or left
the queue without a result is reported after `ENDED_GRACE_S`, never waited on forever.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any, Sequence

from harness.store.results import write_json_atomic

# A job SLURM no longer runs gets this long to show its result file (shared file systems lag).
ENDED_GRACE_S = 30.0
RUNNING_STATES = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "SUSPENDED", "REQUEUED",
                  "RESIZING", "SIGNALING", "STAGE_OUT", "STOPPED", "REQUEUE_HOLD", "REQUEUE_FED"}
RESOURCE_KEYS = ("partition", "nodes", "gpus_per_node", "cpus_per_task", "mem_gb", "timeout_min")


def refusal_line(params: dict[str, Any], error_text: str) -> str:
    """One line: what SLURM said (its `error:` lines) and the resources that were asked for."""
    said = [m.strip() for m in re.findall(r"sbatch: error: (.*)", error_text)]
    reason = "; ".join(dict.fromkeys(said)) or error_text.strip().splitlines()[-1]
    asked = ", ".join(f"{k}={'(cluster default)' if params[k] is None else params[k]}"
                      for k in RESOURCE_KEYS if k in params)
    return (f"SLURM refused the jobs ({reason}); asked for {asked}. Pick a profile that fits "
            "(hydra/launcher=slurm for GPU nodes, slurm_cpu for CPU nodes) or override "
            "hydra.launcher.<key>; the partition comes from hydra.launcher.partition or "
            "$KVH_SLURM_PARTITION")


def accounting_disabled() -> bool:
    try:
        proc = subprocess.run(["sacct", "-n", "-X", "-j", "1"], capture_output=True, text=True,
                              timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "accounting storage is disabled" in (proc.stdout + proc.stderr).lower()


def record_unfinished(sweep_dir: Path, num: int, overrides: Sequence[str], detail: str) -> None:
    """The member's status, unless the member wrote its own before it ended."""
    path = sweep_dir / "status" / f"{num:04d}.json"
    if not path.exists():
        write_json_atomic(path, {"job": num, "status": "failed", "detail": detail,
                                 "overrides": list(overrides), "pid": None})


def queue_states(array_ids: set[str]) -> dict[str, str] | None:
    """SLURM's queue (squeue, array tasks expanded): job id -> state; None if squeue failed."""
    if not array_ids:
        return {}
    try:
        proc = subprocess.run(["squeue", "-h", "-r", "-t", "all", "-o", "%i %T",
                               "-j", ",".join(sorted(array_ids))],
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if proc.returncode != 0:
        # Every id purged from the controller's memory is "Invalid job id": nothing is queued.
        return {} if "invalid job id" in proc.stderr.lower() else None
    return dict(line.split(None, 1) for line in proc.stdout.splitlines() if " " in line)


def ended_in_queue(queue: dict[str, str] | None, job_id: str) -> str | None:
    """What SLURM says about a job that no longer runs, or None while it runs (or if unknown)."""
    if queue is None:
        return None  # squeue failed: no evidence either way
    state = queue.get(job_id)
    if state is None:
        return "no longer in the queue (cancelled while pending, or purged)"
    return None if state in RUNNING_STATES else state
