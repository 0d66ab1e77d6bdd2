"""The default local launcher: `python -m harness -m method=h2o,snapkv method.budget_ratio=0.2,0.5`
composes every member, then runs the members of each (model, task) through the sweep engine in
this process (harness.sweep.run: model, tokenizer and task loaded once, each prompt prefilled
once per prefill group), each member writing its own result folder and status as a member of
Hydra's basic launcher would. `runner.shards=n`: the samples split over n processes on this
machine, each running every member on its share, merged here (harness.sweep.shards).
`runner.sweep_engine=false` (on every member) keeps Hydra's basic launcher: one member after
another, each loading everything itself."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path
from typing import Sequence

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobReturn, JobStatus, configure_log, filter_overrides, setup_globals
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from harness.store.results import write_json_atomic
from kvcore.errors import ConfigError

log = logging.getLogger(__name__)


class SweepLauncher(BasicLauncher):
    """`hydra/launcher=kvh_sweep` (see the module docstring)."""

    def launch(self, job_overrides: Sequence[Sequence[str]],
               initial_job_idx: int) -> Sequence[JobReturn]:
        setup_globals()
        assert self.hydra_context is not None and self.config is not None
        members = []
        for idx, overrides in enumerate(job_overrides, start=initial_job_idx):
            cfg = self.hydra_context.config_loader.load_sweep_config(self.config, list(overrides))
            with open_dict(cfg):
                cfg.hydra.job.id = cfg.hydra.job.num = idx
            members.append((idx, list(overrides), cfg))
        if not all(OmegaConf.select(cfg, "runner.sweep_engine", default=True) is not False
                   for _, _, cfg in members):
            return super().launch(job_overrides, initial_job_idx)
        configure_log(self.config.hydra.hydra_logging, self.config.hydra.verbose)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        groups: dict[str, list] = {}
        for member in members:
            groups.setdefault(shared_key(member[2]), []).append(member)
        log.info(f"Launching {len(members)} members locally through the sweep engine "
                 f"({len(groups)} model x task group(s))")
        for group in groups.values():
            run_group(group, sweep_dir)
        return [JobReturn(overrides=overrides, status=JobStatus.COMPLETED)
                for _, overrides, _ in members]


def shared_key(cfg: DictConfig) -> str:
    """Members with equal keys share one model load and one task (one sweep-engine pass) and
    one split of the samples into shards."""
    plain = OmegaConf.to_container(cfg, resolve=False)
    runner = plain.get("runner") or {}
    return json.dumps([plain.get("model"), plain.get("task"), runner.get("attn_impl"),
                       runner.get("shards", 1)], sort_keys=True, default=str)


def member_configs(group: list) -> tuple[list[DictConfig], list[dict[str, str]]]:
    """Each member's config without its `hydra` node, and its config file per group."""
    cfgs, choices = [], []
    for _, _, cfg in group:
        choices.append({k: str(v) for k, v in cfg.hydra.runtime.choices.items()})
        task_cfg = cfg.copy()
        with read_write(task_cfg), open_dict(task_cfg):
            del task_cfg["hydra"]
        cfgs.append(task_cfg)
    return cfgs, choices


def shard_count(group: list) -> int:
    shards = OmegaConf.select(group[0][2], "runner.shards", default=1)
    return shards if isinstance(shards, int) and not isinstance(shards, bool) and shards > 0 else 1


def run_shard(group: list, shard) -> None:
    """One shard of `group` (harness.sweep.shards): its samples for every member, recorded."""
    from harness.sweep.run import run_sweep

    cfgs, choices = member_configs(group)
    run_sweep(cfgs, choices=choices, shard=shard)


def run_group(group: list, sweep_dir: Path, shards_done: bool = False) -> None:
    """One sweep-engine pass over `group`'s members; a status file per member. Under
    runner.shards=n the pass is n shard processes on this machine (or, `shards_done`, the
    shards of a SLURM array that already ran), then their merge here."""
    from harness.run import _inactive_reason, traceback_wanted
    from harness.sweep.run import run_sweep
    from harness.sweep.shards import start_local, wait_local

    HydraConfig.instance().set_config(group[0][2])  # multirun_job(): the sweep's folder
    cfgs, choices = member_configs(group)
    count = shard_count(group)
    for idx, overrides, _ in group:
        log.info(f"\t#{idx} : {' '.join(filter_overrides(overrides))}")
    try:
        if count > 1 and not shards_done:
            cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (
                os.cpu_count() or 1)
            if count > cpus:  # a process per shard: more than the CPUs only queue and swap
                raise ConfigError(f"runner.shards={count} starts {count} shard processes on this "
                                  f"machine of {cpus} CPUs; allowed here: 1..{cpus} (more on "
                                  "a cluster: hydra/launcher=kvh_slurm)")
            folder = sweep_dir / "shards" / f"{int(group[0][0]):04d}"
            log.info(f"{count} shard processes on this machine (logs: {folder})")
            failed = wait_local(start_local(cfgs, choices, count, folder))
            if failed:
                raise RuntimeError("; ".join(failed))
        outcomes = run_sweep(cfgs, choices=choices, merge=count if count > 1 else 0)
    except KeyboardInterrupt:
        print("interrupted: settings not written yet have no result (a folder is only created "
              "when complete)", file=sys.stderr)
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the group fails together, other groups go on
        if traceback_wanted() or any(OmegaConf.select(c, "runner.debug", default=False)
                                     for c in cfgs):
            raise
        line = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc) else ''}"
        print(f"failed: {line}", file=sys.stderr)
        outcomes = None
    for k, (idx, overrides, _) in enumerate(group):
        if outcomes is None:
            status, detail = "failed", line
        else:
            outcome = outcomes[k]
            status, detail = outcome.status, outcome.detail
            inactive = _inactive_reason(outcome.folder) if outcome.status == "ok" else None
            if inactive:
                status, detail = "inactive", inactive
        write_json_atomic(sweep_dir / "status" / f"{int(idx):04d}.json",
                          {"job": int(idx), "status": status, "detail": detail,
                           "overrides": filter_overrides(overrides), "pid": os.getpid()})
