"""`SweepSummary`, the Hydra callback of every multirun (conf/config.yaml): checks the sweep
before any member runs (harness.config.multirun's checks), prints the members' ok / skipped /
failed counts after it, mirrors the comparison to W&B, and exits non-zero if a member failed."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from harness.config.config_check import group_options
from harness.config.multirun import (check_explicit_sweep_dir, claim_sweep_dir, quote_override,
                                     mark_sweep_dir, read_statuses, unknown_choices, unknown_keys)
from harness.store.results import write_json_atomic
from kvcore.errors import ConfigError


class SweepSummary(Callback):
    """Checks a multirun before it starts; prints ok/skipped/failed counts after it, and exits
    non-zero if any member failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        try:
            self._start(config)
        except ConfigError as exc:  # Hydra turns a callback's Exception into a warning and goes on
            if os.environ.get("KVH_FULL_ERROR") == "1":
                import traceback

                traceback.print_exc()
            print(f"error: {exc}", file=sys.stderr)
            raise SystemExit(2) from None

    def _start(self, config: DictConfig) -> None:
        task_overrides = list(config.hydra.overrides.task)
        pinned = OmegaConf.select(config, "runner.output_dir") or any(
            o.split("=", 1)[0].lstrip("+~") == "runner.output_dir" for o in task_overrides)
        if pinned:
            raise ConfigError("runner.output_dir cannot be used with a sweep (-m): every member "
                              "would write the same folder. Drop it: each member gets its own "
                              "folder under runner.results_root")
        unknown = unknown_choices(task_overrides)
        for _, group, known, bad in unknown:
            if not known:
                raise ConfigError(f"{group}={','.join(bad)}: no known choice left to sweep; "
                                  f"allowed: {', '.join(group_options(group))}")
        undeclared = unknown_keys(task_overrides)
        if undeclared:
            raise ConfigError(undeclared)
        explicit = any(o.split("=", 1)[0] == "hydra.sweep.dir"
                       for o in config.hydra.overrides.hydra)
        sweep_dir = Path(config.hydra.sweep.dir)
        if explicit:
            check_explicit_sweep_dir(sweep_dir)
        else:
            root = OmegaConf.select(config, "runner.results_root") or "results"
            sweep_dir = claim_sweep_dir(sweep_dir, f"runner.results_root={root}")
        mark_sweep_dir(sweep_dir)
        with read_write(config.hydra), open_dict(config.hydra):
            config.hydra.sweep.dir = str(sweep_dir)
            if not explicit:  # members compose their config again: they must see the same folder
                config.hydra.overrides.hydra.append(f"hydra.sweep.dir={quote_override(str(sweep_dir))}")
            for i, group, known, _ in unknown:
                config.hydra.overrides.task[i] = f"{group}={','.join(known)}"
        for k, (_, group, _, bad) in enumerate(unknown):
            for j, value in enumerate(bad):
                choice = f"{group}={value}"
                write_json_atomic(sweep_dir / "status" / f"unknown-{k}-{j}.json", {
                    "job": choice, "status": "failed", "overrides": [choice], "pid": os.getpid(),
                    "detail": f"{choice} is unknown; allowed: {', '.join(group_options(group))}"})

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        statuses = read_statuses(sweep_dir)
        counts = {s: sum(1 for x in statuses if x["status"] == s)
                  for s in ("ok", "inactive", "skipped", "failed")}
        print(f"\nsweep {sweep_dir}: {len(statuses)} members, {counts['ok']} ok, "
              f"{counts['skipped']} skipped, {counts['failed']} failed, "
              f"{counts['inactive']} inactive (complete, but the method did not act)")
        for s in statuses:
            if s["status"] != "ok":
                job = f"#{s['job']} " if isinstance(s["job"], int) else ""
                print(f"  [{s['status']}] {job}{' '.join(s.get('overrides', []))}: {s['detail']}")
        write_json_atomic(sweep_dir / "summary.json", {"counts": counts, "members": statuses})
        self._log_comparison(config, sweep_dir, statuses)
        if counts["failed"]:
            sys.exit(1)

    @staticmethod
    def _log_comparison(config: DictConfig, sweep_dir: Path, statuses: list[dict]) -> None:
        """logger=wandb: the sweep's leaderboard and figures to its W&B group (a failure is a
        warning: the members' results are already written)."""
        from harness.report.loggers import log_sweep

        logger = OmegaConf.to_container(config.logger, resolve=True) if "logger" in config else {}
        folders = [Path(s["detail"]) for s in statuses if s["status"] == "ok"
                   and (Path(str(s.get("detail"))) / "metrics.json").is_file()]
        try:
            facts = log_sweep(logger, sweep_dir, folders)
        except Exception as exc:  # noqa: BLE001 - W&B down must not fail a finished sweep
            print(f"warning: the sweep's W&B comparison was not logged: {type(exc).__name__}: "
                  f"{exc}", file=sys.stderr)
            return
        if facts:
            sync = f"; upload it with: wandb sync {facts['dir']}" if facts["mode"] == "offline" \
                else ""
            print(f"comparison: {facts['rows']} leaderboard rows, {facts['figures']} figures -> "
                  f"W&B group {logger.get('group') or sweep_dir.name} ({facts['mode']}){sync}; "
                  f"report {facts['report']}/report.html")
