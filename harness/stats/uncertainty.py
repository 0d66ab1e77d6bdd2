"""A cell's interval and a run's paired comparison with its reference, from per-sample records.

Each task's samples (samples.jsonl rows, with a content `sample_id`) become scored units in the
design its official score implies (harness.stats.intervals.Design):

* perplexity: every scored token's NLL, in contiguous blocks of ceil(n^(1/3)) tokens (a block
  bootstrap: neighbouring tokens' losses are correlated), the interval taken on exp(mean NLL);
* ruler: each sample's score x100, strata = (sub-task, length) weighted as RULER averages them
  (equal per sub-task, equal per length inside it);
* longbench: each sample's score x100, strata = datasets, equal weights (the mean of datasets);
* multiturn: every turn (x100), clustered by conversation (turns share one context);
* xsum: each scored item's ROUGE-L F x100;
* lm_eval: each document's `acc`, strata = lm-eval tasks, equal weights (acc_mean).

`cell_uncertainty` (the interval a run records in metrics.json) and `compare` (paired, on
identical samples only) are the two entry points; both are pure on (metrics, samples).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np

from harness.store import inputs
from harness.stats import intervals as stats
from kvcore.errors import ConfigError


class PairingError(ConfigError):
    """Two runs whose samples are not the same: no paired comparison."""


@dataclass
class Units:
    """A run's scored units: `keys` pair them across runs ((sample_id, index inside it))."""
    keys: list[tuple[str, int]]
    values: np.ndarray  # (n,) in the metric's units (before any transform)
    strata: list | None
    weights: dict | None
    clusters: list | None
    transform: str
    unit: str  # what one unit is: "tokens", "samples", "turns", "documents"
    what: str  # the design, in words
    full_score: float | None = None  # a pass (scores 0 / full_score are pass/fail); None: graded


def _sid(row: dict) -> str:
    if "sample_id" not in row:
        raise PairingError("samples lack sample_id (written before content ids): re-run them")
    return str(row["sample_id"])


def _perplexity(samples: list[dict]) -> Units:
    keys, values, blocks = [], [], []
    n = sum(len(r.get("token_nll") or []) for r in samples)
    if n == 0:
        raise ValueError("no token_nll in the samples (written before per-token records)")
    length = max(1, math.ceil(n ** (1 / 3)))
    for r in samples:
        for t, x in enumerate(r.get("token_nll") or []):
            keys.append((_sid(r), t))
            values.append(x)
            blocks.append(f"{_sid(r)}:{t // length}")
    return Units(keys, np.asarray(values), None, None, blocks, "exp", "tokens",
                 f"block bootstrap, blocks of {length} contiguous tokens, on exp(mean NLL)")


def _ruler(samples: list[dict]) -> Units:
    cells = [(r["subtask"], r["length_tokens"]) for r in samples]
    per_subtask: dict[str, set] = {}
    for subtask, length in cells:
        per_subtask.setdefault(subtask, set()).add(length)
    weights = {f"{s}@{x}": 1 / (len(per_subtask) * len(per_subtask[s]))
               for s, lengths in per_subtask.items() for x in lengths}
    return Units([(_sid(r), 0) for r in samples], 100 * np.asarray([r["score"] for r in samples],
                                                                   dtype=float),
                 [f"{s}@{x}" for s, x in cells], weights, None, "identity", "samples",
                 "stratified bootstrap over (sub-task, length), RULER's weights", 100.0)


def _longbench(samples: list[dict]) -> Units:
    strata = [r["dataset"] for r in samples]
    return Units([(_sid(r), 0) for r in samples], 100 * np.asarray([r["score"] for r in samples],
                                                                   dtype=float),
                 strata, {d: 1.0 for d in set(strata)}, None, "identity", "samples",
                 "stratified bootstrap over datasets, equal weights (LongBench's average)",
                 100.0)


def _multiturn(samples: list[dict]) -> Units:
    keys, values, clusters = [], [], []
    for r in samples:
        for k, turn in enumerate(r["turns"]):
            keys.append((_sid(r), k))
            values.append(100 * float(turn["correct"]))
            clusters.append(_sid(r))
    return Units(keys, np.asarray(values), None, None, clusters, "identity", "turns",
                 "cluster bootstrap over conversations (turns share a context)", 100.0)


def _xsum(samples: list[dict]) -> Units:
    scored = [r for r in samples if not r.get("skipped")]
    return Units([(_sid(r), 0) for r in scored], np.asarray([r["rougeL"] for r in scored]),
                 None, None, None, "identity", "samples", "bootstrap over items")


def _lm_eval(samples: list[dict]) -> Units:
    scored = [r for r in samples if "acc" in r]
    if not scored:
        raise ValueError("no per-document acc in the samples")
    strata = [r["task"] for r in scored]
    return Units([(_sid(r), 0) for r in scored], np.asarray([r["acc"] for r in scored]),
                 strata, {t: 1.0 for t in set(strata)}, None, "identity", "documents",
                 "stratified bootstrap over lm-eval tasks, equal weights (acc_mean)", 1.0)


