"""Runs -> rows: finding metrics.json files, the labels a reader sees, and one row per run.

Every number a figure, the leaderboard or W&B shows is defined here once (`AXES`, `row`).
"""

from __future__ import annotations

import csv
import glob
import io
import sys
from pathlib import Path
from typing import Any

from harness.store.schema import SchemaError, load
from kvcore.errors import ConfigError

COLUMNS = ["run", "model", "method", "budget", "protocol", "batch", "task", "metric", "value",
           "active", "kv_held", "attended_fraction", "paper_relative_kv_size", "decode_tok_s",
           "decode_ms", "kv_bytes", "bytes_per_step",
           # added after the first reports (appended: readers of the CSV keep their columns)
           "variant", "provenance", "operating_point", "context_tokens",
           # the main metric's 95 % interval and n (harness.report.compare.attach)
           "ci95_low", "ci95_high", "n", "interval",
           # samples answered by the full cache by the method's rule (a sweep's; blank: no rule)
           "identical_to_full"]
# The two trade-off axes, both defined once in harness.core.accounting and read the same way for every
# run: the figures, the leaderboard and W&B take their names and units from here.
# {key: (short name for an axis, its definition for a caption)}.
AXES = {"kv_held": ("KV held", "bytes on every tier / the full cache in the model dtype"),
        "attended_fraction": ("attended fraction", "tokens attended / tokens seen at decode "
                                                   "steps, layers outside the dense set")}
REFERENCE = "full"  # the method every figure emphasises (the full cache)


def find_runs(patterns: list[str], warn=None) -> list[Path]:
    """metrics.json files under folders, globs or files; ConfigError when a path matches nothing.
    Folders whose name starts with "." (a run being written, kept aside) are left out; a
    metrics.json that is no regular file (a FIFO, a link to a device) is skipped with a warning;
    a run reached twice (through a link, or two patterns) is counted once."""
    warn = warn or (lambda text: print(text, file=sys.stderr))
    files: dict[Path, Path] = {}  # resolved -> the first path it was reached by
    for pattern in patterns:
        path = Path(pattern)
        if path.is_dir():
            candidates = [(path, f) for f in path.rglob("metrics.json")]
        else:
            matched = [Path(p) for p in glob.glob(pattern, recursive=True)]
            if not matched:
                raise ConfigError(f"{pattern}: no such file or folder")
            candidates = [(p if p.is_dir() else p.parent, p / "metrics.json" if p.is_dir() else p)
                          for p in matched]
        for root, f in candidates:
            inside = f.parent.relative_to(root).parts if f.parent != root else ()
            if f.name != "metrics.json" or any(part.startswith(".") for part in inside):
                continue
            if not f.is_file():
                if f.exists() or f.is_symlink():
                    warn(f"warning: skipped {f}: not a regular file (a FIFO, device or broken "
                         "link)")
                continue
            files.setdefault(f.resolve(), f)
    return sorted(files.values())


def load_runs(files: list[Path], warn=None) -> list[tuple[Path, dict]]:
    """(path, metrics) of every file that follows the schema; the others are named in a warning."""
    warn = warn or (lambda text: print(text, file=sys.stderr))
    runs = []
    for f in files:
        try:
            runs.append((f, load(f)))
        except SchemaError as exc:
            warn(f"warning: skipped {exc}")
    return runs


def _knobs(method: dict[str, Any], group: str) -> str:
    """The method's own declaration (metrics.json method.axis_keys / variant_keys) of which knobs
    move it along an axis and which name a variant: the report names no method's knobs."""
    hyper = method.get("hyperparameters", {})
    return " ".join(f"{k}={hyper[k]}" for k in method.get(group, []) if hyper.get(k) is not None)


def reference_protocol_label(metrics: dict) -> str:
    """The protocol under which the full cache is this run's reference, when its own section has
    no full-cache run: its own, less what the full cache never acts on (the decode-time
    compression interval, which it refuses; the dense layers, which it attends in full like
    every other), so a setting compressing while decoding, or a method with dense layers of its
    own (Quest's [0, 1]), is compared with the full cache on the same samples."""
    proto = {k: v for k, v in metrics.get("protocol", {}).items()
             if k != "decode_interval_tokens"}
    return protocol_label({**metrics, "protocol": {**proto, "dense_layers": []}})


def protocol_label(metrics: dict) -> str:
    """The runner protocol of a run, as every figure title and table shows it. Keys written by
    newer runners (budget_basis, decode_interval_tokens) are shown when present; older runs
    simply lack them."""
    proto = metrics.get("protocol", {})
    dense = proto.get("dense_layers")
    label = f"dense={dense if dense else '[]'} prefill={proto.get('prefill', '?')}"
    if proto.get("budget_basis"):
        label += f" basis={proto['budget_basis']}"
    if proto.get("decode_interval_tokens"):
        label += f" decode_every={proto['decode_interval_tokens']}"
    # A task's own protocol variant (RULER's query mode, perplexity after a prompt); RULER runs
    # written before `variant` existed carry only the query description ("query-aware: ...").
    variant = proto.get("variant") or (proto.get("query") or "").split(":")[0]
    return f"{label} {variant}" if variant else label


