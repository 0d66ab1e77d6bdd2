"""The rounds sweeper: Hydra's basic sweeper's product of overrides, launched round by round for
the settings still undecided (harness.sweep.rounds holds the logic; this class only connects it to
Hydra's launcher, so every launcher of the harness runs the rounds' jobs)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
from omegaconf import OmegaConf

from harness.sweep.rounds import check_knobs, run_rounds, too_few_samples, unbalanced
from kvcore.errors import ConfigError


def task_cells(config) -> int:
    """The task's cells (RULER: sub-task x length x depth), its samples' round-robin cycle."""
    from tasks import build_task

    options = OmegaConf.to_container(config.task, resolve=True)
    options.pop("name", None)
    options.update(limit=None, skip_samples=0, samples_per_cell=1)
    return len(build_task(str(config.task.name), **options).cells())


class RoundsSweeper(BasicSweeper):
    """`hydra/sweeper=kvh_rounds`; its knobs are harness.sweep.rounds.Knobs (hydra.sweeper.<key>)."""

    def __init__(self, max_batch_size: int | None = None, params: Any = None, **knobs: Any):
        super().__init__(max_batch_size=None, params=None)
        self.knobs = check_knobs(knobs, prefix="hydra.sweeper.")

    def sweep(self, arguments: list[str]) -> Any:
        assert self.config is not None and self.launcher is not None
        task = OmegaConf.select(self.config, "task.name")
        if OmegaConf.select(self.config, "task.skip_samples", default=None) is None:
            raise ConfigError(f"task={task} has no task.skip_samples (a window of its samples): "
                              "rounds run on task=ruler")
        cells = task_cells(self.config)
        short = too_few_samples(self.knobs.max_n, cells,
                                int(OmegaConf.select(self.config, "task.samples_per_cell")))
        if short:
            raise ConfigError(short)
        warning = unbalanced(self.knobs.block, cells)
        if warning:
            print(f"warning: {warning}", file=sys.stderr)
        sweep_dir = Path(str(self.config.hydra.sweep.dir))
        sweep_dir.mkdir(parents=True, exist_ok=True)
        root = str(OmegaConf.select(self.config, "runner.results_root") or "results")

        def launch(batch: list[list[str]], first: int) -> None:
            self.validate_batch_is_legal(batch)
            self.launcher.launch(batch, initial_job_idx=first)

        run_rounds(list(arguments), self.knobs, str(task), root, sweep_dir, launch)
        return []