# task name -> (main metric, units from its samples)
UNITS: dict[str, tuple[str, Callable[[list[dict]], Units]]] = {
    "perplexity": ("ppl", _perplexity), "ruler": ("average", _ruler),
    "longbench": ("average", _longbench), "multiturn": ("accuracy", _multiturn),
    "xsum": ("rougeL", _xsum), "lm_eval": ("acc_mean", _lm_eval),
}


def units(task: str, samples: list[dict]) -> Units:
    if task not in UNITS:
        raise ValueError(f"task={task} has no per-sample design here")
    return UNITS[task][1](samples)


# --- what a samples.jsonl row must hold, per task (checked as it is read) ----------------------

def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _score_problem(row: dict, key: str, low: float, high: float, where: str = "") -> str:
    """'' when row[key] is a finite number in [low, high] (a bool, string, null or NaN is not), or
    absent (written before that record existed: the interval then says it has none)."""
    if key not in row:
        return ""
    value = row[key]
    if not _number(value):
        return (f"{where}{key}={json.dumps(value)[:40]} must be a finite number in "
                f"[{low:g}, {high:g}]")
    if not low <= value <= high:
        return f"{where}{key}={value!r} is outside [{low:g}, {high:g}]"
    return ""


def _text_problem(row: dict, key: str) -> str:
    value = row.get(key)
    return "" if key not in row or (isinstance(value, str) and value) else (
        f"{key}={json.dumps(value)[:40]} must be a non-empty string")


# -log p >= 0; an engine that reports log-probabilities (vLLM) may round one just above 0.
NLL_SLACK = 1e-4


def _perplexity_row(row: dict) -> str:
    if "token_nll" not in row:  # written before per-token records: no interval, said later
        return ""
    nll = row["token_nll"]
    if not isinstance(nll, list):
        return f"token_nll must be a list of numbers (got a JSON {inputs.json_type(nll)})"
    for t, x in enumerate(nll):
        if not _number(x) or x < -NLL_SLACK:  # -log p is never negative
            return f"token_nll[{t}]={json.dumps(x)[:40]} must be a finite number >= 0"
    return ""


def _ruler_row(row: dict) -> str:
    length = row.get("length_tokens", 1)
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        return f"length_tokens={json.dumps(length)[:40]} must be a positive integer"
    return _score_problem(row, "score", 0, 1) or _text_problem(row, "subtask")


def _longbench_row(row: dict) -> str:
    return _score_problem(row, "score", 0, 1) or _text_problem(row, "dataset")


def _multiturn_row(row: dict) -> str:
    turns = row.get("turns", [{}])
    if not isinstance(turns, list) or not turns:
        return f"turns={json.dumps(turns)[:40]} must be a non-empty list of turns"
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            return f"turns[{k}] must be an object with 'correct'"
        problem = _score_problem(turn, "correct", 0, 1, f"turns[{k}].")
        if problem:
            return problem
    return ""


def _xsum_row(row: dict) -> str:
    return "" if row.get("skipped") is True else _score_problem(row, "rougeL", 0, 100)


def _lm_eval_row(row: dict) -> str:
    if "acc" not in row:  # a document without accuracy (e.g. a perplexity task): not scored
        return ""
    return _score_problem(row, "acc", 0, 1) or _text_problem(row, "task")


ROW_CHECKS: dict[str, Callable[[dict], str]] = {
    "perplexity": _perplexity_row, "ruler": _ruler_row, "longbench": _longbench_row,
    "multiturn": _multiturn_row, "xsum": _xsum_row, "lm_eval": _lm_eval_row,
}


def row_problem(task: str, row: dict) -> str:
    """Why one samples.jsonl row of `task` cannot be scored ('' when it can): a content id that
    is not a string, or a score that is not a finite number in the task's range."""
    if "sample_id" in row and (not isinstance(row["sample_id"], str) or not row["sample_id"]):
        return f"sample_id={json.dumps(row['sample_id'])[:40]} must be a non-empty string"
    check = ROW_CHECKS.get(task)
    return check(row) if check else ""


def load_samples(path: Path, task: str, key: str = "samples.jsonl") -> list[dict]:
    """A run's samples.jsonl (or frozen reference) read for `task`: a regular file under the
    size cap, one JSON object per line, every score a finite number in range; ConfigError
    naming `key`, the file and the line otherwise. Before any bootstrap runs."""
    return inputs.jsonl_rows(Path(path), key, lambda row: row_problem(task, row))


def _design(u: Units, values: np.ndarray) -> stats.Design:
    return stats.design(values, u.strata, u.weights, u.clusters, u.transform)


def _binary(u: Units, values: np.ndarray) -> bool:
    return u.full_score is not None and bool(np.all((values == 0) | (values == u.full_score)))


def _simple(u: Units) -> bool:
    """One stratum, one unit per cluster: a plain sample of independent units."""
    return u.clusters is None and (u.strata is None or len(set(u.strata)) == 1)


