"""Loggers: `logger=none` (default; never touches the network) and `logger=wandb`.

metrics.json is the record; W&B receives a copy: one W&B run per harness run (config, summary
metrics, the streaming NLL curve and per-layer KV tokens as charts, samples as a table), grouped
by sweep. The W&B run directory lives inside the result folder. `WANDB_MODE=offline` (or
`logger.mode=offline`) writes it locally for a later `wandb sync`: the runner prints and records
the run's final path (W&B's own hint would name the staging folder, gone once the run is in place).

A sweep (`-m`) ends with one more W&B run in the same group (`log_sweep`, job type "report"):
the leaderboard as one comparison table and the report's figures, built by harness.report from
the sweep's complete runs, so a dashboard compares the methods with no hand-made panels.

Every logger option is checked before weights load (`check_logger`: mode, $WANDB_MODE, entity,
group, project name, credentials for online mode). The runner writes the result first and mirrors
it after: a mirror that fails costs the mirror (one warning line), never the result.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
from pathlib import Path
from typing import Any, Iterator

from harness.store.schema import SchemaError, problems
from kvcore.errors import ConfigError

LOGGERS = ("none", "wandb")
MAX_SAMPLE_ROWS = 500
MODES = ("online", "offline", "disabled")  # logger.mode
# What W&B itself takes from $WANDB_MODE (its Settings.mode)
ENV_MODES = ("online", "offline", "disabled", "dryrun", "run", "shared")
_PROJECT_FORBIDDEN = "/\\#?%:"  # W&B refuses these in a project name (and > 128 characters)


def wandb_mode(logger: dict) -> str:
    """The mode a W&B run gets: logger.mode, else $WANDB_MODE, else online."""
    return logger.get("mode") or os.environ.get("WANDB_MODE") or "online"


def check_logger(logger: dict) -> None:
    """Every logger option, before any weights load (W&B would refuse them only after the run)."""
    name = logger.get("name", "none")
    if name not in LOGGERS:
        raise ConfigError(f"logger={name!r}; allowed: {', '.join(LOGGERS)}")
    if name == "none":
        return
    if importlib.util.find_spec("wandb") is None:
        raise ConfigError("logger=wandb needs the wandb package (pip install wandb, the [wandb] "
                          "extra); or use logger=none")
    mode = logger.get("mode")
    if mode is not None and mode not in MODES:
        raise ConfigError(f"logger.mode={mode!r}; allowed: {', '.join(MODES)} (or null: "
                          "$WANDB_MODE, else online)")
    env = os.environ.get("WANDB_MODE")
    if mode is None and env is not None and env not in ENV_MODES:
        raise ConfigError(f"WANDB_MODE={env!r} (read because logger.mode is null); allowed: "
                          f"{', '.join(ENV_MODES)}; or set logger.mode")
    for key in ("entity", "group"):
        value = logger.get(key)
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise ConfigError(f"logger.{key}={value!r} must be a non-empty string (quote it: "
                              f"logger.{key}='{value}'), or null")
    project = logger.get("project")
    if project is not None:
        bad = sorted({c for c in str(project) if c in _PROJECT_FORBIDDEN})
        if not isinstance(project, str) or not project.strip() or len(project) > 128 or bad:
            why = (f"it contains {' '.join(bad)}" if bad else "at most 128 characters"
                   if isinstance(project, str) and len(project) > 128 else "a non-empty string")
            raise ConfigError(f"logger.project={project!r}: a W&B project name is a non-empty "
                              f"string of at most 128 characters without any of "
                              f"{' '.join(_PROJECT_FORBIDDEN)} ({why})")
    if wandb_mode(logger) in ("online", "run", "shared") and not _has_credentials():
        raise ConfigError("logger=wandb in online mode, but no W&B credentials are set up "
                          "(WANDB_API_KEY, or `wandb login`): log in first, or use "
                          "logger.mode=offline (upload later with wandb sync)")


def _has_credentials() -> bool:
    """Whether W&B can find an API key without asking (environment or netrc), as wandb.init
    looks for one; an unreadable or malformed one is refused with W&B's own reason."""
    if os.environ.get("WANDB_API_KEY") or os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return True
    try:
        from wandb.sdk.lib.wbauth import read_netrc_auth
    except ImportError:  # another W&B version: let wandb.init decide
        return True
    host = os.environ.get("WANDB_BASE_URL") or "https://api.wandb.ai"
    try:
        return read_netrc_auth(host=host) is not None
    except Exception as exc:  # noqa: BLE001 - W&B's AuthenticationError: a malformed key
        raise ConfigError(f"logger=wandb: the W&B credentials in your netrc cannot be used "
                          f"({exc})") from None


@contextlib.contextmanager
def quiet_logging_errors() -> Iterator[None]:
    """A logging handler that cannot write (disk full under the run folder, where W&B keeps its
    debug log) prints a traceback per record; the mirror's own failure is reported in one line."""
    before = logging.raiseExceptions
    logging.raiseExceptions = False
    try:
        yield
    finally:
        logging.raiseExceptions = before


def flatten(d: dict, prefix: str = "") -> dict[str, Any]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flatten(v, key + "/"))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
    return out


