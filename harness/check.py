"""Regression gates: compare runs against thresholds; non-zero exit with a table of regressions.

    python -m harness.check <results dir> --against conf/regression/ci.yaml

Schema (`thresholds:` list), each entry:
    {model, method, task, metric: <dotted key in metrics.json, e.g. accuracy.ppl>,
     min: <optional>, max: <optional>, ratio_to_method: <optional method name>,
     hyperparameters: <optional dict the run's method hyperparameters must contain>}
With `ratio_to_method`, the value checked is metric / the same metric of that method's run on the
same model and task found in the same results (the most recent one), so speed gates are ratios
measured on one machine. An entry that matches no run is itself a failure: a gate that checks
nothing must not pass. With several matching runs, the most recent one is checked.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import yaml

from harness.report import find_runs

REQUIRED = ("model", "method", "task", "metric")


def lookup(metrics: dict, dotted: str) -> Any:
    node: Any = metrics
    for part in dotted.split("."):
        if not isinstance(node, dict) or part not in node:
            return None
        node = node[part]
    return node


def load_thresholds(path: Path) -> list[dict]:
    if not path.is_file():
        raise SystemExit(f"error: --against {path}: no such file")
    data = yaml.safe_load(path.read_text()) or {}
    entries = data.get("thresholds")
    if not isinstance(entries, list) or not entries:
        raise SystemExit(f"error: {path}: needs a non-empty list under 'thresholds:'")
    for i, e in enumerate(entries):
        missing = [k for k in REQUIRED if k not in e]
        if missing:
            raise SystemExit(f"error: {path}: thresholds[{i}] lacks {', '.join(missing)}")
        if "min" not in e and "max" not in e:
            raise SystemExit(f"error: {path}: thresholds[{i}] needs min and/or max")
    return entries


def _matches(metrics: dict, model: str, method: str, task: str, hyper: dict | None) -> bool:
    if (metrics["model"]["name"], metrics["method"]["name"], metrics["task"]["name"]) != (
            model, method, task):
        return False
    got = metrics["method"].get("hyperparameters", {})
    return all(got.get(k) == v for k, v in (hyper or {}).items())


def _latest(runs: list[dict]) -> dict | None:
    return max(runs, key=lambda m: m.get("run", {}).get("started", "")) if runs else None


def check(runs: list[dict], entries: list[dict]) -> list[dict]:
    results = []
    for e in entries:
        chosen = _latest([m for m in runs if _matches(m, e["model"], e["method"], e["task"],
                                                      e.get("hyperparameters"))])
        res = {"entry": f"{e['model']}/{e['method']}/{e['task']} {e['metric']}", "value": None,
               "bounds": f"[{e.get('min', '-inf')}, {e.get('max', 'inf')}]", "ok": False}
        if chosen is None:
            res["why"] = "matched no run"
            results.append(res)
            continue
        value = lookup(chosen, e["metric"])
        if value is None:
            res["why"] = f"{e['metric']} missing in the run"
            results.append(res)
            continue
        if e.get("ratio_to_method"):
            ref = _latest([m for m in runs if _matches(m, e["model"], e["ratio_to_method"],
                                                       e["task"], None)])
            ref_value = lookup(ref, e["metric"]) if ref else None
            if not ref_value:
                res["why"] = f"no {e['ratio_to_method']} run to compare with"
                results.append(res)
                continue
            value = value / ref_value
            res["entry"] += f" / {e['ratio_to_method']}"
        res["value"] = value
        low, high = e.get("min"), e.get("max")
        res["ok"] = (low is None or value >= low) and (high is None or value <= high)
        res["why"] = "" if res["ok"] else ("below min" if low is not None and value < low else "above max")
        results.append(res)
    return results


def table(results: list[dict]) -> str:
    lines = ["| check | value | allowed | status |", "|---|---|---|---|"]
    for r in results:
        value = f"{r['value']:.4g}" if isinstance(r["value"], (int, float)) else "-"
        status = "ok" if r["ok"] else f"REGRESSION: {r['why']}"
        lines.append(f"| {r['entry']} | {value} | {r['bounds']} | {status} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.check", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--against", type=Path, required=True)
    args = ap.parse_args(argv)
    entries = load_thresholds(args.against)
    runs = [json.loads(f.read_text()) for f in find_runs(args.results)]
    results = check(runs, entries)
    print(table(results))
    failed = [r for r in results if not r["ok"]]
    print(f"\nregression gate: {len(results) - len(failed)} checks within bounds, "
          f"{len(failed)} regressed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
