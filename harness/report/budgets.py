"""Which setting at this budget: the leaderboard's settings grouped by budget level, compared
pairwise inside each group, and the compact letter display of those comparisons.

* Budget level: a setting's declared `budget_ratio` (its method's axis knob) where it has one;
  otherwise (a method at its own defaults: a window, a bit width) the band its measured KV held
  falls in (BANDS). The full cache is the reference of every group, never a member.
* Inside a group and task column, every pair of settings is compared on identical samples
  (harness.stats.uncertainty.compare: paired bootstrap, or exact McNemar for pass/fail samples), the
  p-values corrected by Benjamini-Hochberg over the group's pairs (FDR 5 %); a pair is told
  apart when the correction rejects "no difference" and the difference exceeds the noise floor
  where one was measured. A pair that cannot be paired (other samples) is never told apart.
* Letters (harness.report.letters): settings sharing a letter could not be told apart.
* Speed shared: a sweep that decoded `decode_batch` > 1 settings together (lockstep streams,
  batched answers) times one batched step for all of them, so its decode ms is no setting's own.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

from harness.stats import intervals as stats
from harness.report import compare, letters
from harness.report.collect import REFERENCE, fmt
from harness.stats.uncertainty import PairingError
from harness.stats.uncertainty import compare as paired_compare

FDR = compare.FDR
# Upper edges of the KV-held bands for settings with no budget_ratio (the last: more than full).
BANDS = (0.25, 0.5, 1.0, math.inf)


def ratio_of(setting: str) -> float | None:
    """The `budget_ratio=` knob of a setting's label ("budget_ratio=0.2 ..."), else None."""
    for part in setting.split():
        key, _, value = part.partition("=")
        if key == "budget_ratio":
            try:
                return float(value)
            except ValueError:
                return None
    return None


def level(e: dict) -> tuple[tuple, str]:
    """(sort key, label) of a board entry's budget level."""
    ratio = ratio_of(e["setting"])
    if ratio is not None:
        return (0, ratio), f"budget_ratio {fmt(ratio)}"
    held = e.get("kv_held")
    if held is None:
        return (2, 0.0), "own defaults, KV held unknown"
    low = 0.0
    for high in BANDS:
        if held <= high:
            what = (f"KV held > {fmt(low)}" if math.isinf(high)
                    else f"KV held {fmt(low)}-{fmt(high)}" if low else f"KV held <= {fmt(high)}")
            return (1, high), f"own defaults, {what}"
        low = high
    raise AssertionError("BANDS ends with infinity")


def speed_shared(e: dict, by_run: dict[str, dict]) -> int | None:
    """How many settings shared the decode step that timed this entry (None: its own)."""
    batches = [by_run[run]["_metrics"].get("run", {}).get("sweep", {}).get("decode_batch") or 1
               for run in e["cells"].values()]
    shared = max(batches, default=1)
    return shared if shared > 1 else None


def groups(entries: list[dict], column: str) -> list[tuple[str, list[dict]]]:
    """The section's settings with a value in `column`, by budget level (levels in order, each
    best first by the column's metric); the full cache left out."""
    out: dict[tuple, tuple[str, list[dict]]] = {}
    for e in entries:
        if e["method"] != REFERENCE and column in e["tasks"]:
            key, label = level(e)
            out.setdefault(key, (label, []))[1].append(e)
    for _, members in out.values():
        members.sort(key=lambda e: _order(e, column))
    return [out[k] for k in sorted(out)]


def _order(e: dict, column: str) -> tuple:
    value = e["tasks"][column]
    return (-value if e["higher"][column] else value, e["method"], e["setting"])


def _pair(a: dict, b: dict, column: str, by_run: dict[str, dict], resamples: int
          ) -> dict[str, Any]:
    ra, rb = by_run[a["cells"][column]], by_run[b["cells"][column]]
    sa, sb = compare.samples_of(ra), compare.samples_of(rb)
    if not sa or not sb:
        return {"paired": False, "why": "no samples.jsonl to pair"}
    try:
        return {"paired": True, **paired_compare(ra["task"], sa, sb, resamples)}
    except (PairingError, ValueError, KeyError) as exc:
        return {"paired": False, "why": str(exc)}


