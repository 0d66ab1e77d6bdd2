"""Loggers: `logger=none` (default; never touches the network) and `logger=wandb`.

metrics.json is the record; W&B receives a copy: one W&B run per harness run (config, summary
metrics, the streaming NLL curve and per-layer KV tokens as charts, samples as a table), grouped
by sweep. The W&B run directory lives inside the result folder. `WANDB_MODE=offline` (or
`logger.mode=offline`) writes it locally for a later `wandb sync`: the runner prints and records
the run's final path (W&B's own hint would name the staging folder, gone once the run is in place).
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


def _cell(value: Any) -> Any:
    return value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
