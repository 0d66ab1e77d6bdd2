"""`hydra/launcher=slurm` and `slurm_cpu` (conf/hydra/launcher/): hydra-submitit's SLURM launcher
with a one-line refusal and cancelled members recorded as failed (see harness/sweep/cluster.py).
Hydra only instantiates launchers defined under the `hydra_plugins` package, hence this module.

The unit sent to the cluster is the shard, not the member: the members sharing model and task
(hydra_plugins.kvh_sweep) become one job array of `runner.shards` tasks, each running every
member on its share of the samples through the sweep engine (harness.sweep.shards), requeued on
timeout (`hydra.launcher.max_num_timeout` times; a requeued shard resumes from its records);
once all have ended, one merge job per group writes each member's folder and status.
`runner.sweep_engine=false`: one array task per member, each loading everything itself."""

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
from omegaconf import OmegaConf, open_dict

from harness.sweep.cluster import (ENDED_GRACE_S, accounting_disabled, ended_in_queue, queue_states,
                             record_unfinished, refusal_line)

log = logging.getLogger(__name__)


class SlurmLauncher(_Base):
    """`hydra/launcher=slurm` / `slurm_cpu` (conf/hydra/launcher/)."""

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        import submitit

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
        members = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = idx
            members.append((idx, list(overrides), cfg))
        if all(OmegaConf.select(cfg, "runner.sweep_engine", default=True) is not False
               for _, _, cfg in members):
            return launch_shards(executor, params, members, sweep_dir)
        return self.launch_members(executor, params, job_overrides, initial_job_idx, sweep_dir)

    def launch_members(self, executor, params: dict, job_overrides: Sequence[Sequence[str]],
                       initial_job_idx: int, sweep_dir: Path) -> list[JobReturn]:
        """runner.sweep_engine=false: one array task per member (hydra-submitit's way)."""
        from submitit.core.utils import FailedJobError, FailedSubmissionError, UncompletedJobError

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


class SweepJob:
    """One job of a sharded sweep: `part` "shard" (the group's samples of `shard`, recorded),
    "merge" (every member's folder and status from the shards' records) or "whole" (an unsharded
    group: the sweep engine's pass and the folders). It has `checkpoint`, so on timeout submitit
    requeues it: a shard resumes from its records; a merge or whole group also skips the
    members whose folders it already wrote (runner.skip_existing), as their records are gone."""

    def checkpoint(self, part: str, group: list, sweep_dir: str, shard, state):
        from submitit.helpers import DelayedSubmission

        if part != "shard":
            group = [(idx, overrides, _skip_existing(cfg)) for idx, overrides, cfg in group]
        return DelayedSubmission(self, part, group, sweep_dir, shard, state)

    def __call__(self, part: str, group: list, sweep_dir: str, shard, state) -> str:
        from hydra_plugins.kvh_sweep.sweep_launcher import run_group, run_shard

        Singleton.set_state(state)
        if part == "shard":
            run_shard(group, shard)
            return f"shard {shard.label} recorded"
        run_group(group, Path(sweep_dir), shards_done=part == "merge")
        return part


def _skip_existing(cfg):
    cfg = cfg.copy()
    with open_dict(cfg):
        cfg.runner.skip_existing = True
    return cfg


def launch_shards(executor, params: dict, members: list, sweep_dir: Path) -> list[JobReturn]:
    """Per (model, task) group: a job array over its shards, then its merge job (see the module
    docstring). A group whose shard or merge job ended without finishing is recorded as failed,
    every member with SLURM's word; the other groups' results count."""
    from submitit.core.utils import FailedJobError, FailedSubmissionError

    from harness.sweep.shards import Shard
    from hydra_plugins.kvh_sweep.sweep_launcher import shard_count, shared_key

    groups: dict[str, list] = {}
    for member in members:
        groups.setdefault(shared_key(member[2]), []).append(member)
    state = Singleton.get_state()
    parts = []  # (part, group, shard)
    for group in groups.values():
        count = shard_count(group)
        parts += ([("shard", group, Shard(i, count)) for i in range(count)] if count > 1
                  else [("whole", group, None)])
    log.info(f"{len(members)} members in {len(groups)} model x task group(s): one array of "
             f"{len(parts)} task(s) (a group's shards, each running all its members)")

    def submit(todo: list) -> list:
        try:
            return executor.map_array(SweepJob(), *zip(*[(p, g, str(sweep_dir), s, state)
                                                         for p, g, s in todo]))
        except (FailedJobError, FailedSubmissionError) as exc:
            print(f"error: {refusal_line(params, str(exc))}", file=sys.stderr)
            sys.exit(2)

    jobs = submit(parts)
    unfinished = failed_parts(jobs, parts, wait_for_jobs(jobs))
    merges = [("merge", g, None) for g in groups.values() if shard_count(g) > 1
              and not any(g is bad for _, bad in unfinished)]
    if merges:
        jobs = submit(merges)
        unfinished += failed_parts(jobs, merges, wait_for_jobs(jobs))
    reported: set[int] = set()
    for detail, group in unfinished:
        if id(group) in reported:  # its first unfinished job says why
            continue
        reported.add(id(group))
        for idx, overrides, _ in group:
            print(f"failed: member #{idx}: {detail}", file=sys.stderr)
            record_unfinished(sweep_dir, idx, filter_overrides(overrides), detail)
    return [JobReturn(overrides=overrides, status=JobStatus.COMPLETED)
            for _, overrides, _ in members]


def failed_parts(jobs: list, parts: list, ended: dict[str, str]) -> list[tuple[str, list]]:
    """(what SLURM said, the group) of each job that ended without finishing."""
    from submitit.core.utils import UncompletedJobError

    out = []
    for job, (part, group, shard) in zip(jobs, parts):
        try:
            if job.job_id in ended:
                raise UncompletedJobError("no result file; squeue says it ended")
            job.results()
        except Exception as exc:  # noqa: BLE001 - cancelled, killed, timed out, or it raised
            state = ended.get(job.job_id) or job.state
            what = f"shard {shard.label}" if shard is not None else part
            said = str(exc).strip().splitlines()
            out.append((f"SLURM job {job.job_id} ({what}) ended ({state}) before finishing: "
                        f"{said[0] if said else type(exc).__name__} (log: {job.paths.stdout})",
                        group))
    return out


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