def told_apart(members: list[dict], column: str, by_run: dict[str, dict], floor: dict | None,
               resamples: int = stats.RESAMPLES) -> list[tuple[int, int]]:
    """Index pairs (i, j) of `members` told apart after BH over all the group's pairs."""
    pairs = list(itertools.combinations(range(len(members)), 2))
    results = [_pair(members[i], members[j], column, by_run, resamples) for i, j in pairs]
    tested = [(p, r) for p, r in zip(pairs, results) if r["paired"]]
    _, rejected = stats.benjamini_hochberg([r["p_value"] for _, r in tested], FDR)
    margin = floor["magnitude"] if floor and floor.get("paired") else None
    return [p for (p, r), hit in zip(tested, rejected)
            if hit and (margin is None or abs(r["difference"]) > margin)]


def attach(board: list[dict], rows: list[dict], floors: list[dict],
           resamples: int = stats.RESAMPLES) -> list[dict]:
    """Each entry's `letters` {column: "ab"}, `level`, `speed_shared`; returns the answer
    records (one per section, column and budget level), as the page's top shows them."""
    from harness.report.leaderboard import sections

    by_run = {r["run"]: r for r in rows}
    floor_of = compare.widest_floors(floors)
    answers = []
    for (model, protocol), entries in sections(board).items():
        full = next((e for e in entries if e["method"] == REFERENCE and e["batch"] == 1), None)
        for e in entries:
            e["level"] = level(e)[1] if e["method"] != REFERENCE else "full cache"
            e["speed_shared"] = speed_shared(e, by_run)
            e.setdefault("letters", {})
        for column in sorted({c for e in entries for c in e["tasks"]}):
            for label, members in groups(entries, column):
                apart = told_apart(members, column, by_run,
                                   floor_of.get((model, protocol, column)), resamples)
                shown = letters.letters(range(len(members)), apart)
                for i, e in enumerate(members):
                    e["letters"][column] = shown[i]
                best_apart = {j for i, j in apart if i == 0}
                answers.append({
                    "model": model, "protocol": protocol, "column": column, "level": label,
                    "members": members, "apart": len(apart),
                    "pairs": len(members) * (len(members) - 1) // 2,
                    "with_best": [e for j, e in enumerate(members) if j not in best_apart],
                    "full": full if full and column in full["tasks"] else None})
    return answers


def cost(e: dict) -> str:
    """What a setting costs, in a few words: KV held, decode ms (marked when shared), bytes."""
    parts = []
    if e.get("kv_held") is not None:
        parts.append(f"KV held {fmt(e['kv_held'])}")
    if e.get("decode_ms") is not None:
        parts.append(f"decode {fmt(e['decode_ms'])} ms/token"
                     + (f" (shared by {e['speed_shared']})" if e.get("speed_shared") else ""))
    if e.get("bytes_per_step"):
        parts.append(f"{fmt(e['bytes_per_step'] / 2**20)} MiB moved/step")
    return ", ".join(parts)


def name(e: dict) -> str:
    return f"{e['method']} {e['setting']}".strip()


def alone(a: dict, listed: str) -> str:
    """The tail of an answer line: who cannot be told from the best, or why no one."""
    if listed:
        return listed
    if len(a["members"]) == 1:
        return "; the only setting at this level"
    return "; every other setting is told apart from it"


def markdown(answers: list[dict], top: int = 8) -> str:
    """The answer, first in report.md: per section, column and budget level, the best setting,
    those not told apart from it, and the full cache, each with its cost."""
    out = [f"Per budget level, the best setting and those that cannot be told from it (paired "
           f"comparisons inside the level, Benjamini-Hochberg FDR {FDR:.0%}), with what each "
           "costs; the full cache for reference. Decode ms marked \"shared by N\" is one "
           "batched step of N settings in lockstep, not the setting's own.", ""]
    heading = None
    for a in answers:
        if (a["model"], a["protocol"], a["column"]) != heading:
            heading = (a["model"], a["protocol"], a["column"])
            out += ["", f"### {a['model']} · {a['protocol']} · {a['column']}", ""]
            if a["full"]:
                out.append(f"- full cache: {fmt(a['full']['tasks'][a['column']])} "
                           f"({cost(a['full'])})")
        best, same = a["members"][0], a["with_best"][1:]
        listed = "; ".join(f"{name(e)} {fmt(e['tasks'][a['column']])} ({cost(e)})"
                           for e in same[:top])
        more = f"; and {len(same) - top} more (letter a)" if len(same) > top else ""
        count = len(a["members"])
        out.append(f"- **{a['level']}** ({count} setting{'s' if count != 1 else ''}, "
                   f"{a['apart']} of "
                   f"{a['pairs']} pairs told apart): best {name(best)} "
                   f"{fmt(best['tasks'][a['column']])} ({cost(best)})"
                   + alone(a, f"; cannot be told from it: {listed}{more}" if same else ""))
    return "\n".join(out) + "\n"
