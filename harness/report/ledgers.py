"""Sweeps run in rounds (harness.sweep.rounds), as the report shows them.

A rounds sweep writes one run folder per (round, setting): each holds that round's window of
samples (`task.skip_samples`), and a setting stops being sampled once its question is decided.
Read as ordinary runs, its folders give one column per window and fixed-n intervals that do not
hold after repeated looks. What does hold is in the ledger beside them (`rounds.json`): each
setting's anytime-valid confidence sequence against the full cache (harness.stats.sequential),
its verdict and the round it stopped at. The report finds the ledgers above the runs it reads
and shows them, saying which of its runs they cover.
"""

from __future__ import annotations

import json
from pathlib import Path

LEDGER = "rounds.json"
TABLE = "rounds.md"  # the ledger's table, written beside it


def table(ledger: dict) -> str:
    """Per setting: verdict, paired difference with the full cache and its CS at the setting's
    n, the round it stopped (or "-": still undecided at max_n), and its top-k place."""
    return "\n".join([f"# Rounds: {heading(ledger)}", "", *summary(ledger)[:1], "",
                      table_rows(ledger)]) + "\n"


def heading(ledger: dict) -> str:
    knobs = ledger["knobs"]
    return (f"block {knobs['block']}, max_n {ledger['max_n']}, alpha {knobs['alpha']}, "
            f"margin ±{knobs['margin_points']:g} points"
            + (f", top {knobs['top_k']}" if knobs["top_k"] else ""))


def table_rows(ledger: dict) -> str:
    top_k = ledger["knobs"]["top_k"]
    lines = ["| setting | level | verdict vs full | difference (points) | CS | n | stopped at round"
             + (" | top k |" if top_k else " |"),
             "|---|---|---|---|---|---|---|" + ("---|" if top_k else "")]
    for name, r in sorted(ledger.get("reported", {}).items()):
        v = r["versus_reference"]
        cells = [name, ledger["levels"][name], r["verdict"], f"{v['mean']:+.1f}",
                 f"[{v['low']:+.1f}, {v['high']:+.1f}]", str(r["n"]),
                 str(r["round"]) if r["stopped"] else "-"]
        cells += [r.get("membership", "")] if top_k else []
        lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
    for name, why in sorted(ledger.get("skipped", {}).items()):
        lines.append(f"\n{name}: not run ({why})")
    return "\n".join(lines)


def summary(ledger: dict) -> list[str]:
    """One line per setting: verdict, interval at its stopping n, and the samples it used."""
    reported = ledger.get("reported") or {}
    used = sum(r["n"] for r in reported.values())
    budget = ledger["max_n"] * len(reported)
    lines = [f"rounds: {len(ledger['rounds'])} round(s), {ledger['status']}; {used} (setting, "
             f"sample) answers of {budget} at max_n (saved {budget - used})"]
    for name, why in sorted(ledger.get("skipped", {}).items()):
        lines.append(f"  {name}: not run ({why})")
    for name, r in sorted(reported.items()):
        v = r["versus_reference"]
        tail = f", top {ledger['knobs']['top_k']}: {r['membership']}" if "membership" in r else ""
        lines.append(f"  {name}: {r['verdict']} vs full, difference {v['mean']:+.1f} points, "
                     f"CS [{v['low']:+.1f}, {v['high']:+.1f}] at n={r['n']}"
                     f"{' (stopped)' if r['stopped'] else ''}{tail}")
    return lines


def covering(folders: list[Path]) -> dict[Path, list[Path]]:
    """Each ledger folder above some of `folders` (run folders), with the runs it covers."""
    found: dict[Path, list[Path]] = {}
    known: dict[Path, bool] = {}
    for folder in folders:
        for parent in Path(folder).resolve().parents:
            if parent not in known:
                known[parent] = (parent / LEDGER).is_file()
            if known[parent]:
                found.setdefault(parent, []).append(folder)
                break
    return found


def section(folders: list[Path], name=lambda p: p.name, warn=print) -> str:
    """The report's "Sweeps in rounds" section ("" when no run lies under a ledger); a ledger
    that cannot be read is named in a warning and left out."""
    parts = []
    for home, runs in sorted(covering(folders).items()):
        try:
            ledger = json.loads((home / LEDGER).read_text())
            body = table_rows(ledger)
            lines = [f"{name(home)}: {heading(ledger)}; {summary(ledger)[0]}"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            warn(f"warning: skipped the rounds ledger {home / LEDGER}: not readable "
                 f"({type(exc).__name__}: {exc})")
            continue
        parts += [*lines, "", f"{len(runs)} of the runs above were sampled in these rounds: "
                  "their columns split by round (task.skip_samples), and their intervals and "
                  "comparisons, fixed-n, do not hold under the rounds' repeated looks. The "
                  "anytime-valid confidence sequences (CS) with the full cache below do:", "",
                  body, ""]
    if not parts:
        return ""
    return "\n## Sweeps in rounds\n\n" + "\n".join(parts)
