"""Loggers: `logger=none` (default; never touches the network) and `logger=wandb`.

metrics.json is the record; W&B receives a copy: one W&B run per harness run (config, summary
metrics, the streaming NLL curve and per-layer KV tokens as charts, samples as a table), grouped
by sweep. The W&B run directory lives inside the result folder. `WANDB_MODE=offline` (or
`logger.mode=offline`) writes it locally for a later `wandb sync`: the runner prints and records
the run's final path (W&B's own hint would name the staging folder, gone once the run is in place).

A sweep (`-m`) ends with one more W&B run in the same group (`log_sweep`, job type "report"):
the leaderboard as one comparison table and the report's figures, built by harness.report from
the sweep's complete runs, so a dashboard compares the methods with no hand-made panels.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from harness.schema import SchemaError, problems

LOGGERS = ("none", "wandb")
MAX_SAMPLE_ROWS = 500


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
    import wandb

    mode = logger.get("mode") or os.environ.get("WANDB_MODE") or "online"
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
    board = leaderboard.build(rows)
    columns, data = comparison_table(board)
    mode = logger.get("mode") or os.environ.get("WANDB_MODE") or "online"
    run = wandb.init(project=logger.get("project") or "kv-harness", entity=logger.get("entity"),
                     group=logger.get("group") or sweep_dir.name, dir=str(sweep_dir), mode=mode,
                     name=f"report-{sweep_dir.name}", job_type="report",
                     # the report's own definitions of what the columns and figures show
                     config={"axes": {k: f"{name}: {what}" for k, (name, what) in AXES.items()},
                             "figures": {p.stem: question(p) for p in made}},
                     reinit="finish_previous", settings=wandb.Settings(silent=True))
    try:
        run.log({"leaderboard": wandb.Table(columns=columns, data=data),
                 **{f"figures/{p.stem}": wandb.Image(str(p)) for p in made}})
        facts = {"logger": "wandb", "mode": mode, "run_id": run.id, "report": str(out),
                 "dir": str(Path(run.dir).parent), "rows": len(data), "figures": len(made)}
    finally:
        run.finish()
    return facts


def comparison_table(board: list[dict]) -> tuple[list[str], list[list]]:
    """The leaderboard as one flat table: its key, every task column, the measures."""
    from harness.report import leaderboard

    tasks = sorted({c for e in board for c in e["tasks"]})
    columns = [*leaderboard.KEY, *tasks, leaderboard.MEAN, *leaderboard.MEASURES, "active"]
    data = [[_cell(e["tasks"].get(c) if c in tasks else e.get(c)) for c in columns]
            for e in board]
    return columns, data


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
