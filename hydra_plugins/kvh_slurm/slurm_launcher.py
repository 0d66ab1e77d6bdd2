"""`hydra/launcher=slurm` and `slurm_cpu` (conf/hydra/launcher/): hydra-submitit's SLURM launcher
with a one-line refusal and cancelled members recorded as failed (see harness/cluster.py).
Hydra only instantiates launchers defined under the `hydra_plugins` package, hence this module."""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Sequence

from hydra.core.singleton import Singleton
from hydra.core.utils import JobReturn, JobStatus, filter_overrides
from hydra_plugins.hydra_submitit_launcher.config import BaseQueueConf
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import SlurmLauncher as _Base
from omegaconf import OmegaConf

from harness.cluster import (ENDED_GRACE_S, accounting_disabled, ended_in_queue, queue_states,
                             record_unfinished, refusal_line)

log = logging.getLogger(__name__)


class SlurmLauncher(_Base):
    """`hydra/launcher=slurm` / `slurm_cpu` (conf/hydra/launcher/)."""

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit
        from submitit.core.utils import FailedJobError, FailedSubmissionError, UncompletedJobError

        assert self.config is not None
        params = dict(self.params)
        executor = submitit.AutoExecutor(cluster=self._EXECUTOR, folder=params["submitit_folder"],
                                         slurm_max_num_timeout=params.get("max_num_timeout", 0))
        base = set(OmegaConf.structured(BaseQueueConf).keys())
        executor.update_parameters(**{
            k if k in base else f"{self._EXECUTOR}_{k}": v for k, v in params.items()
            if k not in ("submitit_folder", "max_num_timeout")})
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if accounting_disabled():
            print("warning: this cluster has no job accounting (sacct: accounting storage is "
                  "disabled): job ends are read from squeue only", file=sys.stderr)
        log.info(f"Submitit '{self._EXECUTOR}' sweep output dir : {sweep_dir}")
        job_params = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
            job_params.append((list(overrides), "hydra.sweep.dir", idx, f"job_id_for_{idx}",
                               Singleton.get_state()))
        try:
            jobs = executor.map_array(self, *zip(*job_params))
        except (FailedJobError, FailedSubmissionError) as exc:
            print(f"error: {refusal_line(params, str(exc))}", file=sys.stderr)
            sys.exit(2)
        ended = wait_for_jobs(jobs)
        returns = []
        for job, (overrides, _, num, _, _) in zip(jobs, job_params):
            try:
                if job.job_id in ended:
                    raise UncompletedJobError("no result file; squeue says it ended")
                returns.append(job.results()[0])
            except UncompletedJobError as exc:  # cancelled, killed, timed out, or it raised
                state = ended.get(job.job_id) or job.state
                detail = (f"SLURM job {job.job_id} ended ({state}) before writing a result: "
                          f"{str(exc).splitlines()[0]} (log: {job.paths.stdout})")
                print(f"failed: member #{num}: {detail}", file=sys.stderr)
                record_unfinished(sweep_dir, num, filter_overrides(overrides), detail)
                # Reported through the status file; the sweep summary turns it into exit code 1.
                returns.append(JobReturn(overrides=list(overrides), status=JobStatus.COMPLETED))
        return returns


def wait_for_jobs(jobs: list, poll_s: float = 2.0) -> dict[str, str]:
    """Wait until every job is done for submitit (result file, or an end state in `sacct`) or has
    ended without a result in SLURM's queue for `ENDED_GRACE_S` (then: job id -> what SLURM said).
    The queue check covers what `sacct` misses: an array task cancelled while pending leaves no
    accounting record at all, and clusters without slurmdbd have no `sacct`."""
    ended: dict[str, str] = {}
    first_seen: dict[str, float] = {}
    waiting = list(jobs)
    while waiting:
        queue = queue_states({job.job_id.split("_")[0] for job in waiting})
        still = []
        for job in waiting:
            if job.done():
                continue
            said = ended_in_queue(queue, job.job_id)
            if said is None:
                first_seen.pop(job.job_id, None)
                still.append(job)
            elif time.time() - first_seen.setdefault(job.job_id, time.time()) > ENDED_GRACE_S:
                ended[job.job_id] = said
            else:
                still.append(job)
        waiting = still
        if waiting:
            time.sleep(poll_s)
    return ended
