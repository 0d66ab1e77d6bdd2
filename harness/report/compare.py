"""Every leaderboard number with its uncertainty: intervals, rank intervals, paired comparisons
against the full cache, the noise floor, and the flags read from them.

* A cell's interval and n come from its run's `uncertainty` (harness.stats.uncertainty), recomputed
  from samples.jsonl for runs written before it.
* Comparisons: each setting against the full cache of its section (model x protocol) and task
  column, on identical samples only (paired by content id; a run on other samples is listed as
  not paired, with what differs). "worse than full" / "better than full" are decided after a
  Benjamini-Hochberg correction over every comparison of the report (FDR 5 %).
* Noise floors: the full cache run again by another execution path on the same samples, its
  paired difference with our full cache (sdpa) is noise no method can be credited with: our
  engine with the other attention path (runner.attn_impl=eager), and another engine's full
  cache (harness.engines.vllm_engine: a run with an `engine` section whose KV nothing compresses,
  kv.method_active absent, as our full cache's). A method whose difference lies within the
  widest floor of its section and column is a tie. Floor runs are left out of the board.
* Rank intervals: ranks in each bootstrap resample (joint for runs on the reference's samples),
  their 95 % percentile range.
* Flags: a column where the full cache's interval reaches within 10 points (10 % of the scale) of
  the task's floor of 0 is non-discriminative; a budget curve is non-monotonic when a smaller
  budget's interval lies wholly better than a larger budget's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from harness.stats import intervals as stats
from harness.config.config_check import without_neutral
from harness.report.collect import REFERENCE, reference_protocol_label
from harness.stats.uncertainty import (PairingError, cell_uncertainty, compare, load_samples,
                                 units)

FDR = 0.05
FLOOR_MARGIN = 0.10  # of the scale: a full cache this close to scoring nothing
ATTN_FLOOR = "eager"  # the attention path whose full-cache run is the noise floor's second run


def samples_of(r: dict) -> list[dict] | None:
    """The run's samples.jsonl rows (cached on the row); None when it has none. A samples.jsonl
    that is there but cannot be read as the task's samples (a FIFO, a link to a device, too
    large, a NaN or string score, a row that is not an object) is bad input: ConfigError naming
    the file and line (uncertainty.load_samples)."""
    if "_samples" not in r:
        path = Path(r["_folder"]) / "samples.jsonl"
        there = path.exists() or path.is_symlink()
        r["_samples"] = (load_samples(path, r["task"]) or None) if there else None
    return r["_samples"]


def cell(r: dict) -> dict[str, Any]:
    """The run's interval record for its main metric ({} when none can be given)."""
    if "_cell" not in r:
        got = r["_metrics"].get("uncertainty") or {}
        if got.get("metric") != r["metric"]:
            samples = samples_of(r)
            got = (cell_uncertainty(r["task"], r["_metrics"]["accuracy"], samples)
                   if samples else {})
            got = got if got.get("metric") == r["metric"] else {}
        r["_cell"] = got
    return r["_cell"]


def attach(rows: list[dict]) -> None:
    """Each row's ci95, n and interval method, as the leaderboard and figures read them. Every
    run's samples are read (and checked) first, so bad input stops before any bootstrap."""
    for r in rows:
        samples_of(r)
    for r in rows:
        c = cell(r)
        r["ci95_low"], r["ci95_high"] = (c["ci95"] if c.get("ci95") else (None, None))
        r["n"] = c.get("n")
        r["interval"] = c.get("interval", "")
        r["_floor"] = False
    for group in _full_runs(rows).values():
        attn = {_attn(r) for r in group}
        if ATTN_FLOOR in attn and len(attn) > 1:
            for r in group:
                r["_floor"] = _attn(r) == ATTN_FLOOR
        for r in _engine_references(rows, group):
            r["_floor"] = True


def _engine(r: dict) -> str | None:
    """The other engine that ran this run (its metrics' `engine.name`), None for ours."""
    return (r["_metrics"].get("engine") or {}).get("name")


def _engine_references(rows: list[dict], group: list[dict]) -> list[dict]:
    """Other engines' full-cache runs of the same cell as our full-cache `group`: an engine
    run that compresses nothing (kv.method_active absent, as our full cache's), on the same
    model, task, options and batch; the protocol may differ (the full cache ignores it)."""
    cell = _cell_key(group[0])[:1] + _cell_key(group[0])[2:]
    return [r for r in rows if _engine(r) and r["value"] is not None
            and r["_metrics"].get("kv", {}).get("method_active") is None
            and _cell_key(r)[:1] + _cell_key(r)[2:] == cell]