def method_label(metrics: dict) -> str:
    """The method's name, with the engine that ran it when that is not ours and not the name
    itself (Quest inside vLLM is `quest (vllm)`, beside our `quest`; vLLM's own KV formats are
    the method `vllm`)."""
    name = metrics["method"]["name"]
    engine = (metrics.get("engine") or {}).get("name")
    return f"{name} ({engine})" if engine and engine != name else name


def series_label(metrics: dict) -> str:
    """One curve per method variant and protocol: points of different protocols never join."""
    method = metrics["method"]
    return (f"{method_label(metrics)} {_knobs(method, 'variant_keys')} "
            f"[{protocol_label(metrics)}]").replace("  ", " ")


def main_metric(metrics: dict) -> tuple[str, float | None, bool]:
    """(name, value, higher is better) of the run's main metric, as its task class declares it
    (tasks.base.Task.main_metric); a task unknown to this checkout falls back to its first
    number, higher taken as better."""
    from tasks import task_class

    acc = metrics.get("accuracy", {})
    try:
        cls = task_class(metrics["task"]["name"])
        key, higher = cls.main_metric, cls.higher_is_better
    except (ConfigError, AttributeError):
        key, higher = None, True
    if key in acc and _number(acc[key]):
        return key, float(acc[key]), higher
    for k, v in acc.items():
        if _number(v):
            return k, float(v), higher
    return "", None, higher


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def kv_held(kv: dict) -> float | None:
    if kv.get("held_ratio") is not None:
        return kv["held_ratio"]
    return 1 / kv["compression_ratio"] if kv.get("compression_ratio") else None  # same definition


def model_label(metrics: dict) -> str:
    """The model's name, with its dtype unless float32: the name (folder + config hash) leaves the
    dtype out, and a bf16 run must never join an fp32 run's curve or row group."""
    model = metrics["model"]
    dtype = model.get("dtype") or "float32"
    return model["name"] if dtype == "float32" else f"{model['name']} ({dtype})"


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def row(path: Path, metrics: dict, root: Path | None) -> dict[str, Any]:
    speed, kv = metrics.get("speed", {}), metrics.get("kv", {})
    transfer, method = metrics.get("transfer", {}), metrics["method"]
    name, value, higher = main_metric(metrics)
    return {
        "run": str(path.parent.relative_to(root) if root and root in path.parents else path.parent),
        "model": model_label(metrics), "method": method_label(metrics),
        "variant": _knobs(method, "variant_keys"),
        "_variant": {k: fmt(v) for k, v in method.get("hyperparameters", {}).items()
                     if k in method.get("variant_keys", []) and v is not None},
        "setting": _knobs(method, "axis_keys"),
        "budget": " ".join(filter(None, (_knobs(method, "axis_keys"),
                                         _knobs(method, "variant_keys")))),
        "provenance": _text(method.get("provenance")),
        "operating_point": _text(method.get("operating_point")),
        "protocol": protocol_label(metrics), "series": series_label(metrics),
        "batch": metrics.get("protocol", {}).get("batch_size", 1),
        "task": metrics["task"]["name"], "metric": name, "value": value,
        "higher_is_better": higher,
        "active": {True: "yes", False: "INACTIVE", None: "reference"}.get(kv.get("method_active")),
        "kv_held": kv_held(kv), "attended_fraction": kv.get("attended_fraction_sparse_layers"),
        "paper_relative_kv_size": kv.get("paper_relative_kv_size"),
        "decode_tok_s": speed.get("decode_tokens_per_s"),
        "decode_ms": speed.get("decode_ms_per_token_median"),
        "kv_bytes": kv.get("bytes_total"), "bytes_per_step": transfer.get("bytes_per_decode_step"),
        "context_tokens": kv.get("seen_tokens_mean"),
        "ci95_low": None, "ci95_high": None, "n": None, "interval": "",
        "identical_to_full": metrics.get("run", {}).get("sweep", {}).get("identical_to_full"),
        "_metrics": metrics, "_folder": path.parent,
    }


def collect(patterns: list[str], warn=None) -> list[dict]:
    """The rows of every valid run under `patterns` (folders, globs, files), sorted; run names
    relative to the first folder. ConfigError: a path matches nothing, or no valid run."""
    warn = warn or (lambda text: print(text, file=sys.stderr))
    first = Path(patterns[0]) if Path(patterns[0]).is_dir() else None
    skipped: list[str] = []
    files = find_runs(patterns, skipped.append)
    runs = load_runs(files, skipped.append)
    if not runs:  # one line: the first file's reason is the likely one (the wrong folder)
        found = f"{len(files)} metrics.json, none valid" if files else "no metrics.json"
        why = f"; {skipped[0].removeprefix('warning: ')}" if skipped else ""
        raise ConfigError(f"no runs to report under {' '.join(patterns)} ({found}{why})")
    for line in skipped:
        warn(line)
    rows = [row(f, metrics, first) for f, metrics in runs]
    rows.sort(key=lambda r: (r["task"], r["model"], r["method"], r["budget"], r["run"]))
    return rows


def fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    return "" if v is None else str(v)


def markdown(rows: list[dict]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    out += ["| " + " | ".join(fmt(r[c]).replace("|", "\\|") for c in COLUMNS) + " |"
            for r in rows]
    return "\n".join(out) + "\n"


def to_csv(rows: list[dict]) -> str:
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=COLUMNS, extrasaction="ignore")
    writer.writeheader()
    writer.writerows(rows)
    return buf.getvalue()
