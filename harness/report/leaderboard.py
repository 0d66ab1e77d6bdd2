"""The leaderboard: one row per method setting, one column per task, per (model, protocol).

A row is a method at one budget (its axis knobs), variant, provenance / operating point and
batch size; a task column holds that task's main metric (declared on the task class). Runs of a
task whose options differ (perplexity on 150 or 400 tokens) are never one column: the options
that differ between them tag the column ("perplexity max_tokens=400"). The mean column averages
the higher-is-better task columns of a row that has them all. KV held, attended fraction,
decode ms and bytes moved are means over the row's runs. The CSV adds each row's budget level,
how many settings shared its timed decode step (speed_shared) and its letters per task column.

Runs with task.fidelity_tokens > 0 add, per task column, their fidelity to the full cache
(KL mean and 99th percentile, same top token %, gold log-probability, each with its interval;
harness.core.fidelity): shown beside the task's metric, which alone ranks.

Every task cell carries its 95 % interval and n (`ci`, `n`; harness.report.compare attaches them
to the rows) and, once compare.rank_intervals ran, its rank interval: markdown shows
"value [low, high] n=N #best-worst". The mean column's interval combines the task columns'
half-widths as independent estimates (sqrt of the sum of squares / k).
"""

from __future__ import annotations

import csv
import io
import math
import statistics
from typing import Any

from harness.config.config_check import without_neutral
from harness.report.collect import REFERENCE, fmt

# Task options that say where data lives, not what is measured.
# (task.fidelity_tokens adds the fidelity columns; it changes no task metric.)
_NOT_SETTING = {"data_dir", "path", "include_path", "fidelity_tokens"}
KEY = ("model", "protocol", "method", "variant", "setting", "provenance", "operating_point",
       "batch")
MEASURES = ("kv_held", "attended_fraction", "decode_ms", "bytes_per_step")
MEAN = "mean (higher-is-better tasks)"
# Samples of the row's runs that fit its budget, so were the full cache's answer by the method's
# rule (a sweep counts them): shown wherever a section has any, never folded into the scores.
IDENTICAL = "identical_to_full"
# A task column's fidelity to the full cache (task.fidelity_tokens, harness.core.fidelity): the
# metrics.json statistic, its label and whether higher is better. Shown beside the task's
# metric, never ranked: the board ranks by the task's metric.
FIDELITY = (("kl_mean", "KL mean", False), ("kl_p99", "KL p99", False),
            ("top_agree_percent", "same top %", True), ("gold_logprob_mean", "gold logprob", True))


def _options(r: dict) -> dict[str, str]:
    opts = without_neutral("task", r["_metrics"].get("task", {}).get("options", {}))
    return {k: fmt(v) for k, v in opts.items() if k not in _NOT_SETTING}


def task_columns(rows: list[dict]) -> dict[int, str]:
    """id(row) -> its task column: the task (and metric), tagged by the options that differ
    between runs of that task in the same (model, protocol) section."""
    by_task: dict[tuple, list[dict]] = {}
    for r in rows:
        by_task.setdefault((r["model"], r["protocol"], r["task"]), []).append(r)
    out = {}
    for rs in by_task.values():
        opts = [_options(r) for r in rs]
        keys = sorted({k for o in opts for k in o})
        differ = [k for k in keys if len({o.get(k) for o in opts}) > 1]
        for r, o in zip(rs, opts):
            tag = " ".join(f"{k}={o.get(k, '')}" for k in differ)
            out[id(r)] = f"{r['task']} {r['metric']}{' ' + tag if tag else ''}"
    return out


