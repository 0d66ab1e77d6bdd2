"""Runs of a Hydra multirun: run identity, resume (skip complete runs), per-member status, and the
checks the sweep's callback (`SweepSummary`, harness.sweep.summary) makes before any member runs.

* `config_hash(cfg)`: identity of a run = its resolved config minus where/how it is written
  (output paths, debug, skip flag, logger). Two runs with the same hash produce the same
  accuracy fields (tested), so a complete result for the hash can be reused.
* `find_complete(...)`: a finished run for that hash under `runner.results_root` (a run folder
  only appears once complete, so a killed run leaves nothing that looks finished).
* In a Hydra multirun each member writes `<sweep dir>/status/<job>.json` (ok / skipped / failed,
  with the one-line reason); `SweepSummary` (a Hydra callback) prints the counts at the end and
  makes the sweep exit non-zero when a member failed or ended without reporting.
* `SweepSummary.on_multirun_start`, before any member runs: refuses `runner.output_dir` (every
  member would write the same folder), gives the sweep a folder of its own (`_sweeps/<time>` is
  created exclusively; a second sweep in the same second gets `<time>-2`), refuses a sweep folder
  already holding an earlier sweep's statuses, and takes unknown choices of a config group out of
  the sweep (`method=full,nosuch,h2o`), recording each as a failed member with its one-line reason.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from omegaconf import DictConfig, OmegaConf

from harness import CONF_DIR
from harness.config.config_check import (GROUPS, NEUTRAL, TOP_LEVEL, allowed_any, group_options,
                                  unknown_key_message, without_neutral)
from harness.store.results import (SWEEP_MARK, check_output_dir, check_writable, inside_a_run,
                                   write_json_atomic)
from harness.store.schema import SchemaError, load
from kvcore.errors import ConfigError

if TYPE_CHECKING:
    from harness.config.runner import RunnerSettings

CONF = CONF_DIR

# Keys that say where or how a run is written or shown, not what it computes.
_NOT_IDENTITY = {"runner": ("output_dir", "results_root", "debug", "skip_existing", "overwrite",
                            "threads", "sweep_engine", "shards", "sweep_decode_batch"),
                 "logger": None, "hydra": None}


def config_hash(cfg: DictConfig) -> str:
    plain = OmegaConf.to_container(cfg, resolve=True)
    for group, keys in _NOT_IDENTITY.items():
        if keys is None:
            plain.pop(group, None)
        else:
            for key in keys:
                plain.get(group, {}).pop(key, None)
    for group in NEUTRAL:  # options added later, at the value runs before them computed
        if group in plain:
            plain[group] = without_neutral(group, plain[group])
    blob = json.dumps(plain, sort_keys=True, default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def run_hash(folder: Path) -> str | None:
    """The config hash of the complete run in `folder` (None: not a complete run)."""
    try:
        return load(folder / "metrics.json")["run"]["config_hash"]
    except SchemaError:
        return None


def find_complete(search_dir: Path, identity: str) -> Path | None:
    """A complete run folder (a valid metrics.json) under `search_dir` whose hash is `identity`."""
    if not search_dir.is_dir():
        return None
    for metrics in sorted(search_dir.glob("*/metrics.json")):
        if run_hash(metrics.parent) == identity:
            return metrics.parent
    return None


def resolve_output(runner: RunnerSettings, out: Path, identity: str) -> Path | None:
    """Before weights load: the complete run to reuse (`runner.skip_existing`), or None after
    checking that `out` may be written. An explicit `runner.output_dir` is reused only when it
    holds a complete run of this very config, and replaced only under `runner.overwrite=true`."""
    explicit = bool(runner.output_dir)
    if explicit and multirun_job() is not None:
        raise ConfigError("runner.output_dir cannot be used with a sweep (-m): every member would "
                          "write the same folder")
    if runner.skip_existing:
        done = (out if run_hash(out) == identity else None) if explicit else \
            find_complete(out.parent, identity)
        if done is not None:
            return done
    if explicit:
        check_output_dir(out, runner.overwrite)
        return None
    root = runner.results_root
    outer = inside_a_run(out)
    if outer is not None:
        raise ConfigError(f"runner.results_root={root} is inside the run folder {outer}: a run "
                          "folder holds only its own files; choose a results root outside it")
    check_writable(out.parent, f"runner.results_root={root}")
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
    """Every member's status; a member Hydra started (it made `<sweep dir>/<job>/`) that wrote
    none ended without reporting (killed, or an exit inside the member) and counts as failed."""
    out, seen = [], set()
    for path in sorted((sweep_dir / "status").glob("*.json")):
        try:
            status = json.loads(path.read_text())
        except (OSError, ValueError):
            status = {"job": path.stem, "status": "failed", "detail": "unreadable status"}
        out.append(status)
        seen.add(str(status.get("job")))
    started = sorted((int(p.name) for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()),
                     ) if sweep_dir.is_dir() else []
    for num in started:
        if str(num) not in seen:
            out.append({"job": num, "status": "failed", "overrides": [],
                        "detail": "the member ended without reporting a status (killed?)"})
    return out


def quote_override(text: str) -> str:
    """A Hydra override value that stays one literal string."""
    return "'" + text.replace("\\", "\\\\").replace("'", "\\'") + "'"


# Sweep folders this process set up, with the parents it created for them (deepest first): a
# sweep Hydra refuses after that (a member that cannot be composed) leaves nothing of its own
# behind (`discard_claimed`, called by the CLI).
CLAIMED: list[list[Path]] = []


def _missing_parents(path: Path) -> list[Path]:
    made, parent = [], Path(os.path.abspath(path))
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    return made


def claim_sweep_dir(base: Path, key: str = "hydra.sweep.dir") -> Path:
    """Create a sweep folder no other sweep has: `base`, else `base-2`, `base-3`, ... (mkdir is
    atomic, so two sweeps started in the same second cannot share one)."""
    made = _missing_parents(base.parent)
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
        for n in range(1, 10_000):
            path = base if n == 1 else base.with_name(f"{base.name}-{n}")
            try:
                path.mkdir()
                CLAIMED.append([path, *made])
                return path
            except FileExistsError:
                continue
    except OSError as exc:
        raise ConfigError(f"{key}: cannot create the sweep folder {base} "
                          f"({exc.strerror or exc})") from None
    raise ConfigError(f"{key}: could not create a new folder next to {base}")


def mark_sweep_dir(sweep_dir: Path) -> None:
    """Record the folder as a sweep of this harness (an explicit hydra.sweep.dir is made here)."""
    made = _missing_parents(sweep_dir)
    try:
        sweep_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(sweep_dir / SWEEP_MARK, {"harness": "kv-harness", "pid": os.getpid()})
    except OSError as exc:
        raise ConfigError(f"hydra.sweep.dir={sweep_dir}: cannot write there "
                          f"({exc.strerror or exc})") from None
    if made:
        CLAIMED.append(made)
    elif not any(sweep_dir == c[0] for c in CLAIMED):
        CLAIMED.append([sweep_dir])


def discard_claimed() -> None:
    """Undo what this process set up for a sweep Hydra then refused: its mark and Hydra's
    multirun.yaml, and the folders it made, if nothing else is in them."""
    while CLAIMED:
        folders = CLAIMED.pop()
        sweep = folders[0]
        if not sweep.is_dir() or {p.name for p in sweep.iterdir()} - {"multirun.yaml", SWEEP_MARK}:
            continue
        if (sweep / SWEEP_MARK).is_file():
            (sweep / "multirun.yaml").unlink(missing_ok=True)
            (sweep / SWEEP_MARK).unlink()
        for folder in folders:
            try:
                folder.rmdir()
            except OSError:
                break


def check_explicit_sweep_dir(sweep_dir: Path) -> None:
    """An explicit `hydra.sweep.dir` must be new, empty, or a sweep folder of this harness (its
    mark) holding no member statuses yet: a user's folder is never written into (Hydra would
    overwrite a multirun.yaml of theirs), nor an earlier sweep's."""
    if sweep_dir.exists() and not sweep_dir.is_dir():
        raise ConfigError(f"hydra.sweep.dir={sweep_dir} is a file, not a folder")
    if not sweep_dir.is_dir() or not any(sweep_dir.iterdir()):
        return
    status = sweep_dir / "status"
    if status.is_dir() and any(status.iterdir()):
        raise ConfigError(f"hydra.sweep.dir={sweep_dir} already holds an earlier sweep's "
                          "member statuses; give each sweep its own folder (or leave "
                          "hydra.sweep.dir unset)")
    if not (sweep_dir / SWEEP_MARK).is_file():
        held = sorted(p.name for p in sweep_dir.iterdir())
        raise ConfigError(f"hydra.sweep.dir={sweep_dir} is a non-empty folder that is not a "
                          f"sweep of this harness (it holds {', '.join(held[:3])}"
                          f"{' ...' if len(held) > 3 else ''}); nothing was changed. Give the "
                          "sweep a new or empty folder (or leave hydra.sweep.dir unset)")


