"""Regression gates: compare runs against thresholds; non-zero exit with a table of regressions.

    python -m harness.report.check <results dir> --against conf/regression/ci.yaml

Schema (`thresholds:` list), each entry:
    {model, method, task, metric: <dotted key in metrics.json, e.g. accuracy.ppl>,
     min: <optional>, max: <optional>, ratio_to_method: <optional method name>,
     hyperparameters: <optional dict the run's method hyperparameters must contain>}
With `ratio_to_method`, the value checked is metric / the same metric of that method's run on the
same model and task found in the same results (the most recent one), so speed gates are ratios
measured on one machine.

With `paired_reference: <frozen samples.jsonl, relative to the thresholds file>` and metric
`paired.difference` (run - reference) or `paired.retained` (run / reference), the run's task main
metric is compared with the frozen reference predictions on identical samples (paired by content
id; refused otherwise) and the bounds apply to its 95 % paired-bootstrap interval: the check fails
only when the whole interval is beyond a bound (lower bound above max, upper bound below min),
never on noise. Deterministic figures keep plain min/max bands. An entry that matches no run is itself a failure: a gate that checks
nothing must not pass. With several matching runs, the most recent one is checked. A run whose
method did not act (`kv.method_active=false`) is never within bounds: it fails as "not comparable".

The thresholds file is checked strictly (unknown keys such as a misspelled `mxa:` are errors, a
bound must be a number, min <= max; methods, tasks, hyperparameters and metric sections must be
the harness's own, and a model or metric no run has at all is a typo). Runs are read through the
metrics schema; a corrupt one is skipped with a warning naming it (only corrupt ones: bad input,
the wrong folder). Exit codes: 0 all within
bounds, 1 a regression (or a check that matched nothing), 2 bad input (thresholds file, paths)
— so CI can tell them apart.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

import yaml

from harness.store import inputs
from harness.report import find_runs, load_runs
from harness.store.schema import lookup
from kvcore.errors import ConfigError

REQUIRED = ("model", "method", "task", "metric")
STRING_KEYS = ("model", "method", "task", "metric", "ratio_to_method", "paired_reference")
ALLOWED = (*REQUIRED, "min", "max", "ratio_to_method", "hyperparameters", "paired_reference")
PAIRED_METRICS = ("paired.difference", "paired.retained")
REGRESSION_EXIT, BAD_INPUT_EXIT = 1, 2

__all__ = ["check", "load_thresholds", "lookup", "main", "table"]


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _entry_problem(e: Any) -> str:
    if not isinstance(e, dict):
        return f"must be a mapping (got {e!r})"
    unknown = sorted(str(k) for k in e if k not in ALLOWED)
    if unknown:
        return f"has unknown key {unknown[0]!r}; allowed: {', '.join(ALLOWED)}"
    missing = [k for k in REQUIRED if k not in e]
    if missing:
        return f"lacks {', '.join(missing)}"
    for key in STRING_KEYS:
        if key in e and (not isinstance(e[key], str) or not e[key]):
            return f"{key}={e[key]!r} must be a non-empty string"
    if "min" not in e and "max" not in e:
        return "needs min and/or max"
    for key in ("min", "max"):
        if key in e and not _number(e[key]):
            return f"{key}={e[key]!r} must be a number"
    if "min" in e and "max" in e and e["min"] > e["max"]:
        return f"min={e['min']} is above max={e['max']}: no value could pass"
    if "hyperparameters" in e and not isinstance(e["hyperparameters"], dict):
        return f"hyperparameters={e['hyperparameters']!r} must be a mapping"
    if ("paired_reference" in e) != (e["metric"] in PAIRED_METRICS):
        return (f"metric={e['metric']!r}: {' or '.join(PAIRED_METRICS)} go with "
                "paired_reference: <frozen samples.jsonl>, and only they")
    if "paired_reference" in e and "ratio_to_method" in e:
        return "ratio_to_method does not apply to a paired metric"
    return _name_problem(e)


def _name_problem(e: dict) -> str:
    """A method, task, metric section or hyperparameter this harness does not have (a typo):
    bad input, not a regression."""
    from harness.config.config_check import closest
    from harness.store.schema import OPTIONAL_SECTIONS, REQUIRED
    from methods import available_methods, method_class
    from tasks import available_tasks

    def unknown(key: str, value: str, allowed: list[str]) -> str:
        near = closest(value, allowed)
        return (f"{key}={value!r} is unknown" + (f" (did you mean {near!r}?)" if near else "")
                + f"; allowed: {', '.join(allowed)}")

    for key in ("method", "ratio_to_method"):
        if key in e and e[key] not in available_methods():
            return unknown(key, e[key], available_methods())
    if e["task"] not in available_tasks():
        return unknown("task", e["task"], available_tasks())
    sections = [*REQUIRED, *OPTIONAL_SECTIONS]
    section = e["metric"].split(".", 1)[0]
    if e["metric"] not in PAIRED_METRICS and (section not in sections or "." not in e["metric"]):
        return (f"metric={e['metric']!r} must be <section>.<key> of metrics.json, a section being "
                f"one of {', '.join(sections)}")
    names = method_class(e["method"]).hyperparameter_names()
    for key in e.get("hyperparameters") or {}:
        if key not in names:
            return unknown(f"hyperparameters.{key} (of method={e['method']})", str(key),
                           names) if names else f"method={e['method']} has no hyperparameters"
    return ""


def check_names_in_runs(entries: list[dict], runs: list[dict], where: str) -> None:
    """A model or metric that no run under the results has at all is a typo (or the wrong
    results folder): bad input, said with the closest name the runs have."""
    from harness.config.config_check import closest

    if not runs:
        return
    models = sorted({m["model"]["name"] for m in runs})
    for i, e in enumerate(entries):
        if e["model"] not in models:
            near = closest(e["model"], models)
            raise ConfigError(f"thresholds[{i}] model={e['model']!r} has no run under {where}"
                              + (f" (did you mean {near!r}?)" if near else "")
                              + f"; models there: {', '.join(models)}")
        if e["metric"] not in PAIRED_METRICS and all(lookup(m, e["metric"]) is None for m in runs):
            section = e["metric"].split(".", 1)[0]
            keys = sorted({f"{section}.{k}" for m in runs for k in (m.get(section) or {})})
            near = closest(e["metric"], keys)
            raise ConfigError(f"thresholds[{i}] metric={e['metric']!r} is in no run under {where}"
                              + (f" (did you mean {near!r}?)" if near else ""))
        ref = e.get("ratio_to_method")
        methods = sorted({m["method"]["name"] for m in runs if m["model"]["name"] == e["model"]})
        if ref and ref not in methods:
            near = closest(ref, methods)
            raise ConfigError(f"thresholds[{i}] ratio_to_method={ref!r} has no run of "
                              f"model={e['model']!r} under {where}"
                              + (f" (did you mean {near!r}?)" if near else "")
                              + f"; methods there: {', '.join(methods)}")


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (plain YAML keeps the last,
    so a threshold typed twice would silently lose one of its values)."""

    def construct_mapping(self, node, deep=False):
        seen = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", key_node.start_mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_thresholds(path: Path) -> list[dict]:
    """The entries of a thresholds file; ConfigError naming the file (and entry) otherwise."""
    if path.is_dir():
        raise ConfigError(f"--against {path} is a folder; give a thresholds file (YAML), e.g. "
                          "conf/regression/ci.yaml")
    if path.exists() and not path.is_file():
        raise ConfigError(f"--against {path} is not a regular file (a device, FIFO or socket); "
                          "give a thresholds file (YAML)")
    text = inputs.read_text(path, "--against")  # kind and size before a byte is read
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)
    except yaml.YAMLError as exc:
        where = getattr(exc, "problem_mark", None)
        line = f" (line {where.line + 1})" if where is not None else ""
        raise ConfigError(f"{path}: not valid YAML{line}: "
                          f"{getattr(exc, 'problem', None) or exc}") from None
    if not isinstance(data, dict) or set(data) != {"thresholds"}:
        got = sorted(map(str, data)) if isinstance(data, dict) else type(data).__name__
        raise ConfigError(f"{path}: must be a mapping with one key, 'thresholds:' (got {got})")
    entries = data["thresholds"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{path}: needs a non-empty list under 'thresholds:'")
    for i, e in enumerate(entries):
        problem = _entry_problem(e)
        if problem:
            raise ConfigError(f"{path}: thresholds[{i}] {problem}")
        if "paired_reference" in e:
            e["_reference_samples"] = _frozen(path.parent / e["paired_reference"], e["task"],
                                              f"{path}: thresholds[{i}] paired_reference")
    return entries


def _frozen(path: Path, task: str, where: str) -> list[dict]:
    """Frozen reference predictions: a samples.jsonl of `task` whose rows carry sample_id and
    give the task's scored units (read and checked like a run's: harness.stats.uncertainty)."""
    from harness.stats.uncertainty import load_samples, units

    rows = load_samples(path, task, where)
    if not rows or not all("sample_id" in r for r in rows):
        raise ConfigError(f"{where}: {path}: needs samples.jsonl rows with sample_id")
    try:
        units(task, rows)
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{where}: {path}: no scored units for task={task} ({exc})") from None
    return rows


def _matches(metrics: dict, model: str, method: str, task: str, hyper: dict | None) -> bool:
    if (metrics["model"]["name"], metrics["method"]["name"], metrics["task"]["name"]) != (
            model, method, task):
        return False
    got = metrics["method"].get("hyperparameters", {})
    return all(got.get(k) == v for k, v in (hyper or {}).items())


# What a run and its ratio_to_method reference must share for the ratio to mean anything: the
# same model (and dtype, device), task options and runner protocol; only the method differs
# (a method's own dense layers are part of the method, so not compared).
_SETTING = (("model", "name"), ("model", "dtype"), ("model", "device"), ("task", "name"),
            ("task", "options"), ("protocol", "batch_size"), ("protocol", "prefill"),
            ("protocol", "prefill_chunk_tokens"), ("protocol", "attn_impl"),
            ("protocol", "dense_layers_runner"), ("protocol", "budget_basis"))


def _setting(metrics: dict) -> str:
    return json.dumps([metrics.get(part, {}).get(key) for part, key in _SETTING], sort_keys=True,
                      default=str)


def _latest(runs: list[dict]) -> dict | None:
    return max(runs, key=lambda m: m.get("run", {}).get("started", "")) if runs else None


def _inactive(metrics: dict) -> str:
    """Why a run's method did not act ('' when it did, or is a reference)."""
    kv = metrics.get("kv") or {}
    if kv.get("method_active") is False:
        return f"the method did not act (kv.method_active=false: {kv.get('inactive_reason')})"
    return ""


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
        inactive = _inactive(chosen)
        if inactive:  # a gate never certifies a method that did not act
            res["why"] = f"not comparable: {inactive}"
            results.append(res)
            continue
        if "paired_reference" in e:
            results.append(_paired_check(res, chosen, e))
            continue
        value = lookup(chosen, e["metric"])
        if not _number(value) or not math.isfinite(value):
            res["why"] = (f"{e['metric']} missing in the run" if value is None
                          else f"{e['metric']}={value!r} is not a finite number")
            results.append(res)
            continue
        if e.get("ratio_to_method"):
            setting = _setting(chosen)
            ref = _latest([m for m in runs if _matches(m, e["model"], e["ratio_to_method"],
                                                       e["task"], None)
                           and _setting(m) == setting])
            ref_value = lookup(ref, e["metric"]) if ref else None
            if ref is not None and _inactive(ref):
                res["why"] = f"not comparable: the {e['ratio_to_method']} run: {_inactive(ref)}"
                results.append(res)
                continue
            if not _number(ref_value) or ref_value == 0:
                res["why"] = (f"no {e['ratio_to_method']} run measured like it (same model, "
                              "dtype, device, task options and runner protocol) to compare with")
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


def _paired_check(res: dict, chosen: dict, e: dict) -> dict:
    """The run against frozen reference predictions: fails only when the paired 95 % interval
    lies wholly beyond a bound."""
    from harness.stats.uncertainty import PairingError, compare

    res["entry"] += f" vs {e['paired_reference']}"
    res["bounds"] += " (95 % interval)"
    samples = _samples(chosen, e["task"])
    if samples is None:
        res["why"] = "the run has no samples.jsonl to pair"
        return res
    try:
        c = compare(e["task"], e["_reference_samples"], samples)
    except PairingError as exc:  # the reference is not of this run's samples: bad input
        raise ConfigError(f"paired_reference={e['paired_reference']} does not pair with the run "
                          f"{chosen['_folder']}: {exc}") from None
    except (ValueError, KeyError) as exc:
        res["why"] = f"not comparable: {exc}"
        return res
    value, ci = ((c["difference"], c["difference_ci95"]) if e["metric"] == "paired.difference"
                 else (c["retained"], c["retained_ci95"]))
    if value is None or not ci:
        res["why"] = f"{e['metric']} undefined (the reference scores 0)"
        return res
    res["value"], res["ci95"] = value, ci
    low, high = e.get("min"), e.get("max")
    below, above = low is not None and ci[1] < low, high is not None and ci[0] > high
    res["ok"] = not (below or above)
    res["why"] = ("" if res["ok"] else "interval wholly below min" if below
                  else "interval wholly above max")
    return res


def _samples(metrics: dict, task: str) -> list[dict] | None:
    """The run's samples (None when it wrote none); one that cannot be read as the task's
    samples (a FIFO, a device link, a NaN score) is bad input (ConfigError)."""
    from harness.stats.uncertainty import load_samples

    folder = metrics.get("_folder")
    path = Path(folder) / "samples.jsonl" if folder else None
    if path is None or not (path.exists() or path.is_symlink()):
        return None
    return load_samples(path, task) or None


def table(results: list[dict]) -> str:
    lines = ["| check | value | allowed | status |", "|---|---|---|---|"]
    for r in results:
        value = f"{r['value']:.4g}" if isinstance(r["value"], (int, float)) else "-"
        if r.get("ci95"):
            value += f" [{r['ci95'][0]:.4g}, {r['ci95'][1]:.4g}]"
        status = "ok" if r["ok"] else f"REGRESSION: {r['why']}"
        lines.append(f"| {r['entry']} | {value} | {r['bounds']} | {status} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m harness.report.check", description=__doc__.splitlines()[0])
    ap.add_argument("results", nargs="+")
    ap.add_argument("--against", type=Path, required=True)
    args = ap.parse_args(argv)
    try:
        entries = load_thresholds(args.against)
        files, skipped = find_runs(args.results), []
        runs = [dict(metrics, _folder=str(path.parent))
                for path, metrics in load_runs(files, warn=skipped.append)]
        if files and not runs:  # only corrupt runs: the wrong folder, not a regression
            raise ConfigError(f"no runs to check under {' '.join(args.results)} "
                              f"({len(files)} metrics.json, none valid; "
                              f"{skipped[0].removeprefix('warning: ')})")
        for line in skipped:
            print(line, file=sys.stderr)
        check_names_in_runs(entries, runs, " ".join(args.results))
        results = check(runs, entries)  # a run's or reference's samples unreadable: bad input
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return BAD_INPUT_EXIT
    print(table(results))
    failed = [r for r in results if not r["ok"]]
    print(f"\nregression gate: {len(results) - len(failed)} checks within bounds, "
          f"{len(failed)} regressed")
    return REGRESSION_EXIT if failed else 0


if __name__ == "__main__":
    sys.exit(main())