def _attn(r: dict) -> str:
    return r["_metrics"].get("protocol", {}).get("attn_impl", "sdpa")


def _cell_key(r: dict) -> tuple:
    """(model, protocol, task, metric, batch, task options): runs of one cell."""
    options = without_neutral("task", r["_metrics"]["task"].get("options") or {})
    options.pop("fidelity_tokens", None)  # adds records; changes no task metric
    return (r["model"], r["protocol"], r["task"], r["metric"], r["batch"],
            json.dumps(options, sort_keys=True, default=str))


def _full_runs(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Our engine's full-cache runs, by cell."""
    out: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["method"] == REFERENCE and r["value"] is not None and not _engine(r):
            out.setdefault(_cell_key(r), []).append(r)
    return out


def _latest(rs: list[dict]) -> dict:
    return max(rs, key=lambda r: r["_metrics"].get("run", {}).get("started", ""))


def _compare(reference: dict, r: dict, resamples: int) -> dict[str, Any]:
    ref_samples, samples = samples_of(reference), samples_of(r)
    if not ref_samples or not samples:
        return {"paired": False, "why": "no samples.jsonl to pair"}
    try:
        return {"paired": True, **compare(r["task"], ref_samples, samples, resamples)}
    except (PairingError, ValueError, KeyError) as exc:
        return {"paired": False, "why": str(exc)}


def comparisons(board: list[dict], rows: list[dict], resamples: int = stats.RESAMPLES
                ) -> tuple[list[dict], list[dict]]:
    """(comparisons with the full cache, noise floors): one record per (board entry, task
    column) whose section has a full-cache cell, BH-adjusted over the whole report."""
    from harness.report.leaderboard import sections

    by_run = {r["run"]: r for r in rows}
    every_floor = _floors(rows, resamples)
    floors = widest_floors(every_floor)
    out = []
    by_section = sections(board)
    for (model, protocol), entries in by_section.items():
        reference_protocol = _reference_protocol(entries, by_run)
        full = _reference(entries) or _reference(by_section.get((model, reference_protocol), []))
        if full is None:
            continue
        for e in entries:
            if e is full:
                continue
            for column, run in e["cells"].items():
                ref = full["cells"].get(column)
                if ref is None:
                    continue
                c = {"model": model, "protocol": protocol, "method": e["method"],
                     "setting": e["setting"], "variant": e["variant"], "column": column,
                     "higher": e["higher"][column], "entry": e, "reference_run": ref,
                     **_compare(by_run[ref], by_run[run], resamples)}
                c["fidelity"] = fidelity_compare(by_run[run], resamples)
                c["floor"] = (floors.get((model, protocol, column))
                              or floors.get((model, reference_protocol, column)))
                out.append(c)
    paired = [c for c in out if c["paired"]]
    adjusted, rejected = stats.benjamini_hochberg([c["p_value"] for c in paired], FDR)
    for c, q, hit in zip(paired, adjusted, rejected):
        c["q_value"] = q
        c["verdict"] = _verdict(c, hit)
    for c in out:
        c.setdefault("verdict", "not paired")
    return out, every_floor


# (record key, the full cache's own value on a sample: its KL to itself is 0, its top token
# its own; its gold log-probability is recorded beside the setting's)
FIDELITY_PAIRS = (("kl_mean", lambda f: 0.0), ("top_agree_ratio", lambda f: 1.0),
                  ("gold_logprob", lambda f: f.get("gold_logprob_full")))


def fidelity_compare(r: dict, resamples: int = stats.RESAMPLES) -> dict[str, Any] | None:
    """Beside the accuracy comparison: the run's per-sample fidelity (task.fidelity_tokens,
    harness.core.fidelity) against the full cache's on the same samples (each record holds both
    sides: the full cache's reference of that very sample), paired bootstrap of the
    difference (setting - full) per measure. None: the run recorded no fidelity."""
    records = [s["fidelity"] for s in samples_of(r) or [] if s.get("fidelity")]
    if not records:
        return None
    out = {}
    for key, full_value in FIDELITY_PAIRS:
        pairs = [(full_value(f), f[key]) for f in records
                 if f.get(key) is not None and full_value(f) is not None]
        if len(pairs) < 2:
            continue
        result = stats.paired(stats.design(np.array(pairs)), resamples)
        out[key] = {"n": len(pairs), "full": result.reference, "value": result.value,
                    "difference": result.difference,
                    "difference_ci95": list(result.difference_ci95), "p_value": result.p_value}
    return out or None


def _reference(entries: list[dict]) -> dict | None:
    return next((e for e in entries if e["method"] == REFERENCE and e["batch"] == 1), None)


def _reference_protocol(entries: list[dict], by_run: dict[str, dict]) -> str:
    """The section's protocol as the full cache runs it (collect.reference_protocol_label)."""
    runs = [run for e in entries for run in e["cells"].values()]
    return reference_protocol_label(by_run[runs[0]]["_metrics"]) if runs else ""


def _verdict(c: dict, significant: bool) -> str:
    floor = c["floor"]
    if floor is not None and abs(c["difference"]) <= floor["magnitude"]:
        return "tie (noise floor)"
    if not significant:
        return "not distinguishable"
    worse = c["difference"] < 0 if c["higher"] else c["difference"] > 0
    return "worse than full" if worse else "better than full"


def _floors(rows: list[dict], resamples: int) -> list[dict]:
    """Every noise floor: per our full-cache cell, eager vs sdpa and each other engine's full
    cache vs ours, paired on the same samples."""
    from harness.report.leaderboard import task_columns

    columns = task_columns(rows)
    out = []
    for group in _full_runs(rows).values():
        main = [r for r in group if not r["_floor"]]
        if not main:
            continue
        ours = _latest(main)
        others = [("attention path: eager vs sdpa", _latest(eager))
                  for eager in [[r for r in group if r["_floor"]]] if eager]
        others += [(f"engine: {_engine(r)} vs ours", r) for r in _engine_references(rows, group)]
        for kind, other in others:
            c = _compare(ours, other, resamples)
            if c["paired"]:
                low, high = c["difference_ci95"]
                c["magnitude"] = max(abs(low), abs(high), abs(c["difference"]))
            out.append({"model": ours["model"], "protocol": ours["protocol"],
                        "column": columns[id(ours)], "kind": kind,
                        "runs": (ours["run"], other["run"]), **c})
    return out


def widest_floors(floors: list[dict]) -> dict[tuple, dict]:
    """(model, protocol, column) -> its widest paired floor: a difference within it is a tie."""
    out: dict[tuple, dict] = {}
    for f in floors:
        key = (f["model"], f["protocol"], f["column"])
        if f["paired"] and f["magnitude"] >= out.get(key, {}).get("magnitude", -1.0):
            out[key] = f
    return out


def widest_column(board: list[dict]) -> int:
    """The most runs one bootstrap holds side by side: the entries of the fullest task column
    of a section (rank intervals resample them jointly)."""
    from harness.report.leaderboard import sections

    counts = [sum(column in e["cells"] for e in entries)
              for entries in sections(board).values()
              for column in {c for e in entries for c in e["cells"]}]
    return max(counts, default=1)


def rank_intervals(board: list[dict], rows: list[dict], resamples: int = stats.RESAMPLES
                   ) -> None:
    """Each board entry's `ranks` {column: (best, worst)} within its section and column."""
    from harness.report.leaderboard import sections

    by_run = {r["run"]: r for r in rows}
    for entries in sections(board).values():
        for e in entries:
            e["ranks"] = {}
        for column in sorted({c for e in entries for c in e["cells"]}):
            have = [e for e in entries if column in e["cells"]]
            draws = _column_draws([by_run[e["cells"][column]] for e in have], resamples)
            if draws is None or len(have) < 2:
                continue
            for e, rank in zip(have, stats.rank_intervals(draws, have[0]["higher"][column])):
                e["ranks"][column] = rank


def _column_draws(runs: list[dict], resamples: int) -> np.ndarray | None:
    """(resamples, M): each run's estimate per resample; runs on the first full-cache run's
    samples (or else the first run's) are resampled jointly, the others on their own."""
    loaded = []
    for r in runs:
        samples = samples_of(r)
        try:
            loaded.append(units(r["task"], samples) if samples else None)
        except (PairingError, ValueError, KeyError):
            loaded.append(None)
    if any(u is None for u in loaded):
        return None
    anchor = next((i for i, r in enumerate(runs) if r["method"] == REFERENCE), 0)
    keys = loaded[anchor].keys
    joint = [i for i, u in enumerate(loaded) if sorted(u.keys) == sorted(keys)]
    out = np.empty((resamples, len(runs)))
    a = loaded[anchor]
    stacked = np.stack([_aligned(loaded[i], keys) for i in joint], axis=1)
    out[:, joint] = stats.draws(stats.design(stacked, a.strata, a.weights, a.clusters,
                                             a.transform), resamples)
    for i, u in enumerate(loaded):
        if i not in joint:
            out[:, i] = stats.draws(stats.design(u.values, u.strata, u.weights, u.clusters,
                                                 u.transform), resamples, seed=i + 1)[:, 0]
    return out


def _aligned(u, keys) -> np.ndarray:
    index = {k: i for i, k in enumerate(u.keys)}
    return u.values[[index[k] for k in keys]]


def flags(board: list[dict], compared: list[dict]) -> list[str]:
    """Non-discriminative columns and budget curves whose non-monotonicity exceeds their
    intervals, one sentence each."""
    from harness.report.leaderboard import sections

    out = []
    for (model, protocol), entries in sections(board).items():
        full = next((e for e in entries if e["method"] == REFERENCE), None)
        for column, ci in (full or {}).get("ci", {}).items():
            scale = _scale(full, column)
            if full["higher"][column] and ci and scale and ci[0] <= FLOOR_MARGIN * scale:
                out.append(f"{model} · {protocol} · {column}: non-discriminative: the full "
                           f"cache's 95 % interval [{ci[0]:.3g}, {ci[1]:.3g}] reaches within "
                           f"{FLOOR_MARGIN:.0%} of the scale of the floor (0); no method can "
                           "be shown to lose accuracy here")
        out += _non_monotonic(model, protocol, entries)
    return out


def distinguishable(board: list[dict], top: int = 10) -> list[str]:
    """Per section and column, the top entries by value and which pairs of them the bootstrap
    tells apart (disjoint rank intervals), one line each."""
    from harness.report.leaderboard import sections

    out = []
    for (model, protocol), entries in sections(board).items():
        for column in sorted({c for e in entries for c in e.get("ranks", {})}):
            ranked = [e for e in entries if column in e["ranks"]]
            higher = ranked[0]["higher"][column]
            ranked.sort(key=lambda e: -e["tasks"][column] if higher else e["tasks"][column])
            ranked = ranked[:top]
            name = {id(e): " ".join(filter(None, (e["method"], e["setting"], e["variant"])))
                    for e in ranked}  # the variant too: two vLLM KV formats are two entries
            apart = [f"{name[id(a)]} > {name[id(b)]}" for i, a in enumerate(ranked)
                     for b in ranked[i + 1:] if a["ranks"][column][1] < b["ranks"][column][0]]
            total = len(ranked) * (len(ranked) - 1) // 2
            out.append(f"{model} · {protocol} · {column}: top {len(ranked)}, {len(apart)} of "
                       f"{total} pairs distinguishable" + (f": {'; '.join(apart)}" if apart
                                                            else ""))
    return out


def _scale(e: dict, column: str) -> float | None:
    """100 for scores in points, 1 for lm-eval's acc, None for unbounded metrics (ppl)."""
    task = column.split(" ", 1)[0]
    return {"ruler": 100.0, "longbench": 100.0, "multiturn": 100.0, "xsum": 100.0,
            "lm_eval": 1.0}.get(task)


def _non_monotonic(model: str, protocol: str, entries: list[dict]) -> list[str]:
    out = []
    curves: dict[tuple, list[dict]] = {}
    for e in entries:
        if e["method"] != REFERENCE and e["kv_held"] is not None:
            curves.setdefault((e["method"], e["variant"]), []).append(e)
    for (method, variant), curve in curves.items():
        curve.sort(key=lambda e: e["kv_held"])
        for column in sorted({c for e in curve for c in e["ci"]}):
            points = [e for e in curve if e["ci"].get(column)]
            higher = points[0]["higher"][column] if points else True
            for i, small in enumerate(points):
                for large in points[i + 1:]:
                    lo_s, hi_s = small["ci"][column]
                    lo_l, hi_l = large["ci"][column]
                    if (lo_s > hi_l) if higher else (hi_s < lo_l):
                        out.append(f"{model} · {protocol} · {column}: {method} {variant} "
                                   f"non-monotonic beyond its intervals: {small['setting']} "
                                   f"(KV held {small['kv_held']:.3g}) [{lo_s:.3g}, {hi_s:.3g}] "
                                   f"beats {large['setting']} (KV held {large['kv_held']:.3g}) "
                                   f"[{lo_l:.3g}, {hi_l:.3g}]".replace("  ", " "))
    return out


def _f(x) -> str:
    return "" if x is None else f"{x:.4g}"


def _ci(pair) -> str:
    return f"[{_f(pair[0])}, {_f(pair[1])}]" if pair else ""


def markdown(compared: list[dict], floors: list[dict], flagged: list[str],
             apart: list[str] = (), resamples: int = stats.RESAMPLES) -> str:
    """The paired comparisons with the full cache, the noise floors and the flags."""
    out = [f"Each setting against the full cache of its section, on identical samples (paired "
           f"by content id; {resamples} paired-bootstrap resamples, seed {stats.SEED}). "
           f"Verdicts after Benjamini-Hochberg over the {sum(c['paired'] for c in compared)} "
           f"paired comparisons of this report, FDR {FDR:.0%}; a difference within the widest noise "
           "floor of its column (the full cache run by another path: eager attention, another "
           "engine) is a tie.", ""]
    cols = ["model", "protocol", "method", "setting", "column", "n", "difference [95 %]",
            "retained [95 %]", "test", "p", "q (BH)", "discordance", "verdict"]
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in compared:
        if c["paired"]:
            cells = [c["model"], c["protocol"], c["method"], c["setting"], c["column"],
                     f"{c['n']} {c['n_unit']}",
                     f"{_f(c['difference'])} {_ci(c['difference_ci95'])}",
                     f"{_f(c['retained'])} {_ci(c['retained_ci95'])}", c["test"],
                     _f(c["p_value"]), _f(c["q_value"]), _f(c["discordance"]), c["verdict"]]
        else:
            cells = [c["model"], c["protocol"], c["method"], c["setting"], c["column"]] + [""] * 7 \
                + [f"not paired: {c['why']}"]
        out.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    out += fidelity_markdown(compared)
    out += ["", "Noise floors (the full cache run by another path, same samples):", ""]
    if not floors:
        out.append("- none measured (run the full cache with runner.attn_impl=eager beside "
                   "sdpa, or through harness.engines.vllm_engine, on the same samples)")
    for f in floors:
        out.append(f"- {f['model']} · {f['protocol']} · {f['column']} · {f['kind']}: "
                   + (f"difference {_f(f['difference'])} {_ci(f['difference_ci95'])}, "
                      f"floor ±{_f(f['magnitude'])}, discordance {_f(f['discordance'])} "
                      f"(n={f['n']} {f['n_unit']})" if f["paired"]
                      else f"not paired: {f['why']}"))
    out += ["", "Flags:", ""] + ([f"- {x}" for x in flagged] or ["- none"])
    out += ["", "Which pairs the bootstrap tells apart (disjoint 95 % rank intervals):", ""] + (
        [f"- {x}" for x in apart] or ["- no ranked column"])
    return "\n".join(out) + "\n"


def fidelity_markdown(compared: list[dict]) -> list[str]:
    """The paired fidelity table (runs with task.fidelity_tokens > 0), beside accuracy's."""
    rows = [c for c in compared if c.get("fidelity")]
    if not rows:
        return []
    out = ["", "Paired fidelity with the full cache (task.fidelity_tokens: per sample, the full "
           "cache's first K greedy tokens teacher-forced through the setting; difference setting - "
           "full per sample, paired bootstrap):", ""]
    cols = ["model", "protocol", "method", "setting", "column", "n", "KL mean [95 %]",
            "same top token (ratio) difference [95 %]", "gold log-prob difference [95 %]"]
    out += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for c in rows:
        fid = c["fidelity"]
        parts = [f"{_f(fid[k]['difference'])} {_ci(fid[k]['difference_ci95'])}" if k in fid
                 else "" for k, _ in FIDELITY_PAIRS]
        n = max(v["n"] for v in fid.values())
        cells = [c["model"], c["protocol"], c["method"], c["setting"], c["column"], n, *parts]
        out.append("| " + " | ".join(str(x).replace("|", "\\|") for x in cells) + " |")
    return out


CSV_FIELDS = ("model", "protocol", "method", "setting", "variant", "column", "paired", "n",
              "n_unit", "reference", "value", "difference", "difference_ci95", "retained",
              "retained_ci95", "test", "p_value", "q_value", "discordance",
              *(f"fidelity_{k}_{part}" for k, _ in FIDELITY_PAIRS
                for part in ("difference", "difference_ci95")), "verdict", "why")


def to_csv(compared: list[dict]) -> str:
    import csv
    import io

    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(CSV_FIELDS)
    for c in compared:
        flat = {**c, **_fidelity_fields(c.get("fidelity") or {})}
        writer.writerow([" ".join(_f(v) for v in flat[k]) if isinstance(flat.get(k), (list, tuple))
                         else _f(flat[k]) if isinstance(flat.get(k), float) else flat.get(k, "")
                         for k in CSV_FIELDS])
    return buf.getvalue()


def _fidelity_fields(fid: dict) -> dict[str, Any]:
    return {f"fidelity_{k}_{part}": v[part] for k, v in fid.items()
            for part in ("difference", "difference_ci95")}