def build(rows: list[dict]) -> list[dict[str, Any]]:
    """Leaderboard rows (dicts): KEY fields, `tasks` {column: value}, the measures, `runs`."""
    columns = task_columns(rows)
    higher = {columns[id(r)]: r["higher_is_better"] for r in rows}
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["value"] is not None and not r.get("_floor"):  # noise-floor runs: compare.py
            groups.setdefault(tuple(r[k] for k in KEY), []).append(r)
    board = []
    for key, rs in groups.items():
        latest: dict[str, dict] = {}  # a re-run of the same cell: the latest run counts
        for r in sorted(rs, key=lambda r: r["_metrics"].get("run", {}).get("started", "")):
            latest[columns[id(r)]] = r
        entry = dict(zip(KEY, key))
        entry["tasks"] = {c: r["value"] for c, r in latest.items()}
        entry["cells"] = {c: r["run"] for c, r in latest.items()}
        entry["ci"] = {c: ((r["ci95_low"], r["ci95_high"]) if r.get("ci95_low") is not None
                           else None) for c, r in latest.items()}
        entry["n"] = {c: r.get("n") for c, r in latest.items()}
        entry["ranks"] = {}
        entry["higher"] = {c: higher[c] for c in latest}
        for m in MEASURES:
            values = [r[m] for r in latest.values() if r[m] is not None]
            entry[m] = statistics.fmean(values) if values else None
        entry["active"] = ("INACTIVE" if any(r["active"] == "INACTIVE" for r in latest.values())
                           else latest[next(iter(latest))]["active"])
        entry["runs"] = [r["run"] for r in latest.values()]
        counted = [r["identical_to_full"] for r in latest.values()
                   if r.get("identical_to_full") is not None]
        entry[IDENTICAL] = sum(counted) if counted else None
        entry["fidelity"] = fidelity_cells(latest)
        board.append(entry)
    _mean_column(board)
    board.sort(key=lambda e: (e["model"], e["protocol"], e["method"] != REFERENCE,
                              -(e["kv_held"] if e["kv_held"] is not None else 2), e["method"],
                              e["setting"]))
    return board


def fidelity_column(column: str, label: str) -> str:
    return f"{column} · {label}"


def fidelity_cells(latest: dict[str, dict]) -> dict[str, tuple]:
    """{fidelity column: (value, its 95 % interval or None)} of the row's runs that recorded
    fidelity."""
    out = {}
    for column, r in latest.items():
        section = r["_metrics"].get("fidelity") or {}
        if not section.get("tokens"):
            continue
        for key, label, _ in FIDELITY:
            stat = section.get(key) or {}
            if stat.get("value") is not None:
                out[fidelity_column(column, label)] = (stat["value"], stat.get("ci95"))
    return out


def fidelity_columns(entries: list[dict]) -> list[str]:
    """The fidelity columns of these rows, by task column then FIDELITY's order."""
    have = {c for e in entries for c in e.get("fidelity", {})}
    tasks = sorted({c for e in entries for c in e["tasks"]})
    return [fidelity_column(t, label) for t in tasks for _, label, _ in FIDELITY
            if fidelity_column(t, label) in have]


def _mean_column(board: list[dict]) -> None:
    """Per section, the mean over its higher-is-better task columns, for rows that have all."""
    sections: dict[tuple, set[str]] = {}
    for e in board:
        sections.setdefault((e["model"], e["protocol"]), set()).update(
            c for c, h in e["higher"].items() if h)
    for e in board:
        wanted = sections[e["model"], e["protocol"]]
        have = [e["tasks"][c] for c in wanted if c in e["tasks"]]
        e[MEAN] = statistics.fmean(have) if wanted and len(have) == len(wanted) else None
        halves = [(e["ci"][c][1] - e["ci"][c][0]) / 2 for c in wanted if e["ci"].get(c)]
        e["mean_ci"] = None
        if e[MEAN] is not None and len(halves) == len(wanted) > 1:
            half = math.sqrt(sum(h * h for h in halves)) / len(halves)
            e["mean_ci"] = (e[MEAN] - half, e[MEAN] + half)


def sections(board: list[dict]) -> dict[tuple[str, str], list[dict]]:
    out: dict[tuple[str, str], list[dict]] = {}
    for e in board:
        out.setdefault((e["model"], e["protocol"]), []).append(e)
    return out


TEXT = ("method", "setting", "batch", "active", "provenance", "operating_point", "variant")


def header(entries: list[dict]) -> tuple[list[str], list[str]]:
    """(the row's key columns, the rest) of one section: method and budget first, the task
    columns (sorted), the mean and the measures, then the labels a section has any of, the
    variant knobs (long) last."""
    tasks = sorted({c for e in entries for c in e["tasks"]})
    own = ["method", "setting"] + (["batch"] if any(e["batch"] != 1 for e in entries) else [])
    labels = [c for c in ("provenance", "operating_point", "variant") if any(e[c] for e in entries)]
    identical = [IDENTICAL] if any(e.get(IDENTICAL) is not None for e in entries) else []
    return own, (tasks + ([MEAN] if len(tasks) > 1 else []) + fidelity_columns(entries)
                 + list(MEASURES) + identical + ["active"] + labels)


