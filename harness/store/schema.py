"""The one schema of a run's `metrics.json`, versioned; used by every writer and reader.

The runner stamps and checks what it writes (`stamp`); `harness.report`, `harness.report.check`, sweeps'
resume (`harness.config.multirun.find_complete`) and the W&B logger read runs through `load` / `problems`,
so a corrupt or foreign file is skipped with a warning naming it instead of breaking a report.

The schema fixes the sections, the keys the readers rely on and their types; sections may carry
more keys (methods and the engine add figures over time) without a version change. Bump
`SCHEMA_VERSION` when a required key is renamed, removed or changes meaning.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

SCHEMA_VERSION = 1

def json_safe(value: Any) -> Any:
    """JSON-safe (every writer of the harness goes through it): NaN/inf become None (strict JSON), tuples become lists."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(v) for v in value]
    return value


NUMBER = "number"  # int or float, not bool
OPT_NUMBER = "number or null"
STRING = "string"
MAPPING = "mapping"
LIST = "list"
OPT_LIST = "list or null"
OPT_BOOL = "boolean or null"

# section -> {key: type}; every section is a mapping that may hold more keys.
REQUIRED: dict[str, dict[str, str]] = {
    "accuracy": {},
    "speed": {"decode_tokens_per_s": OPT_NUMBER, "decode_ms_per_token_median": OPT_NUMBER},
    "memory": {},
    "kv": {},
    "transfer": {},
    "model": {"name": STRING},
    "method": {"name": STRING, "hyperparameters": MAPPING},
    "task": {"name": STRING, "options": MAPPING},
    "protocol": {"dense_layers": LIST, "prefill": STRING},
    "env": {},
    "run": {"started": STRING, "config_hash": STRING, "status": STRING},
}
# Typed when present (the readers use them; not every run has them).
OPTIONAL: dict[str, dict[str, str]] = {
    # compression_ratio (full / held): written by older runs only; the report reads held_ratio.
    "kv": {"compression_ratio": OPT_NUMBER, "held_ratio": OPT_NUMBER,
           "attended_fraction_sparse_layers": OPT_NUMBER, "attended_fraction_all_layers": OPT_NUMBER,
           "paper_relative_kv_size": OPT_NUMBER, "method_active": OPT_BOOL,
           "bytes_total": OPT_NUMBER, "seen_tokens_mean": OPT_NUMBER, "tokens_per_layer": LIST,
           "kv_layout": STRING, "storage_waste_ratio": OPT_NUMBER},
    "transfer": {"bytes_per_decode_step": OPT_NUMBER},
    "accuracy": {"nll_per_block": LIST, "block_tokens": NUMBER},
    "logger": {"dir": STRING},
    # harness.stats.uncertainty.cell_uncertainty: the main metric's 95 % interval, n and its method
    "uncertainty": {"n": OPT_NUMBER, "ci95": OPT_LIST, "interval": STRING},
    # harness.stats.fidelity.summary (task.fidelity_tokens > 0): KL to the full cache and agreement
    "fidelity": {"samples": NUMBER, "tokens": NUMBER, "kl_mean": MAPPING,
                 "top_agree_percent": MAPPING, "interval": STRING},
}
OPTIONAL_SECTIONS = ("diagnostics", "projected", "logger", "uncertainty", "fidelity")


class SchemaError(ValueError):
    """A metrics.json that is unreadable or does not follow the schema (the message says why)."""


def _type_ok(value: Any, kind: str) -> bool:
    if kind == NUMBER:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == OPT_NUMBER:
        return value is None or _type_ok(value, NUMBER)
    if kind == OPT_BOOL:
        return value is None or isinstance(value, bool)
    if kind == STRING:
        return isinstance(value, str)
    if kind == MAPPING:
        return isinstance(value, dict)
    if kind == LIST:
        return isinstance(value, list)
    if kind == OPT_LIST:
        return value is None or isinstance(value, list)
    raise AssertionError(kind)


def problems(metrics: Any) -> list[str]:
    """What is wrong with a metrics record (empty when it follows the schema)."""
    if not isinstance(metrics, dict):
        return [f"the top level is a {type(metrics).__name__}, not a mapping"]
    version = metrics.get("schema_version")
    if version != SCHEMA_VERSION:
        return [f"schema_version={version!r}; this harness reads {SCHEMA_VERSION}"
                + (" (written before versioned results)" if version is None else "")]
    out = []
    for section, keys in REQUIRED.items():
        node = metrics.get(section)
        if not isinstance(node, dict):
            out.append(f"{section}: missing or not a mapping")
            continue
        for key, kind in keys.items():
            if key not in node:
                out.append(f"{section}.{key}: missing")
            elif not _type_ok(node[key], kind):
                out.append(f"{section}.{key}={node[key]!r}: must be a {kind}")
    for section in OPTIONAL_SECTIONS:
        if section in metrics and not isinstance(metrics[section], dict):
            out.append(f"{section}: not a mapping")
    for section, keys in OPTIONAL.items():
        node = metrics.get(section)
        if not isinstance(node, dict):
            continue
        for key, kind in keys.items():
            if key in node and not _type_ok(node[key], kind):
                out.append(f"{section}.{key}={node[key]!r}: must be a {kind}")
    return out


def stamp(metrics: dict[str, Any]) -> dict[str, Any]:
    """The record as written: `schema_version` first, checked (a writer bug fails loudly here,
    before anything is moved into place)."""
    record = {"schema_version": SCHEMA_VERSION,
              **{k: v for k, v in metrics.items() if k != "schema_version"}}
    wrong = problems(json.loads(json.dumps(json_safe(record), default=str)))
    if wrong:
        raise SchemaError(f"the runner built a metrics record that breaks schema "
                          f"{SCHEMA_VERSION}: {'; '.join(wrong)}")
    return record


def load(path: Path) -> dict[str, Any]:
    """Read and check one metrics.json; SchemaError names the file and the first problems (also
    a FIFO, device or oversized file, refused before a byte is read: harness.store.inputs)."""
    from harness.store import inputs
    from kvcore.errors import ConfigError

    try:
        text = inputs.read_text(Path(path), "metrics.json", inputs.SMALL_MAX_BYTES)
    except ConfigError as exc:
        raise SchemaError(str(exc).removeprefix("metrics.json: ")) from None
    try:
        data = inputs.strict_json(text)
    except ValueError as exc:
        raise SchemaError(f"{path}: not valid JSON ({str(exc).splitlines()[0]})") from None
    wrong = problems(data)
    if wrong:
        raise SchemaError(f"{path}: not a kv-harness run: {'; '.join(wrong[:3])}"
                          + (f" (+{len(wrong) - 3} more)" if len(wrong) > 3 else ""))
    return data


def is_complete_run(folder: Path) -> bool:
    """A folder holding a complete run of this harness (a valid metrics.json)."""
    try:
        load(Path(folder) / "metrics.json")
    except SchemaError:
        return False
    return True


def lookup(metrics: dict, dotted: str) -> Any:
    """`metrics["a"]["b"]` for "a.b"; None when a part is missing."""
    node: Any = metrics
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def finite(value: Any) -> bool:
    return _type_ok(value, NUMBER) and math.isfinite(value)
