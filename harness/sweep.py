"""Sweeps: run identity, resume (skip complete runs), per-member status, and the sweep summary.

* `config_hash(cfg)`: identity of a run = its resolved config minus where/how it is written
  (output paths, debug, skip flag, logger). Two runs with the same hash produce the same
  accuracy fields (tested), so a complete result for the hash can be reused.
* `find_complete(...)`: a finished run for that hash under `runner.results_root` (a run folder
  only appears once complete, so a killed run leaves nothing that looks finished).
* In a Hydra multirun each member writes `<sweep dir>/status/<job>.json` (ok / skipped / failed,
  with the one-line reason); `SweepSummary` (a Hydra callback) prints the counts at the end and
  makes the sweep exit non-zero when a member failed.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from harness.results import write_json_atomic

# Keys that say where or how a run is written or shown, not what it computes.
_NOT_IDENTITY = {"runner": ("output_dir", "results_root", "debug", "skip_existing", "threads"),
                 "logger": None, "hydra": None}


def config_hash(cfg: DictConfig) -> str:
    plain = OmegaConf.to_container(cfg, resolve=True)
    for group, keys in _NOT_IDENTITY.items():
        if keys is None:
            plain.pop(group, None)
        else:
            for key in keys:
                plain.get(group, {}).pop(key, None)
    blob = json.dumps(plain, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def find_complete(search_dir: Path, identity: str) -> Path | None:
    """A complete run folder (metrics.json present) whose config hash is `identity`."""
    if not search_dir.is_dir():
        return None
    for metrics in sorted(search_dir.glob("*/metrics.json")):
        try:
            if json.loads(metrics.read_text()).get("run", {}).get("config_hash") == identity:
                return metrics.parent
        except (OSError, ValueError):
            continue  # unreadable: not complete
    return None


def multirun_job() -> tuple[Path, str] | None:
    """(sweep dir, job number) when running as a Hydra multirun member, else None."""
    try:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if not HydraConfig.initialized():
            return None
        hc = HydraConfig.get()
        if hc.mode != RunMode.MULTIRUN:
            return None
        return Path(hc.sweep.dir), str(hc.job.num)
    except Exception:  # outside Hydra (tests calling run() directly)
        return None


def record_status(status: str, detail: str, overrides: list[str] | None = None) -> None:
    job = multirun_job()
    if job is None:
        return
    sweep_dir, num = job
    write_json_atomic(sweep_dir / "status" / f"{int(num):04d}.json",
                      {"job": int(num), "status": status, "detail": detail,
                       "overrides": overrides or [], "pid": os.getpid()})


def read_statuses(sweep_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted((sweep_dir / "status").glob("*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            out.append({"job": path.stem, "status": "failed", "detail": "unreadable status"})
    return out


class SweepSummary(Callback):
    """Prints ok/skipped/failed counts after a multirun; non-zero exit if any member failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        statuses = read_statuses(sweep_dir)
        counts = {s: sum(1 for x in statuses if x["status"] == s)
                  for s in ("ok", "inactive", "skipped", "failed")}
        print(f"\nsweep {sweep_dir}: {len(statuses)} members, {counts['ok']} ok, "
              f"{counts['inactive']} inactive (the method did not act), "
              f"{counts['skipped']} skipped, {counts['failed']} failed")
        for s in statuses:
            if s["status"] != "ok":
                print(f"  [{s['status']}] #{s['job']} {' '.join(s.get('overrides', []))}: {s['detail']}")
        write_json_atomic(sweep_dir / "summary.json", {"counts": counts, "members": statuses})
        if counts["failed"]:
            sys.exit(1)