def cell(e: dict, column: str) -> Any:
    """A task column's value (None where the row has no run of it), a fidelity column's, else
    the row's own field."""
    if column in e.get("fidelity", {}):
        return e["fidelity"][column][0]
    return e["tasks"].get(column, e.get(column))


def shown(e: dict, column: str) -> str:
    """A cell as text: a task column with its interval, n and rank interval."""
    value = cell(e, column)
    if column == "decode_ms" and value is not None and e.get("speed_shared"):
        return f"{fmt(value)} shared"  # one batched step of several settings: none's own
    if column in e.get("fidelity", {}):
        value, ci = e["fidelity"][column]
        return fmt(value) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else "")
    ci = e.get("mean_ci") if column == MEAN else e.get("ci", {}).get(column)
    if column not in e["tasks"] and column != MEAN or value is None:
        return fmt(value)
    text = fmt(value) + (f" [{fmt(ci[0])}, {fmt(ci[1])}]" if ci else " [no interval]")
    n = e["n"].get(column)
    rank = e.get("ranks", {}).get(column)
    verdict = e.get("verdicts", {}).get(column, "")
    return (text + (f" n={n}" if n else "")
            + (f" #{rank[0]}" + (f"-{rank[1]}" if rank[1] != rank[0] else "") if rank else "")
            + (f" · {verdict}" if verdict.startswith(("worse", "better", "tie")) else ""))


def arrow(entries: list[dict], column: str) -> str:
    for _, label, higher in FIDELITY:
        if column.endswith(" · " + label):
            return " ↑" if higher else " ↓"
    for e in entries:
        if column in e["higher"]:
            return " ↑" if e["higher"][column] else " ↓"
    return ""


def markdown(board: list[dict]) -> str:
    out = []
    for (model, protocol), entries in sections(board).items():
        own, rest = header(entries)
        names = own + [c + arrow(entries, c) for c in rest]
        out += [f"### {model} · {protocol}", "", "| " + " | ".join(names) + " |",
                "|" + "---|" * len(names)]
        for e in entries:
            out.append("| " + " | ".join(shown(e, c).replace("|", "\\|")
                                         for c in own + rest) + " |")
        out.append("")
    return "\n".join(out)


def to_csv(board: list[dict]) -> str:
    """One flat table: the key, every task column of the whole report, the measures."""
    tasks = sorted({c for e in board for c in e["tasks"]})
    fid = fidelity_columns(board)
    extra = ([f"{c} {part}" for c in tasks for part in INTERVAL_PARTS]
             + [f"{c} {part}" for c in fid for part in ("ci95_low", "ci95_high")])
    fields = (list(KEY) + tasks + [MEAN, *MEASURES, "active", "runs", IDENTICAL, "level",
                                    "speed_shared"] + fid + extra)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(fields)
    for e in board:
        writer.writerow([fmt(e["tasks"].get(f) if f in tasks else
                             " ".join(e["runs"]) if f == "runs" else cell(e, f))
                         for f in fields[:len(fields) - len(extra)]]
                        + [fmt(v) for c in tasks for v in interval_parts(e, c)]
                        + [fmt(v) for c in fid for v in fidelity_interval(e, c)])
    return buf.getvalue()


# letters: the compact letter display inside the row's budget level (harness.report.budgets).
INTERVAL_PARTS = ("ci95_low", "ci95_high", "n", "rank_best", "rank_worst", "letters")


def interval_parts(e: dict, column: str) -> list:
    """A task cell's INTERVAL_PARTS (None where it has none)."""
    ci = e.get("ci", {}).get(column) or (None, None)
    rank = e.get("ranks", {}).get(column) or (None, None)
    return [ci[0], ci[1], e.get("n", {}).get(column), rank[0], rank[1],
            e.get("letters", {}).get(column)]


def fidelity_interval(e: dict, column: str) -> tuple:
    """A fidelity cell's 95 % interval (None, None where it has none)."""
    ci = (e.get("fidelity", {}).get(column) or (None, None))[1]
    return tuple(ci) if ci else (None, None)