def log_run(logger: dict, folder: Path, config: dict, metrics: dict, samples: list[dict],
            group: str | None) -> dict | None:
    """Mirror one run to the configured logger; returns facts for metrics.json (or None)."""
    if logger.get("name", "none") == "none":
        return None
    wrong = problems(metrics)  # W&B gets exactly the record metrics.json holds
    if wrong:
        raise SchemaError(f"metrics for W&B break the schema: {'; '.join(wrong)}")
    with quiet_logging_errors():
        return _mirror(logger, folder, config, metrics, samples, group)


def _mirror(logger: dict, folder: Path, config: dict, metrics: dict, samples: list[dict],
            group: str | None) -> dict:
    import wandb

    mode = wandb_mode(logger)
    run = wandb.init(project=logger.get("project") or "kv-harness", entity=logger.get("entity"),
                     group=logger.get("group") or group, dir=str(folder), mode=mode,
                     name=f"{metrics['method']['name']}-{metrics['task']['name']}-"
                          f"{metrics['model']['name']}", config=config, reinit="finish_previous",
                     # W&B's own messages name the staging folder, gone once the run is in
                     # place; the runner prints the final path (and the URL online) instead.
                     settings=wandb.Settings(silent=True))
    try:
        run.summary.update({k: v for k, v in flatten(metrics).items() if not k.startswith("env/")})
        nll = metrics.get("accuracy", {}).get("nll_per_block") or []
        block = metrics.get("accuracy", {}).get("block_tokens", 256)
        for i, value in enumerate(nll):
            run.log({"nll_per_block": value, "tokens": (i + 1) * block})
        per_layer = metrics.get("kv", {}).get("tokens_per_layer") or []
        if per_layer:
            table = wandb.Table(columns=["layer", "kv_tokens"], data=list(enumerate(per_layer)))
            run.log({"kv_tokens_per_layer": wandb.plot.bar(table, "layer", "kv_tokens",
                                                           title="KV tokens per layer")})
        if samples:
            columns = sorted({k for s in samples[:MAX_SAMPLE_ROWS] for k in s})
            rows = [[_cell(s.get(c)) for c in columns] for s in samples[:MAX_SAMPLE_ROWS]]
            run.log({"samples": wandb.Table(columns=columns, data=rows)})
        facts = {"logger": "wandb", "mode": mode, "run_id": run.id, "dir": str(Path(run.dir).parent),
                 "url": getattr(run, "url", None)}
    finally:
        run.finish()
    return facts


def log_sweep(logger: dict, sweep_dir: Path, run_folders: list[Path]) -> dict | None:
    """The sweep's comparison on W&B: harness.report's leaderboard rows as one table and its
    figures as images, in one run of the sweep's group; the report (report.html included) is
    written to `<sweep dir>/report` as well. None for `logger=none` or no complete run."""
    if logger.get("name", "none") == "none" or not run_folders:
        return None
    import wandb

    from harness.report import AXES, build_report, leaderboard
    from harness.report.figures import question

    out = sweep_dir / "report"
    rows, out, made = build_report([str(f / "metrics.json") for f in run_folders], out,
                                   warn=lambda text: None)
    from harness.report.compare import rank_intervals

    board = leaderboard.build(rows)  # rows carry their intervals (build_report attached them)
    rank_intervals(board, rows)
    columns, data = comparison_table(board)
    with quiet_logging_errors():  # as a run's mirror: W&B's log errors are not shown
        mode = wandb_mode(logger)
        # the report's own definitions of what the columns and figures show
        described = {"axes": {k: f"{name}: {what}" for k, (name, what) in AXES.items()},
                     "figures": {p.stem: question(p) for p in made}}
        run = wandb.init(project=logger.get("project") or "kv-harness",
                         entity=logger.get("entity"), group=logger.get("group") or sweep_dir.name,
                         dir=str(sweep_dir), mode=mode, name=f"report-{sweep_dir.name}",
                         job_type="report", config=described, reinit="finish_previous",
                         settings=wandb.Settings(silent=True))
        try:
            run.log({"leaderboard": wandb.Table(columns=columns, data=data),
                     **{f"figures/{p.stem}": wandb.Image(str(p)) for p in made}})
            facts = {"logger": "wandb", "mode": mode, "run_id": run.id, "report": str(out),
                     "dir": str(Path(run.dir).parent), "rows": len(data), "figures": len(made)}
        finally:
            run.finish()
    return facts


def comparison_table(board: list[dict]) -> tuple[list[str], list[list]]:
    """The leaderboard as one flat table: its key, every task column, the measures, then each
    task column's 95 % interval, n and rank interval."""
    from harness.report import leaderboard

    tasks = sorted({c for e in board for c in e["tasks"]})
    columns = [*leaderboard.KEY, *tasks, leaderboard.MEAN, *leaderboard.MEASURES, "active"]
    data = [[_cell(e["tasks"].get(c) if c in tasks else e.get(c)) for c in columns]
            + [_cell(v) for c in tasks for v in leaderboard.interval_parts(e, c)]
            for e in board]
    return columns + [f"{c} {part}" for c in tasks for part in leaderboard.INTERVAL_PARTS], data


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