def cell_uncertainty(task: str, metrics: dict[str, Any], samples: list[dict],
                     resamples: int = stats.RESAMPLES, seed: int = stats.SEED) -> dict[str, Any]:
    """The 95 % interval of a run's main metric, its n and how it was computed (metrics.json's
    `uncertainty` section). Wilson for pass/fail scores of independent samples, Student's t
    for a plain continuous mean, else the design's bootstrap (percentile, seeded)."""
    metric = UNITS.get(task, (None,))[0]
    out: dict[str, Any] = {"metric": metric, "value": metrics.get(metric) if metric else None,
                           "confidence": stats.CONFIDENCE, "n": None, "ci95": None}
    try:
        u = units(task, samples)
    except (ValueError, KeyError, PairingError) as exc:
        return {**out, "interval": f"none: {exc}"}
    d = _design(u, u.values)
    n = len(u.values)
    out.update(n=n, n_unit=u.unit, clusters=d.clusters, estimate=float(stats.estimate(d)[0]))
    if n < 2:
        return {**out, "interval": "none: fewer than 2 scored units"}
    if _simple(u) and _binary(u, u.values):
        low, high = stats.wilson(int(np.sum(u.values > 0)), n)
        out.update(ci95=[low * u.full_score, high * u.full_score],
                   interval="Wilson score interval")
    elif _simple(u) and u.transform == "identity" and task == "xsum":
        out.update(ci95=list(stats.clt_interval(u.values)), interval="mean +- t s/sqrt(n) (CLT)")
    else:
        out.update(ci95=list(stats.bootstrap_interval(d, resamples, seed)),
                   interval=f"{u.what}; percentile, {resamples} resamples, seed {seed}")
    value = out["value"]
    if isinstance(value, (int, float)) and abs(out["estimate"] - value) > 0.01 * max(1, abs(value)):
        # e.g. an lm-eval group whose own weighting the samples do not say: the interval is the
        # design's, around its estimate; said so rather than hidden
        out["interval"] += (f"; NOTE: around the design's estimate {out['estimate']:.4g}, not the "
                            f"reported {value:.4g}")
    return out


@dataclass
class Pairing:
    """Two runs' units aligned by key."""
    reference: np.ndarray
    run: np.ndarray
    units: Units


def pair(task: str, reference_samples: list[dict], samples: list[dict]) -> Pairing:
    """The run's units aligned to the reference's by content id (never by position); refused
    with what differs when the two runs were not scored on the same samples."""
    ref, run = units(task, reference_samples), units(task, samples)
    ref_index = {k: i for i, k in enumerate(ref.keys)}
    run_index = {k: i for i, k in enumerate(run.keys)}
    if len(ref_index) != len(ref.keys) or len(run_index) != len(run.keys):
        raise PairingError("a run scores the same sample twice: no pairing by id")
    if ref_index.keys() != run_index.keys():
        only_run = sorted({k[0] for k in run_index.keys() - ref_index.keys()})
        only_ref = sorted({k[0] for k in ref_index.keys() - run_index.keys()})
        parts = []
        if only_ref:
            parts.append(f"{len(only_ref)} sample(s) of the reference are not in the run "
                         f"(e.g. {only_ref[0]})")
        if only_run:
            parts.append(f"{len(only_run)} sample(s) of the run are not in the reference "
                         f"(e.g. {only_run[0]})")
        if not parts:
            parts.append("the same samples are scored on different units (e.g. tokens)")
        raise PairingError(f"not the same samples ({len(ref.keys)} units in the reference, "
                           f"{len(run.keys)} in the run): {'; '.join(parts)}")
    order = [run_index[k] for k in ref.keys]
    return Pairing(ref.values, run.values[order], ref)


def compare(task: str, reference_samples: list[dict], samples: list[dict],
            resamples: int = stats.RESAMPLES, seed: int = stats.SEED) -> dict[str, Any]:
    """The paired comparison of a run with its reference on identical samples: difference
    (run - reference) with its paired-bootstrap interval, retained fraction (run / reference)
    with its interval, discordance, and the exact McNemar p-value for pass/fail scores of
    independent samples (else the paired bootstrap's)."""
    p = pair(task, reference_samples, samples)
    d = _design(p.units, np.stack([p.reference, p.run], axis=1))
    both = np.concatenate([p.reference, p.run])
    counts = None
    if _simple(p.units) and _binary(p.units, both):
        passed_ref, passed_run = p.reference > 0, p.run > 0
        counts = (int(np.sum(passed_ref & ~passed_run)), int(np.sum(~passed_ref & passed_run)))
    result = stats.paired(d, resamples, seed, lost_gained=counts)
    out = {**asdict(result), "difference_ci95": list(result.difference_ci95),
           "retained_ci95": list(result.retained_ci95) if result.retained_ci95 else None,
           "n": int(p.reference.size), "n_unit": p.units.unit,
           "discordance": stats.discordance(p.reference, p.run),
           "design": p.units.what, "resamples": resamples, "seed": seed}
    if counts is not None:
        out.update(lost=counts[0], gained=counts[1])
    return out


def half_width(cell: dict[str, Any]) -> float | None:
    ci = cell.get("ci95") if cell else None
    return None if not ci else (ci[1] - ci[0]) / 2