def unknown_keys(overrides: list[str]) -> str | None:
    """The first override naming a key no option of its group declares (`+runner.foo=1,2`),
    as a one-line reason; refused before any member runs (harness.config.config_check)."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    for override in OverridesParser.create().parse_overrides(overrides):
        dotted = override.key_or_group
        group, _, key = dotted.partition(".")
        if override.package or (not key and (CONF / group).is_dir()):
            continue  # a group choice (method=h2o), not a key
        if not key:
            if group not in TOP_LEVEL:
                return unknown_key_message(None, group, list(GROUPS))
            continue
        if group not in GROUPS or "." in key:
            continue
        allowed = allowed_any(group, None)
        if allowed and key not in allowed:
            return unknown_key_message(group, key, allowed)
    return None


def unknown_choices(overrides: list[str], conf: Path = CONF
                    ) -> list[tuple[int, str, list[str], list[str]]]:
    """(index, group, known, unknown) for each swept config group with unknown choices."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    out = []
    for i, override in enumerate(OverridesParser.create().parse_overrides(overrides)):
        group = override.key_or_group
        swept_group = (override.is_sweep_override() and not group.startswith("hydra")
                       and (conf / group).is_dir())
        if not swept_group:
            continue
        values = list(override.sweep_string_iterator())
        bad = [v for v in values if v.startswith("_") or not (conf / group / f"{v}.yaml").is_file()]
        if bad:
            out.append((i, group, [v for v in values if v not in bad], bad))
    return out


def config_groups() -> str:
    """`--help`'s list of choices (the template in conf/config.yaml): Hydra's own list would
    offer `_`-prefixed fragments such as method=_shared, which are not choices. Methods are
    listed one per line with their provenance."""
    from methods import build_method

    lines = []
    for p in sorted(CONF.iterdir()):
        if not (p.is_dir() and p.name != "hydra" and group_options(p.name)):
            continue
        if p.name == "method":
            lines.append("method (provenance: official code | paper | reconstruction | reference):")
            lines += [f"  {name:<17} {build_method(name).provenance_label()}"
                      for name in group_options("method")]  # the defaults' label
        else:
            lines.append(f"{p.name}: {', '.join(group_options(p.name))}")
    return "\n".join(lines)


# Registered on import: every process that runs a member (submitit's too) imports this module.
OmegaConf.register_new_resolver("kvh_config_groups", config_groups, replace=True)
